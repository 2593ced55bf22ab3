"""Host sampling: greedy, logit_bias, top-k/top-p filtering, seeded reproducibility and logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kvforge.contract.errors import KvforgeError
from kvforge.runtime.sampling.sampler import (
    Sampler,
    SampleResult,
    greedy_tokens,
    log_softmax,
    sample_batch,
    top_ids,
)
from kvforge.runtime.types import SamplingParams

LOGITS = arrays(np.float32, st.integers(2, 40), elements=st.floats(-30, 30, width=32))
SEEDS = st.integers(0, 2**32)


def params(**overrides: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 0, "token_logprob": True,
                             **overrides})


def reference_log_softmax(row: np.ndarray) -> np.ndarray:
    values = [float(v) for v in row]
    total = math.log(sum(math.exp(v - max(values)) for v in values)) + max(values)
    return np.array([v - total for v in values])


# --- helpers --------------------------------------------------------------------------------------------


@given(LOGITS)
def test_log_softmax_matches_reference(row: np.ndarray) -> None:
    result = log_softmax(row)
    assert result.dtype == np.float64
    np.testing.assert_allclose(result, reference_log_softmax(row), rtol=1e-9, atol=1e-9)


def test_log_softmax_is_safe_for_huge_logits_and_batches() -> None:
    result = log_softmax(np.array([[1e30, 1e30 - 1e15, -np.inf], [0.0, 0.0, 0.0]]))
    assert result[0, 0] == pytest.approx(-math.log(1 + math.exp(-1e15)))
    assert result[0, 2] == -np.inf
    np.testing.assert_allclose(result[1], np.full(3, -math.log(3)))


def test_greedy_tokens_is_argmax_with_ties_to_lowest_id() -> None:
    logits = np.array([[0, 3, 3, 1], [5, 5, 5, 5], [-1, -2, -3, -0.5]], dtype=np.float32)
    result = greedy_tokens(logits)
    assert result.dtype == np.int64 and result.tolist() == [1, 0, 3]


def test_top_ids_orders_by_value_then_lower_id() -> None:
    values = np.array([1.0, 3.0, 2.0, 3.0, 2.0])
    assert top_ids(values, 4).tolist() == [1, 3, 2, 4]
    assert top_ids(values, 0).tolist() == []
    assert top_ids(values, 99).tolist() == [1, 3, 2, 4, 0]


# --- greedy ---------------------------------------------------------------------------------------------


@given(LOGITS, SEEDS)
def test_temperature_zero_and_top_k_one_are_argmax(row: np.ndarray, seed: int) -> None:
    expected = int(np.argmax(row))
    assert Sampler(params(temperature=0, seed=seed)).sample(row).token_id == expected
    assert Sampler(params(top_k=1, temperature=1.7, seed=seed)).sample(row).token_id == expected


def test_greedy_does_not_consume_randomness() -> None:
    sampler = Sampler(params(temperature=0))
    state = sampler.rng.bit_generator.state
    sampler.sample(np.array([0.0, 1.0]))
    assert sampler.rng.bit_generator.state == state


# --- filtering ------------------------------------------------------------------------------------------


@settings(max_examples=200)
@given(LOGITS, st.integers(1, 10), SEEDS, st.floats(0.1, 3.0))
@example(np.array([-3.3696898e-19, 0.0, 1.0], dtype=np.float32), 2, 0, 2.0)
def test_top_k_never_leaves_the_top_k(row: np.ndarray, top_k: int, seed: int, temperature: float) -> None:
    token_id = Sampler(params(top_k=top_k, seed=seed, temperature=temperature)).sample(row).token_id
    allowed = top_ids(row.astype(np.float64), top_k)
    # The sampler ranks float32 logits shifted by their max: two logits closer than float32 resolves there tie
    # (hypothesis found -3.4e-19 and 0.0 beside 1.0, both -1.0 after the shift), and a tie may go either way.
    shifted = (row.astype(np.float32) - np.float32(row.max())) / np.float32(temperature)
    tied = np.flatnonzero(shifted >= np.sort(shifted)[-min(top_k, row.size)])
    assert token_id in allowed.tolist() + tied.tolist()


def nucleus(row: np.ndarray, top_p: float, temperature: float) -> set[int]:
    """The nucleus computed the slow, obvious way: best-first until the kept mass reaches top_p."""
    probs = np.exp(log_softmax(row.astype(np.float64) / temperature))
    kept: set[int] = set()
    mass = 0.0
    # Ordered as the sampler orders them: by (logit - max) / T in float64 (logits that become equal after the
    # shift, such as 0 and 6e-34 next to a max of 1, tie), ties by lower id.
    scaled = (row.astype(np.float64) - float(row.max())) / temperature
    for token_id in sorted(range(row.size), key=lambda i: (-float(scaled[i]), i)):
        if kept and mass >= top_p:
            break
        kept.add(token_id)
        mass += probs[token_id]
    return kept


@settings(max_examples=200)
@given(LOGITS, st.floats(0.01, 0.99), SEEDS, st.floats(0.2, 3.0))
def test_top_p_never_leaves_the_nucleus(row: np.ndarray, top_p: float, seed: int, temperature: float) -> None:
    token_id = Sampler(params(top_p=top_p, seed=seed, temperature=temperature)).sample(row).token_id
    # Slack: a token right at the boundary may fall either side through float rounding of the sums.
    assert token_id in nucleus(row, min(top_p + 1e-9, 1.0), temperature)


@given(LOGITS, SEEDS)
def test_tiny_top_p_keeps_only_the_argmax(row: np.ndarray, seed: int) -> None:
    assert Sampler(params(top_p=1e-9, seed=seed)).sample(row).token_id == int(np.argmax(row))


def test_top_k_then_top_p_renormalizes_over_the_top_k() -> None:
    # After top_k=2 the two best tokens share the mass 0.5/0.5, so top_p=0.5 keeps only the first.
    row = np.array([2.0, 2.0, 1.9, 1.9, 1.9])
    assert {Sampler(params(top_k=2, top_p=0.5, seed=s)).sample(row).token_id for s in range(50)} == {0}


def test_masked_tokens_are_never_drawn() -> None:
    row = np.array([-np.inf, 0.0, -np.inf, 0.0])
    drawn = {Sampler(params(seed=s)).sample(row).token_id for s in range(100)}
    assert drawn == {1, 3}


def test_draws_follow_the_softmax() -> None:
    row = np.log(np.array([0.5, 0.3, 0.2]))
    sampler = Sampler(params(seed=1234))
    counts = np.bincount([sampler.sample(row).token_id for _ in range(5_000)], minlength=3)
    np.testing.assert_allclose(counts / counts.sum(), [0.5, 0.3, 0.2], atol=0.03)


def test_low_temperature_concentrates_high_temperature_spreads() -> None:
    row = np.array([1.0, 0.0, 0.0, 0.0])
    cold, hot = Sampler(params(temperature=0.05, seed=3)), Sampler(params(temperature=100.0, seed=3))
    assert {cold.sample(row).token_id for _ in range(200)} == {0}
    assert len({hot.sample(row).token_id for _ in range(200)}) == 4


def test_tiny_temperature_is_numerically_safe() -> None:
    row = np.array([1e4, 1e4 - 1, -1e4])
    assert Sampler(params(temperature=1e-300)).sample(row).token_id == 0


# --- logit_bias -----------------------------------------------------------------------------------------


@given(LOGITS, SEEDS, st.data())
def test_logit_bias_can_force_a_token(row: np.ndarray, seed: int, data: st.DataObject) -> None:
    forced = data.draw(st.integers(0, row.size - 1))
    # +100 on one token against logits within [-30, 30]: every other token has probability < e^-40.
    for sampling in (params(seed=seed), params(temperature=0), params(top_k=5, top_p=0.5, seed=seed)):
        sampling.logit_bias = {forced: 100.0}
        assert Sampler(sampling).sample(row).token_id == forced


def test_logit_bias_can_ban_a_token() -> None:
    row = np.array([10.0, 0.0, 0.0])
    sampling = params(temperature=0, logit_bias={0: -100.0})
    assert Sampler(sampling).sample(row).token_id in (1, 2)


def test_logit_bias_does_not_modify_the_callers_logits() -> None:
    row = np.array([0.0, 1.0], dtype=np.float32)
    Sampler(params(logit_bias={0: 5.0})).sample(row)
    assert row.tolist() == [0.0, 1.0]


def test_logit_bias_outside_the_vocabulary() -> None:
    with pytest.raises(KvforgeError) as info:
        Sampler(params(logit_bias={7: 1.0})).sample(np.zeros(4))
    assert info.value.field == "logit_bias" and "size 4" in info.value.message


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logits_are_rejected(bad: float) -> None:
    with pytest.raises(KvforgeError) as info:
        Sampler(params()).sample(np.array([0.0, bad]))
    assert info.value.field == "logits"


def test_all_masked_logits_are_rejected() -> None:
    with pytest.raises(KvforgeError) as info:
        Sampler(params(logit_bias={1: -100.0})).sample(np.array([-np.inf, -np.inf]))
    assert info.value.field == "logits"


# --- reproducibility ------------------------------------------------------------------------------------


def token_stream(sampling: SamplingParams, steps: int = 64) -> list[int]:
    logits = np.random.default_rng(99).normal(size=(steps, 50)).astype(np.float32)
    sampler = Sampler(sampling)
    return [sampler.sample(row).token_id for row in logits]


@settings(max_examples=25)
@given(SEEDS, st.floats(0.3, 2.0), st.integers(0, 60), st.floats(0.05, 1.0))
def test_same_seed_same_stream(seed: int, temperature: float, top_k: int, top_p: float) -> None:
    sampling = params(seed=seed, temperature=temperature, top_k=top_k, top_p=top_p)
    assert token_stream(sampling) == token_stream(sampling)


def test_different_seeds_differ_and_no_seed_is_fresh() -> None:
    assert token_stream(params(seed=1)) != token_stream(params(seed=2))
    assert token_stream(params(seed=None)) != token_stream(params(seed=None))


# --- logprobs -------------------------------------------------------------------------------------------


@given(LOGITS, SEEDS, st.integers(0, 50))
def test_logprobs_are_log_softmax_after_bias(row: np.ndarray, seed: int, num_logprobs: int) -> None:
    sampling = params(seed=seed, temperature=0.5, top_k=3, num_logprobs=num_logprobs, logit_bias={1: 2.5})
    result = Sampler(sampling).sample(row)
    biased = row.astype(np.float64)
    biased[1] += 2.5
    expected = reference_log_softmax(biased)
    assert isinstance(result, SampleResult)
    assert result.logprob == pytest.approx(expected[result.token_id], abs=1e-9)
    assert len(result.top_logprobs) == min(num_logprobs, row.size)
    # Sorted by the reported value, best first, ties by lower id.
    assert result.top_logprobs == sorted(result.top_logprobs, key=lambda pair: (-pair[1], pair[0]))
    for token_id, logprob in result.top_logprobs:
        assert isinstance(token_id, int) and isinstance(logprob, float)
        assert logprob == pytest.approx(expected[token_id], abs=1e-9)
    if result.top_logprobs:  # nothing left out beats what was reported
        left_out = set(range(row.size)) - {token_id for token_id, _ in result.top_logprobs}
        assert all(expected[i] <= result.top_logprobs[-1][1] + 1e-9 for i in left_out)


def test_top_logprobs_ties_go_to_lower_id() -> None:
    result = Sampler(params(temperature=0, num_logprobs=3)).sample(np.array([0.0, 1.0, 0.0, 1.0, 0.0]))
    assert [token_id for token_id, _ in result.top_logprobs] == [1, 3, 0]
    assert result.token_id == 1


def test_greedy_logprob_is_the_models_not_zero() -> None:
    result = Sampler(params(temperature=0, num_logprobs=1)).sample(np.zeros(4))
    assert result.logprob == pytest.approx(-math.log(4))


# --- batches --------------------------------------------------------------------------------------------


def test_sample_batch_uses_one_sampler_per_row() -> None:
    logits = np.array([[0.0, 9.0, 0.0], [9.0, 0.0, 0.0]], dtype=np.float32)
    samplers = [Sampler(params(temperature=0)), Sampler(params(temperature=0, logit_bias={2: 50.0}))]
    assert [r.token_id for r in sample_batch(samplers, logits)] == [1, 2]
    with pytest.raises(ValueError):
        sample_batch(samplers[:1], logits)


# --- presence and frequency penalties --------------------------------------------------------------------


@given(LOGITS, SEEDS)
def test_zero_penalties_change_nothing(row: np.ndarray, seed: int) -> None:
    plain, zero = Sampler(params(seed=seed)), Sampler(params(seed=seed, presence_penalty=0, frequency_penalty=0.0))
    for _ in range(4):
        a, b = plain.sample(row), zero.sample(row)
        assert (a.token_id, a.logprob) == (b.token_id, b.logprob)


def test_penalties_subtract_per_generated_token() -> None:
    row = np.array([5.0, 4.0, 3.9, 0.0])
    # Presence: the argmax loses 1.5 once it was generated, so 1 (4.0) beats it (3.5) at the next step.
    presence = Sampler(params(temperature=0, presence_penalty=1.5))
    assert [presence.sample(row).token_id for _ in range(3)] == [0, 1, 2]
    # Frequency: 0.6 per occurrence. Token 0 wins twice (5.0, then 4.4 > 4.0), then 1 (4.0 > 3.8).
    frequency = Sampler(params(temperature=0, frequency_penalty=0.6))
    assert [frequency.sample(row).token_id for _ in range(3)] == [0, 0, 1]
    # A negative penalty favours repeats; `scored` (an accepted draft) counts like a sampled token.
    repeat = Sampler(params(temperature=0, presence_penalty=-2))
    repeat.scored(row, 3)
    assert repeat.probs(np.array([0.0, 0, 0, -1.5]))[3] == 1.0  # -1.5 + 2 is the argmax now


def test_penalties_leave_the_callers_row_alone() -> None:
    row = np.array([1.0, 2.0, 3.0])
    sampler = Sampler(params(temperature=0, frequency_penalty=2))
    sampler.sample(row)
    sampler.sample(row)
    assert row.tolist() == [1.0, 2.0, 3.0]


# --- SamplingParams checks (the request file's, in one place) --------------------------------------------


@pytest.mark.parametrize(("overrides", "field", "words"), [
    ({"temperature": -1}, "temperature", ">= 0"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"top_p": 5}, "top_p", "(0, 1]"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_k": -3}, "top_k", ">= 0"),
    ({"top_k": 2.0}, "top_k", "integer"),
    ({"max_generate_length": 0}, "max_generate_length", ">= 1"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": 5, "max_generate_length": 7}, "max_tokens", "give one"),
    ({"num_logprobs": 51}, "num_logprobs", "0..50"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias[-1]", "token id"),
    ({"logit_bias": {3: 101}}, "logit_bias[3]", "[-100, 100]"),
    ({"stop": ""}, "stop", "non-empty"),
    ({"stop": ["ok", 3]}, "stop[1]", "non-empty string"),
    ({"seed": -1}, "seed", ">= 0"),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": "1"}, "frequency_penalty", "number"),
])
def test_sampling_params_refuse_bad_values(overrides: dict[str, object], field: str, words: str) -> None:
    with pytest.raises(KvforgeError) as info:
        SamplingParams(**overrides)  # type: ignore[arg-type]
    assert info.value.field == field and words in info.value.message
    assert "\n" not in str(info.value)


def test_sampling_params_normalize_stop_and_max_tokens() -> None:
    assert SamplingParams(stop="Paris").stop == ("Paris",)  # one stop string, not five characters
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(max_tokens=12).max_generate_length == 12
    assert SamplingParams(max_tokens=12, max_generate_length=12).max_generate_length == 12
    assert SamplingParams(logit_bias={"7": 1}).logit_bias == {7: 1}


# --- greedy without the float64 row copy -------------------------------------------------------------------


def slow_greedy(row: np.ndarray, bias: dict[int, float],
                num_logprobs: int) -> tuple[int, float, list[tuple[int, float]]]:
    """Greedy sampling as the general path computes it: a float64 copy, the bias added, one log-sum-exp."""
    logits = row.astype(np.float64)
    for token_id, value in bias.items():
        logits[token_id] += value
    peak = logits.max()
    log_total = float(peak + np.log(np.exp(logits - peak).sum()))
    token_id = int(np.argmax(logits))
    logprobs = logits - log_total
    top = sorted(range(row.size), key=lambda i: (-logprobs[i], i))[:num_logprobs]
    return token_id, float(logits[token_id] - log_total), [(i, float(logprobs[i])) for i in top]


BIASES = st.dictionaries(st.integers(0, 39), st.sampled_from([-100.0, -1.5, 0.25, 3.0, 40.0]), max_size=4)


@given(LOGITS, BIASES, st.integers(0, 3))
@example(np.array([1.0, 5.0, 5.0, 2.0], np.float32), {2: 0.0}, 2)  # a biased token tied with the best: lower id
@example(np.array([1.0, 5.0, 4.0, 2.0], np.float32), {1: -100.0}, 1)  # the best is biased away: the slow path
@example(np.array([1.0, 2.0, 7.0, 2.0], np.float32), {3: 5.0}, 1)  # a bias lifts another token to tie the best
def test_greedy_equals_the_general_path_to_the_last_bit(row: np.ndarray, bias: dict[int, float],
                                                         num_logprobs: int) -> None:
    """Greedy rows skip the float64 copy of the row (kvforge/runtime/sampling/sampler.py `sample`): the token, its
    logprob and the top logprobs must be what the general computation gives, bit for bit."""
    bias = {token_id: value for token_id, value in bias.items() if token_id < row.size}
    sampler = Sampler(params(temperature=0, num_logprobs=num_logprobs, logit_bias=bias))
    result = sampler.sample(row)
    token_id, logprob, top = slow_greedy(row, bias, num_logprobs)
    assert (result.token_id, result.logprob) == (token_id, logprob)
    assert result.top_logprobs == top
    assert sampler.sample(row).logprob == logprob  # its buffers reused: the same again


@pytest.mark.parametrize("greedy", [True, False])
def test_a_token_logprob_is_computed_only_when_asked(greedy: bool) -> None:
    """Without token_logprob or num_logprobs the sampled token is the same and its logprob is NaN (no log-sum-exp
    over the vocabulary); either one brings back the value of the full computation."""
    row = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    temperature = 0.0 if greedy else 1.0
    asked = Sampler(params(temperature=temperature)).sample(row)
    plain = Sampler(params(temperature=temperature, token_logprob=False)).sample(row)
    top = Sampler(params(temperature=temperature, token_logprob=False, num_logprobs=2)).sample(row)
    assert plain.token_id == asked.token_id == top.token_id
    assert np.isnan(plain.logprob) and plain.top_logprobs == []
    assert top.logprob == asked.logprob and not np.isnan(asked.logprob)
    assert SamplingParams().token_logprob is False

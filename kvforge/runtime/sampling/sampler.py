"""Picks the next token from last-token logits on the host, reproducibly, without pulling in torch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvforge.contract.errors import KvforgeError
from kvforge.runtime.sampling.grammar import GrammarConstraint
from kvforge.runtime.types import SamplingParams


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprob: float  # log-probability of token_id (see Sampler.sample); NaN unless token_logprob or num_logprobs
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # best first, ties → lower id


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis in float64; subtracting the max keeps exp() from overflowing."""
    x = np.asarray(x, dtype=np.float64)
    peak = np.max(x, axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)  # a row of -inf stays -inf/nan instead of inf - inf
    shifted = x - peak
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def greedy_tokens(logits: np.ndarray) -> np.ndarray:
    """Argmax over the last axis for a whole batch ([B, V] -> [B] int64); ties go to the lowest id."""
    return np.argmax(np.asarray(logits), axis=-1).astype(np.int64)


def top_ids(values: np.ndarray, count: int) -> np.ndarray:
    """Ids of the `count` largest values, best first, ties broken by lower id (deterministic output)."""
    count = min(count, values.shape[-1])
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    # Partition to a threshold first so a 150k vocabulary is not fully sorted for a handful of ids.
    threshold = np.partition(values, values.shape[-1] - count)[values.shape[-1] - count]
    candidate_ids = np.flatnonzero(values >= threshold)
    order = np.lexsort((candidate_ids, -values[candidate_ids]))
    return candidate_ids[order[:count]].astype(np.int64)


class Sampler:
    """Sampling state of one sequence: its parameters and its own seeded random stream."""

    def __init__(self, params: SamplingParams, constraint: GrammarConstraint | None = None,
                 prompt_ids: Sequence[int] = ()) -> None:
        """`constraint`: the sequence's own grammar state (response_format), masking every row it samples;
        `prompt_ids`: the prompt, which repetition_penalty also penalizes (vLLM's and HF's rule)."""
        self.params = params
        self.constraint = constraint
        self.rng = np.random.default_rng(params.seed)  # seed None → fresh OS entropy
        self._bias_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64, count=len(params.logit_bias))
        self._bias_values = np.fromiter(params.logit_bias.values(), dtype=np.float64,
                                        count=len(params.logit_bias))
        # Reused float64 rows: fresh 1 MiB temporaries per token cost more in page faults than the math.
        self._logits = np.empty(0, dtype=np.float64)
        self._scratch = np.empty(0, dtype=np.float64)
        # How often each token was generated, for the penalties: every token `sample` or `scored` returns is
        # committed to the sequence (the verifiers stop at the first one they do not keep), so counting here
        # also covers the drafts accepted earlier in the same step.
        self._generated: dict[int, int] = {}
        self._logprobs_wanted = params.token_logprob or params.num_logprobs > 0
        self._prompt_ids = np.unique(np.asarray(prompt_ids, dtype=np.int64)) if params.repetition_penalty != 1 \
            else np.zeros(0, dtype=np.int64)

    def sample(self, logits_row: np.ndarray) -> SampleResult:
        """Draw one token from a [V] row of logits.

        Order: logit_bias and the penalties, then greedy argmax or temperature -> top-k -> top-p -> draw. The
        reported logprobs are the log-softmax of the logits after logit_bias and the penalties but before
        temperature/top-k/top-p:
        that is the model's own distribution as the user biased it, which is what OpenAI-style clients
        expect, and it does not collapse to 0/-inf under greedy decoding.
        """
        if self.params.is_greedy and self.constraint is None and not self.params.has_penalties:
            fast = self._greedy(np.asarray(logits_row))
            if fast is not None:
                return fast
        logits = self._biased(logits_row)
        token_id = int(np.argmax(logits)) if self.params.is_greedy else self._draw(logits)
        self._count(token_id)
        return self._result(logits, token_id)

    def _result(self, logits: np.ndarray, token_id: int) -> SampleResult:
        if not self._logprobs_wanted:
            return SampleResult(token_id=token_id, logprob=math.nan)
        # One log-sum-exp instead of a full log_softmax row: only a few logprobs are ever read.
        log_total = _log_sum_exp(logits, self._scratch)
        return SampleResult(token_id=token_id, logprob=float(logits[token_id] - log_total),
                            top_logprobs=self._top_logprobs(logits, log_total))

    def scored(self, logits_row: np.ndarray, token_id: int) -> SampleResult:
        """The result for a token chosen elsewhere (an accepted draft): its logprob and top logprobs as `sample`
        would report them for this row."""
        logits = self._biased(logits_row)
        self._count(token_id)
        return self._result(logits, token_id)

    def probs(self, logits_row: np.ndarray) -> np.ndarray:
        """The distribution `sample` draws from for this row, as a [V] float64 vector (a copy): logit_bias, then
        temperature, top-k and top-p, renormalized; one-hot at the argmax for greedy. Rejection sampling of draft
        tokens compares it against the drafter's."""
        logits = self._biased(logits_row)
        out = np.zeros(logits.size, dtype=np.float64)
        if self.params.is_greedy:
            out[int(np.argmax(logits))] = 1.0
            return out
        candidate_ids, probs = self._candidates(logits)
        out[candidate_ids] = probs / probs.sum()
        return out

    def draw_from(self, probs: np.ndarray) -> int:
        """A token drawn from a [V] distribution (not necessarily normalized) with this sequence's random stream."""
        return self._pick(np.asarray(probs, dtype=np.float64))

    def _top_logprobs(self, logits: np.ndarray, log_total: float) -> list[tuple[int, float]]:
        if self.params.num_logprobs <= 0:
            return []
        # Rank the reported values themselves, so logits that round to the same logprob tie by id.
        logprobs = np.subtract(logits, log_total, out=self._scratch)
        return [(int(i), float(logprobs[i])) for i in top_ids(logprobs, self.params.num_logprobs)]

    def _greedy(self, row: np.ndarray) -> SampleResult | None:
        """Greedy decoding with nothing but logit_bias to apply, without the float64 copy of the row that `_biased`
        makes (a decode step's sampling was ~0.3 ms of SmolLM2's ~6 ms, mostly that copy and the passes over it):
        the same token and the same logprobs to the last bit, from the same float64 operations on the same values.
        None where the slow path must decide: a non-finite best logit (it raises or masks), a biased best token (the
        best of the rest is then needed), a bias id outside the row (it raises)."""
        if row.ndim != 1 or row.size == 0 or row.dtype.kind != "f":
            return None
        best = int(np.argmax(row))  # the first NaN where there is one
        value = float(row[best])
        ids = self._bias_ids
        if not np.isfinite(value) or (ids.size and ((ids < 0) | (ids >= row.size) | (ids == best)).any()):
            return None
        biased = row[ids].astype(np.float64) + self._bias_values  # as `_biased` adds them, in float64
        token_id, peak = best, value
        for bias_id, biased_value in zip(ids.tolist(), biased.tolist(), strict=True):
            if biased_value > peak or (biased_value == peak and bias_id < token_id):
                token_id, peak = bias_id, biased_value
        self._count(token_id)
        if not self._logprobs_wanted:
            return SampleResult(token_id=token_id, logprob=math.nan)
        if self._scratch.size != row.size:
            self._logits, self._scratch = np.empty(row.size), np.empty(row.size)
        shifted = np.subtract(row, peak, out=self._scratch, dtype=np.float64)
        shifted[ids] = biased - peak
        np.exp(shifted, out=shifted)
        log_total = float(peak + np.log(shifted.sum()))  # peak is also the chosen token's biased logit
        top: list[tuple[int, float]] = []
        if self.params.num_logprobs > 0:
            logprobs = np.subtract(row, log_total, out=self._scratch, dtype=np.float64)
            logprobs[ids] = biased - log_total
            top = [(int(i), float(logprobs[i])) for i in top_ids(logprobs, self.params.num_logprobs)]
        return SampleResult(token_id=token_id, logprob=peak - log_total, top_logprobs=top)

    def _biased(self, logits_row: np.ndarray) -> np.ndarray:
        row = np.asarray(logits_row)
        if row.ndim != 1 or row.size == 0:
            raise ValueError(f"expected a non-empty [V] logits row, got shape {row.shape}")
        if self._logits.size != row.size:
            self._logits, self._scratch = np.empty(row.size), np.empty(row.size)
        logits = self._logits
        np.copyto(logits, row)  # a float64 copy: the caller's buffer is left alone
        if self._bias_ids.size:
            outside = (self._bias_ids < 0) | (self._bias_ids >= logits.size)
            if outside.any():
                bad_id = int(self._bias_ids[outside][0])
                raise KvforgeError(f"token id {bad_id} is outside the vocabulary (size {logits.size})",
                                   "logit_bias")
            logits[self._bias_ids] += self._bias_values
        if (self._generated or self._prompt_ids.size) and self.params.has_penalties:
            self._penalize(logits)
        if self.constraint is not None:  # last: a bias or penalty must not lift a token the grammar refuses
            self.constraint.mask(logits)
        peak = logits.max()  # NaN propagates into max, so one reduction checks the whole row
        if np.isnan(peak) or peak == np.inf:
            raise KvforgeError("the engine produced NaN or +inf logits", "logits")
        if peak == -np.inf:
            raise KvforgeError("every token is masked (all logits are -inf)", "logits")
        return logits

    def _count(self, token_id: int) -> None:
        if self.constraint is not None:  # every token counted here is committed: the grammar moves past it
            self.constraint.advance(token_id)
        if self.params.has_penalties:  # nothing to keep otherwise: the common case costs one attribute read
            self._generated[token_id] = self._generated.get(token_id, 0) + 1

    def _penalize(self, logits: np.ndarray) -> None:
        """repetition_penalty first (vLLM's order): a positive logit of every prompt or generated token divided by it,
        a negative one multiplied; then OpenAI's: logit -= frequency_penalty * count + presence_penalty, for each
        generated token."""
        ids = np.fromiter(self._generated.keys(), dtype=np.int64, count=len(self._generated))
        counts = np.fromiter(self._generated.values(), dtype=np.float64, count=len(self._generated))
        inside = ids < logits.size  # a token id past the row cannot come from it; kept out of the index
        penalty = self.params.repetition_penalty
        if penalty != 1:
            seen = np.union1d(self._prompt_ids, ids)
            seen = seen[(seen >= 0) & (seen < logits.size)]
            values = logits[seen]
            logits[seen] = np.where(values > 0, values / penalty, values * penalty)
        logits[ids[inside]] -= self.params.frequency_penalty * counts[inside] + self.params.presence_penalty

    def _draw(self, logits: np.ndarray) -> int:
        candidate_ids, probs = self._candidates(logits)
        return int(candidate_ids[self._pick(probs)])

    def _candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Ids that may be drawn and their (unnormalized after top-p) probabilities: temperature, min-p, top-k,
        top-p."""
        params = self.params
        # Shift before dividing: (x - max) / T is <= 0, so a tiny temperature cannot overflow to inf.
        scaled = np.subtract(logits, logits.max(), out=self._scratch)  # scratch is free after the lse
        scaled /= params.temperature
        if params.min_p > 0:  # log(p / p_best) of each token is `scaled` itself: the best token always stays
            scaled[scaled < math.log(params.min_p)] = -np.inf
        if 0 < params.top_k < scaled.size:
            candidate_ids = top_ids(scaled, params.top_k)
            probs = np.exp(scaled[candidate_ids])
            probs /= probs.sum()  # renormalized over the top-k, as top-p then sees them
        else:
            all_probs = np.exp(scaled)
            all_probs /= all_probs.sum()
            candidate_ids = (_nucleus_order(scaled, all_probs, params.top_p) if params.top_p < 1
                             else np.arange(scaled.size))  # no filtering: the order does not matter
            probs = all_probs[candidate_ids]
        if params.top_p < 1:
            # Keep the shortest best-first prefix whose mass reaches top_p; the first token always stays.
            mass_before = np.cumsum(probs) - probs
            keep = max(int(np.count_nonzero(mass_before < params.top_p)), 1)
            candidate_ids, probs = candidate_ids[:keep], probs[:keep]
        return candidate_ids, probs

    def _pick(self, probs: np.ndarray) -> int:
        """Inverse-CDF draw; a zero-probability entry can never be chosen, even after rounding."""
        cumulative = np.cumsum(probs)
        index = int(np.searchsorted(cumulative, self.rng.random() * cumulative[-1], side="right"))
        last_positive = int(np.flatnonzero(probs > 0)[-1])
        return min(index, last_positive)


def _log_sum_exp(x: np.ndarray, scratch: np.ndarray) -> float:
    """log(sum(exp(x))) with the max subtracted first; `scratch` is a same-sized buffer to work in."""
    peak = x.max()
    np.subtract(x, peak, out=scratch)
    np.exp(scratch, out=scratch)
    return float(peak + np.log(scratch.sum()))


def _nucleus_order(scaled: np.ndarray, probs: np.ndarray, top_p: float) -> np.ndarray:
    """Best-first ids covering at least top_p of the mass, without sorting the whole vocabulary if possible.

    The nucleus is usually tens to hundreds of tokens; a full stable argsort of 150k logits costs ~25 ms.
    The prefix test uses cumsum, the same sum the caller cuts with, so both agree to the last bit.
    """
    count = 256
    while count <= scaled.size // 8:  # past that a full sort is cheaper than another partition
        ids = top_ids(scaled, count)
        if np.cumsum(probs[ids])[-1] >= top_p:
            return ids
        count *= 8
    return np.argsort(-scaled, kind="stable")  # stable: ties keep the lower id first


def sample_batch(samplers: Sequence[Sampler], logits: np.ndarray) -> list[SampleResult]:
    """Sample row b of [B, V] logits with samplers[b]; each sequence keeps its own random stream."""
    if logits.ndim != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"expected [{len(samplers)}, V] logits, got shape {logits.shape}")
    return [sampler.sample(row) for sampler, row in zip(samplers, logits, strict=True)]

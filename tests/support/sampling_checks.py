"""What the temperature > 0 speculative tests share: the histogram of seeded runs' first two tokens, and the
distance between two of them."""

from __future__ import annotations

from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import SamplingParams
from support.engine_driver import step_audited

RUNS = 600
PROMPT = list(range(5, 11))


def first_two_tokens(engine, max_generate_length: int, runs: int = RUNS) -> dict[tuple[int, ...], int]:
    """`runs` seeded requests (temperature 1, top-3, EOS suppressed): how often each pair of first two tokens came."""
    eos = engine.engine_dir.model.eos_token_ids[0]
    ids = [engine.add_request(EngineRequest(list(PROMPT), SamplingParams(
        temperature=1.0, top_k=3, top_p=1.0, seed=seed, max_generate_length=max_generate_length,
        logit_bias={eos: -100.0}))) for seed in range(runs)]
    finished = step_audited(engine)
    counts: dict[tuple[int, ...], int] = {}
    for rid in ids:
        key = tuple(finished[rid].token_ids[:2])  # the second is verified: a draft kept or replaced
        counts[key] = counts.get(key, 0) + 1
    return counts


def second_token_ranking(counts: dict[tuple[int, ...], int]) -> list[int]:
    """Second tokens, most frequent first."""
    seconds: dict[int, int] = {}
    for (_, second), count in counts.items():
        seconds[second] = seconds.get(second, 0) + count
    return sorted(seconds, key=seconds.__getitem__, reverse=True)


def total_variation(a: dict[tuple[int, ...], int], b: dict[tuple[int, ...], int], runs: int = RUNS) -> float:
    return sum(abs(a.get(o, 0) - b.get(o, 0)) for o in set(a) | set(b)) / (2 * runs)

"""Which restored document tokens a request recomputes beyond each document's first page (types/document_chunks.py
applies them): `overlap`'s lexical guess, and `attention` (issue 53), which reads the documents the question attends
to from the attention kernel's mass output and spends a repair budget on them.

Decisions, written down as the issue asks:

- **It combines with `first-page`.** Every document's first page is recomputed at admission, as `first-page` does;
  a document's first stored token was computed at position 0, where it became an attention sink, and left
  unrepaired it draws the question's attention for that reason alone, which would rank documents by nothing.
  Budget 0 is exactly `first-page`.
- **The pass.** The request computes its prompt up to (not including) its last token with the documents restored
  (first pages repaired); meanwhile the CPU kernel sums the softmax probabilities of the question's rows (the prompt
  after its last document) over every position, every query head and every layer (`MassMeter`: a watch armed on
  the request's question page, kvforge/plugins/attention_mass.py). The last token is left to the second pass so the
  first pass samples nothing.
- **The choice.** A document's share is the mass over its positions. The budget, a fraction of the request's
  document tokens, is spent in order of share: each chosen document's repair extends from its first page towards its
  end (a partial repair is still contiguous from the document's start), the next document gets what is left. A
  budget of 1.0 repairs every document whole: the second pass then computes what `full` computes.
- **The second pass** recomputes from the first newly repaired position on: the chosen tokens in place, and every
  computed token after them (the question included, whose K/V was computed over unrepaired documents); the
  documents still restored are skipped as before. `lease.exact_tokens` stays at the first restored position, so
  nothing of either pass becomes findable under exact keys.
- **Counted**: `attention_passes` (passes whose mass was read) and `attention_repaired_tokens` (the tokens they
  chose); those tokens also move from `reused_tokens` to `repaired_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

import numpy as np

from kvforge.contract.errors import InvalidConfig

# The setup's entry for the kernel's meter (CacheSetup.copier): the engine gives one with `--documentRepair
# attention` on the CPU kernel, and refuses the policy without it (runtime/engine/config.py).
ATTENTION_METER = "document_attention_mass"
# The fraction of a request's document tokens the pass may recompute beyond the first pages. Measured on SmolLM2
# (64 requests showing 4 of 16 reports, docs/document-reuse.md): 0.1 kept 75 % of prompt tokens cached (first-page
# 84 %) and raised greedy agreement with cold over 8 tokens from 45/64 to 50/64 and answers from 13 to 16 of 64;
# 0.25 cached 61 % for 52/64 and 17; 0.5 cached 39 % for 61/64 and 24 (cold 26). The cheapest point that gains.
DEFAULT_REPAIR_BUDGET = 0.1


class Hit(Protocol):
    """A document hit (document_chunks.DocumentHit): tokens [start, start + repair) of it are recomputed."""

    @property
    def start(self) -> int: ...

    @property
    def length(self) -> int: ...

    @property
    def repair(self) -> int: ...


H = TypeVar("H", bound=Hit)


class MassReading(Protocol):
    mass: np.ndarray  # [positions]: probability summed over the watched rows, heads and layers
    rows: int  # (query row, head, layer call) softmaxes summed: 0 when the kernel never saw the sequence


class MassMeter(Protocol):
    """The attention kernel's mass output (kvforge/plugins/attention_mass.py `AttentionMassMeter`)."""

    def watch(self, page: int, page_index: int, query_from: int, positions: int) -> Any | None: ...

    def read(self, watch: Any) -> MassReading: ...


@dataclass(frozen=True, slots=True)
class QuestionPass:
    """A lease's pass in progress: the question starts at `query_from`; the first pass ends at `end`."""

    query_from: int
    end: int
    watch: Any


def check_budget(budget: object) -> float:
    """`--documentRepairBudget` as a float in [0, 1], or InvalidConfig naming it."""
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0.0 <= float(budget) <= 1.0:
        raise InvalidConfig(f"must be a fraction of the document tokens in [0, 1], got {budget!r}",
                            "document_repair_budget")
    return float(budget)


def start_pass(meter: MassMeter | None, page_ids: Sequence[int], tokens_per_page: int, query_from: int,
               num_tokens: int) -> QuestionPass | None:
    """Arm a watch on the request's question rows [query_from, num_tokens - 1), or None when there are none (the
    question is the last token alone) or no meter or watch is left: the request then keeps its first-page repair."""
    end, index = num_tokens - 1, query_from // tokens_per_page
    if meter is None or query_from >= end or index >= len(page_ids):
        return None
    watch = meter.watch(int(page_ids[index]), index, query_from, num_tokens)
    return None if watch is None else QuestionPass(query_from, end, watch)


def document_shares(mass: np.ndarray, spans: Sequence[tuple[int, int]]) -> list[float]:
    """Each document's share of the question's attention: the mass over its positions [start, start + length)."""
    return [float(np.asarray(mass[start:start + length], dtype=np.float64).sum()) for start, length in spans]


def spend_budget(spans: Sequence[tuple[int, int, int]], shares: Sequence[float], budget: float) -> list[int]:
    """The new repair of each document (start, length, repair): `budget` x the documents' tokens, spent in order of
    share (ties: the earlier document), each extending its repair towards its end."""
    left = int(budget * sum(length for _, length, _ in spans) + 1e-9)
    repairs = [repair for _, _, repair in spans]
    for i in sorted(range(len(spans)), key=lambda i: (-shares[i], i)):
        if left <= 0:
            break
        extra = min(spans[i][1] - repairs[i], left)
        repairs[i] += extra
        left -= extra
    return repairs


def chosen_repairs(reading: MassReading, hits: Sequence[H], budget: float) -> tuple[H, ...]:
    """`attention`: the hits with the repairs the question's mass chose (unchanged when the kernel never saw the
    question: the first pages stay the repair)."""
    if not reading.rows:
        return tuple(hits)
    shares = document_shares(reading.mass, [(hit.start, hit.length) for hit in hits])
    repairs = spend_budget([(hit.start, hit.length, hit.repair) for hit in hits], shares, budget)
    return tuple(replace(hit, repair=repair) for hit, repair in zip(hits, repairs, strict=True))  # type: ignore


def closest_to_question(hits: Sequence[H], tokens: np.ndarray, documents: Sequence[tuple[int, int]]) -> list[H]:
    """`overlap`: besides each document's first page, recompute the whole document that shares the most distinct
    token ids with the question (the prompt after its last document). A lexical stand-in for the document the
    question attends to most, which `attention` reads from the kernel."""
    question = set(tokens[max(start + length for start, length in documents):].tolist())
    scores = [len(question & set(tokens[hit.start:hit.start + hit.length].tolist())) for hit in hits]
    best = max(range(len(hits)), key=lambda i: (scores[i], -i))
    if not scores[best]:
        return list(hits)
    return [replace(hit, repair=hit.length) if i == best else hit for i, hit in enumerate(hits)]  # type: ignore

"""A model-free engine: the product's scheduler, cache, state manager and loop over a backend that computes nothing.

The fake's "K/V" is the token id written at each pool position and its "recurrent state" is (tokens consumed, a
rolling hash of them); the next token is a hash of the context. Every row first checks that every earlier
position of its pages and its state hold exactly the sequence's tokens, so a wrong hit page, a wrong restore, a
page overwritten under another record or a rollback that left a draft in the state fails at once, and a finished
request can be compared with `cold_answer`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvforge.runtime.context_cache.manager import ContextCacheManager
from kvforge.runtime.engine.core import EngineCore
from kvforge.runtime.engine.output import OutputProcessor
from kvforge.runtime.engine.scheduler import ExternalLoader, Scheduler
from kvforge.runtime.engine.state import CheckpointPolicy, StateManager
from kvforge.runtime.execution.recurrent_state import RecurrentStates
from kvforge.runtime.execution.snapshots import PartialKVSnapshotStore, RecurrentSnapshotStore
from kvforge.runtime.profile import Profiler
from kvforge.runtime.step import BatchOutput, ScheduledRow
from kvforge.runtime.types import Deployment

VOCAB = 97
FIRST_TOKEN = 100  # generated ids live above the prompts' (documents and questions use ids below 100)
MODULUS = 65521  # the rolling hash stays exact in the fp32 state rows
STATE = "recurrent_state_0"


def rolling_hash(tokens: list[int], value: int = 0) -> int:  # 0: a zeroed state row, no token seen
    for token in tokens:
        value = (value * 31 + token) % MODULUS
    return value


def next_token(context: list[int]) -> int:
    return FIRST_TOKEN + rolling_hash(context) % VOCAB


def cold_answer(prompt: list[int], length: int) -> list[int]:
    """What greedy decoding of `prompt` gives, computed without any engine."""
    context, out = list(prompt), []
    for _ in range(length):
        out.append(next_token(context))
        context.append(out[-1])
    return out


class TokenPool:
    """The KV pool as KVStorage: one "layer" whose page p holds the token ids written at its T positions."""

    def __init__(self, num_pages: int, tokens_per_page: int) -> None:
        self.pages = np.full((max(num_pages, 1), tokens_per_page), -1, dtype=np.int64)

    @property
    def nbytes(self) -> int:
        return int(self.pages.nbytes)

    def read_page(self, page: int) -> list[np.ndarray]:
        return [self.pages[page].copy()]

    def write_page(self, page: int, stored: list[np.ndarray]) -> None:
        self.pages[page] = stored[0]

    def read_tokens(self, page_ids: list[int], num_tokens: int) -> list[np.ndarray]:
        raise AssertionError("the legacy system-prompt cache is not part of the model-free engine")

    def write_tokens(self, page_ids: list[int], stored_rows: list[np.ndarray]) -> None:
        raise AssertionError("the legacy system-prompt cache is not part of the model-free engine")


class FakeExecutor:
    """Runs scheduled rows against the TokenPool and the state rows, checking what it reads."""

    def __init__(self, pool: TokenPool, state: StateManager, tokens_per_page: int, paged: bool) -> None:
        self.pool, self.state, self.T, self.paged = pool, state, tokens_per_page, paged
        self.calls = 0

    def run(self, rows: list[ScheduledRow]) -> BatchOutput:
        self.calls += 1
        logits = []
        for row in rows:
            seq, lease = row.seq, row.seq.lease
            assert lease is not None
            start = seq.num_computed_tokens
            context = seq.all_token_ids()[:start]
            new = seq.all_token_ids()[start:start + row.num_new_tokens] + list(row.draft_token_ids)
            assert len(new) == row.num_new_tokens + len(row.draft_token_ids)
            if self.paged:
                for p in range(start):  # attention reads every earlier position
                    assert self.pool.pages[lease.page_ids[p // self.T], p % self.T] == context[p], \
                        f"position {p} of a KV page holds another token"
                for i, token in enumerate(new):
                    p = start + i
                    self.pool.pages[lease.page_ids[p // self.T], p % self.T] = token
            else:
                assert lease.page_ids == []
            if self.state.states is not None:
                row_state = self.state.states.arrays[STATE][self.state.rows[lease]]
                assert (int(row_state[0]), int(row_state[1])) == (start, rolling_hash(context)), \
                    "the recurrent state is not this sequence's prefix"
                row_state[:] = (start + len(new), rolling_hash(new, rolling_hash(context)))
            positions = range(row.num_new_tokens - 1, len(new))
            row_logits = np.zeros((len(positions), VOCAB + FIRST_TOKEN), dtype=np.float32)
            for i, position in enumerate(positions):
                row_logits[i, next_token(context + new[:position + 1])] = 10.0
            logits.append(row_logits)
        return BatchOutput(logits)


class FakeTokenizer:
    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    def token_text(self, token_id: int) -> str:
        return str(token_id)


@dataclass(slots=True)
class ModelFreeEngine:
    core: EngineCore
    cache: ContextCacheManager
    scheduler: Scheduler
    state: StateManager
    executor: FakeExecutor


def model_free_engine(deployment: Deployment, *, num_pages: int, tokens_per_page: int = 4, reuse: bool = True,
                      partial_slots: int = 0, recurrent_slots: int = 0, max_records: int = 1024,
                      max_batch_size: int = 4, max_num_tokens: int = 32, chunk: int = 64,
                      checkpoints: CheckpointPolicy | None = None, capacity: int = 1 << 20,
                      loader: ExternalLoader | None = None, eos_ids: set[int] = frozenset()) -> ModelFreeEngine:
    """The product's parts wired as Engine wires them, over the fake backend (what Engine builds from a dir)."""
    paged = deployment is not Deployment.PURE_RECURRENT
    pool = TokenPool(num_pages if paged else 0, tokens_per_page)
    states = None if deployment is Deployment.VANILLA else RecurrentStates({STATE: (2,)}, max_batch_size)
    partial = PartialKVSnapshotStore(pool, partial_slots) if partial_slots and paged else None
    recurrent = RecurrentSnapshotStore(states, recurrent_slots) if states is not None and recurrent_slots else None
    policy = checkpoints or CheckpointPolicy(enabled=recurrent is not None)
    state = StateManager(tokens_per_page=tokens_per_page, states=states, partial=partial, recurrent=recurrent,
                         system_prompts=None, checkpoints=policy)
    cache = ContextCacheManager(num_pages if paged else 0, tokens_per_page, enabled=reuse, max_records=max_records,
                                partial_kv_snapshot_slots=partial_slots if paged else 0,
                                recurrent_snapshot_slots=recurrent_slots, deployment=deployment, copier=state)
    outputs = OutputProcessor(FakeTokenizer(), frozenset(eos_ids), capacity)  # type: ignore[arg-type]
    scheduler = Scheduler(cache, state, outputs, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                          prefill_chunk_tokens=chunk, max_seq_tokens=capacity, loader=loader)
    executor = FakeExecutor(pool, state, tokens_per_page, paged)
    return ModelFreeEngine(EngineCore(scheduler, executor, outputs, Profiler()), cache, scheduler, state, executor)

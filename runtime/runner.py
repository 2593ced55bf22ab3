"""The engine runner boundary: what one engine call takes and returns, whatever the backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvforge.runtime.kv_pool import KVPool


@dataclass(slots=True)
class StepInputs:
    """One engine call over B rows: each row has `kvcache_start_index` tokens cached already and
    `context_lengths` new tokens (padded to S) whose pages are allocated in `page_ids`."""

    inputs_embeds: np.ndarray  # [B, S, H] float32
    context_lengths: np.ndarray  # [B] int32
    kvcache_start_index: np.ndarray  # [B] int32
    page_ids: list[list[int]]  # per row, pages covering positions [0, start + length)
    lora_tensors: dict[str, np.ndarray] | None = None  # per-row adapters [B, in, r] / [B, r, out]; None = base


class EngineRunner(Protocol):
    pool: KVPool

    def forward(self, step: StepInputs) -> np.ndarray:
        """Runs one call, writes the new tokens' K/V into the pool and returns last-token logits [B, V]."""
        ...

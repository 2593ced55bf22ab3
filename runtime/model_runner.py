"""Turns scheduled rows into one engine call: embedding lookup, per-row LoRA inputs, page tables, forward."""

from __future__ import annotations

import numpy as np

from kvforge.runtime.lora import LoraAdapter, stack_adapters
from kvforge.runtime.runner import EngineRunner, StepInputs
from kvforge.runtime.scheduler import ScheduledRow


class ModelRunner:
    """Owns what an engine call needs besides the pool: the embedding table and the stacked adapters."""

    __slots__ = ("runner", "embedding", "_lora_shapes", "_lora_stack", "_lora_stack_key")

    def __init__(self, runner: EngineRunner, embedding: np.ndarray, lora_shapes: dict[str, tuple[int, int]]) -> None:
        self.runner = runner
        self.embedding = embedding
        self._lora_shapes = lora_shapes
        self._lora_stack: dict[str, np.ndarray] | None = None
        self._lora_stack_key: tuple[int, ...] = ()

    def forget_adapters(self) -> None:
        """Call when adapters are (re)loaded: ids of replaced adapter objects may be reused by new ones."""
        self._lora_stack_key = ()

    def run(self, rows: list[ScheduledRow]) -> np.ndarray:
        """One engine call for all rows, whatever their adapters; returns each row's last-token logits [B, V]."""
        new_ids = []
        for row in rows:
            start = row.seq.num_computed_tokens
            new_ids.append(row.seq.all_token_ids()[start:start + row.num_new_tokens])
        width = max(len(ids) for ids in new_ids)
        embeds = np.zeros((len(rows), width, self.embedding.shape[1]), dtype=np.float32)
        for i, ids in enumerate(new_ids):
            embeds[i, :len(ids)] = self.embedding[ids]
        step = StepInputs(embeds, np.array([len(ids) for ids in new_ids], dtype=np.int32),
                          np.array([row.seq.num_computed_tokens for row in rows], dtype=np.int32),
                          [row.seq.lease.page_ids for row in rows],  # type: ignore[union-attr]
                          self._lora_inputs([row.seq.request.adapter for row in rows]))
        return self.runner.forward(step)

    def _lora_inputs(self, adapters: list[LoraAdapter | None]) -> dict[str, np.ndarray] | None:
        """Stacked per-row adapters, rebuilt only when the batch's adapter composition changes."""
        if all(a is None for a in adapters):
            return None
        key = tuple(id(a) for a in adapters)
        if self._lora_stack_key != key:
            self._lora_stack = stack_adapters(adapters, self._lora_shapes)
            self._lora_stack_key = key
        return self._lora_stack

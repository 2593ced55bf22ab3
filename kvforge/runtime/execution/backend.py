"""The engine runner boundary: what one engine call takes and returns, and the KV storage a runner owns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvforge.runtime.execution.recurrent_state import RecurrentStates


@dataclass(slots=True)
class StepInputs:
    """One engine call over B rows: each row has `kvcache_start_index` tokens cached already and
    `context_lengths` new tokens (padded to S) whose pages are allocated in `page_ids`.

    `context_lengths` keeps TensorRT Edge-LLM's binding name although it counts only the *new* tokens.
    `logits_indices` are the positions whose logits (and hidden states) come back: flat indices b * S + t into the
    call's [B, S] grid (`inputs_embeds`' first two dims); None = each row's last new token (`last_token_indices`).
    """

    inputs_embeds: np.ndarray  # [B, S, H] float32
    context_lengths: np.ndarray  # [B] int32: new tokens per row
    kvcache_start_index: np.ndarray  # [B] int32: tokens already in the pool per row
    page_ids: list[list[int]]  # per row, pages covering positions [0, start + length)
    lora_tensors: dict[str, np.ndarray] | None = None  # per-row adapters [B, in, r] / [B, r, out]; None = base
    adapter_start: np.ndarray | None = None  # [B] int32: first adapted position (activated LoRA); None = all 0
    # recurrent engines: each row's recurrent state row (kvforge/runtime/recurrent_state)
    state_rows: list[int] | None = None
    logits_indices: np.ndarray | None = None  # [N] int64; None = last_token_indices(...)
    # Engines with hidden_states: the positions they come back at (flat, like logits_indices); None = logits_indices.
    hidden_indices: np.ndarray | None = None
    # Named graph inputs beyond the contract's (an EAGLE3 draft's hidden-state inputs [B, S, width]).
    extra_inputs: dict[str, np.ndarray] | None = None
    # Tree attention (engines built with tree_attention): each new token's RoPE position [B, S] int32 (None = start
    # + i) and which new tokens each new token sees [B, S, S] bool (None = causal). K/V is still written at start + i.
    position_ids: np.ndarray | None = None
    attention_mask: np.ndarray | None = None
    # Page groups beside the global one (`page_ids`), by group name: per row, that group's table (the sliding-window
    # group's: -1 where a page fell out of the window). Filled from the cache type that owns each group.
    page_tables: dict[str, list[list[int]]] = field(default_factory=dict)

    def positions(self) -> np.ndarray:
        """The call's logits_indices as int64 [N], the default resolved."""
        if self.logits_indices is None:
            return last_token_indices(self.context_lengths, self.inputs_embeds.shape[1])
        indices = np.asarray(self.logits_indices, dtype=np.int64)
        grid = self.inputs_embeds.shape[0] * self.inputs_embeds.shape[1]
        if indices.ndim != 1 or not indices.size or indices.min() < 0 or indices.max() >= grid:
            raise AssertionError(f"logits_indices must be a non-empty [N] of positions in [0, {grid}), got {indices}")
        return indices

    def hidden_positions(self) -> np.ndarray:
        """Where hidden states come back: `hidden_indices`, or the logits positions."""
        if self.hidden_indices is None:
            return self.positions()
        return np.ascontiguousarray(self.hidden_indices, dtype=np.int64)


def last_token_indices(context_lengths: np.ndarray, width: int) -> np.ndarray:
    """Each row's last new token as a flat index b * width + length - 1: one logits row per row, in row order."""
    lengths = np.asarray(context_lengths, dtype=np.int64)
    return np.arange(len(lengths), dtype=np.int64) * width + lengths - 1


@dataclass(slots=True)
class ForwardOutput:
    """One call's results: `logits` [N, V] float32 at its logits_indices and, when the engine exports them,
    `hidden_states` [M, len(hidden_state_layers) * H] (model_config.hidden_state_layers) at its hidden positions."""

    logits: np.ndarray
    hidden_states: np.ndarray | None = None


class KVStorage(Protocol):
    """The KV pool as the runner holds it (host numpy arrays, or device memory). Only the runner and the
    stores it hands this to (the legacy system-prompt cache, the partial-KV snapshot store) touch K/V bytes."""

    # Each layer's page group (None: the global one, addressed by the lease's page ids; another: by the rows' table
    # of that group, e.g. the sliding layers' window group).
    layer_group: list[str | None]

    @property
    def nbytes(self) -> int: ...

    def read_tokens(self, page_ids: list[int], num_tokens: int) -> list[np.ndarray]:
        """Stored rows [n, 2, Hkv, D] of positions [0, num_tokens) per layer (host copies, storage dtype)."""
        ...

    def write_tokens(self, page_ids: list[int], stored_rows: list[np.ndarray]) -> None:
        """Write rows read by read_tokens back at positions [0, n) of another page-table row."""
        ...

    def copy_positions(self, page_ids: list[int], sources: list[int], targets: list[int]) -> None:
        """Move the rows at positions `sources` of one sequence to `targets` (all layers; sources read first)."""
        ...

    def read_page(self, page: int) -> list[np.ndarray]:
        """One whole page per layer [2, Hkv, T, D] in the storage dtype (a view or a copy: copy before writing)."""
        ...

    def write_page(self, page: int, stored: list[np.ndarray]) -> None:
        """Overwrite one whole page in every layer with what read_page returned (a snapshot restore)."""
        ...

    def read_group_page(self, page: int, group: str | None) -> list[np.ndarray]:
        """One page [2, Hkv, T, D] of each layer of page group `group` (a store with more than one group)."""
        ...

    def write_group_page(self, page: int, stored: list[np.ndarray], group: str | None) -> None:
        """Overwrite one page of each layer of `group` with what read_group_page returned."""
        ...


class Backend(Protocol):
    kv_store: KVStorage  # attention layers only; empty on a pure recurrent engine
    states: RecurrentStates | None  # recurrent layers' carried states; None on an attention-only engine

    def forward(self, step: StepInputs) -> ForwardOutput:
        """Runs one call over every new token of every row, writes their K/V into the pool (and each row's state
        after its last new token into its state row) and returns logits [N, V] at `step.positions()` in that
        order, with hidden states [N, layers * H] when the engine has them. Engines built before logits_indices
        return each row's last token only and refuse calls asking for other positions."""
        ...


def activation_values(adapter_start: np.ndarray | None, batch: int, graph_has_input: bool) -> np.ndarray | None:
    """The [B] int32 activation input of an engine call (activated LoRA), or None for a graph without the input;
    such a graph (exported before activated LoRA) cannot run a row whose adapter starts past position 0."""
    if not graph_has_input:
        if adapter_start is not None and adapter_start.any():
            from kvforge.contract.errors import KvforgeError
            raise KvforgeError("this engine has no adapter_activation_start input, so it cannot run an activated "
                               "LoRA; re-export the model with llm_export and rebuild it", "engine_dir")
        return None
    if adapter_start is None:
        return np.zeros(batch, dtype=np.int32)
    return np.ascontiguousarray(adapter_start, dtype=np.int32)

"""Turns scheduled rows into one engine call: embedding lookup, per-row LoRA inputs, page tables, forward."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import numpy as np

from kvforge.contract.engine_dir import PER_LAYER_INPUT
from kvforge.runtime.adapters import LoraAdapter, stack_adapters
from kvforge.runtime.context_cache.lease import Lease
from kvforge.runtime.execution.backend import Backend, ForwardOutput, StepInputs
from kvforge.runtime.execution.corrections import AdapterCorrector
from kvforge.runtime.execution.tree_attention import ancestor_mask, causal_masks, start_positions
from kvforge.runtime.sequence import Sequence
from kvforge.runtime.step import BatchOutput, ScheduledRow

# A row joins a call while the call's padding stays within this many positions or a quarter of its real
# tokens. A separate call costs one more read of every weight: for SmolLM2 on 2 CPU cores a decode call
# (~30 ms) costs about as much as prefilling a dozen tokens, so little padding is worth paying for.
PADDING_SLACK_TOKENS = 16
MAX_LORA_STACKS = 8


def group_by_width(lengths: list[int]) -> list[list[int]]:
    """Row indices grouped into engine calls, longest rows first; a row joins the current call while the
    call's padding stays within PADDING_SLACK_TOKENS or a quarter of its real tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    width = real = 0
    for i in order:
        if groups:
            padded = (len(groups[-1]) + 1) * width
            if padded - (real + lengths[i]) <= max((real + lengths[i]) // 4, PADDING_SLACK_TOKENS):
                groups[-1].append(i)
                real += lengths[i]
                continue
        groups.append([i])
        width = real = lengths[i]
    return [sorted(group) for group in groups]


class ModelExecutor:
    """Owns what an engine call needs besides the pool: the embedding table and the stacked adapters."""

    __slots__ = ("backend", "embedding", "state_rows", "all_hidden", "per_layer", "media_row", "corrector",
                 "page_tables", "_lora_shapes", "_lora_stacks")

    def __init__(self, runner: Backend, embedding: np.ndarray, lora_shapes: dict[str, tuple[int, int]],
                 state_rows: dict[Lease, int] | None = None, all_hidden: bool = False,
                 per_layer: np.ndarray | None = None, media_row: int = 0,
                 corrector: AdapterCorrector | None = None,
                 page_tables: Callable[[Lease], Mapping[str, list[int]]] | None = None) -> None:
        """`state_rows`: the engine's recurrent state row of each running lease (recurrent engines only).
        `all_hidden`: hidden states at every computed position, not only the logits ones. `per_layer`: Gemma 4's
        per-layer table, fed as PER_LAYER_INPUT beside the embedding rows; a media position gets its row
        `media_row` (the pad token's: transformers looks media placeholders up as padding there). `corrector`:
        corrected adapters' factors are computed from every call's hidden states (all positions). `page_tables`: a
        lease's tables of the page groups beside the global one, by group (the cache's: each from its type)."""
        self.backend = runner
        self.embedding = np.asarray(embedding)  # a plain view of a memmap: its __getitem__ costs ~11 us a lookup
        self.per_layer = None if per_layer is None else np.asarray(per_layer)
        self.media_row = media_row
        self.state_rows = state_rows
        self.corrector = corrector
        self.page_tables = page_tables
        self.all_hidden = all_hidden or corrector is not None
        self._lora_shapes = lora_shapes
        # Stacked inputs per adapter composition; a step with two calls alternates two compositions.
        self._lora_stacks: dict[tuple[int, ...], dict[str, np.ndarray]] = {}

    def forget_adapters(self) -> None:
        """Call when adapters are (re)loaded: ids of replaced adapter objects may be reused by new ones."""
        self._lora_stacks.clear()

    def run(self, rows: list[ScheduledRow]) -> BatchOutput:
        """Compute every scheduled row, whatever their adapters; returns each row's logits (see BatchOutput).

        A row's new tokens are its pending ones (`num_new_tokens` from `num_computed_tokens` on) followed by its
        draft tokens: the call writes K/V (and the recurrent state) for all of them, and returns logits at the last
        pending token and at each draft. (A recurrent row with drafts had its state saved by the scheduler's state
        manager when the step was scheduled, so the commit step can roll back what rejected drafts did to it.)

        Rows of similar length share one engine call. The graph takes ragged rows but pads them to the
        longest, and padded positions cost as much as real ones, so a 512-token prefill chunk and three
        decode rows in one call would compute 2,048 positions for 515 tokens: such a step runs the chunk
        and the decode rows as two calls (see `group_by_width`; a row's width counts its drafts).
        """
        new_ids = []
        for row in rows:
            start = row.seq.num_computed_tokens
            new_ids.append(row.seq.all_token_ids()[start:start + row.num_new_tokens] + list(row.draft_token_ids))
        groups = group_by_width([len(ids) for ids in new_ids])
        logits: list[np.ndarray | None] = [None] * len(rows)
        hidden: list[np.ndarray | None] = [None] * len(rows)
        for group in groups:
            members = [rows[i] for i in group]
            output = self._call(members, [new_ids[i] for i in group])
            offset = hidden_offset = 0
            for i, row in zip(group, members, strict=True):
                count = 1 + len(row.draft_token_ids)
                logits[i] = output.logits[offset:offset + count]
                hidden_count = len(new_ids[i]) if self.all_hidden else count
                if output.hidden_states is not None:
                    hidden[i] = output.hidden_states[hidden_offset:hidden_offset + hidden_count]
                offset += count
                hidden_offset += hidden_count
        has_hidden = any(h is not None for h in hidden)
        if self.corrector is not None and has_hidden:
            self.corrector.observe(rows, new_ids, hidden, self.embedding)
        return BatchOutput(logits, hidden if has_hidden else None)  # type: ignore[arg-type]

    def _call(self, rows: list[ScheduledRow], new_ids: list[list[int]]) -> ForwardOutput:
        width = max(len(ids) for ids in new_ids)
        embeds = np.zeros((len(rows), width, self.embedding.shape[1]), dtype=np.float32)
        per_layer = None if self.per_layer is None else np.zeros((len(rows), width, self.per_layer.shape[1]),
                                                                 dtype=np.float32)
        positions, every = [], []
        for i, ids in enumerate(new_ids):
            embeds[i, :len(ids)] = self.embedding[ids]
            _splice_media(embeds[i], rows[i].seq, len(ids))
            if per_layer is not None:
                per_layer[i, :len(ids)] = self.per_layer[ids]  # type: ignore[index]
                _pad_media(per_layer[i], self.per_layer[self.media_row], rows[i].seq, len(ids))  # type: ignore[index]
            # The last pending token and every draft: len(ids) - 1 - drafts .. len(ids) - 1 within row i.
            first = len(ids) - 1 - len(rows[i].draft_token_ids)
            positions.append(i * width + np.arange(first, len(ids), dtype=np.int64))
            if self.all_hidden:
                every.append(i * width + np.arange(len(ids), dtype=np.int64))
        starts = np.array([row.seq.num_computed_tokens for row in rows], dtype=np.int32)
        position_ids = mask = None
        if any(row.draft_parents for row in rows):
            position_ids, mask = tree_inputs(rows, starts, width)
        step = StepInputs(embeds, np.array([len(ids) for ids in new_ids], dtype=np.int32), starts,
                          [row.seq.lease.page_ids for row in rows],  # type: ignore[union-attr]
                          self._lora_inputs([row.seq.request.adapter for row in rows]),
                          logits_indices=np.concatenate(positions),
                          hidden_indices=np.concatenate(every) if self.all_hidden else None,
                          position_ids=position_ids, attention_mask=mask,
                          page_tables=self._group_tables(rows))
        if per_layer is not None:
            step.extra_inputs = {PER_LAYER_INPUT: per_layer}
        adapter_starts = [row.seq.request.adapter_start for row in rows]
        if any(adapter_starts):  # an activated LoRA row: its delta applies from its invocation on
            step.adapter_start = np.array(adapter_starts, dtype=np.int32)
        if self.state_rows is not None:
            step.state_rows = [self.state_rows[row.seq.lease] for row in rows]  # type: ignore[index]
        return self.backend.forward(step)

    def keep_paths(self, rows: list[ScheduledRow], output: BatchOutput, paths: list[list[int] | None]) -> None:
        """A tree row wrote draft i's K/V at position C + 1 + i (C: its pending token); the accepted path's drafts
        move to C + 1, C + 2, ... as a chain would have left them, and its hidden states are reordered the same way
        (pending token, then the path), so the commit and a drafter's catch-up read a chain."""
        for i, (row, path) in enumerate(zip(rows, paths, strict=True)):
            if path is None:
                continue
            start = row.seq.num_computed_tokens + 1
            moves = [(start + node, start + depth) for depth, node in enumerate(path) if node != depth]
            if moves:
                assert row.seq.lease is not None
                self.backend.kv_store.copy_positions(row.seq.lease.page_ids, [a for a, _ in moves],
                                                     [b for _, b in moves])
            if output.hidden_states is not None and output.hidden_states[i] is not None:
                output.hidden_states[i] = output.hidden_states[i][[0] + [1 + node for node in path]]

    def _lora_inputs(self, adapters: list[LoraAdapter | None]) -> dict[str, np.ndarray] | None:
        """Stacked per-row adapters, rebuilt only when the batch's adapter composition changes."""
        if all(a is None for a in adapters):
            return None
        key = tuple(id(a) for a in adapters)
        stacked = self._lora_stacks.get(key)
        if stacked is None:
            if len(self._lora_stacks) >= MAX_LORA_STACKS:
                self._lora_stacks.pop(next(iter(self._lora_stacks)))
            stacked = self._lora_stacks[key] = stack_adapters(adapters, self._lora_shapes)
        return stacked

    def _group_tables(self, rows: list[ScheduledRow]) -> dict[str, list[list[int]]]:
        """Each page group's tables of the call's rows, by group (none on an engine with only the global group)."""
        if self.page_tables is None:
            return {}
        per_row = [self.page_tables(row.seq.lease) for row in rows]  # type: ignore[arg-type]
        return {group: [tables[group] for tables in per_row] for group in per_row[0]}


def tree_inputs(rows: list[ScheduledRow], starts: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """RoPE positions [B, S] and the attention mask [B, S, S] of a call holding tree rows: a draft sits at its
    pending token's position plus its depth and sees the pending token, its ancestors and itself; every other row
    (and a chain) is causal at start + i."""
    positions, mask = start_positions(starts, width), causal_masks(len(rows), width)
    for b, row in enumerate(rows):
        if row.draft_parents:  # the pending token is node 0, the root of the row's tree
            nodes = ancestor_mask([-1] + [parent + 1 for parent in row.draft_parents])
            positions[b, :len(nodes)] = starts[b] + nodes.sum(axis=1) - 1
            mask[b, :len(nodes), :len(nodes)] = nodes
    return positions, mask


def _splice_media(row_embeds: np.ndarray, seq: Sequence, num_new: int) -> None:
    """Overwrite the placeholder positions among this call's tokens with their encoder rows."""
    begin = seq.num_computed_tokens
    for span in seq.request.media:
        span.splice(row_embeds, begin, begin + num_new)

def _pad_media(row_inputs: np.ndarray, pad_row: np.ndarray, seq: Sequence, num_new: int) -> None:
    """Overwrite the placeholder positions among this call's tokens with `pad_row` (per-layer inputs)."""
    begin = seq.num_computed_tokens
    for span in seq.request.media:
        padded = replace(span, embeds=np.broadcast_to(pad_row, (len(span.embeds), len(pad_row))))
        padded.splice(row_inputs, begin, begin + num_new)

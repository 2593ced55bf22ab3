"""The engine side of corrected adapters: factors from a base call's hidden states, and corrected page copies."""

from __future__ import annotations

import numpy as np

from kvforge.plugins.reference import apply_rope, from_storage, to_storage
from kvforge.runtime.adapters import (
    FoldedCorrection,
    LoraAdapter,
    correction_deltas,
    correction_factors,
    fold_correction,
    normed_inputs,
)
from kvforge.runtime.context_cache.types.adapter_corrections import FactorCapture
from kvforge.runtime.execution.kv_store import KVStore
from kvforge.runtime.step import ScheduledRow

ADAPTER_CORRECTIONS_PART = "adapter_corrections"  # the cache type's name (profile_schema.ADAPTER_CORRECTIONS)


class AdapterCorrector:
    """Holds the corrected adapters folded with the engine's norm weights, the pool and the rope table.

    `observe` runs after each engine call: every base row whose lease collects factors gets P = x A of its new
    positions for every corrected adapter. `correct` is what the cache type calls at a corrected admission."""

    __slots__ = ("kv", "cos_sin", "kv_cache_dtype", "num_kv_heads", "head_dim", "norm_weights", "eps", "names",
                 "_folded")

    def __init__(self, kv: KVStore, cos_sin: np.ndarray, kv_cache_dtype: str, num_kv_heads: int, head_dim: int,
                 norm_weights: np.ndarray, eps: float, names: tuple[str, ...]) -> None:
        self.kv = kv
        self.cos_sin = cos_sin
        self.kv_cache_dtype = kv_cache_dtype
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.norm_weights = norm_weights  # [L, H]
        self.eps = eps
        self.names = names  # what the option names (checked against the adapters when they are loaded)
        self._folded: dict[bytes, FoldedCorrection] = {}

    @property
    def digests(self) -> tuple[bytes, ...]:
        return tuple(self._folded)

    @property
    def num_adapters(self) -> int:
        return len(self.names)

    def register(self, adapters: list[LoraAdapter]) -> None:
        """The corrected adapters of the loaded set (replacing any before)."""
        self._folded = {adapter.digest: fold_correction(adapter, self.norm_weights) for adapter in adapters}

    def observe(self, rows: list[ScheduledRow], new_ids: list[list[int]], hidden: list[np.ndarray | None] | None,
                embedding: np.ndarray) -> None:
        """Factors of every collecting row's new positions (hidden states at each of them: the executor asks)."""
        if not self._folded or hidden is None:
            return
        for row, ids, states in zip(rows, new_ids, hidden, strict=True):
            lease = row.seq.lease
            capture = None if lease is None else lease.parts.get(ADAPTER_CORRECTIONS_PART)
            if not isinstance(capture, FactorCapture) or states is None or row.draft_token_ids:
                continue
            normed = normed_inputs(np.asarray(embedding[ids]), states[:len(ids)], self.eps)
            capture.add(row.seq.num_computed_tokens, {digest: correction_factors(folded, normed)
                                                      for digest, folded in self._folded.items()})

    def correct(self, digest: bytes, src_pages: list[int], dst_pages: list[int], factors: list[np.ndarray]) -> None:
        """dst page i = base page i + (rot(P_k B_k), P_v B_v) at positions i*T .. (i+1)*T - 1, in the pool's dtype.
        An adapter without k/v targets gets the base pages as they are."""
        if not src_pages:
            return
        folded = self._folded[digest]
        T = self.kv.tokens_per_page
        src, dst = np.asarray(src_pages, np.int64), np.asarray(dst_pages, np.int64)
        pages = [layer[src].copy() for layer in self.kv.layers]  # [n, 2, Hkv, T, D] each: every source read first
        if folded.adapts_kv:
            deltas = correction_deltas(folded, np.concatenate(factors))  # [L, 2, n*T, Hkv*D]
            positions = np.arange(len(src_pages) * T)
            n, heads, dim = len(src_pages), self.num_kv_heads, self.head_dim
            for layer, stored in enumerate(pages):
                dk = apply_rope(deltas[layer, 0].reshape(-1, heads, dim), self.cos_sin, positions)
                dv = deltas[layer, 1].reshape(-1, heads, dim)
                delta = np.stack([dk, dv]).reshape(2, n, T, heads, dim).transpose(1, 0, 3, 2, 4)  # [n, 2, Hkv, T, D]
                pages[layer] = to_storage(from_storage(stored, self.kv_cache_dtype) + delta, self.kv_cache_dtype)
        for layer, stored in zip(self.kv.layers, pages, strict=True):
            layer[dst] = stored

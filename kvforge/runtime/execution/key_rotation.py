"""How each pool layer's stored keys turn with position, so a restored document's keys move by that layer's own RoPE
(issue 53): on Gemma it is not the runtime's one table (local bases, linear scaling, proportional and wider heads).

Gemma's graphs (kvforge/tools/export/families/gemma3.py, gemma4.py) turn a layer's q and k first by its own angle
minus the table's, then by the table: the key stored at position p is the layer's own RoPE at p, in the pool's dim
order. Moving it by delta is one more turn by the layer's own frequencies times delta. A global Gemma 4 head wider
than the table is stored in table order (the table's pairs over its first rotary_dim dims, the other pairs after),
so its rotation is two rotate-half segments. A KV-shared layer has no pool: its source's pool turns once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvforge.contract.model_config import ModelConfig
from kvforge.plugins import cpu_kernel
from kvforge.plugins.reference import rotate_keys


def moved_keys(stored_k: np.ndarray, delta: int, cos_sin: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """`rotate_keys` through the CPU kernel library when it is built (the same bytes, without numpy's temporaries),
    else the numpy reference itself (KVFORGE_CPU_KERNEL=off, no compiler)."""
    moved = cpu_kernel.rotate_keys(stored_k, delta, cos_sin, kv_cache_dtype)
    return moved if moved is not None else rotate_keys(stored_k, delta, cos_sin, kv_cache_dtype)


def inverse_frequencies(theta: float, dims: int) -> np.ndarray:
    """Rotate-half inverse frequencies of base `theta` over `dims` dims, float64 (as rope_table computes them)."""
    return 1.0 / (theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims))


@dataclass(frozen=True, slots=True)
class KeyRotation:
    """One pool layer's RoPE as its keys are stored: rotate-half segments, each (first dim, inverse frequencies of
    its pairs), the segment's pairs (first + i, first + n + i) for its n frequencies."""

    segments: tuple[tuple[int, np.ndarray], ...]

    def move(self, stored_k: np.ndarray, delta: int, kv_cache_dtype: str) -> np.ndarray:
        """Keys [..., D] in the storage dtype, computed at p, turned to p + delta (a new array)."""
        moved = stored_k
        for first, inv_freq in self.segments:
            # A two-row table whose row 1 holds the angles of |delta|: rotate_keys reads only that row (its sign
            # turns back), and the kernel library takes it as it takes the engine's table, without capacity rows.
            angles = abs(delta) * inv_freq
            table = np.zeros((2, 2 * len(inv_freq)), dtype=np.float32)
            table[0, :len(inv_freq)] = 1.0
            table[1] = np.concatenate([np.cos(angles), np.sin(angles)]).astype(np.float32)
            step = 1 if delta > 0 else -1 if delta < 0 else 0
            if first == 0:
                moved = moved_keys(moved, step, table, kv_cache_dtype)
            else:
                moved = np.array(moved, copy=True) if moved is stored_k else moved
                moved[..., first:] = moved_keys(moved[..., first:], step, table, kv_cache_dtype)
        return moved

    def tables(self, capacity: int) -> list[np.ndarray]:
        """Each segment's rope table [capacity, 2n] (the start-up check's)."""
        positions = np.arange(capacity, dtype=np.float64)[:, None]
        return [np.concatenate([np.cos(positions * f), np.sin(positions * f)], axis=1).astype(np.float32)
                for _, f in self.segments]


def _own_frequencies(model: ModelConfig, layer: int) -> np.ndarray:
    """The layer's own inverse frequencies over its head's rotate-half pairs (j, j + size/2), the exporter's rules:
    sliding layers the local base; Gemma 3's global layers rope_theta linearly scaled; Gemma 4's global layers
    rope_theta over their own head size, turning only its first rope_proportion of pairs."""
    size = model.layer_head_dim(layer)
    if layer in model.sliding_window_layers:
        return inverse_frequencies(model.rope_local_theta or model.rope_theta, size)
    own = inverse_frequencies(model.rope_theta, size)
    if model.model == "gemma4":
        if model.rope_proportion:
            own[int(model.rope_proportion * size // 2):] = 0.0  # transformers' int(p * D // 2) turning
        return own
    return own / (model.rope_linear_factor or 1.0)


def layer_rotations(model: ModelConfig) -> list[KeyRotation]:
    """One rotation per pool layer (model.attention_layer_ids, the pools' order). An engine whose every layer turns
    by the runtime's table gets that table's frequencies for each: the same bytes as a table-driven move."""
    if model.uniform_rope:
        plain = KeyRotation(((0, inverse_frequencies(model.rope_theta, model.rotary_dim)),))
        return [plain for _ in model.attention_layer_ids]
    rotations = []
    for layer in model.attention_layer_ids:
        own, size = _own_frequencies(model, layer), model.layer_head_dim(layer)
        if size == model.head_dim:
            rotations.append(KeyRotation(((0, own),)))
            continue
        # A head wider than the table, stored in table order: the table's rotary_dim/2 pairs first, the rest after.
        turned = model.rotary_dim // 2
        segments = [(0, own[:turned])]
        if own[turned:].any():
            segments.append((model.rotary_dim, own[turned:]))
        rotations.append(KeyRotation(tuple(segments)))
    return rotations

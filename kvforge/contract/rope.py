"""The RoPE table every backend feeds the attention ops (`rope_rotary_cos_sin`), in one place: plain numpy, so the
GPU check script, which runs without kvforge's dependencies, computes it with the runtime's own code."""

from __future__ import annotations

import numpy as np


def rope_table(capacity: int, head_dim: int, theta: float) -> np.ndarray:
    """[capacity, head_dim]: cos of the head_dim/2 rotate-half frequencies, then their sin."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.arange(capacity, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)

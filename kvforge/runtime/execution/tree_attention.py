"""The tree-attention inputs of an engine call (RoPE positions and which new tokens each new token sees), built in
one place for the base's verify rows, the EAGLE3 draft's tree rounds and the runner's defaults."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ancestor_mask(parents: Sequence[int]) -> np.ndarray:
    """[n, n] bool: node i sees itself and its ancestors (`parents[i]` < i is its parent's index, -1 = none)."""
    mask = np.zeros((len(parents), len(parents)), dtype=bool)
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(f"node {node}'s parent {parent} does not come before it")
        if parent >= 0:
            mask[node] = mask[parent]
        mask[node, node] = True
    return mask


def tree_depths(parents: Sequence[int]) -> np.ndarray:
    """Depth of each node of a tree (1 = a child of the root, parent -1): the ancestors it sees, itself included."""
    return ancestor_mask(parents).sum(axis=1)


def start_positions(starts: np.ndarray, width: int) -> np.ndarray:
    """[B, S] int32 positions start + i: a call without a tree."""
    return (np.asarray(starts, dtype=np.int32)[:, None] + np.arange(width, dtype=np.int32)[None, :]).astype(np.int32)


def causal_masks(batch: int, width: int) -> np.ndarray:
    """[B, S, S] bool, causal: the mask of the rows of a tree call that are not trees (each one a writable copy)."""
    return np.broadcast_to(np.tril(np.ones((width, width), dtype=bool)), (batch, width, width)).copy()

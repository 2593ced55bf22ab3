"""Carried recurrent and conv states of the running sequences: one row per batch slot, gathered into each call.

A recurrent layer's state after token n is all the model keeps of tokens [0, n): unlike K/V it cannot be
paged or shared, so every running sequence owns one row of every state tensor while it runs. The engine
assigns rows at admission (zeroed for a cold start, or copied from a recurrent snapshot) and frees them when
the sequence finishes or is preempted; the runner gathers the call's rows into the graph's
`conv_state_{i}` / `recurrent_state_{i}` inputs and scatters `present_*` back. Rows are preallocated
(max batch size) in fp32, so a step never allocates state memory.

A call overwrites a row's state with the state after all of its new tokens, drafts included, and a recurrence
cannot be run backwards: a speculative verify row whose drafts are rejected needs the state from before the
call. `save` copies rows into a preallocated scratch copy before such a call and `rollback` puts one back; the
commit step then recomputes the accepted tokens from there (llama.cpp's speculative checkpoints, one per row).
"""

from __future__ import annotations

from collections import deque

import numpy as np

CONV_STATE_PREFIX = "conv_state_"
RECURRENT_STATE_PREFIX = "recurrent_state_"
STATE_PREFIXES = (CONV_STATE_PREFIX, RECURRENT_STATE_PREFIX)


def is_state_input(name: str) -> bool:
    return name.startswith(STATE_PREFIXES)


def present_name(state_input: str) -> str:
    """The graph output carrying a state input's value after the call's last real token of each row."""
    return f"present_{state_input}"


class RecurrentStates:
    """Per state input of the graph, a [rows, ...] fp32 array; `rows` = sequences that may run at once."""

    __slots__ = ("arrays", "_free", "_scratch", "_saved")

    def __init__(self, shapes: dict[str, tuple[int, ...]], num_rows: int) -> None:
        """`shapes`: state input name -> shape of one sequence's state (the graph's dims after `batch`)."""
        self.arrays = {name: np.zeros((num_rows, *shape), dtype=np.float32) for name, shape in sorted(shapes.items())}
        self._free: deque[int] = deque(range(num_rows))
        # Row r's saved state lives in scratch row r: a save never allocates and rows never share a slot.
        self._scratch = {name: np.zeros_like(array) for name, array in self.arrays.items()}
        self._saved: set[int] = set()

    @property
    def nbytes(self) -> int:
        """The rows and their scratch copy."""
        return 2 * sum(array.nbytes for array in self.arrays.values())

    @property
    def bytes_per_row(self) -> int:
        return sum(array[0].nbytes for array in self.arrays.values()) if self.arrays else 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free row, zeroed (a cold start: no token seen). The engine admits at most as many sequences as rows."""
        if not self._free:
            raise AssertionError("no free recurrent state row: more running sequences than the batch size")
        row = self._free.popleft()
        for array in self.arrays.values():
            array[row] = 0.0
        return row

    def free(self, row: int) -> None:
        if row in self._free:
            raise AssertionError(f"recurrent state row {row} freed twice")
        self._saved.discard(row)  # a saved state dies with its sequence's row
        self._free.append(row)

    def save(self, rows: list[int]) -> None:
        """Copy these rows' states to the scratch copy before a call that may be undone (drafts); a row saved again
        replaces its earlier copy. Rows must be allocated."""
        index = np.asarray(rows, dtype=np.int64)
        free = sorted(set(rows) & set(self._free))
        if free:
            raise AssertionError(f"recurrent state row {free[0]} is not allocated: nothing to save")
        for name, array in self.arrays.items():
            self._scratch[name][index] = array[index]
        self._saved.update(rows)

    def rollback(self, row: int) -> None:
        """Restore `row` to its state at the last `save` (before the call), once: the saved copy is used up."""
        if row not in self._saved:
            raise AssertionError(f"recurrent state row {row} has no saved state: save() it before the call, and "
                                 "roll back at most once per save")
        for name, array in self.arrays.items():
            array[row] = self._scratch[name][row]
        self._saved.discard(row)

    def is_saved(self, row: int) -> bool:
        return row in self._saved

    def gather(self, rows: list[int]) -> dict[str, np.ndarray]:
        """The call's state inputs [B, ...] (copies: the graph must not alias rows it is about to overwrite)."""
        index = np.asarray(rows, dtype=np.int64)
        return {name: np.ascontiguousarray(array[index]) for name, array in self.arrays.items()}

    def scatter(self, rows: list[int], present: dict[str, np.ndarray]) -> None:
        """Store the call's `present_*` outputs back into the rows they came from."""
        index = np.asarray(rows, dtype=np.int64)
        for name, array in self.arrays.items():
            array[index] = present[present_name(name)]

    def read(self, row: int) -> list[np.ndarray]:
        """One sequence's states, in input-name order (views: copy before the row is written again)."""
        return [array[row] for array in self.arrays.values()]

    def write(self, row: int, states: list[np.ndarray]) -> None:
        for array, state in zip(self.arrays.values(), states, strict=True):
            array[row] = state

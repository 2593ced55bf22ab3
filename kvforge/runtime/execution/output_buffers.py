"""Engine-call outputs written by ONNX Runtime straight into arrays kept across calls: a decode step allocates,
copies and rebinds no output while no caller still holds the previous call's array (issue 43, Python per step)."""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort

FLOAT_TYPE = "tensor(float)"
# getrefcount's own argument, the local name and the dict entry: an array nobody else holds (no view of it either:
# a view keeps its base alive, so it counts too).
_UNHELD = 3


class OutputBuffers:
    """One float32 array per output whose shape is [rows, static dims...]; `arrays` returns the call's arrays,
    reusing the last call's (still bound to the IOBinding, so not even bound again) when its shape is the same and
    nothing outside this object refers to it; otherwise a new array is allocated and bound. Reuse never changes an
    answer: an array a caller kept (a draft's hidden states, an earlier call's logits in the same step) is never
    written over."""

    def __init__(self, trailing: dict[str, tuple[int, ...]]) -> None:
        self.trailing = trailing
        self._arrays: dict[str, np.ndarray] = {}
        self.allocations = 0  # arrays allocated and bound so far (tests read it: decode steps add none)

    @classmethod
    def for_session(cls, session: ort.InferenceSession, names: tuple[str, ...]) -> OutputBuffers | None:
        """Buffers for every output of `session`, or None when one is not among `names` (outputs whose rows the
        caller knows per call) or not float32 [rows, static dims...] (a recurrent state or a legacy new_key_values
        output: those keep ONNX Runtime's own allocation)."""
        trailing = {}
        for output in session.get_outputs():
            dims = output.shape[1:] if output.shape else None
            if output.name not in names or output.type != FLOAT_TYPE or not dims \
                    or not all(isinstance(d, int) and d > 0 for d in dims):
                return None
            trailing[output.name] = tuple(dims)
        return cls(trailing)

    def arrays(self, binding: ort.IOBinding, rows: dict[str, int]) -> dict[str, np.ndarray]:
        """The arrays this call writes, by output name; `rows`: each output's first dimension for this call."""
        out = {}
        for name, tail in self.trailing.items():
            shape = (rows[name], *tail)
            held = self._arrays.get(name)
            if held is None or held.shape != shape or sys.getrefcount(held) > _UNHELD:
                held = np.empty(shape, dtype=np.float32)
                binding.bind_output(name, "cpu", 0, np.float32, list(shape), held.ctypes.data)
                self._arrays[name] = held
                self.allocations += 1
            out[name] = held
        return out

"""Backend wrappers a test builds an Engine with (`Engine(..., backend=...)`): observe or break calls, never rewire."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvforge.contract.engine_dir import load_engine_dir
from kvforge.runtime.execution.backend import Backend, ForwardOutput, StepInputs
from kvforge.runtime.execution.load import load_backend


class RecordingBackend:
    """Keeps each call's logits [N, V] (what the engine sampled from), in call order."""

    def __init__(self, inner: Backend) -> None:
        self.inner, self.logits = inner, []
        self.kv_store, self.states = inner.kv_store, inner.states

    @classmethod
    def load(cls, engine_dir: Path, num_threads: int = 2) -> RecordingBackend:
        return cls(load_backend(load_engine_dir(engine_dir), num_threads))

    def forward(self, step: StepInputs) -> ForwardOutput:
        output = self.inner.forward(step)
        self.logits.append(np.array(output.logits))
        return output


class FlakyBackend:
    """Raises on its next call once told to (`backend.fail_next = True`): fault injection through the object the
    engine was built with, not by swapping its parts."""

    def __init__(self, inner: Backend) -> None:
        self.inner, self.fail_next = inner, False
        self.kv_store, self.states = inner.kv_store, inner.states

    def forward(self, step: StepInputs) -> ForwardOutput:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("simulated engine failure")
        return self.inner.forward(step)

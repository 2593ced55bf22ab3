"""Picks the engine runner for an engine dir's backend, so nothing above it switches on backend names."""

from __future__ import annotations

import numpy as np

from kvforge.contract.engine_dir import EngineDir
from kvforge.runtime.runner import EngineRunner


def load_runner(engine: EngineDir, num_threads: int = 0, embedding: np.ndarray | None = None) -> EngineRunner:
    """The runner for `engine`: TensorRT (imported only here, only when the engine needs it) or ONNX Runtime."""
    if engine.build.backend == "tensorrt":
        from kvforge.runtime.trt_runner import TrtEngineRunner

        return TrtEngineRunner(engine)
    from kvforge.runtime.ort_runner import OrtEngineRunner

    return OrtEngineRunner(engine, num_threads, embedding)

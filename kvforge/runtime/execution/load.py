"""Picks the engine runner for an engine dir's backend, so nothing above it switches on backend names."""

from __future__ import annotations

import numpy as np

from kvforge.contract.engine_dir import EngineDir
from kvforge.runtime.execution.backend import Backend


def load_backend(engine: EngineDir, num_threads: int = 0, embedding: np.ndarray | None = None,
                 shares_cores: bool = False, shared_pools: dict[int, np.ndarray] | None = None) -> Backend:
    """The runner for `engine`: TensorRT (imported only here, only when the engine needs it) or ONNX Runtime.
    `shares_cores`: another session alternates with this one (an EAGLE3 base and its draft), so idle threads sleep;
    `shared_pools`: the base's pools an assistant reads (OrtBackend)."""
    if engine.build.backend == "tensorrt":
        from kvforge.runtime.execution.trt import TrtBackend

        return TrtBackend(engine)
    from kvforge.runtime.execution.ort import OrtBackend

    return OrtBackend(engine, num_threads, embedding, spinning=not shares_cores, shared_pools=shared_pools)

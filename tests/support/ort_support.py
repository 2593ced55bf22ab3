"""ONNX Runtime sessions over graphs a test lowered itself, on the attention path this run takes.

`make test` runs the engine tests twice: on kvforge's CPU kernel (when it builds here) and with
KVFORGE_CPU_KERNEL=off on the pure-ONNX fallback; tests that lower graphs by hand follow the same switch.
"""

from __future__ import annotations

import onnx
import onnxruntime as ort
from onnx import TensorProto

from kvforge.plugins import ops
from kvforge.plugins.cpu_kernel import kernel_status, register

# The ONNX element type of a pool of each KV storage dtype (fp8 pools are bytes).
POOL_ELEM = {"fp16": TensorProto.FLOAT16, "fp8": TensorProto.UINT8, "fp32": TensorProto.FLOAT}


def cpu_kernel_on() -> bool:
    """Whether this run lowers attention to the CPU kernel (its library builds, KVFORGE_CPU_KERNEL is not off)."""
    return kernel_status()[0] is not None


def session_for(model: onnx.ModelProto | str) -> ort.InferenceSession:
    """A CPU session over a lowered graph (a model or a path), the kernel library registered when it needs it."""
    loaded = onnx.load(model, load_external_data=False) if isinstance(model, str) else model
    options = ort.SessionOptions()
    if any(node.domain == ops.CPU_DOMAIN for node in loaded.graph.node):
        reason = register(options)
        assert not reason, reason
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])

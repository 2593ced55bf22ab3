"""kvforge: ONNX LLM engine builder and runner with content-addressed KV-cache reuse.

`LLM` and `SamplingParams` are the Python API; they load lazily so importing a contract module (or
running a CLI) does not pull in ONNX Runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]

if TYPE_CHECKING:
    from kvforge.runtime.api import LLM
    from kvforge.runtime.engine.output import RequestOutput
    from kvforge.runtime.types import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvforge.runtime.api import LLM

        return LLM
    if name == "SamplingParams":
        from kvforge.runtime.types import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from kvforge.runtime.engine.output import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'kvforge' has no attribute {name!r}")

"""kvforge: ONNX LLM engine builder and runner with content-addressed KV-cache reuse.

`LLM` and `SamplingParams` are the Python API; they load lazily so importing a contract module (or
running a CLI) does not pull in ONNX Runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvforge.contract.version import __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]

if TYPE_CHECKING:
    from kvforge.runtime.api import LLM
    from kvforge.runtime.engine.output import RequestOutput
    from kvforge.runtime.types import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvforge.runtime import api

        if api.MODEL_RESOLVER is None:  # kvforge.LLM takes a MODEL as llm_serve does (exported and built once)
            api.MODEL_RESOLVER = _model_engine
        return api.LLM
    if name == "SamplingParams":
        from kvforge.runtime.types import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from kvforge.runtime.engine.output import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'kvforge' has no attribute {name!r}")


def _model_engine(model: Any) -> Any:
    """kvforge.tools.testcases.models.model_engine, imported only when an LLM is made (it brings the exporter)."""
    from kvforge.tools.testcases.models import model_engine

    return model_engine(model)

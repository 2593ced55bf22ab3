"""The engine loop: wiring (`engine`), the step (`core`), the scheduler, stop rules, config and row state.

`Engine`, `EngineConfig`, `EngineRequest`, `RequestOutput` and the other names of `_EXPORTS` are re-exported lazily,
so `from kvforge.runtime.engine import Engine` works and importing `engine.scheduler` does not load the backends."""

from __future__ import annotations

from typing import Any

# The engine's public interface: front ends (llm_serve, kvforge.LLM, llm_inference, llm_test, llm_bench) import
# these names, kvforge.runtime.engine.engine and .config, and no other engine part (tests/test_layering.py).
_EXPORTS = {
    "Engine": "kvforge.runtime.engine.engine",
    "EngineInfo": "kvforge.runtime.engine.engine",
    "EngineRequest": "kvforge.runtime.sequence",
    "EngineStats": "kvforge.runtime.engine.core",
    "EngineConfig": "kvforge.runtime.engine.config",
    "RequestOutput": "kvforge.runtime.engine.output",
    "SampleResult": "kvforge.runtime.sampling.sampler",
    "FinishReason": "kvforge.runtime.sequence",
    "cache_samples": "kvforge.runtime.context_cache.registry",  # /metrics: each cache type's series
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvforge.runtime.engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

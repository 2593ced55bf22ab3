"""The engine loop: wiring (`engine`), the step (`core`), the scheduler, stop rules, config and row state.

`Engine`, `EngineConfig`, `EngineRequest` and `RequestOutput` are re-exported lazily, so
`from kvforge.runtime.engine import Engine` works and importing `engine.scheduler` does not load the backends."""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Engine": "kvforge.runtime.engine.engine",
    "EngineRequest": "kvforge.runtime.engine.engine",
    "EngineStats": "kvforge.runtime.engine.engine",
    "EngineConfig": "kvforge.runtime.engine.config",
    "RequestOutput": "kvforge.runtime.engine.output",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvforge.runtime.engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

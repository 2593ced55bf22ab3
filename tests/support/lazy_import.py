"""A module imported on first use, so collecting a test file never imports torch (seconds): `make test-fast`
collects the whole tree and must stay torch-free."""

from __future__ import annotations

import types

import pytest


class LazyModule:
    """`torch = LazyModule("torch", reason=...)`: the first attribute read imports it, or skips the test with the
    reason (pytest.importorskip). `lazy_module` names it for the tier rule (support/tiers.py)."""

    def __init__(self, name: str, reason: str | None = None) -> None:
        self.lazy_module = name
        self._reason = reason or f"{name} is not installed (pip install 'kvforge[dev]')"
        self._module: types.ModuleType | None = None

    def __getattr__(self, attr: str) -> object:
        if attr.startswith(("_", "pytest")):  # what collection probes (pytestmark, __test__, _pytestfixture...)
            raise AttributeError(attr)
        if self._module is None:
            self._module = pytest.importorskip(self.lazy_module, reason=self._reason)
        return getattr(self._module, attr)

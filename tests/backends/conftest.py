"""The CPU kernel's library for the kernel tests: built (or found) once per session, or every such test skips saying
why."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvforge.plugins import cpu_kernel


@pytest.fixture(scope="session")
def library() -> Path:
    path, reason = cpu_kernel.kernel_status()
    if path is None:
        pytest.skip(reason)
    return path

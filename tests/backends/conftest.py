"""The CPU kernel's compiled targets for the kernel tests: each one this CPU runs is forced in turn
(KVFORGE_CPU_TARGET), so every target is checked on one machine whatever the machine's best."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvforge.plugins import cpu_kernel


@pytest.fixture
def each_target(library: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Iterator[str]]:
    """`for target in each_target(): ...` runs the body once per compiled target this CPU runs, with the target
    forced (checked to be the one the library reports running), and prints the ones it cannot run."""
    compiled, runnable = cpu_kernel.compiled_targets(library), cpu_kernel.runnable_targets(library)
    skipped = [name for name in compiled if name not in runnable]
    if skipped:
        print(f"compiled but not runnable on this CPU, not checked here: {' '.join(skipped)}")

    def targets() -> Iterator[str]:
        # Every x86-64 CPU runs sse4 and scalar at least; an aarch64 build holds neon alone.
        assert len(runnable) >= (2 if os.uname().machine == "x86_64" else 1), f"runnable targets: {runnable}"
        for target in runnable:
            monkeypatch.setenv(cpu_kernel.TARGET_ENV, target)
            assert cpu_kernel.chosen_target(library) == target
            yield target
        monkeypatch.delenv(cpu_kernel.TARGET_ENV)

    return targets

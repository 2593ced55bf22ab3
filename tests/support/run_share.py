"""One build per test run, however many pytest-xdist workers it has: a session fixture's expensive artifact (the
SmolLM2 export, `make demo`'s engine) is made by the first worker that needs it, under a file lock, in the run's
common temp dir; the other workers wait for it and read it. Without xdist it is the session's own temp dir."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

COMPLETE = ".complete"  # `NAME.complete` beside the dir, written last: without it a worker failed midway


def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temp dir every worker of this run shares: xdist gives each worker `<run's basetemp>/popen-gwN`."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """`run_dir/name`, made by `make(path)` in the first worker to ask (the others block on the lock meanwhile,
    then reuse it). Tests only read it; a `make` that raised leaves no COMPLETE mark, so the next asker retries."""
    path = run_dir(tmp_path_factory) / name
    complete = path.with_name(name + COMPLETE)
    with open(path.with_name(f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not complete.exists():
                shutil.rmtree(path, ignore_errors=True)
                path.mkdir(parents=True)
                make(path)
                complete.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path

"""support/run_share.py: a session artifact is made once per run, whichever xdist worker asks first; a make that
failed midway is made again by the next asker; without xdist it lives in the session's own temp dir."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from support.run_share import once_per_run, run_dir


def test_concurrent_askers_get_one_make(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    made: list[int] = []

    def make(path: Path) -> None:
        made.append(1)
        time.sleep(0.2)  # long enough for every other asker to be waiting on the lock
        (path / "artifact").write_text("built")

    name = f"artifact-{tmp_path.name}"
    results: list[Path] = []
    askers = [threading.Thread(target=lambda: results.append(once_per_run(tmp_path_factory, name, make)))
              for _ in range(4)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join(30)
    assert len(made) == 1 and len(set(results)) == 1 and len(results) == 4
    assert (results[0] / "artifact").read_text() == "built"


def test_a_failed_make_is_made_again(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    name = f"flaky-{tmp_path.name}"

    def fail(path: Path) -> None:
        (path / "half").write_text("x")
        raise RuntimeError("killed midway")

    with pytest.raises(RuntimeError):
        once_per_run(tmp_path_factory, name, fail)
    path = once_per_run(tmp_path_factory, name, lambda p: (p / "whole").write_text("y"))
    assert sorted(p.name for p in path.iterdir()) == ["whole"]  # the half-made dir was cleared first


def test_the_run_dir_is_the_workers_common_parent(tmp_path_factory: pytest.TempPathFactory,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    base = tmp_path_factory.getbasetemp()
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert run_dir(tmp_path_factory) == base
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")  # xdist's basetemp for a worker: <run's basetemp>/popen-gw1
    assert run_dir(tmp_path_factory) == base.parent

"""Output dirs are replaced only when they provably are kvforge's, and the final swap never loses both dirs."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from support.hardening_support import invoke, snapshot

from kvforge.builder.cli import app as build_app
from kvforge.contract import files
from kvforge.contract.files import SwapFailed, check_output_dir, kvforge_dir_problem, staged_dir
from kvforge.contract.formats import MANIFEST_FILE, MANIFEST_FORMAT
from kvforge.contract.manifest import ENGINE_KIND, ONNX_KIND, write_manifest
from kvforge.tools.export.cli import app as export_app

WEB_MANIFEST = {"name": "my app", "short_name": "app", "icons": [{"src": "icon.png", "sizes": "192x192"}]}


def user_dir(path: Path, manifest: object) -> Path:
    """A directory of the user's that happens to hold a manifest.json (a web app, an extension, a kvforge-ish one)."""
    path.mkdir()
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    (path / "index.html").write_text("<html>my work</html>")
    (path / "src").mkdir()
    (path / "src" / "app.js").write_text("console.log(1)")
    return path


def kvforge_like(files_listed: dict) -> dict:
    return {"format": MANIFEST_FORMAT, "kind": ENGINE_KIND, "files": files_listed}


FOREIGN = {
    "web-app": WEB_MANIFEST,
    "ours-listing-nothing": kvforge_like({}),
    "ours-listing-other-files": kvforge_like({"config.json": {"size": 2, "digest": "sha256:00"}}),
    "ours-of-another-kind": {"format": MANIFEST_FORMAT, "kind": "website", "files": {"index.html": {"size": 20}}},
    "not-an-object": [1, 2],
}


@pytest.mark.parametrize("name", FOREIGN)
def test_build_never_replaces_a_dir_because_it_holds_a_manifest(tiny_onnx_dir: Path, tmp_path: Path,
                                                                name: str) -> None:
    target = user_dir(tmp_path / "site", FOREIGN[name])
    before = snapshot(target)
    invoke(build_app, "--onnxDir", tiny_onnx_dir, "--engineDir", target, "--backend", "onnxruntime").one_line_error(
        "--engineDir", "not written by kvforge")
    assert snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]  # no staging dir left either


def test_export_never_replaces_a_web_app(tmp_path: Path) -> None:
    target = user_dir(tmp_path / "site", WEB_MANIFEST)
    before = snapshot(target)
    invoke(export_app, "model", "--synthetic", "tiny-llama", "--outputDir", target).one_line_error(
        "--outputDir", "not written by kvforge")
    assert snapshot(target) == before


def test_a_kvforge_dir_with_a_file_of_the_users_is_not_replaced(tiny_engine_dir: Path, tiny_onnx_dir: Path,
                                                                 tmp_path: Path) -> None:
    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, engine)
    assert kvforge_dir_problem(engine) is None  # as built: replaceable
    (engine / "notes.md").write_text("my notes about this engine")
    before = snapshot(engine)
    line = invoke(build_app, "--onnxDir", tiny_onnx_dir, "--engineDir", engine, "--backend", "onnxruntime"
                  ).one_line_error("--engineDir", "notes.md")
    assert "not in its manifest.json" in line
    assert snapshot(engine) == before


def test_edited_and_linked_files_make_a_dir_the_users(tiny_engine_dir: Path, tmp_path: Path) -> None:
    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, engine)
    with open(engine / "config.json", "a", encoding="utf-8") as handle:
        handle.write("\n")
    assert "config.json was changed" in (kvforge_dir_problem(engine) or "")
    shutil.copy(tiny_engine_dir / "config.json", engine / "config.json")
    (engine / "extra").symlink_to(tmp_path)
    assert "extra is a link" in (kvforge_dir_problem(engine) or "")


def test_a_draft_engine_inside_its_base_is_kvforge_output(tiny_engine_dir: Path, tmp_path: Path) -> None:
    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, engine)
    shutil.copytree(tiny_engine_dir, engine / "draft")
    assert kvforge_dir_problem(engine) is None
    (engine / "draft" / "mine.txt").write_text("x")
    assert "draft/: mine.txt" in (kvforge_dir_problem(engine) or "")
    with pytest.raises(files.KvforgeError, match="draft/"):
        check_output_dir(engine, "engine_dir")


def kvforge_dir(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "weights.bin").write_text(content)
    write_manifest(path, ONNX_KIND)
    return path


def test_the_swap_is_checked_again_when_it_happens(tmp_path: Path) -> None:
    """Someone writes into the output dir while the (minutes long) build runs: the swap refuses, keeping it."""
    target = kvforge_dir(tmp_path / "out", "old")
    with pytest.raises(files.KvforgeError, match="thesis.tex"), staged_dir(target, "--outputDir") as staging:
        (staging / "weights.bin").write_text("new")
        write_manifest(staging, ONNX_KIND)
        (target / "thesis.tex").write_text("chapter 1")
    assert (target / "thesis.tex").read_text() == "chapter 1" and (target / "weights.bin").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def new_into(target: Path) -> None:
    with staged_dir(target, "--outputDir") as staging:
        (staging / "weights.bin").write_text("new")
        write_manifest(staging, ONNX_KIND)


def test_the_swap_is_one_exchange(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = kvforge_dir(tmp_path / "out", "old")
    renames: list[tuple[str, str]] = []
    real_replace = os.replace
    monkeypatch.setattr(files.os, "replace", lambda a, b: (renames.append((str(a), str(b))), real_replace(a, b)))
    new_into(target)
    assert (target / "weights.bin").read_text() == "new"
    moved = [pair for pair in renames if str(target) in pair]
    assert moved == []  # no moment without a dir at `target`: renameat2 swapped the two names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def swap_by_renames_failing(monkeypatch: pytest.MonkeyPatch, failing: Callable[[int], BaseException | None]) -> None:
    """No renameat2 (other filesystems), and the swap's n-th rename (1: old dir aside, 2: new dir in, 3: old dir
    back) raising `failing(n)` when that is not None."""
    monkeypatch.setattr(files, "exchange_paths", lambda a, b: False)
    real_replace, calls = os.replace, []

    def replace(a: object, b: object) -> None:
        if Path(str(b)).name == "out":  # the swap's renames, not the manifest's own atomic write
            calls.append(b)
            error = failing(len(calls))
            if error is not None:
                raise error
        real_replace(a, b)

    monkeypatch.setattr(files.os, "replace", replace)


def test_an_interrupted_two_rename_swap_puts_the_old_dir_back(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C between the two renames leaves the old dir, not neither."""
    target = kvforge_dir(tmp_path / "out", "old")
    swap_by_renames_failing(monkeypatch, lambda n: KeyboardInterrupt() if n == 2 else None)
    with pytest.raises(KeyboardInterrupt):
        new_into(target)
    assert (target / "weights.bin").read_text() == "old"


def test_a_swap_that_cannot_put_the_old_dir_back_says_where_both_are(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    target = kvforge_dir(tmp_path / "out", "old")
    swap_by_renames_failing(monkeypatch, lambda n: OSError(5, "Input/output error") if n >= 2 else None)
    with pytest.raises(SwapFailed) as caught:
        new_into(target)
    message = caught.value.message
    old, new = message.split(" is at ")[1].split(" and the new one at ")
    new = new.split(";")[0]
    assert (Path(old) / "weights.bin").read_text() == "old" and (Path(new) / "weights.bin").read_text() == "new"


def test_the_exchange_swaps_two_names_atomically(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "x").write_text("b")
    if not files.exchange_paths(a, b):
        pytest.skip("this filesystem has no renameat2 RENAME_EXCHANGE; the two-rename path is tested above")
    assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"


def test_staged_files_get_the_usual_permissions(tmp_path: Path) -> None:
    """onnx's external-data writer and safetensors create 0600 files: a service account could not read the engine."""
    target = tmp_path / "out"
    with staged_dir(target, "--outputDir") as staging:
        fd = os.open(staging / "weights.bin", os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)
        write_manifest(staging, ONNX_KIND)
    mask = os.umask(0)
    os.umask(mask)
    assert (target / "weights.bin").stat().st_mode & 0o777 == 0o666 & ~mask

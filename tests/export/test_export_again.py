"""A second `llm_export` into the same --outputDir replaces what the first wrote, media models included: their
encoder folder (visual/, audio/) carries its own manifest, so it is provably kvforge's and not refused as the user's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.in_process  # run_cli in process: the process is not the point


@pytest.mark.parametrize(("synthetic", "subdir"), [("tiny-idefics3", "visual"), ("tiny-qwen2-audio", "audio")])
def test_a_media_model_exports_twice_into_one_dir(tmp_path: Path, run_cli, synthetic: str, subdir: str) -> None:
    out = tmp_path / "onnx"
    for _ in range(2):
        result = run_cli(["llm_export", "--synthetic", synthetic, "--outputDir", out])
        assert result.returncode == 0, result.stderr
    manifest = json.loads((out / subdir / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(p.name for p in (out / subdir).iterdir() if p.name != "manifest.json")
    # A file that is not the export's still keeps the dir from being replaced.
    (out / subdir / "notes.txt").write_text("mine")
    result = run_cli(["llm_export", "--synthetic", synthetic, "--outputDir", out])
    assert result.returncode == 2 and f"{subdir}/: notes.txt is not in its manifest.json" in result.stderr

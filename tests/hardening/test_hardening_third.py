"""The third hostile pass (issue 42): writers that overwrite, outputs inside kvforge's dirs, flags out of range."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.hardening_support import edit_engine, invoke, request_file, snapshot

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.errors import InvalidConfig, KvforgeError
from kvforge.runtime.cli import app as inference_app
from kvforge.tools.bench.engines import parse_engine
from kvforge.tools.export.cli import app as export_app

RANDOM_WRITERS = {
    "random-eagle3": ["--baseOnnxDir"],
    "random-block-draft": ["--baseOnnxDir"],
    "random-gemma4-assistant": ["--baseOnnxDir"],
    "random-mtp": ["--baseOnnxDir"],
    "random-lora": ["--onnxDir"],
}


def users_checkpoint(path: Path) -> Path:
    """A trained draft or adapter of the user's: the very file names the random writers write."""
    path.mkdir()
    for name in ("config.json", "model.safetensors", "adapter_config.json", "adapter_model.safetensors"):
        (path / name).write_text(f"trained {name}")
    return path


@pytest.mark.parametrize("command", RANDOM_WRITERS)
def test_random_writers_never_overwrite_a_users_dir(tiny_onnx_dir: Path, tmp_path: Path, command: str) -> None:
    target = users_checkpoint(tmp_path / "trained")
    before = snapshot(target)
    invoke(export_app, command, *RANDOM_WRITERS[command], tiny_onnx_dir, "--outputDir", target).one_line_error(
        "--outputDir", "not written by kvforge")
    assert snapshot(target) == before


def test_random_lora_still_writes_into_a_new_dir(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    made = invoke(export_app, "random-lora", "--onnxDir", tiny_onnx_dir, "--outputDir", tmp_path / "new")
    assert made.code == 0, made.stderr
    assert (tmp_path / "new" / "adapter_model.safetensors").is_file()


def test_lora_output_inside_an_engine_dir_is_refused(tiny_engine_dir: Path, tmp_path: Path) -> None:
    engine = shutil.copytree(tiny_engine_dir, tmp_path / "engine")
    (tmp_path / "adapter").mkdir()
    before = snapshot(engine)
    invoke(export_app, "lora", "--adapterDir", tmp_path / "adapter", "--onnxDir", tmp_path / "adapter", "--output",
           engine / "embedding.safetensors").one_line_error("--output", "kvforge engine dir")
    invoke(export_app, "lora", "--adapterDir", tmp_path / "adapter", "--onnxDir", tmp_path / "adapter", "--output",
           engine / "new.safetensors").one_line_error("--output", "kvforge engine dir")
    assert snapshot(engine) == before


def test_inference_output_inside_another_export_is_refused(tiny_engine_dir: Path, tiny_onnx_dir: Path,
                                                           tmp_path: Path) -> None:
    export = shutil.copytree(tiny_onnx_dir, tmp_path / "export")
    input_file = request_file(tmp_path / "in.json")
    before = snapshot(export)
    for target, flag in ((export / "config.json", "--outputFile"), (export / "profile.json", "--profileOutputFile")):
        args = ["--outputFile", tmp_path / "out.json", "--profileOutputFile", tmp_path / "p.json"]
        args[args.index(flag) + 1] = target
        invoke(inference_app, "--engineDir", tiny_engine_dir, "--inputFile", input_file, *args).one_line_error(
            flag, "kvforge onnx dir")
    assert snapshot(export) == before and not (tmp_path / "out.json").exists()


def test_a_users_manifest_json_owns_nothing(tiny_engine_dir: Path, tmp_path: Path) -> None:
    """A web app's manifest.json is not kvforge's: writing beside it stays allowed."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "manifest.json").write_text(json.dumps({"name": "my app"}))
    input_file = request_file(tmp_path / "in.json")
    done = invoke(inference_app, "--engineDir", tiny_engine_dir, "--inputFile", input_file, "--outputFile",
                  site / "out.json")
    assert done.code == 0, done.stderr
    assert (site / "out.json").is_file()


@pytest.mark.parametrize("value", ["nan", "1e400", "99999999999999999999", "-inf"])
def test_shared_cache_timeout_must_be_finite_and_in_range(tiny_engine_dir: Path, tmp_path: Path, value: str) -> None:
    input_file = request_file(tmp_path / "in.json")
    invoke(inference_app, "--engineDir", tiny_engine_dir, "--inputFile", input_file, "--outputFile",
           tmp_path / "out.json", "--enableContextReuse", "--sharedCache", "redis://127.0.0.1:1/0",
           "--sharedCacheTimeoutMs", value).one_line_error("--sharedCacheTimeoutMs", "finite")
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("text", ["e,reuse=on,reuse=off", "e,spec=ngram,spec=off", "e,spec=ngram,draftStep=2,"
                                  "draftStep=3"])
def test_bench_engine_options_given_twice_are_refused(text: str) -> None:
    with pytest.raises(KvforgeError, match="given twice"):
        parse_engine(text)
    assert parse_engine("e,reuse=off").reuse is False  # each once still parses


def _as_draft(engine: Path) -> Path:
    """An engine dir whose config says it is a draft (the role is what the rebuild compares)."""
    config = json.loads((engine / "config.json").read_text())
    config["engine_role"] = "draft"
    config["builder_config"]["spec_draft"] = True
    return edit_engine(engine, config=config)


def test_a_draft_build_never_replaces_a_base(tiny_engine_dir: Path, tiny_onnx_dir: Path, tmp_path: Path) -> None:
    base = shutil.copytree(tiny_engine_dir, tmp_path / "base")
    before = snapshot(base)
    with pytest.raises(InvalidConfig, match="refusing to replace it") as caught:
        build_engine(tiny_onnx_dir, base, BuildOptions(spec_draft=True))
    assert caught.value.field == "engine_dir"
    assert snapshot(base) == before


def test_a_base_build_never_replaces_a_draft(tiny_engine_dir: Path, tiny_onnx_dir: Path, tmp_path: Path) -> None:
    draft = _as_draft(shutil.copytree(tiny_engine_dir, tmp_path / "draft"))
    before = snapshot(draft)
    with pytest.raises(InvalidConfig, match="holds a draft engine"):
        build_engine(tiny_onnx_dir, draft, BuildOptions(spec_base=True))
    assert snapshot(draft) == before

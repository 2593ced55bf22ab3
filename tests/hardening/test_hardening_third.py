"""The third hostile pass (issue 42): writers that overwrite, outputs inside kvforge's dirs, flags out of range."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.engine_driver import make_engine
from support.hardening_support import edit_engine, invoke, request_file, snapshot

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.engine_dir import load_engine_dir
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


def _manifest_without(engine: Path, *names: str, listing_nothing: bool = False) -> None:
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["files"] = {} if listing_nothing else {k: v for k, v in manifest["files"].items() if k not in names}
    (engine / "manifest.json").write_text(json.dumps(manifest))


def test_an_engine_whose_manifest_lists_nothing_is_refused(tiny_engine_dir: Path, tmp_path: Path) -> None:
    engine = shutil.copytree(tiny_engine_dir, tmp_path / "engine")
    config = json.loads((engine / "tokenizer_config.json").read_text())
    (engine / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 'edited' }}"}))
    _manifest_without(engine, listing_nothing=True)
    with pytest.raises(InvalidConfig, match="lists no files") as caught:
        load_engine_dir(engine)
    assert caught.value.field == "engine_dir"


@pytest.mark.parametrize("edit", ["unlisted-template", "unlisted-graph"])
def test_a_file_the_engine_reads_must_be_in_the_manifest(tiny_engine_dir: Path, tmp_path: Path, edit: str) -> None:
    engine = shutil.copytree(tiny_engine_dir, tmp_path / "engine")
    if edit == "unlisted-template":  # the edited chat template's file taken out of the manifest
        config = json.loads((engine / "tokenizer_config.json").read_text())
        (engine / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 'edited' }}"}))
        needle = "tokenizer_config.json"
    else:
        needle = "model.onnx"
    _manifest_without(engine, needle)
    input_file = request_file(tmp_path / "in.json")
    invoke(inference_app, "--engineDir", engine, "--inputFile", input_file, "--outputFile",
           tmp_path / "out.json").one_line_error("--engineDir", needle, "not in its manifest.json")


def _eagle3_copy(tiny_eagle3_engine_dir: Path, tmp_path: Path) -> Path:
    return shutil.copytree(tiny_eagle3_engine_dir, tmp_path / "engine")


D2T_CASES = {
    "outside-vocab": lambda d2t: d2t + 10_000,
    "negative": lambda d2t: d2t - 10_000,
    "short": lambda d2t: d2t[:-1],
    "rank-2": lambda d2t: d2t.reshape(1, -1),
    "float": lambda d2t: d2t.astype(np.float32),
}


@pytest.mark.parametrize("case", D2T_CASES)
def test_a_bad_d2t_map_is_refused_at_load_naming_the_draft(tiny_eagle3_engine_dir: Path, tmp_path: Path,
                                                           case: str) -> None:
    engine = _eagle3_copy(tiny_eagle3_engine_dir, tmp_path)
    draft = engine / "draft"
    d2t = np.asarray(load_file(str(draft / "d2t.safetensors"))["d2t"])
    save_file({"d2t": np.ascontiguousarray(D2T_CASES[case](d2t))}, str(draft / "d2t.safetensors"))
    edit_engine(draft)  # a consistent manifest: the d2t check itself must catch it
    with pytest.raises(InvalidConfig, match="d2t") as caught:
        make_engine(engine, spec_decode="eagle3")
    assert caught.value.field == "spec_draft_engine_dir"


def test_the_d2t_check_passes_the_map_as_exported(tiny_eagle3_engine_dir: Path) -> None:
    load_engine_dir(tiny_eagle3_engine_dir / "draft")  # no error: the exporter's own map is in range


def test_a_broken_draft_graph_names_the_draft_flag(tiny_eagle3_engine_dir: Path, tmp_path: Path) -> None:
    engine = _eagle3_copy(tiny_eagle3_engine_dir, tmp_path)
    (engine / "draft" / "model.onnx").write_bytes(b"not a graph")
    edit_engine(engine / "draft")
    input_file = request_file(tmp_path / "in.json")
    line = invoke(inference_app, "--engineDir", engine, "--inputFile", input_file, "--outputFile",
                  tmp_path / "out.json", "--specDecode", "eagle3").one_line_error("--specDraftEngineDir")
    assert "--engineDir" not in line


def test_random_gemma4_assistant_refuses_a_base_without_its_last_layer(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    invoke(export_app, "random-gemma4-assistant", "--baseOnnxDir", tiny_onnx_dir, "--outputDir",
           tmp_path / "assistant").one_line_error("--baseOnnxDir", "--hiddenStateLayers 1")
    assert not (tmp_path / "assistant").exists()  # refused before anything is written


def test_random_gemma4_assistant_reads_a_layer_the_base_returns(tmp_path: Path) -> None:
    from kvforge.tools.export.sources.synthetic import synthetic_model
    from kvforge.tools.export.writer import write_onnx_dir

    write_onnx_dir(synthetic_model("tiny-llama", hidden_state_layers=[1]), tmp_path / "base")
    made = invoke(export_app, "random-gemma4-assistant", "--baseOnnxDir", tmp_path / "base", "--outputDir",
                  tmp_path / "hf", "--numLayers", "1")
    assert made.code == 0, made.stderr
    exported = invoke(export_app, "gemma4-assistant", "--draftDir", tmp_path / "hf", "--baseOnnxDir",
                      tmp_path / "base", "--outputDir", tmp_path / "onnx")
    assert exported.code == 0, exported.stderr


TINY_FLAGS = ["--maxInputLen", "64", "--maxKVCacheCapacity", "256", "--maxBatchSize", "4", "--tokensPerPage", "16",
              "--backend", "onnxruntime"]


@pytest.mark.parametrize("share", [0.85, 0.1])
def test_a_pool_near_the_machines_memory_builds_with_a_warning(tiny_engine_dir: Path, tiny_onnx_dir: Path,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               share: float) -> None:
    from kvforge.builder.cli import app as build_app
    from kvforge.contract import memory

    engine = load_engine_dir(tiny_engine_dir)  # the same geometry as TINY_FLAGS
    needs = engine.kv_pool_bytes + sum((tiny_engine_dir / name).stat().st_size
                                       for name in ("model.onnx", "model.onnx.data"))
    monkeypatch.setattr(memory, "machine_memory_bytes", lambda: int(needs / share))
    built = invoke(build_app, "--onnxDir", tiny_onnx_dir, "--engineDir", tmp_path / "engine", *TINY_FLAGS)
    assert built.code == 0, built.stderr
    warned = [line for line in built.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == (1 if share > 0.8 else 0), built.stderr
    assert not warned or "of this machine's" in warned[0] and "--maxKVPoolPages" in warned[0]

"""Outputs are never lost or clobbered: checked before work, distinct from inputs and each other, atomic."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.hardening_support import HI, invoke, request_file, snapshot

from kvforge.builder.cli import app as build_app
from kvforge.contract.files import atomic_output, check_distinct, staged_dir
from kvforge.contract.manifest import ONNX_KIND, write_manifest
from kvforge.runtime.cli import app as inference_app
from kvforge.runtime.file_loop import write_output_file
from kvforge.tools.export.cli import app as export_app


def inference(engine: Path, input_file: Path, output: Path, *extra: object):
    return invoke(inference_app, "--engineDir", engine, "--inputFile", input_file, "--outputFile", output, *extra)


def test_profile_and_output_on_the_same_path(tiny_engine_dir: Path, tmp_path: Path) -> None:
    input_file = request_file(tmp_path / "in.json")
    out = tmp_path / "out.json"
    before = snapshot(tmp_path, tiny_engine_dir)
    inference(tiny_engine_dir, input_file, out, "--profileOutputFile", out).one_line_error(
        "--outputFile", "--profileOutputFile")
    assert snapshot(tmp_path, tiny_engine_dir) == before and not out.exists()


@pytest.mark.parametrize("alias", ["same", "dot", "hardlink", "symlink"])
def test_output_equal_to_the_input_is_refused(tiny_engine_dir: Path, tmp_path: Path, alias: str) -> None:
    input_file = request_file(tmp_path / "in.json")
    output = {"same": input_file, "dot": tmp_path / "." / "in.json", "hardlink": tmp_path / "link.json",
              "symlink": tmp_path / "sym.json"}[alias]
    if alias == "hardlink":
        os.link(input_file, output)
    if alias == "symlink":
        output.symlink_to(input_file)
    before = snapshot(tmp_path)
    inference(tiny_engine_dir, input_file, output).one_line_error("--outputFile", "--inputFile")
    assert snapshot(tmp_path) == before


def test_output_inside_the_engine_dir_replacing_a_file(tiny_engine_dir: Path, tmp_path: Path) -> None:
    input_file = request_file(tmp_path / "in.json")
    before = snapshot(tiny_engine_dir)
    inference(tiny_engine_dir, input_file, tiny_engine_dir / "config.json").one_line_error("--outputFile",
                                                                                        "kvforge engine dir")
    assert snapshot(tiny_engine_dir) == before


def test_output_over_an_adapter_file_is_refused(tiny_engine_dir: Path, tmp_path: Path) -> None:
    adapter = tmp_path / "a.safetensors"
    adapter.write_bytes(b"adapter bytes")
    input_file = request_file(tmp_path / "in.json", available_lora_weights={"a": "a.safetensors"})
    inference(tiny_engine_dir, input_file, adapter).one_line_error("--outputFile", "available_lora_weights")
    assert adapter.read_bytes() == b"adapter bytes"


def test_unusable_output_paths_fail_before_any_work(tiny_engine_dir: Path, tmp_path: Path) -> None:
    input_file = request_file(tmp_path / "in.json")
    inference(tiny_engine_dir, input_file, tmp_path).one_line_error("--outputFile", "is a directory")
    inference(tiny_engine_dir, input_file, tmp_path / "out.json", "--profileOutputFile",
              tmp_path / "missing" / "p.json").one_line_error("--profileOutputFile", "does not exist")
    assert not (tmp_path / "out.json").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories; permission checks untestable")
def test_unwritable_output_dir(tiny_engine_dir: Path, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    inference(tiny_engine_dir, request_file(tmp_path / "in.json"), locked / "o.json").one_line_error(
        "--outputFile", "not writable")


def test_a_failed_run_leaves_no_output_and_keeps_an_old_one(tiny_engine_dir: Path, tmp_path: Path) -> None:
    # The second request is too long for the engine: found while preparing, after the output was checked.
    input_file = request_file(tmp_path / "in.json", {"messages": [HI]},
                              {"messages": [{"role": "user", "content": "x" * 200}]})
    fresh, existing = tmp_path / "fresh.json", tmp_path / "existing.json"
    existing.write_text("precious", encoding="utf-8")
    inference(tiny_engine_dir, input_file, fresh).one_line_error("requests[1].messages")
    inference(tiny_engine_dir, input_file, existing).one_line_error("requests[1].messages")
    assert not fresh.exists() and existing.read_text(encoding="utf-8") == "precious"
    assert not [p for p in tmp_path.iterdir() if ".kvforge-tmp-" in p.name]  # no temporary left behind


def test_a_successful_run_writes_the_documented_format(tiny_engine_dir: Path, tmp_path: Path) -> None:
    input_file = request_file(tmp_path / "in.json", {"messages": [HI]}, {"messages": [HI]}, batch_size=2)
    out, profile = tmp_path / "out.json", tmp_path / "profile.json"
    assert inference(tiny_engine_dir, input_file, out, "--profileOutputFile", profile).code == 0
    data = json.loads(out.read_text(encoding="utf-8"))
    assert [r["request_idx"] for r in data["responses"]] == [0, 1] and "prefill" in json.loads(profile.read_text())
    # Streaming keeps the exact bytes json.dumps(..., indent=4) gave when responses were held in memory.
    assert out.read_text(encoding="utf-8") == json.dumps(data, indent=4, ensure_ascii=False) + "\n"


def test_write_output_file_streams_and_is_atomic(tmp_path: Path) -> None:
    out = tmp_path / "o.json"
    responses = [{"output_text": "a\nb", "n": [1, {"x": "é"}]}, {"output_text": ""}]
    write_output_file(out, "in.json", iter(responses))
    assert out.read_text(encoding="utf-8") == json.dumps({"input_file": "in.json", "responses": responses},
                                                         indent=4, ensure_ascii=False) + "\n"

    def failing():
        yield responses[0]
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError):
        write_output_file(out, "in.json", failing())
    assert json.loads(out.read_text(encoding="utf-8"))["responses"] == responses  # the old file stands
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.json"]


def test_atomic_output_and_staged_dir_leave_nothing_on_failure(tmp_path: Path) -> None:
    with pytest.raises(ValueError), atomic_output(tmp_path / "f.txt") as handle:
        handle.write("partial")
        raise ValueError
    target = tmp_path / "dir"
    target.mkdir()
    (target / "old").write_text("old")
    write_manifest(target, ONNX_KIND)  # a dir kvforge wrote: replaceable
    with pytest.raises(ValueError), staged_dir(target) as staging:
        (staging / "new").write_text("new")
        raise ValueError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"] and (target / "old").read_text() == "old"
    with staged_dir(target) as staging:
        (staging / "new").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]


def test_check_distinct_rules(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "keep").write_text("x")
    check_distinct({"--out": data / "new.json"}, {"--dir": data})  # a new file next to inputs is fine
    for outputs, dirs in (({"--out": data / "keep"}, False), ({"--out": data / "sub"}, True),
                          ({"--out": tmp_path}, True)):
        with pytest.raises(Exception, match="--dir"):
            check_distinct(outputs, {"--dir": data}, outputs_are_dirs=dirs)


# ------------------------------------------------------------------------------------------- llm_build

def test_build_refuses_engine_dir_equal_to_or_inside_the_onnx_dir(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    before = snapshot(tiny_onnx_dir)
    for engine in (tiny_onnx_dir, tiny_onnx_dir / "engine", tiny_onnx_dir / ".." / tiny_onnx_dir.name):
        invoke(build_app, "--onnxDir", tiny_onnx_dir, "--engineDir", engine, "--backend", "onnxruntime"
               ).one_line_error("--engineDir", "--onnxDir")
    assert snapshot(tiny_onnx_dir) == before and not (tiny_onnx_dir / "engine").exists()


def test_build_refuses_to_replace_a_foreign_directory(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not an engine")
    invoke(build_app, "--onnxDir", tiny_onnx_dir, "--engineDir", mine, "--backend", "onnxruntime").one_line_error(
        "--engineDir", "not written by kvforge")
    assert (mine / "notes.txt").read_text() == "not an engine"


def test_failed_build_keeps_the_previous_engine(tiny_engine_dir: Path, tiny_onnx_dir: Path, tmp_path: Path) -> None:
    import shutil

    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, engine)
    before = snapshot(engine)
    invoke(build_app, "--onnxDir", tiny_onnx_dir, "--engineDir", engine, "--backend", "onnxruntime",
           "--tokensPerPage", "100").one_line_error("--tokensPerPage")
    assert snapshot(engine) == before


def test_export_refuses_an_output_dir_over_its_source(tmp_path: Path) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF" + b"\0" * 64)
    invoke(export_app, "model", source, "--outputDir", source).one_line_error("--outputDir")
    assert source.read_bytes() == b"GGUF" + b"\0" * 64


def test_output_to_a_device_is_refused_and_a_symlink_is_written_through(tiny_engine_dir: Path,
                                                                          tmp_path: Path) -> None:
    input_file = request_file(tmp_path / "in.json")
    inference(tiny_engine_dir, input_file, "/dev/null").one_line_error("--outputFile", "not a regular file")
    assert Path("/dev/null").is_char_device()
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old")
    link.symlink_to(real)
    assert inference(tiny_engine_dir, input_file, link).code == 0
    assert link.is_symlink() and json.loads(real.read_text())["responses"]

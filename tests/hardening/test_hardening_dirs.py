"""Engine and ONNX dirs are validated on load: config schema, manifest, graph and embedding cross-checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save
from support.hardening_support import copy_engine, edit_engine, invoke, request_file

from kvforge.builder.cli import app as build_app
from kvforge.runtime.cli import app as inference_app

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here


def run(engine: Path, tmp_path: Path):
    return invoke(inference_app, "--engineDir", engine, "--inputFile", request_file(tmp_path / "in.json"),
                  "--outputFile", tmp_path / "out.json")


def config_of(engine_dir: Path) -> dict:
    return json.loads((engine_dir / "config.json").read_text(encoding="utf-8"))


def changed(config: dict, path: str, value: object) -> dict:
    config = json.loads(json.dumps(config))
    *parents, key = path.split(".")
    target = config
    for parent in parents:
        target = target[parent]
    if value is DELETE:
        del target[key]
    else:
        target[key] = value
    return config


class _Delete:
    def __repr__(self) -> str:  # in a test id: an object()'s address differs between xdist workers' collections
        return "<deleted>"


DELETE = _Delete()
CONFIG_CASES = [  # (dotted key, bad value, field named in the error)
    ("num_key_value_heads", 0, "config.num_key_value_heads"),
    ("hidden_size", "64", "config.hidden_size"),
    ("eos_token_ids", "2", "config.eos_token_ids"),
    ("eos_token_ids", [2, 99999], "config.eos_token_ids"),
    ("num_attention_heads", 4.0, "config.num_attention_heads"),
    ("rope_theta", -1, "config.rope_theta"),
    ("vocab_size", 10**30, "config.vocab_size"),
    ("tie_word_embeddings", "yes", "config.tie_word_embeddings"),
    ("head_dim", DELETE, "config.head_dim"),
    ("lora_targets", ["q", "zz"], "config.lora_targets"),
    ("builder_config.max_kv_pool_pages", "64", "builder_config.max_kv_pool_pages"),
    ("builder_config.tokens_per_page", 15, "builder_config.tokens_per_page"),
    ("builder_config.max_pages_per_seq", 3, "builder_config.max_pages_per_seq"),
    ("builder_config.max_batch_size", True, "builder_config.max_batch_size"),
    ("builder_config.backend", None, "builder_config.backend"),
]


@pytest.mark.parametrize("key, value, field", CONFIG_CASES, ids=[f"{c[0]}={c[1]!r}"[:40] for c in CONFIG_CASES])
def test_config_schema_names_the_field(tiny_engine_dir: Path, tmp_path: Path, key: str, value: object,
                                       field: str) -> None:
    engine = edit_engine(copy_engine(tiny_engine_dir, tmp_path / "engine"),
                         config=changed(config_of(tiny_engine_dir), key, value))
    run(engine, tmp_path).one_line_error(field)
    assert not (tmp_path / "out.json").exists()


def test_layer_count_disagreeing_with_the_graph(tiny_engine_dir: Path, tmp_path: Path) -> None:
    engine = edit_engine(copy_engine(tiny_engine_dir, tmp_path / "engine"),
                         config=changed(config_of(tiny_engine_dir), "num_hidden_layers", 3))
    run(engine, tmp_path).one_line_error("--engineDir", "num_hidden_layers 3", "2 KV pool inputs")


def test_embedding_of_the_wrong_shape(tiny_engine_dir: Path, tmp_path: Path) -> None:
    config = config_of(tiny_engine_dir)
    wrong = save({"embedding": np.zeros((config["vocab_size"], config["hidden_size"] + 1), np.float32)})
    engine = edit_engine(copy_engine(tiny_engine_dir, tmp_path / "engine"), text={"embedding.safetensors": wrong})
    run(engine, tmp_path).one_line_error("--engineDir", "embedding", "hidden_size")


@pytest.mark.parametrize("name, content, needles", [
    ("tokenizer.json", "{not json", ("--engineDir", "tokenizer.json")),
    ("tokenizer_config.json", json.dumps({"chat_template": "{% for m in messages %}"}),
     ("--engineDir", "chat template does not compile")),
    ("tokenizer_config.json", json.dumps({"chat_template": ["not", "a", "string"]}),
     ("--engineDir", "chat_template")),
    ("model.onnx", b"\x08\x07garbage", ("--engineDir", "onnxruntime cannot load")),
])
def test_corrupt_files_are_one_line(tiny_engine_dir: Path, tmp_path: Path, name: str, content: str | bytes,
                                    needles: tuple[str, ...]) -> None:
    engine = edit_engine(copy_engine(tiny_engine_dir, tmp_path / "engine"), text={name: content})
    run(engine, tmp_path).one_line_error(*needles)


def test_changed_or_truncated_files_fail_the_manifest(tiny_engine_dir: Path, tmp_path: Path) -> None:
    engine = copy_engine(tiny_engine_dir, tmp_path / "engine")
    data = (engine / "model.onnx.data").read_bytes()
    (engine / "model.onnx.data").write_bytes(data[: len(data) // 2])
    run(engine, tmp_path).one_line_error("--engineDir", "model.onnx.data", "manifest.json")
    (engine / "model.onnx.data").write_bytes(data)
    (engine / "manifest.json").unlink()
    run(engine, tmp_path).one_line_error("--engineDir", "no manifest.json", "llm_build")


def test_onnx_dir_is_checked_by_the_build(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    import shutil

    onnx = tmp_path / "onnx"
    shutil.copytree(tiny_onnx_dir, onnx)
    (onnx / "tokenizer.json").write_text("{}", encoding="utf-8")  # changed after the export finished
    invoke(build_app, "--onnxDir", onnx, "--engineDir", tmp_path / "engine", "--backend", "onnxruntime"
           ).one_line_error("--onnxDir", "tokenizer.json", "llm_export")
    assert not (tmp_path / "engine").exists()


def test_ort_logging_stays_off_stderr(run_cli, tiny_engine_dir: Path, tmp_path: Path) -> None:
    """A graph ONNX Runtime refuses would log multi-line errors to stderr (fd 2, below Python) without the
    severity setting; the real console script must print one line."""
    engine = edit_engine(copy_engine(tiny_engine_dir, tmp_path / "engine"), text={"model.onnx": b"\x08\x07junk"})
    proc = run_cli(["llm_inference", "--engineDir", engine, "--inputFile", request_file(tmp_path / "in.json"),
                    "--outputFile", tmp_path / "out.json"])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_onnx_config_disagreeing_with_its_graph(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    import shutil

    from kvforge.contract.manifest import ONNX_KIND, write_manifest

    onnx = tmp_path / "onnx"
    shutil.copytree(tiny_onnx_dir, onnx)
    (onnx / "config.json").write_text(json.dumps(changed(config_of(onnx), "num_hidden_layers", 3)))
    write_manifest(onnx, ONNX_KIND)
    invoke(build_app, "--onnxDir", onnx, "--engineDir", tmp_path / "engine", "--backend", "onnxruntime"
           ).one_line_error("--onnxDir", "num_hidden_layers 3", "2 KV pool inputs")
    assert not (tmp_path / "engine").exists()


def test_tokenizer_larger_than_the_model_vocabulary(tiny_engine_dir: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_engine_dir / "tokenizer.json"))
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(50)])
    engine = edit_engine(copy_engine(tiny_engine_dir, tmp_path / "engine"), text={"tokenizer.json": tokenizer.to_str()})
    run(engine, tmp_path).one_line_error("--engineDir", "tokenizer.json", "vocab_size")

"""Memory has bounds: the KV pool against the machine, adapter headers before data, request-file size."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save
from support.engine_driver import lora_model_with_adapters
from support.hardening_support import invoke, request_file

from kvforge.builder.cli import app as build_app
from kvforge.contract.errors import KvforgeError
from kvforge.contract.geometry import DEFAULT_TOKENS_PER_PAGE
from kvforge.contract.lora import ADAPTER_FORMAT, lora_inputs, model_fingerprint, target_dims
from kvforge.contract.memory import machine_memory_bytes
from kvforge.runtime.cli import app as inference_app

HUGE_POOL = str(2**29)  # pages: 2 KiB per page per layer on the tiny model (16-token pages), 2 TiB in all


def test_build_refuses_a_pool_larger_than_the_machine(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    assert machine_memory_bytes() is not None
    engine = tmp_path / "engine"
    line = invoke(build_app, "--onnxDir", tiny_onnx_dir, "--engineDir", engine, "--backend", "onnxruntime",
                  "--maxKVPoolPages", HUGE_POOL).one_line_error("--maxKVPoolPages", "bytes", "--force")
    # K and V, 2 KV heads, the default page's tokens, head_dim 16, fp16
    per_page = 2 * 2 * DEFAULT_TOKENS_PER_PAGE * 16 * 2
    assert f"KV pool {per_page * 2 * 2**29 / 2**30:,.1f} GiB" in line  # the pool (2 layers) beside the weights
    assert "weights" in line
    assert not engine.exists()


def test_forced_build_is_refused_by_the_runtime_before_allocating(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    engine = tmp_path / "engine"
    built = invoke(build_app, "--onnxDir", tiny_onnx_dir, "--engineDir", engine, "--backend", "onnxruntime",
                   "--maxKVPoolPages", HUGE_POOL, "--force")
    assert built.code == 0, built.stderr
    started = time.perf_counter()
    invoke(inference_app, "--engineDir", engine, "--inputFile", request_file(tmp_path / "in.json"),
           "--outputFile", tmp_path / "out.json").one_line_error("--maxKVPoolPages", "GiB")
    assert time.perf_counter() - started < 30 and not (tmp_path / "out.json").exists()


def test_request_file_size_cap(tiny_engine_dir: Path, tmp_path: Path) -> None:
    input_file = request_file(tmp_path / "in.json")
    size = input_file.stat().st_size
    args = ["--engineDir", tiny_engine_dir, "--inputFile", input_file, "--outputFile", tmp_path / "o.json"]
    invoke(inference_app, *args, "--maxInputFileBytes", size - 1).one_line_error("--maxInputFileBytes",
                                                                                  f"{size:,} bytes")
    assert invoke(inference_app, *args, "--maxInputFileBytes", size).code == 0
    invoke(inference_app, *args, "--maxInputFileBytes", 0).one_line_error("--maxInputFileBytes")


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory):
    from kvforge.builder.build import BuildOptions
    from kvforge.runtime.engine.engine import Engine

    root = tmp_path_factory.mktemp("lora_hardening")
    build = BuildOptions(max_input_len=64, max_kv_cache_capacity=128, max_batch_size=2, tokens_per_page=16,
                         max_lora_rank=8)
    loaded, adapters = lora_model_with_adapters(root, build, "fp16", (("good", 1, 4),))
    return root, Engine(root / "engine"), adapters["good"]


def _adapter_file(path: Path, engine, tensors: dict[str, np.ndarray], rank: int) -> Path:
    metadata = {"format": ADAPTER_FORMAT, "rank": str(rank),
                "model_fingerprint": model_fingerprint(engine.engine_dir.model)}
    path.write_bytes(save(tensors, metadata=metadata))
    return path


def test_adapter_shapes_are_checked_before_any_tensor_is_read(lora_setup, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    _root, engine, _good = lora_setup
    model = engine.engine_dir.model
    a_name, b_name, _layer, target = lora_inputs(model)[0]
    in_dim, out_dim = target_dims(model, target)
    wrong = _adapter_file(tmp_path / "wrong.safetensors", engine,
                          {a_name: np.zeros((in_dim + 1, 4), np.float32), b_name: np.zeros((4, out_dim), np.float32)},
                          rank=4)
    import kvforge.runtime.adapters as lora

    def no_reading(*_args, **_kwargs):
        raise AssertionError("tensor data read before the header was checked")

    monkeypatch.setattr(lora, "safe_open", no_reading)
    with pytest.raises(KvforgeError, match=a_name) as info:
        engine.load_adapters({"w": str(wrong)})
    assert info.value.field == 'available_lora_weights["w"]'


@pytest.mark.serial  # a wall-clock bound: run alone, not beside another worker
def test_forged_adapter_header_claiming_gigabytes(lora_setup, tmp_path: Path) -> None:
    _root, engine, _good = lora_setup
    a_name = lora_inputs(engine.engine_dir.model)[0][0]
    header = {"__metadata__": {"format": ADAPTER_FORMAT, "rank": "4",
                               "model_fingerprint": model_fingerprint(engine.engine_dir.model)},
              a_name: {"dtype": "F32", "shape": [2**20, 2**20], "data_offsets": [0, 4 * 2**40]}}
    raw = json.dumps(header).encode()
    forged = tmp_path / "forged.safetensors"
    forged.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 64)
    started = time.perf_counter()
    with pytest.raises(KvforgeError, match="outside the file"):
        engine.load_adapters({"f": str(forged)})
    assert time.perf_counter() - started < 1.0


def test_valid_adapter_still_loads(lora_setup) -> None:
    _root, engine, good = lora_setup
    engine.load_adapters({"good": str(good)})
    assert engine.loras.adapters["good"].rank == 4


def test_endless_inputs_are_read_bounded(tiny_engine_dir: Path, tmp_path: Path) -> None:
    from kvforge.tools.profile.cli import app as profile_app

    invoke(profile_app, "show", "/dev/zero").one_line_error("larger than")
    invoke(inference_app, "--engineDir", tiny_engine_dir, "--inputFile", "/dev/zero", "--outputFile",
           tmp_path / "o.json", "--maxInputFileBytes", 1024).one_line_error("--maxInputFileBytes")


@pytest.mark.parametrize("flag, value", [("--warmup", 10**9), ("--numThreads", 10**5), ("--maxInputFileBytes", 10**20)])
def test_hostile_counts_are_refused(tiny_engine_dir: Path, tmp_path: Path, flag: str, value: int) -> None:
    invoke(inference_app, "--engineDir", tiny_engine_dir, "--inputFile", request_file(tmp_path / "in.json"),
           "--outputFile", tmp_path / "o.json", flag, value).one_line_error(flag)


def test_snapshot_budgets_beyond_memory_name_their_flag(tiny_engine_dir: Path, tmp_path: Path) -> None:
    """A budget far beyond memory used to end in a MemoryError (exit 3) when the snapshot pool was allocated."""
    for flag in ("--contextCachePartialKVSnapshotPoolBytes",):
        invoke(inference_app, "--engineDir", tiny_engine_dir, "--inputFile", request_file(tmp_path / "in.json"),
               "--outputFile", tmp_path / "out.json", "--enableContextReuse", flag, str(2**50)).one_line_error(
            flag, "available", "partial-KV snapshots")
    assert not (tmp_path / "out.json").exists()


def test_recurrent_snapshot_budget_beyond_memory(tiny_hybrid_engine_dir: Path, tmp_path: Path) -> None:
    flag = "--contextCacheRecurrentSnapshotPoolBytes"
    invoke(inference_app, "--engineDir", tiny_hybrid_engine_dir, "--inputFile", request_file(tmp_path / "in.json"),
           "--outputFile", tmp_path / "out.json", "--enableContextReuse", flag, str(2**50),
           "--contextCachePartialKVSnapshotPoolBytes", str(2**20)).one_line_error(flag, "recurrent snapshots")


def test_the_pool_is_checked_beside_the_weights_against_available_memory(tiny_engine_dir: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Room for the pool alone is not enough: the weights load beside it, into what is available, not total RAM."""
    from kvforge.contract.engine_dir import load_engine_dir
    from kvforge.runtime.engine import config as engine_config

    engine = load_engine_dir(tiny_engine_dir)
    assert engine.weight_bytes > 0
    pool = engine.kv_pool_bytes + engine.rope_bytes
    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: pool + engine.weight_bytes // 2)
    invoke(inference_app, "--engineDir", tiny_engine_dir, "--inputFile", request_file(tmp_path / "in.json"),
           "--outputFile", tmp_path / "out.json").one_line_error("--maxKVPoolPages", "weights", "available")
    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: pool + engine.weight_bytes)
    assert invoke(inference_app, "--engineDir", tiny_engine_dir, "--inputFile", request_file(tmp_path / "in.json"),
                  "--outputFile", tmp_path / "out.json").code == 0


def test_build_counts_the_weights_beside_the_pool(tiny_onnx_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from kvforge.contract import memory

    weights = (tiny_onnx_dir / "model.onnx.data").stat().st_size
    monkeypatch.setattr(memory, "machine_memory_bytes", lambda: weights // 2)  # the pool fits, pool + weights not
    invoke(build_app, "--onnxDir", tiny_onnx_dir, "--engineDir", tmp_path / "engine", "--backend", "onnxruntime",
           "--maxKVPoolPages", "1", "--maxInputLen", "16", "--maxKVCacheCapacity", "16").one_line_error(
        "--maxKVPoolPages", "weights")

"""resolve_geometry and the recorded geometry: pool sizing, explicit pools, errors naming the setting at fault."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from kvforge.builder.build import resolve_cpu_attention
from kvforge.cli_common import BUILD_FLAGS
from kvforge.contract.engine_dir import BuilderConfig, load_engine_dir
from kvforge.contract.errors import InvalidConfig
from kvforge.contract.geometry import INT32_MAX, MAX_KV_POOL_PAGES, PageGeometry, kv_bytes_per_page, resolve_geometry
from kvforge.contract.manifest import ENGINE_KIND, write_manifest
from kvforge.contract.paging import pages_for


def geometry(**overrides):
    args = dict(max_input_len=64, max_kv_cache_capacity=256, max_batch_size=4, tokens_per_page=16,
                max_kv_pool_pages=0, max_position_embeddings=4096)
    args.update(overrides)
    return resolve_geometry(**args)


@pytest.mark.parametrize("capacity, page, batch", [(256, 16, 4), (4096, 128, 4), (100, 16, 3), (1, 128, 1),
                                                    (129, 128, 2), (4096, 1, 1)])
def test_default_pool_is_batch_times_pages_per_sequence(capacity: int, page: int, batch: int) -> None:
    g = geometry(max_input_len=1, max_kv_cache_capacity=capacity, tokens_per_page=page, max_batch_size=batch)
    per_seq = math.ceil(capacity / page)
    assert g.max_pages_per_seq == per_seq == pages_for(capacity, page)
    assert g.full_batch_pages == batch * per_seq
    assert g.max_kv_pool_pages == batch * per_seq


def test_explicit_pool_at_or_above_full_batch_is_kept() -> None:
    assert geometry(max_kv_pool_pages=64).max_kv_pool_pages == 64  # exactly a full batch (4 × 256/16)
    g = geometry(max_kv_pool_pages=1000)
    assert g.max_kv_pool_pages == 1000 and g.full_batch_pages == 64


@pytest.mark.parametrize("pages", [16, 17, 63])
def test_pool_for_one_full_sequence_is_enough(pages: int) -> None:
    # Rows wait or are preempted when the pool is full, so one sequence at full capacity (256/16 pages) suffices.
    g = geometry(max_kv_pool_pages=pages)
    assert g.max_kv_pool_pages == pages and g.max_pages_per_seq == 16 and g.full_batch_pages == 64


def test_pool_minimum_is_one_sequence_at_full_capacity() -> None:
    with pytest.raises(InvalidConfig) as info:
        geometry(max_kv_pool_pages=15)  # 256 tokens need ceil(256 / 16) = 16 pages
    assert info.value.field == "max_kv_pool_pages"
    assert "at least 16" in info.value.message and "one sequence of 256 tokens" in info.value.message
    assert geometry(max_kv_cache_capacity=100, max_kv_pool_pages=7).max_kv_pool_pages == 7  # ceil(100 / 16)
    with pytest.raises(InvalidConfig, match="at least 7"):
        geometry(max_kv_cache_capacity=100, max_kv_pool_pages=6)


def test_builder_config_records_the_resolved_numbers() -> None:
    build = BuilderConfig.from_geometry(geometry(max_kv_pool_pages=100), "onnxruntime", 8)
    assert build.to_dict() == {
        "max_input_len": 64, "max_kv_cache_capacity": 256, "max_batch_size": 4, "tokens_per_page": 16,
        "max_kv_pool_pages": 100, "max_pages_per_seq": 16, "minimum_active_pages": 64,
        "backend": "onnxruntime", "max_lora_rank": 8, "layer_types": (), "partial_kv_snapshot_bytes_per_slot": 0,
        "recurrent_snapshot_bytes_per_slot": 0, "attention": "onnx-ops", "spec_base": False, "spec_draft": False,
        "max_verify_tree_size": 0, "max_draft_tree_size": 0, "tree_attention": False, "kernel_kv_write": False,
        "kernel_matmul": False, "linear_kernel": "", "linear_kernel_reason": "",
        "window_pool_pages": 0, "kv_pool_bytes_global": 0, "kv_pool_bytes_sliding": 0}
    assert BuilderConfig.from_geometry(geometry(), "tensorrt", 0, attention="kvforge-cpu-kernel").attention == \
        "tensorrt-plugin"  # a TensorRT engine attends with its plugin whatever it is asked


def test_largest_pool_allowed() -> None:
    assert geometry(max_kv_pool_pages=MAX_KV_POOL_PAGES).max_kv_pool_pages == INT32_MAX // 2


@pytest.mark.parametrize("overrides, field, flag, needle", [
    pytest.param({"tokens_per_page": 100}, "tokens_per_page", "--tokensPerPage", "power of two", id="page-100"),
    pytest.param({"tokens_per_page": 0}, "tokens_per_page", "--tokensPerPage", "power of two", id="page-0"),
    pytest.param({"tokens_per_page": -16}, "tokens_per_page", "--tokensPerPage", "power of two",
                 id="page-negative"),
    pytest.param({"max_kv_pool_pages": 15}, "max_kv_pool_pages", "--maxKVPoolPages", "at least 16",
                 id="pool-below-one-sequence"),
    pytest.param({"max_kv_pool_pages": -1}, "max_kv_pool_pages", "--maxKVPoolPages", "-1", id="pool-negative"),
    pytest.param({"max_kv_pool_pages": MAX_KV_POOL_PAGES + 1}, "max_kv_pool_pages", "--maxKVPoolPages",
                 str(MAX_KV_POOL_PAGES), id="pool-above-int32-half"),
    pytest.param({"max_kv_cache_capacity": 8192}, "max_kv_cache_capacity", "--maxKVCacheCapacity",
                 "max_position_embeddings", id="capacity-over-max-positions"),
    pytest.param({"max_kv_cache_capacity": 0}, "max_kv_cache_capacity", "--maxKVCacheCapacity", "got 0",
                 id="capacity-0"),
    pytest.param({"max_input_len": 0}, "max_input_len", "--maxInputLen", "got 0", id="input-len-0"),
    pytest.param({"max_input_len": 257}, "max_input_len", "--maxInputLen", "maxKVCacheCapacity=256",
                 id="input-len-over-capacity"),
    pytest.param({"max_batch_size": 0}, "max_batch_size", "--maxBatchSize", "got 0", id="batch-0"),
    pytest.param({"max_batch_size": 1025}, "max_batch_size", "--maxBatchSize", "1025", id="batch-over-1024"),
])
def test_errors_name_their_setting_and_flag(overrides: dict, field: str, flag: str, needle: str) -> None:
    with pytest.raises(InvalidConfig) as info:
        geometry(**overrides)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert needle in info.value.message
    assert "\n" not in str(info.value)
    assert str(info.value.with_flag_names(BUILD_FLAGS)) == f"{flag}: {info.value.message}"  # what llm_build prints


def test_default_pool_above_int32_half_is_refused() -> None:
    # Huge batch × capacity / 1-token pages: the *resolved* default pool must still fit int32 page ids.
    with pytest.raises(InvalidConfig) as info:
        geometry(max_batch_size=1024, max_kv_cache_capacity=2**21, max_position_embeddings=2**21,
                 tokens_per_page=1, max_input_len=1)
    assert info.value.field == "max_kv_pool_pages"


@pytest.mark.parametrize("dtype, itemsize", [("fp32", 4), ("fp16", 2), ("fp8", 1)])
def test_kv_bytes_per_page(dtype: str, itemsize: int) -> None:
    # K and V, each kv_heads × tokens × head_dim elements.
    assert kv_bytes_per_page(2, 16, 16, dtype) == 2 * 2 * 16 * 16 * itemsize
    assert kv_bytes_per_page(3, 64, 128, dtype) == 2 * 3 * 128 * 64 * itemsize


def test_kv_bytes_per_page_scales_with_dtype() -> None:
    sizes = [kv_bytes_per_page(2, 64, 128, d) for d in ("fp8", "fp16", "fp32")]
    assert sizes == [32768, 65536, 131072]


def test_engine_dir_build_is_the_recorded_geometry(tiny_engine_dir: Path, tiny_build_options, tmp_path: Path) -> None:
    build = load_engine_dir(tiny_engine_dir).build
    assert isinstance(build, PageGeometry)
    model = load_engine_dir(tiny_engine_dir).model
    # The attention path follows this run's kernel switch (tests/test_cpu_attention_path.py checks which).
    assert build == BuilderConfig.from_geometry(tiny_build_options.geometry(4096), "onnxruntime", 0, model,
                                                resolve_cpu_attention("auto", head_dim=model.head_dim),
                                                kernel_kv_write=build.attention == "kvforge-cpu-kernel")
    # The snapshot geometry: one K+V page per attention layer per partial-KV slot, no recurrent layers.
    assert build.layer_types == ("attention",) * model.num_hidden_layers
    assert build.partial_kv_snapshot_bytes_per_slot == model.num_hidden_layers * kv_bytes_per_page(
        model.num_key_value_heads, model.head_dim, build.tokens_per_page, model.kv_cache_dtype) > 0
    assert build.recurrent_snapshot_bytes_per_slot == 0
    # An engine dir from before LoRA (no max_lora_rank) still loads; extra keys such as minimum_active_pages are fine.
    old = tmp_path / "old_engine"
    shutil.copytree(tiny_engine_dir, old)
    data = json.loads((old / "config.json").read_text())
    del data["builder_config"]["max_lora_rank"]
    (old / "config.json").write_text(json.dumps(data))
    write_manifest(old, ENGINE_KIND)  # the edit is deliberate: record it, as llm_build would have
    assert load_engine_dir(old).build == build


def test_engine_dir_errors_name_the_engine_dir(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig) as info:
        load_engine_dir(tiny_onnx_dir)  # an ONNX dir has no builder_config
    assert info.value.field == "engine_dir" and "llm_build" in info.value.message
    with pytest.raises(InvalidConfig) as info:
        load_engine_dir(tmp_path / "missing")
    assert info.value.field == "engine_dir"

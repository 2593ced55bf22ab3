"""The TensorRT path at its boundary: plugins, network, profiles and runner calls against a recording fake."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from support import fake_tensorrt as fake

from kvforge.builder.build import BuildOptions, build_engine, resolve_backend
from kvforge.contract.engine_dir import TRT_ENGINE_FILE, load_engine_dir
from kvforge.contract.errors import KvforgeError
from kvforge.contract.lora import LORA_TARGETS
from kvforge.plugins import ops
from kvforge.plugins import trt as trt_plugins
from kvforge.runtime.execution.backend import StepInputs
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

TRT_BUILD = BuildOptions(max_input_len=64, max_kv_cache_capacity=256, max_batch_size=4, tokens_per_page=16,
                         backend="tensorrt")


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> fake.Recorder:
    """A fresh fake `tensorrt` in sys.modules; what kvforge asked of it is in the returned recorder."""
    return fake.install(monkeypatch)


@pytest.fixture
def no_tensorrt(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import tensorrt` fails here even on a machine that has it."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", None)


@pytest.fixture(scope="module")
def lora_onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    loaded = synthetic_model("tiny-llama")
    loaded.config.lora_targets = list(LORA_TARGETS)
    path = tmp_path_factory.mktemp("tiny_lora_onnx")
    write_onnx_dir(loaded, path)
    return path


def _geometry(options: BuildOptions = TRT_BUILD):
    return options.geometry(max_position_embeddings=1 << 20)


def _config(onnx_dir: Path) -> dict:
    return json.loads((onnx_dir / "config.json").read_text())


# --- backend choice ---------------------------------------------------------------------------------------------

def test_tensorrt_backend_without_tensorrt_is_one_line_error(no_tensorrt: None, tiny_onnx_dir: Path,
                                                             tmp_path: Path) -> None:
    with pytest.raises(KvforgeError) as info:
        build_engine(tiny_onnx_dir, tmp_path / "engine", TRT_BUILD)
    message = str(info.value)
    assert "TensorRT is not installed" in message and "kvforge[tensorrt]" in message
    assert info.value.field == "backend" and "\n" not in message


def test_auto_without_tensorrt_is_onnxruntime(no_tensorrt: None) -> None:
    assert resolve_backend("auto") == "onnxruntime"


def test_auto_needs_a_gpu_as_well(recorder: fake.Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trt_plugins, "cuda_device_count", lambda: 0)
    assert resolve_backend("auto") == "onnxruntime"
    monkeypatch.setattr(trt_plugins, "cuda_device_count", lambda: 1)
    assert resolve_backend("auto") == "tensorrt"
    assert resolve_backend("onnxruntime") == "onnxruntime"


def test_no_gpu_here_counts_zero_devices() -> None:
    assert trt_plugins.cuda_device_count() >= 0  # never raises, whatever cuda-python / libcuda state


# --- plugin registration ----------------------------------------------------------------------------------------

def test_register_plugins_records_both_qdps_once(recorder: fake.Recorder) -> None:
    trt_plugins.register_plugins(arch="sm_90")
    trt_plugins.register_plugins(arch="sm_90")  # idempotent: a second register would raise in tensorrt.plugin
    write, attention = recorder.plugins["kvforge::PagedKVWrite"], recorder.plugins["kvforge::PagedAttention"]
    assert write.tensor_names == list(ops.PAGED_KV_WRITE.inputs)
    assert write.attrs == {"num_kv_heads": int, "head_dim": int, "tokens_per_page": int}
    assert attention.tensor_names == list(ops.PAGED_ATTENTION.inputs)
    assert attention.attrs == {"num_q_heads": int, "num_kv_heads": int, "head_dim": int, "tokens_per_page": int,
                               "scale": float}
    assert write.aot_impl_func is not None and attention.aot_impl_func is not None


def test_kv_write_output_aliases_the_pool_input(recorder: fake.Recorder) -> None:
    trt_plugins.register_plugins(arch="sm_90")
    pool = fake.tensor_desc([32, 2, 2, 16, 64], fake.DataType.HALF)
    others = [fake.tensor_desc(["B", "S", 128], fake.DataType.FLOAT) for _ in range(6)]
    out = recorder.plugins["kvforge::PagedKVWrite"].register_func(*others, pool, 2, 64, 16)
    assert out.get_aliased() is pool and out.dtype == fake.DataType.HALF
    query = fake.tensor_desc(["B", "S", 256], fake.DataType.FLOAT)
    out = recorder.plugins["kvforge::PagedAttention"].register_func(query, pool, *others[:3], 4, 2, 64, 16, 0.125)
    assert not out.is_aliased and out.dtype == fake.DataType.FLOAT and out.shape_expr is query.shape_expr


# --- build -------------------------------------------------------------------------------------------------------

def test_build_records_network_profiles_and_engine(recorder: fake.Recorder, tiny_onnx_dir: Path,
                                                   tmp_path: Path) -> None:
    engine_dir = tmp_path / "engine"
    geometry, plan = build_engine(tiny_onnx_dir, engine_dir, TRT_BUILD)
    config = _config(tiny_onnx_dir)
    layers, hkv, head_dim, hidden = (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"],
                                     config["hidden_size"])
    pool = (geometry.max_kv_pool_pages, 2, hkv, 16, head_dim)
    assert geometry.max_kv_pool_pages == 4 * 16  # resolved: batch 4 x ceil(256 / 16)

    # Plugins: both QDPs, and every custom node bound to one with tokens_per_page set and AOT requested.
    assert set(recorder.plugins) == {"kvforge::PagedKVWrite", "kvforge::PagedAttention"}
    assert len(recorder.plugin_nodes) == 2 * layers
    for attrs in recorder.plugin_nodes.values():
        assert attrs["tokens_per_page"] == 16 and attrs["plugin_namespace"] == b"kvforge" and attrs["aot"] == 1
    assert recorder.aliased_outputs == {f"present_key_values_{i}": f"past_key_values_{i}" for i in range(layers)}
    assert recorder.preview_features == {"ALIASED_PLUGIN_IO_10_03": True}
    assert recorder.network_flags == 1 << int(fake.NetworkDefinitionCreationFlag.STRONGLY_TYPED)

    # Pools are fixed in the network itself, not only in the profiles.
    for i in range(layers):
        assert recorder.network_inputs[f"past_key_values_{i}"] == ("float16", pool)

    batch, pages = 4, geometry.max_pages_per_seq
    common = {"context_lengths": ((1,), (batch,), (batch,)), "kvcache_start_index": ((1,), (batch,), (batch,)),
              "kv_page_table": ((1, 1), (batch, pages), (batch, pages)),
              "rope_rotary_cos_sin": ((256, head_dim),) * 3,
              **{f"past_key_values_{i}": (pool,) * 3 for i in range(layers)}}
    # logits_indices: up to MAX_POSITIONS_PER_ROW (16) per row in the prefill profile (verify rows), one in decode.
    prefill = {"inputs_embeds": ((1, 1, hidden), (batch, 32, hidden), (batch, 64, hidden)),
               "logits_indices": ((1,), (batch,), (batch * 16,)), **common}
    decode = {"inputs_embeds": ((1, 1, hidden), (batch, 1, hidden), (batch, 1, hidden)),
              "logits_indices": ((1,), (batch,), (batch,)), **common}
    assert recorder.profiles == [prefill, decode]

    assert (engine_dir / TRT_ENGINE_FILE).read_bytes() == recorder.serialized
    assert not (engine_dir / "model.onnx").exists()
    assert not [p for p in engine_dir.iterdir() if p.name.startswith(".kvforge-trt-")]  # scratch copy removed
    engine = load_engine_dir(engine_dir)
    assert engine.build.backend == "tensorrt" and engine.build.max_kv_pool_pages == geometry.max_kv_pool_pages
    assert plan.pool_bytes_per_layer == geometry.max_kv_pool_pages * 2 * hkv * 16 * head_dim * 2


def test_patched_onnx_sets_tokens_per_page_on_every_custom_node(tiny_onnx_dir: Path) -> None:
    from kvforge.builder.trt_build import patch_for_tensorrt
    from kvforge.contract.model_config import ModelConfig
    config = ModelConfig.from_dict(_config(tiny_onnx_dir), "config.json")
    model = onnx.load(tiny_onnx_dir / "model.onnx", load_external_data=False)
    custom = [n for n in model.graph.node if n.domain == ops.DOMAIN]
    assert custom and all(onnx.helper.get_attribute_value(a) == 0 for n in custom for a in n.attribute
                          if a.name == "tokens_per_page")  # what export leaves
    patched = patch_for_tensorrt(model, config, _geometry())
    for node in (n for n in patched.graph.node if n.domain == ops.DOMAIN):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["tokens_per_page"] == 16, node.name
        assert attrs["plugin_namespace"] == b"kvforge" and attrs["aot"] == 1
    pools = [vi for vi in patched.graph.input if vi.name.startswith("past_key_values_")]
    assert all([d.dim_value for d in vi.type.tensor_type.shape.dim] == [64, 2, config.num_key_value_heads, 16,
                                                                        config.head_dim] for vi in pools)


def test_build_strips_lora_without_rank(recorder: fake.Recorder, lora_onnx_dir: Path, tmp_path: Path) -> None:
    build_engine(lora_onnx_dir, tmp_path / "engine", TRT_BUILD)
    assert not [n for n in recorder.network_inputs if n.startswith("lora_")]
    assert all(not n.startswith("lora_") for p in recorder.profiles for n in p)
    assert load_engine_dir(tmp_path / "engine").model.lora_targets == []


def test_build_adds_lora_profiles(recorder: fake.Recorder, lora_onnx_dir: Path, tmp_path: Path) -> None:
    from dataclasses import replace

    from kvforge.contract.lora import lora_inputs, target_dims
    from kvforge.contract.model_config import ModelConfig
    build_engine(lora_onnx_dir, tmp_path / "engine", replace(TRT_BUILD, max_lora_rank=8))
    config = ModelConfig.from_dict(_config(lora_onnx_dir), "config.json")
    expected = {}
    for a, b, _layer, target in lora_inputs(config):  # per-row adapters: A [B, in, r], B [B, r, out]
        in_dim, out_dim = target_dims(config, target)
        expected[a] = ((1, in_dim, 0), (4, in_dim, 4), (4, in_dim, 8))
        expected[b] = ((1, 0, out_dim), (4, 4, out_dim), (4, 8, out_dim))
    for profile in recorder.profiles:
        assert {k: v for k, v in profile.items() if k.startswith("lora_")} == expected
    assert load_engine_dir(tmp_path / "engine").build.max_lora_rank == 8


def test_fp32_kv_has_no_tensorrt_kernel(recorder: fake.Recorder, tmp_path: Path) -> None:
    write_onnx_dir(synthetic_model("tiny-llama", kv_cache_dtype="fp32"), tmp_path / "onnx")
    with pytest.raises(KvforgeError, match="fp32.*no TensorRT kernel"):
        build_engine(tmp_path / "onnx", tmp_path / "engine", TRT_BUILD)


def test_parse_error_names_the_node(recorder: fake.Recorder, tiny_onnx_dir: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import kvforge.builder.trt_build as trt_build
    monkeypatch.setattr(trt_build, "register_plugins", lambda: None)  # the parser then finds no plugin
    with pytest.raises(KvforgeError) as info:
        build_engine(tiny_onnx_dir, tmp_path / "engine", TRT_BUILD)
    message = str(info.value)
    assert "paged_kv_write_0" in message and "PagedKVWrite" in message and "\n" not in message


# --- symbolic launch geometry --------------------------------------------------------------------------------------

def test_symdim_lowers_to_the_same_values_as_ints() -> None:
    batch, seq = trt_plugins.SymDim.leaf("B", fake.ShapeExpr("B")), trt_plugins.SymDim.leaf("S", fake.ShapeExpr("S"))
    env = {"B": 3, "S": 37}
    trtp = fake.make_fake_tensorrt(fake.Recorder()).plugin
    for value in (-(-(seq * 2 * 32) // 256), batch, 7, seq * 4 - 1, 2 * seq, 100 - seq, 1000 // seq, (seq + 31) // 32):
        expected = trt_plugins.evaluate(value, env)
        lowered = trt_plugins.to_trt_expr(value, trtp)
        assert (lowered if isinstance(lowered, int) else lowered.evaluate(env)) == expected
    # ceil-div becomes cdiv: no negative intermediate dims (the fake refuses them, as TensorRT's dims are >= 0)
    assert trt_plugins.to_trt_expr(-(-seq // 8), trtp).node[0] == "cdiv"
    with pytest.raises(TypeError, match="branches on the runtime dim"):
        max(seq, 1)


def test_calling_convention_check() -> None:
    aliases = trt_plugins.ATTENTION_ALIASES
    inputs_then_out = (*ops.PAGED_ATTENTION.inputs, "attention_output")
    trt_plugins.check_calling_convention(ops.PAGED_ATTENTION, inputs_then_out, 0, aliases)  # no scalars: same order
    with pytest.raises(KvforgeError, match="declare the outputs after the scalars"):
        trt_plugins.check_calling_convention(ops.PAGED_ATTENTION, inputs_then_out, 2, aliases)
    # PagedKVWrite's only output aliases its last input, so "pool then scalars" is what TensorRT passes.
    kv_args = (*ops.PAGED_KV_WRITE.inputs[:-1], "present_key_values")
    trt_plugins.check_calling_convention(ops.PAGED_KV_WRITE, kv_args, 6, trt_plugins.KV_WRITE_ALIASES)


def _kernel_specs_or_skip():
    if importlib.util.find_spec("kvforge.plugins.kernel_specs") is None:
        pytest.skip("kvforge.plugins.kernel_specs is not present")
    from kvforge.plugins import kernel_specs
    return kernel_specs


def _kernel_modules_or_skip():
    kernel_specs = _kernel_specs_or_skip()
    if importlib.util.find_spec("kvforge.plugins.nvrtc") is None:
        pytest.skip("kvforge.plugins.nvrtc is not present")
    from kvforge.plugins import nvrtc
    available, why = nvrtc.nvrtc_available()
    if not available:
        print(f"aot_impl PTX check skipped: {why}")
        pytest.skip(f"NVRTC is not available to compile the kernels to PTX: {why}")
    return kernel_specs


SHAPES = [{"B": 1, "S": 1, "P": 1, "C": 16}, {"B": 4, "S": 37, "P": 16, "C": 256}, {"B": 3, "S": 64, "P": 5, "C": 80}]


@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8"])
def test_symbolic_launches_match_kernel_specs(kv_dtype: str) -> None:
    """The AOT launch, evaluated at concrete shapes, is what kernel_specs gives for those shapes."""
    from dataclasses import asdict
    ks = _kernel_specs_or_skip()
    leaf = trt_plugins.SymDim.leaf
    batch, seq, pages, cap = leaf("B"), leaf("S"), leaf("P"), leaf("C")
    write = trt_plugins.kv_write_symbolic_launch(batch, seq, pages, cap, num_kv_heads=2, head_dim=64,
                                                 tokens_per_page=16, kv_cache_dtype=kv_dtype)
    attention = trt_plugins.attention_symbolic_launch(batch, seq, pages, num_q_heads=6, num_kv_heads=2, head_dim=128,
                                                      tokens_per_page=16, scale=0.09, kv_cache_dtype=kv_dtype)
    for env in SHAPES:
        b, s, p, c = env["B"], env["S"], env["P"], env["C"]
        assert write.evaluate(env) == asdict(ks.kv_write_launch(b, s, 2, 64, 16, p, c, kv_dtype))
        assert attention.evaluate(env) == asdict(ks.attention_launch(b, s, 6, 2, 128, 16, p, kv_dtype, scale=0.09,
                                                                     variant="prefill"))


def _aot_call(recorder: fake.Recorder, plugin_id: str, inputs: list, attrs: list):
    record = recorder.plugins[plugin_id]
    outputs = (record.register_func(*inputs, *attrs),)
    return record.aot_impl_func(*inputs, *attrs, outputs, 0)


def _launch_values(params: fake.KernelLaunchParams, extra: fake.SymIntExprs, env: dict[str, int]) -> dict:
    value = fake._eval  # noqa: SLF001 - the fake's evaluator
    return {"grid": tuple(value(getattr(params, f"grid_{a}").node, env) for a in "xyz"),
            "block": tuple(value(getattr(params, f"block_{a}").node, env) for a in "xyz"),
            "shared_bytes": value(params.shared_mem.node, env),
            "scalar_args": tuple(value(e.node, env) for e in extra)}


@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8"])
def test_kv_write_aot_impl_launch(recorder: fake.Recorder, kv_dtype: str) -> None:
    kernel_specs = _kernel_modules_or_skip()
    trt_plugins.register_plugins(arch="sm_90")
    hkv, d, t, cap = 2, 64, 16, 256
    pool_dtype = fake.DataType.HALF if kv_dtype == "fp16" else fake.DataType.UINT8
    inputs = [fake.tensor_desc(["B", "S", hkv * d], fake.DataType.FLOAT),
              fake.tensor_desc(["B", "S", hkv * d], fake.DataType.FLOAT),
              fake.tensor_desc([cap, d], fake.DataType.FLOAT), fake.tensor_desc(["B"], fake.DataType.INT32),
              fake.tensor_desc(["B"], fake.DataType.INT32), fake.tensor_desc(["B", "P"], fake.DataType.INT32),
              fake.tensor_desc([64, 2, hkv, t, d], pool_dtype)]
    name, ptx, params, extra = _aot_call(recorder, "kvforge::PagedKVWrite", inputs, [hkv, d, t])
    for env in ({"B": 1, "S": 1, "P": 16}, {"B": 4, "S": 37, "P": 16}):
        want = kernel_specs.kv_write_launch(env["B"], env["S"], hkv, d, t, env["P"], cap, kv_dtype)
        assert name == want.kernel.encode()
        assert _launch_values(params, extra, env) == {"grid": want.grid, "block": want.block,
                                                      "shared_bytes": want.shared_bytes,
                                                      "scalar_args": want.scalar_args}
    assert isinstance(ptx, bytes) and name in ptx  # the entry point is in the module TensorRT embeds


@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8"])
def test_attention_aot_impl_launch(recorder: fake.Recorder, kv_dtype: str) -> None:
    kernel_specs = _kernel_modules_or_skip()
    trt_plugins.register_plugins(arch="sm_90")
    hq, hkv, d, t = 4, 2, 64, 16
    pool_dtype = fake.DataType.HALF if kv_dtype == "fp16" else fake.DataType.UINT8
    inputs = [fake.tensor_desc(["B", "S", hq * d], fake.DataType.FLOAT),
              fake.tensor_desc([64, 2, hkv, t, d], pool_dtype), fake.tensor_desc(["B"], fake.DataType.INT32),
              fake.tensor_desc(["B"], fake.DataType.INT32), fake.tensor_desc(["B", "P"], fake.DataType.INT32)]
    try:
        name, ptx, params, extra = _aot_call(recorder, "kvforge::PagedAttention", inputs, [hq, hkv, d, t, d ** -0.5])
    except KvforgeError as exc:
        if "declare the outputs after the scalars" in str(exc):
            pytest.xfail(str(exc))  # the kernel's parameter order, not the plugin, has to change
        raise
    for env in ({"B": 1, "S": 1, "P": 16}, {"B": 3, "S": 40, "P": 16}):
        want = kernel_specs.attention_launch(env["B"], env["S"], hq, hkv, d, t, env["P"], kv_dtype, scale=d ** -0.5,
                                             variant="prefill")
        assert name == want.kernel.encode()
        assert _launch_values(params, extra, env) == {"grid": want.grid, "block": want.block,
                                                      "shared_bytes": want.shared_bytes,
                                                      "scalar_args": want.scalar_args}
    assert isinstance(ptx, bytes) and name in ptx


# --- runner ---------------------------------------------------------------------------------------------------------

@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> fake.FakeCudaDriver:
    driver = fake.FakeCudaDriver()
    monkeypatch.setattr(trt_plugins, "require_cuda_driver", lambda: driver)
    return driver


def _step(hidden: int, batch: int, seq: int, starts: list[int], lengths: list[int], pages: list[list[int]]):
    embeds = np.random.default_rng(0).standard_normal((batch, seq, hidden)).astype(np.float32)
    return StepInputs(embeds, np.array(lengths, np.int32), np.array(starts, np.int32), pages)


def test_runner_binds_profiles_page_table_and_aliased_pools(recorder: fake.Recorder, fake_cuda: fake.FakeCudaDriver,
                                                             tiny_onnx_dir: Path, tmp_path: Path) -> None:
    from kvforge.runtime.execution.trt import DECODE_PROFILE, PREFILL_PROFILE, TrtBackend
    build_engine(tiny_onnx_dir, tmp_path / "engine", TRT_BUILD)
    engine = load_engine_dir(tmp_path / "engine")
    runner = TrtBackend(engine)
    hidden, vocab, layers = engine.model.hidden_size, engine.model.vocab_size, engine.model.num_hidden_layers
    pages = [[5, 9], [7]]  # row 0: 20 tokens over two pages; row 1: 3 tokens
    logits = runner.forward(_step(hidden, 2, 20, [0, 0], [20, 3], pages)).logits
    assert logits.shape == (2, vocab) and logits.dtype == np.float32
    prefill = recorder.calls[-1]
    assert prefill["profile"] == PREFILL_PROFILE and prefill["shapes"]["inputs_embeds"] == (2, 20, hidden)
    # The full page table: the new tokens' pages too, since the plugin writes them on the GPU.
    assert prefill["kv_page_table"].tolist() == [[5, 9] + [-1] * 14, [7] + [-1] * 15]
    for i in range(layers):
        assert prefill["addresses"][f"present_key_values_{i}"] == prefill["addresses"][f"past_key_values_{i}"]
    runner.forward(_step(hidden, 2, 1, [20, 3], [1, 1], pages))
    decode = recorder.calls[-1]
    assert decode["profile"] == DECODE_PROFILE and decode["shapes"]["inputs_embeds"] == (2, 1, hidden)
    assert decode["kvcache_start_index"].tolist() == [20, 3]

    # The fake kernel wrote K = 1 + position in place; the device pool reads it back page by page.
    rows = runner.kv_store.read_tokens([5, 9], 21)
    assert len(rows) == layers and rows[0].shape == (21, 2, engine.model.num_key_value_heads, engine.model.head_dim)
    assert rows[0][:, 0, 0, 0].tolist() == [1 + p for p in range(21)]
    # write_tokens puts saved rows into other pages (legacy system-prompt cache restore).
    runner.kv_store.write_tokens([11, 12], rows)
    assert all(np.array_equal(a, b) for a, b in zip(runner.kv_store.read_tokens([11, 12], 21), rows, strict=True))
    assert runner.kv_store.read_tokens([7], 3)[0][:, 0, 0, 0].tolist() == [1, 2, 3]
    # Partial-KV snapshots of a device pool: a page captured to a slot and restored into another page.
    from kvforge.runtime.execution.snapshots import PartialKVSnapshotStore
    store = PartialKVSnapshotStore(runner.kv_store, num_slots=2)
    store.capture(9, 1)
    store.restore(1, 13)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(runner.kv_store.read_page(13), runner.kv_store.read_page(9),
                                                          strict=True))
    assert runner.kv_store.read_tokens([12, 13], 21)[0][16:, 0, 0, 0].tolist() == [17, 18, 19, 20, 21]
    runner.close()
    assert not fake_cuda.buffers


def test_runner_rejects_calls_past_the_profiles(recorder: fake.Recorder, fake_cuda: fake.FakeCudaDriver,
                                                tiny_onnx_dir: Path, tmp_path: Path) -> None:
    from kvforge.runtime.execution.trt import TrtBackend
    build_engine(tiny_onnx_dir, tmp_path / "engine", TRT_BUILD)
    engine = load_engine_dir(tmp_path / "engine")
    runner = TrtBackend(engine)
    with pytest.raises(KvforgeError, match="maxInputLen"):
        runner.forward(_step(engine.model.hidden_size, 1, 65, [0], [65], [list(range(5))]))


def test_runner_without_tensorrt_is_one_line_error(no_tensorrt: None, tiny_engine_dir: Path) -> None:
    from kvforge.runtime.execution.trt import TrtBackend
    with pytest.raises(KvforgeError, match="TensorRT is not installed"):
        TrtBackend(load_engine_dir(tiny_engine_dir))


def test_runner_binds_rank_zero_or_per_row_adapters(recorder: fake.Recorder, fake_cuda: fake.FakeCudaDriver,
                                                     lora_onnx_dir: Path, tmp_path: Path) -> None:
    from dataclasses import replace

    from kvforge.contract.lora import lora_inputs, target_dims
    from kvforge.runtime.execution.trt import TrtBackend
    build_engine(lora_onnx_dir, tmp_path / "engine", replace(TRT_BUILD, max_lora_rank=8))
    engine = load_engine_dir(tmp_path / "engine")
    runner = TrtBackend(engine)
    step = _step(engine.model.hidden_size, 2, 3, [0, 0], [3, 2], [[1], [2]])
    runner.forward(step)
    names = lora_inputs(engine.model)
    a, b, _layer, target = names[0]
    in_dim, out_dim = target_dims(engine.model, target)
    assert recorder.calls[-1]["shapes"][a] == (2, in_dim, 0) and recorder.calls[-1]["shapes"][b] == (2, 0, out_dim)
    step.lora_tensors = {}
    for a_name, b_name, _layer, tgt in names:
        i, o = target_dims(engine.model, tgt)
        step.lora_tensors[a_name] = np.ones((2, i, 5), np.float32)
        step.lora_tensors[b_name] = np.ones((2, 5, o), np.float32)
    runner.forward(step)
    assert recorder.calls[-1]["shapes"][a] == (2, in_dim, 5) and recorder.calls[-1]["shapes"][b] == (2, 5, out_dim)


def test_runner_binds_logits_indices_and_returns_hidden_states(recorder: fake.Recorder, fake_cuda: fake.FakeCudaDriver,
                                                               tmp_path: Path) -> None:
    """A verify call asks for several positions of a row: N logits rows (and hidden-states rows) come back."""
    from kvforge.runtime.execution.trt import PREFILL_PROFILE, TrtBackend
    write_onnx_dir(synthetic_model("tiny-llama", hidden_state_layers=[1, 0]), tmp_path / "onnx")
    build_engine(tmp_path / "onnx", tmp_path / "engine", TRT_BUILD)
    assert "hidden_states" in json.loads(recorder.serialized[len(b"FAKETRT"):])["outputs"]
    engine = load_engine_dir(tmp_path / "engine")
    runner = TrtBackend(engine)
    assert runner.max_positions == 4 * 16
    step = _step(engine.model.hidden_size, 2, 4, [5, 7], [4, 1], [[1], [2]])
    step.logits_indices = np.array([0, 1, 2, 3, 4], np.int64)  # row 0: 1 pending + 3 drafts; row 1: one token
    out = runner.forward(step)
    assert out.logits.shape == (5, engine.model.vocab_size)
    assert out.hidden_states is not None and out.hidden_states.shape == (5, 2 * engine.model.hidden_size)
    call = recorder.calls[-1]
    assert call["profile"] == PREFILL_PROFILE and call["logits_indices"].tolist() == [0, 1, 2, 3, 4]
    assert call["addresses"]["hidden_states"] == runner.buffers["hidden_states"]
    step.logits_indices = np.arange(65, dtype=np.int64) % 8
    with pytest.raises(KvforgeError, match="at most 64"):
        runner.forward(step)
    runner.close()


def test_an_engine_from_before_logits_indices_builds_and_decodes(recorder: fake.Recorder,
                                                                 fake_cuda: fake.FakeCudaDriver, tiny_onnx_dir: Path,
                                                                 tmp_path: Path) -> None:
    from test_logits_positions import legacy_copy

    from kvforge.contract.manifest import ONNX_KIND
    from kvforge.runtime.execution.trt import TrtBackend
    build_engine(legacy_copy(tiny_onnx_dir, tmp_path / "onnx", ONNX_KIND), tmp_path / "engine", TRT_BUILD)
    assert all(p["last_token_ids"] == ((1,), (4,), (4,)) and "logits_indices" not in p for p in recorder.profiles)
    engine = load_engine_dir(tmp_path / "engine")
    runner = TrtBackend(engine)
    step = _step(engine.model.hidden_size, 2, 4, [0, 0], [4, 2], [[1], [2]])
    assert runner.forward(step).logits.shape == (2, engine.model.vocab_size)
    assert recorder.calls[-1]["last_token_ids"].tolist() == [3, 1]
    step.logits_indices = np.array([2, 3, 5], np.int64)
    with pytest.raises(KvforgeError, match="rebuild it with llm_build"):
        runner.forward(step)
    runner.close()

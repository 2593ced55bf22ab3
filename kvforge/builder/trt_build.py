"""llm_build's TensorRT path: patch the ONNX for the paged-KV plugins, parse it, add two profiles, write llm.engine."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import onnx
from onnx import helper

from kvforge.builder.engine_files import load_model, write_engine_config
from kvforge.contract.engine_dir import (
    ENGINE_MODEL_FILE,
    ENGINE_WEIGHTS_FILE,
    HIDDEN_STATES_INDICES,
    LEGACY_LAST_TOKEN_IDS,
    LOGITS_INDICES,
    TRT_ENGINE_FILE,
    BuilderConfig,
)
from kvforge.contract.errors import InvalidConfig
from kvforge.contract.geometry import PageGeometry
from kvforge.contract.lora import ACTIVATION_INPUT
from kvforge.contract.model_config import ModelConfig
from kvforge.plugins import ops
from kvforge.plugins.trt import AOT_ATTR, PLUGIN_NAMESPACE_ATTR, register_plugins, require_tensorrt

PREFILL_PROFILE = 0  # as in TensorRT Edge-LLM: 0 = context/prefill, 1 = generation (seq dim 1)
DECODE_PROFILE = 1
PATCHED_MODEL_FILE = "model.trt.onnx"
PATCHED_WEIGHTS_FILE = "model.trt.onnx.data"
WORKSPACE_BYTES = 1 << 30  # activations scratch; the KV pools are engine inputs, not workspace
TRT_KV_CACHE_DTYPES = ("fp16", "fp8")  # the kernels the plugins launch
# Logits rows a prefill-profile call may ask for per batch row: the last pending token plus up to 15 drafts of a
# speculative verify row. It bounds the logits (and hidden-states) buffers the runner allocates: N x V floats,
# where N up to maxBatchSize x maxInputLen would cost gigabytes for a large vocabulary.
MAX_POSITIONS_PER_ROW = 16

Shape = tuple[int, ...]
Profile = dict[str, tuple[Shape, Shape, Shape]]  # input name -> (min, opt, max)


def pool_shape(config: ModelConfig, geometry: PageGeometry) -> Shape:
    """[maxKVPoolPages, 2, Hkv, tokensPerPage, D]: the pool the runtime allocates, fixed in the engine."""
    return (geometry.max_kv_pool_pages, 2, config.num_key_value_heads, geometry.tokens_per_page, config.head_dim)


def patch_for_tensorrt(model: onnx.ModelProto, config: ModelConfig, geometry: PageGeometry) -> onnx.ModelProto:
    """Bind the custom nodes to the QDPs and fix the pool shapes; the export leaves tokens_per_page 0."""
    for node in model.graph.node:
        if node.domain == ops.DOMAIN and node.op_type in ops.SCHEMAS:
            _patch_plugin_node(node, geometry)
    fixed = pool_shape(config, geometry)
    for vi in (*model.graph.input, *model.graph.output):
        if vi.name.startswith(("past_key_values_", "present_key_values_")):
            _set_dims(vi, fixed)
    return model


def _patch_plugin_node(node: onnx.NodeProto, geometry: PageGeometry) -> None:
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    values.update({"tokens_per_page": geometry.tokens_per_page, PLUGIN_NAMESPACE_ATTR: ops.DOMAIN,
                   AOT_ATTR: 1})
    del node.attribute[:]
    node.attribute.extend(helper.make_attribute(name, value) for name, value in values.items())


def _set_dims(vi: onnx.ValueInfoProto, dims: Shape) -> None:
    shape = vi.type.tensor_type.shape
    del shape.dim[:]
    for value in dims:
        shape.dim.add().dim_value = value


def optimization_profiles(model: onnx.ModelProto, config: ModelConfig, geometry: PageGeometry,
                          max_lora_rank: int) -> list[Profile]:
    """Profile 0 = prefill (seq 1..maxInputLen; verify rows ask for up to MAX_POSITIONS_PER_ROW logits each),
    1 = decode (seq 1, one logits row per row); every other input is shared."""
    batch, hidden = geometry.max_batch_size, config.hidden_size
    seq_opt = max(1, geometry.max_input_len // 2)
    positions = batch * min(geometry.max_input_len, MAX_POSITIONS_PER_ROW)
    grid = batch * geometry.max_input_len  # hidden states may come back at every position a call computes
    prefill = {"inputs_embeds": ((1, 1, hidden), (batch, seq_opt, hidden), (batch, geometry.max_input_len, hidden)),
               LOGITS_INDICES: ((1,), (batch,), (positions,)), HIDDEN_STATES_INDICES: ((1,), (batch,), (grid,))}
    decode = {"inputs_embeds": ((1, 1, hidden), (batch, 1, hidden), (batch, 1, hidden)),
              LOGITS_INDICES: ((1,), (batch,), (batch,)), HIDDEN_STATES_INDICES: ((1,), (batch,), (batch,))}
    common = _common_shapes(model, config, geometry, max_lora_rank)
    return [{**prefill, **common}, {**decode, **common}]


def _common_shapes(model: onnx.ModelProto, config: ModelConfig, geometry: PageGeometry,
                   max_lora_rank: int) -> Profile:
    batch, pages = geometry.max_batch_size, geometry.max_pages_per_seq
    per_row = ((1,), (batch,), (batch,))
    shapes: Profile = {
        "context_lengths": per_row,
        "kvcache_start_index": per_row,
        ACTIVATION_INPUT: per_row,  # activated LoRA (kvforge/contract/lora.py); unused names are skipped below
        LEGACY_LAST_TOKEN_IDS: per_row,  # an ONNX dir exported before logits_indices
        "kv_page_table": ((1, 1), (batch, pages), (batch, pages)),
        "rope_rotary_cos_sin": _fixed((geometry.max_kv_cache_capacity, config.head_dim)),
    }
    for vi in model.graph.input:
        if vi.name.startswith("past_key_values_"):
            shapes[vi.name] = _fixed(pool_shape(config, geometry))
        elif vi.name.startswith("lora_"):
            shapes[vi.name] = _lora_shapes(vi, max_lora_rank, batch)
    return shapes


def _fixed(shape: Shape) -> tuple[Shape, Shape, Shape]:
    return shape, shape, shape


def _lora_shapes(vi: onnx.ValueInfoProto, rank: int, batch: int) -> tuple[Shape, Shape, Shape]:
    """A [B, in, r] and B [B, r, out] (per-row adapters) with r in [0, maxLoraRank]; rank 0 is a call without
    adapters (exact zeros). A rank-2 export ([in, r] / [r, out], one adapter per call) gets the same ranks."""
    dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
    is_a = vi.name.startswith("lora_A")
    shapes = []
    for rows, r in ((1, 0), (batch, rank // 2), (batch, rank)):
        matrix = (dims[-2], r) if is_a else (r, dims[-1])
        shapes.append((rows, *matrix) if len(dims) == 3 else matrix)
    return tuple(shapes)  # type: ignore[return-value]


def build_tensorrt_engine(onnx_dir: Path, engine_dir: Path, config: ModelConfig, geometry: PageGeometry,
                          step: Callable[[str], None] = lambda _m: None, *, max_lora_rank: int = 0,
                          speculative: dict[str, bool | int] | None = None) -> None:
    """The TensorRT half of build_engine: validated geometry in, a complete engine dir out."""
    if config.sliding_window_layers:  # the CUDA kernels attend over every cached position
        raise InvalidConfig("sliding-window attention layers (Gemma) have no TensorRT kernel yet; build with "
                            "--backend onnxruntime", "backend")
    if config.hidden_size_per_layer_input:  # the TensorRT runner binds no per_layer_embeds input
        raise InvalidConfig("per-layer embeddings (Gemma 4) are fed by the ONNX Runtime runner only; build with "
                            "--backend onnxruntime", "backend")
    trt = require_tensorrt()
    if config.kv_cache_dtype not in TRT_KV_CACHE_DTYPES:
        raise InvalidConfig(f"kv_cache_dtype {config.kv_cache_dtype!r} has no TensorRT kernel; re-export with "
                            f"--kvCacheDtype {' or '.join(TRT_KV_CACHE_DTYPES)}", "backend")
    model = load_model(onnx_dir, config, max_lora_rank)
    model = patch_for_tensorrt(model, config, geometry)
    profiles = optimization_profiles(model, config, geometry, max_lora_rank)
    step("patched ONNX for the TensorRT plugins")
    register_plugins()
    engine_dir.mkdir(parents=True, exist_ok=True)
    # The patched copy (weights included) lives next to the output only while TensorRT parses it.
    with tempfile.TemporaryDirectory(prefix=".kvforge-trt-", dir=engine_dir) as scratch:
        patched = Path(scratch) / PATCHED_MODEL_FILE
        onnx.save_model(model, patched, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=PATCHED_WEIGHTS_FILE, size_threshold=1024)
        serialized = _build_serialized(trt, patched, profiles)
    step("built TensorRT engine")
    _write_engine_dir(onnx_dir, engine_dir, config, geometry, max_lora_rank, serialized, speculative or {})
    step("wrote engine dir")


def encoder_profile(model: onnx.ModelProto, max_batch_size: int) -> Profile:
    """The one profile of an encoder engine: the leading (items) dim of every input from 1 to maxBatchSize,
    every other dim as exported (encoders take fixed-size images / mel windows)."""
    profile: Profile = {}
    for vi in model.graph.input:
        dims = vi.type.tensor_type.shape.dim
        rest = tuple(d.dim_value for d in dims[1:])
        if not dims or any(d <= 0 for d in rest):
            raise InvalidConfig(f"encoder input {vi.name} has a dynamic dimension past the leading items one; "
                                "re-export it with llm_export", "onnx_dir")
        profile[vi.name] = ((1, *rest), (max_batch_size, *rest), (max_batch_size, *rest))
    return profile


def build_encoder_tensorrt(model_path: Path, max_batch_size: int) -> Any:
    """A serialized TensorRT engine of an encoder ONNX file (its external weights next to it): no plugins, one
    profile; the caller writes the bytes. Unverified on real TensorRT (tested against tests/fake_tensorrt.py)."""
    trt = require_tensorrt()
    if max_batch_size < 1:
        raise InvalidConfig(f"must be >= 1 for a TensorRT encoder engine, got {max_batch_size}", "max_batch_size")
    model = onnx.load(str(model_path), load_external_data=False)
    return _build_serialized(trt, model_path, [encoder_profile(model, max_batch_size)], aliased_plugin_io=False)


def _build_serialized(trt: ModuleType, model_path: Path, profiles: list[Profile], *,
                      aliased_plugin_io: bool = True) -> Any:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # Strongly typed: the graph's float32/fp16/uint8 types are kept as exported, and plugin I/O types follow.
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(model_path)):  # resolves the external weights next to the file
        raise InvalidConfig(_parse_error(parser), "onnx_dir")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    if aliased_plugin_io:  # the pool output aliases the pool input (in-place KV writes); a TensorRT 10.x preview
        config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    names = {network.get_input(i).name for i in range(network.num_inputs)}
    for shapes in profiles:
        _add_profile(builder, config, shapes, names)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise InvalidConfig("TensorRT could not build the engine; its log above names the failing layer", "backend")
    return serialized


def _parse_error(parser: Any) -> str:
    """One line naming the first failing node (TensorRT >= 10 ParserError has node_name/node_operator)."""
    if parser.num_errors == 0:
        return "TensorRT's ONNX parser failed without an error message"
    error = parser.get_error(0)
    node = error.node_name() if hasattr(error, "node_name") else f"#{error.node()}"
    op = error.node_operator() if hasattr(error, "node_operator") else "?"
    desc = " ".join(str(error.desc()).split())
    return f"TensorRT cannot parse node {node} ({op}): {desc}"


def _add_profile(builder: Any, config: Any, shapes: Profile, network_inputs: set[str]) -> None:
    missing = sorted(network_inputs - shapes.keys())
    if missing:
        raise InvalidConfig(f"no optimization-profile shape for engine input(s) {', '.join(missing)}", "onnx_dir")
    profile = builder.create_optimization_profile()
    for name in sorted(network_inputs):
        profile.set_shape(name, *shapes[name])
    config.add_optimization_profile(profile)


def _write_engine_dir(onnx_dir: Path, engine_dir: Path, config: ModelConfig, geometry: PageGeometry,
                      max_lora_rank: int, serialized: Any, speculative: dict[str, bool | int]) -> None:
    for stale in (ENGINE_MODEL_FILE, ENGINE_WEIGHTS_FILE):  # an engine dir holds one backend's artefact
        (engine_dir / stale).unlink(missing_ok=True)
    with open(engine_dir / TRT_ENGINE_FILE, "wb") as handle:
        handle.write(memoryview(serialized))  # IHostMemory exposes the buffer protocol
    write_engine_config(onnx_dir, engine_dir, config,
                        BuilderConfig.from_geometry(geometry, "tensorrt", max_lora_rank, config, **speculative))

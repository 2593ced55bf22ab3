"""The engine-dir contract the runtime runs: which files, which config keys, validated on load."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.files import check_path_name, read_json
from kvforge.contract.geometry import (
    INT32_MAX,
    MAX_KV_POOL_PAGES,
    PageGeometry,
    recurrent_bytes_per_slot,
    resolve_geometry,
)
from kvforge.contract.manifest import ENGINE_KIND, verify_manifest
from kvforge.contract.memory import check_pool_fits_memory
from kvforge.contract.model_config import SPEC_DSPARK, ModelConfig
from kvforge.contract.safetensors_map import map_tensor
from kvforge.contract.tensor_header import read_tensor_header
from kvforge.contract.validation import describe, one_line
from kvforge.contract.window_pool import layer_page_bytes, pool_bytes_by_layer_type, window_pool_layers

MAX_LORA_RANK = 1024
MAX_TREE_SIZE = 128  # tokens one verify row or drafting round may hold (TensorRT Edge-LLM's kMAX_EAGLE_DECODING_TOKENS)

ENGINE_MODEL_FILE = "model.onnx"
ENGINE_WEIGHTS_FILE = "model.onnx.data"
TRT_ENGINE_FILE = "llm.engine"  # backend "tensorrt": the serialized TensorRT engine (AOT plugin kernels inside)
BACKEND_FILES = {"onnxruntime": (ENGINE_MODEL_FILE, ENGINE_WEIGHTS_FILE), "tensorrt": (TRT_ENGINE_FILE,)}
EMBEDDING_FILE = "embedding.safetensors"
EMBEDDING_TENSOR = "embedding"
# Gemma 4's per-layer embeddings (model_config.hidden_size_per_layer_input): the table [vocab, layers * width]
# (tensor EMBEDDING_TENSOR) the runtime looks each token up in, and the graph input [B, S, layers * width] it feeds.
PER_LAYER_EMBEDDING_FILE, PER_LAYER_INPUT = "per_layer_embedding.safetensors", "per_layer_embeds"
# ONNX Runtime engines of tied models take the LM head as this input [vocab, hidden] float32 and the runtime binds
# the (memory-mapped) embedding table to it: one copy of the largest weight instead of two.
TIED_HEAD_INPUT = "lm_head_weight"
# The positions a call returns logits for: flat indices b * S + t into its [B, S] token grid, int64 [N] -> `logits`
# [N, V] (each row's last new token for plain decode and prefill; every verified position of a speculative row).
LOGITS_INDICES = "logits_indices"
# Engine graphs exported before logits_indices took each row's last new token, `last_token_ids` [B] (lengths - 1),
# and returned [B, V]; the runners still run them for calls that ask for exactly those positions.
LEGACY_LAST_TOKEN_IDS = "last_token_ids"
# Optional output [M, len(hidden_state_layers) * H]: the named decoder layers' outputs at the positions
# `hidden_states_indices` [M] names (flat b * S + t, like logits_indices): a drafter reads every position a call
# computes, while logits are needed at a few. An EAGLE3 draft graph has no such input: its one layer's output comes
# back at the logits_indices positions.
HIDDEN_STATES = "hidden_states"
HIDDEN_STATES_INDICES = "hidden_states_indices"
# An EAGLE3 draft graph's extra inputs: the base's hidden states [B, S, base_model_hidden_size] (projected by its fc)
# and its own previous output [B, S, H]; the graph adds the two, so a call passes zeros for the one it does not use.
BASE_HIDDEN_INPUT = "hidden_states_input"
DRAFT_HIDDEN_INPUT = "draft_hidden_states_input"
# Tree attention (speculative bases and drafts built on the kvforge CPU kernel; TensorRT Edge-LLM's names): each new
# token's RoPE position [B, S] int32, and which new tokens each new token sees [B, S, S] bool. An empty mask
# ([B, 0, 0]) means causal, so calls without a tree pay nothing for it.
TREE_POSITIONS_INPUT = "attention_pos_id"
TREE_MASK_INPUT = "attention_mask"
# EAGLE3 drafts: int64 [draft_vocab] offsets, base id = draft id + d2t[draft id] (the Hugging Face format's map).
D2T_FILE, D2T_TENSOR = "d2t.safetensors", "d2t"
# DSpark drafts: the previous-token (Markov) head and the acceptance predictor, applied by the runtime (TensorRT
# Edge-LLM's file name): markov_w1 [V, r], markov_w2 [V, r], accept_weight [H], accept_bias [1].
DSPARK_HEADS_FILE = "dspark_heads.safetensors"
# A graph input of block drafts [B, S, 1] float32: 1 where the token is a context position (its K/V are projections
# of the base's hidden states), 0 in the block being drafted (K/V of the draft's own layers).
CONTEXT_TOKEN_MASK_INPUT = "context_token_mask"
# A speculative base engine dir keeps its draft engine here (TensorRT Edge-LLM writes spec_draft.engine and
# draft_config.json beside the base; a subfolder keeps one config.json per engine).
DRAFT_ENGINE_SUBDIR = "draft"
COPIED_FILES = (EMBEDDING_FILE, "tokenizer.json", "tokenizer_config.json")
DRAFT_COPIED_FILES = (EMBEDDING_FILE,)  # an EAGLE3 draft has no tokenizer of its own; its d2t map is added


def copied_files(model: ModelConfig) -> tuple[str, ...]:
    """The files an ONNX dir of this model hands its engine dir besides the graph."""
    if model.is_eagle3_draft:
        return (*DRAFT_COPIED_FILES, D2T_FILE)
    if model.spec_decode_type == SPEC_DSPARK:
        return (*DRAFT_COPIED_FILES, DSPARK_HEADS_FILE)
    if model.is_draft:
        return DRAFT_COPIED_FILES
    return (*COPIED_FILES, PER_LAYER_EMBEDDING_FILE) if model.hidden_size_per_layer_input else COPIED_FILES


def engine_role(model: ModelConfig, spec_base: bool) -> str:
    """TensorRT Edge-LLM's `engine_role`: a plain engine, a speculative base, or a draft."""
    return "draft" if model.is_draft else "base" if spec_base else "llm"
# How an engine's attention reads the KV pool (builder_config.attention): kvforge's CPU kernel (an ONNX Runtime
# custom-op library reading pages in place), stock ONNX ops over gathered pages (the fallback where the kernel
# cannot be built; engine dirs from before the kernel), or the TensorRT plugin.
ATTENTION_CPU_KERNEL, ATTENTION_ONNX_OPS, ATTENTION_TRT_PLUGIN = "kvforge-cpu-kernel", "onnx-ops", "tensorrt-plugin"
ATTENTION_PATHS = (ATTENTION_CPU_KERNEL, ATTENTION_ONNX_OPS, ATTENTION_TRT_PLUGIN)
LINEAR_KERNELS = ("", "kvforge", "mlas", "onnx")  # builder_config.linear_kernel's values ("": not chosen)


def new_rows_name(pool_input: str) -> str:
    """The lowered graph's output holding a call's new K/V rows for the layer whose pool input is `pool_input`."""
    return pool_input.replace("past_key_values_", "new_key_values_")


@dataclass(frozen=True, slots=True)
class BuilderConfig(PageGeometry):
    """config.json's `builder_config`: the engine's page geometry plus what it was built for."""

    backend: str  # a key of BACKEND_FILES
    max_lora_rank: int = 0  # 0: no LoRA inputs (engine dirs from before LoRA lack the key)
    # Snapshot geometry (informational: the runtime recomputes it from the model config): partial-KV slots over the
    # attention layers, recurrent slots over the recurrent ones (0 where a model has none).
    layer_types: tuple[str, ...] = ()
    partial_kv_snapshot_bytes_per_slot: int = 0  # one K+V page per attention layer
    recurrent_snapshot_bytes_per_slot: int = 0
    attention: str = ATTENTION_ONNX_OPS  # one of ATTENTION_PATHS
    # Speculative roles (TensorRT Edge-LLM's keys): a base whose graph returns the hidden states its draft reads, and
    # the draft itself; the tree sizes bound a verify row (base) and a drafting round (draft).
    spec_base: bool = False
    spec_draft: bool = False
    max_verify_tree_size: int = 0
    max_draft_tree_size: int = 0
    tree_attention: bool = False  # the graph takes TREE_POSITIONS_INPUT and TREE_MASK_INPUT (tree drafting)
    # The CPU kernel's variant: PagedAttentionRope rotates Q/K and writes the pool in place (no new_key_values_*
    # outputs to scatter). False: the rotated rows come back and the runtime scatters them (engines built before).
    kernel_kv_write: bool = False
    # 4-bit block matmuls run as kvforge.cpu.MatMulBlocks (kvforge/builder/lower_matmul.py; informational: the graph
    # says it,
    # and the kernel library is loaded for the attention anyway). False: MatMulNBits (engines built before, --cpuMatmul
    # onnx, the fallback attention).
    kernel_matmul: bool = False
    # Which op the block-quantized linears run, chosen per CPU class at build (kvforge/builder/linear_choice.py):
    # "kvforge" (MatMulBlocks), "mlas" (MatMulNBits at level 4) or "onnx" (the export's MatMulNBits as they are),
    # and the one line that says why; "" where there is no choice
    # (no such linears, the fallback attention, engines built before).
    linear_kernel: str = ""
    linear_kernel_reason: str = ""
    # The sliding layers' own page group (llm_build --slidingWindowPool; 0 = each keeps a full-length pool) and the
    # KV pool bytes of each layer type (recomputed from the model on load, like the snapshot sizes).
    window_pool_pages: int = 0
    kv_pool_bytes_global: int = 0
    kv_pool_bytes_sliding: int = 0

    @classmethod
    def from_geometry(cls, geometry: PageGeometry, backend: str, max_lora_rank: int,
                      model: ModelConfig | None = None, attention: str = ATTENTION_ONNX_OPS,
                      **speculative: Any) -> BuilderConfig:
        resolved = {f.name: getattr(geometry, f.name) for f in fields(PageGeometry)}
        snapshots: dict[str, Any] = {}
        if model is not None:
            recurrent = len(model.recurrent_layer_ids)
            snapshots = {
                "layer_types": tuple(model.layer_types) or ("attention",) * model.num_hidden_layers,
                # A K+V page of every attention layer, each of its own head size.
                "partial_kv_snapshot_bytes_per_slot": sum(layer_page_bytes(model, geometry.tokens_per_page).values()),
                "recurrent_snapshot_bytes_per_slot": recurrent_bytes_per_slot(
                    recurrent, model.recurrent_state_num_heads, model.recurrent_state_head_dim,
                    model.recurrent_state_size, model.conv_dim, model.conv_kernel) if recurrent else 0}
            window_pages = int(speculative.get("window_pool_pages", 0))
            snapshots["kv_pool_bytes_global"], snapshots["kv_pool_bytes_sliding"] = pool_bytes_by_layer_type(
                model, geometry, window_pages)
        if backend == "tensorrt":
            attention = ATTENTION_TRT_PLUGIN
        return cls(**resolved, backend=backend, max_lora_rank=max_lora_rank, attention=attention, **snapshots,
                   **speculative)

    def to_dict(self) -> dict[str, Any]:
        # minimum_active_pages: written since the first engine dirs (batch × pages per sequence); nothing reads it.
        return {**asdict(self), "minimum_active_pages": self.full_batch_pages}


BUILDER_KEYS = tuple(f.name for f in fields(BuilderConfig) if f.default is MISSING)  # required in builder_config


@dataclass(frozen=True, slots=True)
class EngineDir:
    path: Path
    model: ModelConfig
    build: BuilderConfig

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def kv_pool_bytes(self) -> int:
        if self.build.window_pool_pages:
            return self.build.kv_pool_bytes_global + self.build.kv_pool_bytes_sliding
        return sum(layer_page_bytes(self.model, self.build.tokens_per_page).values()) * self.build.max_kv_pool_pages

    @property
    def rope_bytes(self) -> int:
        """ONNX Runtime engines keep float32 cos and sin per position in host memory (TensorRT's on the GPU)."""
        return self.build.max_kv_cache_capacity * self.model.head_dim * 4 if self.build.backend == "onnxruntime" else 0

    @property
    def weight_bytes(self) -> int:
        """What the backend reads into memory: its model files (the embedding is memory-mapped, paged in as used)."""
        if self.build.backend != "onnxruntime":
            return 0  # on the GPU
        return sum((self.path / name).stat().st_size for name in BACKEND_FILES[self.build.backend]
                   if (self.path / name).is_file())


REBUILD = "rebuild it with llm_build"


def load_engine_dir(path: Path) -> EngineDir:
    """The engine dir at `path`, checked: config schema, completion manifest, embedding shape and the pool's
    memory; errors name the field `engine_dir` (or the config field, `config.NAME`)."""
    check_path_name(path, "engine_dir")  # ONNX Runtime takes only text paths
    if not path.is_dir():
        raise InvalidConfig(f"{one_line(str(path))} is not a directory", "engine_dir")
    data = read_json(path / "config.json", "engine_dir")
    model = ModelConfig.from_dict(data, f"{path}/config.json")
    raw = data.get("builder_config")
    if not isinstance(raw, dict):
        raise InvalidConfig(f"{path}/config.json has no builder_config; is this an ONNX dir? build it with llm_build",
                            "engine_dir")
    build = read_builder_config(raw, model)
    if build.backend != "onnxruntime" and len(model.attention_layer_ids) < model.num_hidden_layers:
        raise InvalidConfig(f"engine has recurrent layers ({model.model}) and backend {build.backend}; recurrent "
                            "layers run on onnxruntime only; rebuild it with llm_build --backend onnxruntime",
                            "engine_dir")
    for name in (*BACKEND_FILES[build.backend], *copied_files(model)):
        if not (path / name).is_file():
            raise InvalidConfig(f"engine dir {path} is missing {name}; {REBUILD}", "engine_dir")
    verify_manifest(path, ENGINE_KIND, "engine_dir", REBUILD,
                    required=("config.json", *BACKEND_FILES[build.backend], *copied_files(model)))
    check_embedding(path / EMBEDDING_FILE, model, "engine_dir")
    if model.is_eagle3_draft:
        check_d2t(path / D2T_FILE, model, "engine_dir")
    engine = EngineDir(path, model, build)
    if build.backend == "onnxruntime":  # pool, RoPE table and weights live in host memory (TensorRT's on the GPU)
        check_pool_fits_memory(engine.kv_pool_bytes + engine.rope_bytes, weight_bytes=engine.weight_bytes,
                               hint=" when rebuilding it")
    return engine


def read_builder_config(raw: dict[str, Any], model: ModelConfig) -> BuilderConfig:
    """builder_config checked like llm_build checked it: strict integer types, then the same geometry rules."""
    where = "builder_config"
    missing = [k for k in BUILDER_KEYS if k not in raw]
    if missing:
        raise InvalidConfig(f"builder_config lacks {', '.join(missing)}; {REBUILD}", "engine_dir")
    numbers = {k: raw[k] for k in BUILDER_KEYS if k != "backend"}
    numbers["max_lora_rank"] = raw.get("max_lora_rank", 0)
    for key, value in numbers.items():
        if type(value) is not int or not 0 <= value <= INT32_MAX:
            raise InvalidConfig(f"must be an integer in [0, {INT32_MAX}], got {describe(value)}", f"{where}.{key}")
    if not isinstance(raw["backend"], str) or raw["backend"] not in BACKEND_FILES:
        raise InvalidConfig(f"engine backend {describe(raw['backend'])} cannot run here", f"{where}.backend")
    if numbers["max_lora_rank"] > MAX_LORA_RANK:
        raise InvalidConfig(f"must be at most {MAX_LORA_RANK}, got {numbers['max_lora_rank']}",
                            f"{where}.max_lora_rank")
    try:
        geometry = resolve_geometry(max_input_len=numbers["max_input_len"],
                                    max_kv_cache_capacity=numbers["max_kv_cache_capacity"],
                                    max_batch_size=numbers["max_batch_size"],
                                    tokens_per_page=numbers["tokens_per_page"],
                                    max_kv_pool_pages=numbers["max_kv_pool_pages"] or -1,
                                    max_position_embeddings=model.max_position_embeddings)
    except InvalidConfig as exc:
        raise InvalidConfig(f"{exc.message}; {REBUILD}", f"{where}.{exc.field}") from None
    if geometry.max_pages_per_seq != numbers["max_pages_per_seq"]:
        raise InvalidConfig(f"must be {geometry.max_pages_per_seq} (capacity / tokens_per_page), got "
                            f"{numbers['max_pages_per_seq']}; {REBUILD}", f"{where}.max_pages_per_seq")
    attention = raw.get("attention", ATTENTION_ONNX_OPS)
    if attention not in ATTENTION_PATHS:  # a TensorRT engine's is its plugin whatever the file says
        raise InvalidConfig(f"must be one of {ATTENTION_PATHS}, got {describe(attention)}; {REBUILD}",
                            f"{where}.attention")
    speculative: dict[str, Any] = {}
    for key in ("spec_base", "spec_draft", "tree_attention", "kernel_kv_write", "kernel_matmul"):
        if type(raw.get(key, False)) is not bool:
            raise InvalidConfig(f"must be true or false, got {describe(raw[key])}", f"{where}.{key}")
        speculative[key] = raw.get(key, False)
    for key in ("max_verify_tree_size", "max_draft_tree_size"):
        value = raw.get(key, 0)
        if type(value) is not int or not 0 <= value <= MAX_TREE_SIZE:
            raise InvalidConfig(f"must be an integer in [0, {MAX_TREE_SIZE}], got {describe(value)}", f"{where}.{key}")
        speculative[key] = value
    if raw.get("linear_kernel", "") not in LINEAR_KERNELS:
        raise InvalidConfig(f"must be one of {LINEAR_KERNELS}, got {describe(raw['linear_kernel'])}",
                            f"{where}.linear_kernel")
    if not isinstance(raw.get("linear_kernel_reason", ""), str):
        raise InvalidConfig(f"must be a string, got {describe(raw['linear_kernel_reason'])}",
                            f"{where}.linear_kernel_reason")
    speculative["linear_kernel"] = raw.get("linear_kernel", "")
    speculative["linear_kernel_reason"] = raw.get("linear_kernel_reason", "")
    window = raw.get("window_pool_pages", 0)
    if window and (type(window) is not int or not 0 < window <= MAX_KV_POOL_PAGES or not window_pool_layers(model)):
        raise InvalidConfig(f"must be 0, or a page count in [1, {MAX_KV_POOL_PAGES}] on a model with "
                            f"sliding-window layers, got {describe(window)}; {REBUILD}", f"{where}.window_pool_pages")
    speculative["window_pool_pages"] = window
    if speculative["spec_draft"] != model.is_draft:
        raise InvalidConfig(f"spec_draft is {speculative['spec_draft']} but config.json's spec_decode_type is "
                            f"{model.spec_decode_type!r}; {REBUILD}", f"{where}.spec_draft")
    # Snapshot geometry and layer types are recomputed from the model, not trusted from the file.
    return BuilderConfig.from_geometry(geometry, raw["backend"], numbers["max_lora_rank"], model, attention,
                                       **speculative)


def check_embedding(path: Path, model: ModelConfig, field: str) -> None:
    """The embedding table is [vocab_size, hidden_size] float32 (an assistant's: its base's, backbone wide), read
    from the header alone."""
    tensors, _ = read_tensor_header(path, field)
    info = tensors.get(EMBEDDING_TENSOR)
    expected = (model.vocab_size, model.embedding_width)
    if info is None or info.dtype != "F32" or info.shape != expected:
        got = f"{info.dtype} {list(info.shape)}" if info else "no tensor named 'embedding'"
        raise InvalidConfig(f"{EMBEDDING_FILE} must hold F32 'embedding' of shape {list(expected)} (vocab_size x "
                            f"hidden_size of config.json), got {got}", field)


def check_d2t(path: Path, model: ModelConfig, field: str) -> None:
    """An EAGLE3 draft's d2t map: one integer offset per draft token, each landing in the vocabulary (draft id i
    is base id i + d2t[i]). Checked at load, since a bad offset would only fail mid-run, indexing the embedding."""
    tensors, _ = read_tensor_header(path, field)
    info = tensors.get(D2T_TENSOR)
    width = model.logits_width
    if info is None or info.dtype not in ("I64", "I32") or info.shape != (width,):
        got = f"{info.dtype} {list(info.shape)}" if info else f"no tensor named {D2T_TENSOR!r}"
        raise InvalidConfig(f"{D2T_FILE} must hold integer {D2T_TENSOR!r} of shape [{width}] (draft_vocab_size), "
                            f"got {got}; {REBUILD}", field)
    d2t = np.asarray(map_tensor(path, D2T_TENSOR), dtype=np.int64)
    targets = np.arange(width, dtype=np.int64) + d2t
    bad = np.flatnonzero((targets < 0) | (targets >= model.vocab_size))
    if bad.size:
        first = int(bad[0])
        raise InvalidConfig(f"{D2T_FILE} maps draft token {first} to {int(targets[first])}, outside the vocabulary "
                            f"[0, {model.vocab_size}) ({bad.size} such tokens); {REBUILD}", field)

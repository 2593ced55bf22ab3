"""llm_build's work: validate an ONNX dir and the geometry, lower for a backend, write the engine dir."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from kvforge.builder.engine_files import load_model, write_engine_config
from kvforge.builder.fuse_ort import fuse_for_onnxruntime
from kvforge.builder.linear_choice import CHOICES as LINEAR_CHOICES
from kvforge.builder.linear_choice import EXPORT_FORM, MLAS, LinearChoice, canonical, choose_linear_kernel
from kvforge.builder.lower_matmul import has_q4_1_corrections, lower_block_matmuls, run_on_mlas
from kvforge.builder.lower_ort import kernel_writes_kv, lower_for_onnxruntime, share_tied_head
from kvforge.builder.lower_recurrent import lower_recurrent_ops
from kvforge.builder.lower_swiglu import lower_swiglu
from kvforge.builder.pack_qkv import pack_attention_inputs
from kvforge.builder.window_pool import bind_window_table, check_window_build, size_window_pools
from kvforge.contract.engine_dir import (
    ATTENTION_CPU_KERNEL,
    ATTENTION_ONNX_OPS,
    BACKEND_FILES,
    EMBEDDING_FILE,
    ENGINE_MODEL_FILE,
    ENGINE_WEIGHTS_FILE,
    MAX_TREE_SIZE,
    BuilderConfig,
    check_embedding,
    copied_files,
)
from kvforge.contract.errors import InvalidConfig
from kvforge.contract.files import check_output_dir, overlaps, read_json, staged_dir
from kvforge.contract.formats import MANIFEST_FILE
from kvforge.contract.geometry import (
    DEFAULT_TOKENS_PER_PAGE,
    PageGeometry,
    kv_bytes_per_page,
    recurrent_bytes_per_slot,
    resolve_geometry,
)
from kvforge.contract.manifest import ENGINE_KIND, ONNX_KIND, verify_manifest, write_manifest
from kvforge.contract.memory import check_pool_fits_memory
from kvforge.contract.model_config import ModelConfig
from kvforge.contract.speculation import base_kind, draft_methods_on
from kvforge.contract.validation import one_line
from kvforge.contract.window_pool import layer_page_bytes, window_pool_pages

BACKENDS = ("auto", "onnxruntime", "tensorrt")
# --cpuAttention: kvforge's CPU kernel where it builds here (auto), insist on it (kernel), or stock ONNX ops (onnx)
CPU_ATTENTION_CHOICES = ("auto", "kernel", "onnx")
# --linearKernel (--cpuMatmul): on kernel-attention engines, 4-bit blocks run kvforge's MatMulBlocks (kvforge), MLAS's
# MatMulNBits at accuracy level 4 (mlas), whichever the measurement table says is faster on this CPU class (auto;
# kvforge/builder/linear_choice.py), or the export's MatMulNBits as they are (onnx); kernel is kvforge's older name
CPU_MATMUL_CHOICES = LINEAR_CHOICES
# --cpuPrefillMatmul: MatMulBlocks' calls of more than 16 rows (prefill chunks) in bfloat16 where the CPU has
# AVX512_BF16 (float32 sums; twice SGEMM's rate), or always float32 (SGEMM on the dequantized weight)
CPU_PREFILL_MATMUL_CHOICES = ("bf16", "fp32")
STEPS = 4
DEFAULT_TREE_SIZE = 60  # TensorRT Edge-LLM's --maxVerifyTreeSize / --maxDraftTreeSize defaults


@dataclass(frozen=True, slots=True)
class BuildOptions:
    """llm_build's settings as given: the unresolved geometry (pool 0 = the default, see PageGeometry) and more."""

    max_input_len: int = 1024
    max_kv_cache_capacity: int = 4096
    max_kv_pool_pages: int = 0
    max_batch_size: int = 4
    tokens_per_page: int = DEFAULT_TOKENS_PER_PAGE
    backend: str = "onnxruntime"  # the CLI defaults to "auto"; the API stays explicit so tests never switch
    max_lora_rank: int = 0
    force: bool = False  # build even when the KV pool is larger than this machine's memory
    cpu_attention: str = "auto"  # a CPU_ATTENTION_CHOICES entry, or an ATTENTION_PATHS one once resolved
    spec_base: bool = False  # a speculative base: its graph returns the hidden states an EAGLE3 draft reads
    spec_draft: bool = False  # an EAGLE3 draft (its ONNX dir from llm_export eagle3)
    max_verify_tree_size: int = DEFAULT_TREE_SIZE  # the most positions one verify row holds (base)
    max_draft_tree_size: int = DEFAULT_TREE_SIZE  # the most tokens one drafting round proposes (draft)
    sliding_window_pool: bool = False  # sliding layers get their own page group, sized for the window
    sliding_window_records: int = 0  # window checkpoints the group keeps beyond its rows' pages (reuse)
    # A CPU_MATMUL_CHOICES entry; only engines attending with the kernel take it. The CLI defaults to "auto" (per
    # CPU class); the API stays explicit so tests do not depend on the build host's CPU.
    cpu_matmul: str = "kvforge"
    cpu_prefill_matmul: str = "bf16"  # a CPU_PREFILL_MATMUL_CHOICES entry; only MatMulBlocks takes it

    def geometry(self, max_position_embeddings: int) -> PageGeometry:
        """The validated geometry for a model with `max_position_embeddings` (InvalidConfig otherwise)."""
        return resolve_geometry(max_input_len=self.max_input_len, max_kv_cache_capacity=self.max_kv_cache_capacity,
                                max_batch_size=self.max_batch_size, tokens_per_page=self.tokens_per_page,
                                max_kv_pool_pages=self.max_kv_pool_pages,
                                max_position_embeddings=max_position_embeddings)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    bytes_per_page_per_layer: int  # a layer of head_dim heads
    pool_bytes_per_layer: int
    num_layers: int
    partial_kv_bytes_per_slot: int  # --contextCachePartialKVSnapshotPoolBytes buys whole slots of this size
    recurrent_bytes_per_slot: int = 0  # --contextCacheRecurrentSnapshotPoolBytes (recurrent layers only)
    wide_layers: int = 0  # of num_layers, those with wider heads (Gemma 4's global_head_dim), each pool this big:
    wide_pool_bytes_per_layer: int = 0

    @property
    def total_bytes(self) -> int:
        return self.pool_bytes_per_layer * (self.num_layers - self.wide_layers) + \
            self.wide_pool_bytes_per_layer * self.wide_layers


def read_onnx_dir(onnx_dir: Path) -> ModelConfig:
    """The export's config, checked: schema, files, completion manifest and embedding shape."""
    if not onnx_dir.is_dir():
        raise InvalidConfig(f"{onnx_dir} is not a directory", "onnx_dir")
    config = ModelConfig.from_dict(read_json(onnx_dir / "config.json", "onnx_dir"), f"{onnx_dir}/config.json")
    for name in (ENGINE_MODEL_FILE, *copied_files(config)):
        if not (onnx_dir / name).is_file():
            raise InvalidConfig(f"missing {name} in {onnx_dir}; re-export it with llm_export", "onnx_dir")
    verify_manifest(onnx_dir, ONNX_KIND, "onnx_dir", "re-export it with llm_export")
    check_embedding(onnx_dir / EMBEDDING_FILE, config, "onnx_dir")
    return config


def resolve_backend(backend: str) -> str:
    """`auto` picks TensorRT only where it imports and a CUDA GPU is visible; `tensorrt` insists on it."""
    from kvforge.plugins.trt import cuda_device_count, require_tensorrt, tensorrt_importable

    if backend not in BACKENDS:
        raise InvalidConfig(f"must be one of {BACKENDS}, got {backend!r}", "backend")
    if backend == "tensorrt":
        require_tensorrt()  # one-line "TensorRT is not installed (pip install 'kvforge[tensorrt]' ...)" error
        return "tensorrt"
    if backend == "auto" and tensorrt_importable() and cuda_device_count() > 0:
        return "tensorrt"
    return "onnxruntime"


def resolve_cpu_attention(choice: str, *, head_dim: int, paged: bool = True) -> str:
    """The attention path of an ONNX Runtime engine (an engine_dir ATTENTION_* value): `auto` takes kvforge's CPU
    kernel when its library builds and loads here (KVFORGE_CPU_KERNEL=off forces the fallback) and takes the
    model's head width, `kernel` insists on it, `onnx` takes the stock-ops lowering. Resolved values pass through
    (cached-engine keys use them); `paged=False` (TensorRT, pure recurrent models: no paged attention to lower)
    only checks the choice."""
    from kvforge.plugins.cpu_kernel import MAX_HEAD_DIM, kernel_status, supports_head_dim

    if choice in (ATTENTION_CPU_KERNEL, ATTENTION_ONNX_OPS):
        return choice
    if choice not in CPU_ATTENTION_CHOICES:
        raise InvalidConfig(f"must be one of {CPU_ATTENTION_CHOICES}, got {choice!r}", "cpu_attention")
    if choice == "onnx" or not paged:
        return ATTENTION_ONNX_OPS
    if not supports_head_dim(head_dim):
        if choice == "kernel":
            raise InvalidConfig(f"the kvforge CPU attention kernel takes head_dim in multiples of 16 up to "
                                f"{MAX_HEAD_DIM}, this model's is {head_dim}; use onnx", "cpu_attention")
        return ATTENTION_ONNX_OPS
    library, reason = kernel_status()
    if library is None and choice == "kernel":
        raise InvalidConfig(f"the kvforge CPU attention kernel is not available here: {reason}", "cpu_attention")
    return ATTENTION_CPU_KERNEL if library is not None else ATTENTION_ONNX_OPS


def resolve_linear_kernel(choice: str, q4_1: bool) -> LinearChoice:
    """The op of an engine's 4-bit block linears (`q4_1`: they carry the export's Q4_1 correction, which the MLAS
    form runs as two more MatMuls and an Add) for the kernel target the library runs on this host
    (KVFORGE_CPU_TARGET forces one)."""
    if canonical(choice) is None:
        raise InvalidConfig(f"must be one of {LINEAR_CHOICES[:4]}, got {choice!r}", "cpu_matmul")
    from kvforge.plugins.cpu_kernel import chosen_target, kernel_status

    library, _ = kernel_status()
    target = chosen_target(library) if library is not None else ""
    return choose_linear_kernel(choice, target or None, q4_1)


def memory_plan(config: ModelConfig, geometry: PageGeometry) -> MemoryPlan:
    """The KV pool over the attention layers (none on a pure recurrent model) and the snapshot slot sizes: a
    partial-KV slot is a K+V page per attention layer, a recurrent slot every recurrent layer's states."""
    recurrent = recurrent_bytes_per_slot(
        len(config.recurrent_layer_ids), config.recurrent_state_num_heads, config.recurrent_state_head_dim,
        config.recurrent_state_size, config.conv_dim, config.conv_kernel) if config.recurrent_layer_ids else 0
    if config.is_recurrent:
        return MemoryPlan(0, 0, 0, 0, recurrent)
    per_page = kv_bytes_per_page(config.num_key_value_heads, config.head_dim, geometry.tokens_per_page,
                                 config.kv_cache_dtype)
    by_layer = layer_page_bytes(config, geometry.tokens_per_page)
    wide = [b for b in by_layer.values() if b != per_page]  # one wider size at most: the global layers'
    return MemoryPlan(per_page, per_page * geometry.max_kv_pool_pages, len(by_layer), sum(by_layer.values()),
                      recurrent, len(wide), max(wide, default=0) * geometry.max_kv_pool_pages)


def build_engine(onnx_dir: Path, engine_dir: Path, options: BuildOptions,
                 step: Callable[[str], None] = lambda _m: None) -> tuple[PageGeometry, MemoryPlan]:
    """Build into a staging dir next to `engine_dir` and swap it in when complete (manifest written last), so
    an interrupted or failed build leaves `engine_dir` as it was and nothing the runtime accepts."""
    if canonical(options.cpu_matmul) is None:
        raise InvalidConfig(f"must be one of {LINEAR_CHOICES[:4]}, got {options.cpu_matmul!r}", "cpu_matmul")
    if options.cpu_prefill_matmul not in CPU_PREFILL_MATMUL_CHOICES:
        raise InvalidConfig(f"must be one of {CPU_PREFILL_MATMUL_CHOICES}, got {options.cpu_prefill_matmul!r}",
                            "cpu_prefill_matmul")
    if overlaps(engine_dir, onnx_dir):
        raise InvalidConfig("is the same directory as (or overlaps) --onnxDir; the build would destroy the export",
                            "engine_dir")
    check_output_dir(engine_dir, "engine_dir")
    check_same_role(engine_dir, options.spec_draft)
    config = read_onnx_dir(onnx_dir)
    backend = resolve_backend(options.backend)
    paged = backend == "onnxruntime" and not config.is_recurrent
    # The kernel is built now, before any work.
    attention = resolve_cpu_attention(options.cpu_attention, head_dim=max(config.head_dim, config.global_head_dim),
                                      paged=paged)
    options = replace(options, cpu_attention=attention)
    geometry = options.geometry(config.max_position_embeddings)
    plan = memory_plan(config, geometry)
    if not options.force and backend == "onnxruntime":
        weights = sum((onnx_dir / name).stat().st_size for name in BACKEND_FILES["onnxruntime"]
                      if (onnx_dir / name).is_file())  # the export's graph and weights: at most what the engine loads
        check_pool_fits_memory(plan.total_bytes, hint=" (or --force to build it anyway)", weight_bytes=weights)
    speculative = check_speculative_build(config, options)
    if options.sliding_window_records and not options.sliding_window_pool:
        raise InvalidConfig("sizes the sliding-window page group: add --slidingWindowPool", "sliding_window_records")
    if not 0 <= options.sliding_window_records <= 1 << 20:
        raise InvalidConfig(f"must be in [0, {1 << 20}], got {options.sliding_window_records}",
                            "sliding_window_records")
    if options.sliding_window_pool:
        check_window_build(config, backend, speculative)
    step("validated geometry" + (f"; attention: {attention}" if paged else ""))
    with staged_dir(engine_dir, "engine_dir") as staging:
        build = _build_recurrent if config.is_recurrent else _build_hybrid if config.is_hybrid else _build_into
        build(onnx_dir, staging, config, geometry, backend, options, step, speculative)
        write_manifest(staging, ENGINE_KIND)
    step("wrote engine dir")
    return geometry, plan


def check_same_role(engine_dir: Path, spec_draft: bool) -> None:
    """A rebuild in place keeps the engine's role: a draft never replaces a base (with the draft/ it holds), nor
    a base or plain engine a draft, which a typo in --engineDir would otherwise do silently."""
    try:
        existing = json.loads((engine_dir / "config.json").read_bytes()) if (engine_dir / MANIFEST_FILE).is_file() \
            else None
    except (OSError, ValueError):
        return  # not a readable engine: check_output_dir has judged whether it may be replaced
    if not isinstance(existing, dict):
        return
    raw = existing.get("builder_config")
    was_draft = existing.get("engine_role") == "draft" or (isinstance(raw, dict) and raw.get("spec_draft") is True)
    if was_draft != spec_draft:
        held = "a draft engine" if was_draft else "a base engine" if isinstance(raw, dict) and raw.get(
            "spec_base") is True else "an engine"
        made = "a draft engine (--specDraft)" if spec_draft else "an engine that is not a draft"
        raise InvalidConfig(f"{one_line(str(engine_dir))} holds {held}; refusing to replace it with {made}: choose "
                            "another dir, or delete it first", "engine_dir")


def check_speculative_build(config: ModelConfig, options: BuildOptions) -> dict[str, bool | int]:
    """--specBase / --specDraft against the export (the support matrix's build-time rows); builder_config's keys."""
    if options.spec_base and options.spec_draft:
        raise InvalidConfig("an engine is either the speculative base or its draft; build them one at a time",
                            "spec_draft")
    if config.is_draft and not options.spec_draft:
        raise InvalidConfig(f"this ONNX dir holds a {config.spec_decode_type} draft; build it with --specDraft",
                            "spec_draft")
    if options.spec_draft and not config.is_draft:
        raise InvalidConfig("--specDraft builds a draft's ONNX dir (llm_export eagle3, block-draft or "
                            f"gemma4-assistant); this one holds a {config.model} model", "spec_draft")
    if config.is_block_draft and options.cpu_attention != ATTENTION_CPU_KERNEL:
        # The block attends to itself both ways: masked attention, which only the kernel has.
        raise InvalidConfig(f"a {config.spec_decode_type} draft needs the kvforge CPU kernel (its block attention "
                            "is non-causal); build it with --cpuAttention kernel", "cpu_attention")
    if config.reads_base_kv and options.cpu_attention != ATTENTION_CPU_KERNEL:
        raise InvalidConfig(f"a {config.spec_decode_type} assistant reads its base's KV pools in place, which only "
                            "the kvforge CPU kernel does; build it with --cpuAttention kernel", "cpu_attention")
    if options.spec_base:
        if not draft_methods_on(base_kind(config.is_recurrent, config.is_hybrid)):  # the speculation table's bases
            raise InvalidConfig(f"a speculative base has attention layers; a {config.model} model is pure recurrent "
                                "(the support matrix rejects pure-recurrent speculative bases)", "spec_base")
        if not config.hidden_state_layers:
            raise InvalidConfig("a speculative base returns the hidden states its draft reads: re-export it with "
                                "llm_export --hiddenStateLayers (llm_export eagle3 says which)", "spec_base")
    for name, value in (("max_verify_tree_size", options.max_verify_tree_size),
                        ("max_draft_tree_size", options.max_draft_tree_size)):
        if not 1 <= value <= MAX_TREE_SIZE:
            raise InvalidConfig(f"must be in [1, {MAX_TREE_SIZE}], got {value}", name)
    return {"spec_base": options.spec_base, "spec_draft": options.spec_draft,
            "max_verify_tree_size": options.max_verify_tree_size if options.spec_base else 0,
            "max_draft_tree_size": options.max_draft_tree_size if options.spec_draft else 0}


def _build_into(onnx_dir: Path, engine_dir: Path, config: ModelConfig, geometry: PageGeometry, backend: str,
                options: BuildOptions, step: Callable[[str], None], speculative: dict[str, bool | int]) -> None:
    if backend == "tensorrt" and config.quantization != "none":
        raise InvalidConfig(f"this export has {config.quantization} MatMulNBits weights, an ONNX Runtime operator; "
                            "build it with --backend onnxruntime, or export with --quantization none for TensorRT",
                            "backend")
    if backend == "tensorrt":
        from kvforge.builder.trt_build import build_tensorrt_engine  # TensorRT stays an optional extra
        build_tensorrt_engine(onnx_dir, engine_dir, config, geometry, step, max_lora_rank=options.max_lora_rank,
                              speculative=speculative)
        return
    window_pages = window_pool_pages(config, geometry, options.sliding_window_records) \
        if options.sliding_window_pool else 0
    model = load_model(onnx_dir, config, options.max_lora_rank)
    step("loaded model.onnx")
    if window_pages:
        bind_window_table(model, config)
    kernel = options.cpu_attention == ATTENTION_CPU_KERNEL
    # Speculative roles on the kernel take tree inputs (tree drafting and verification); the fallback lowering has
    # no masked attention, so its engines draft linearly (the runtime says so for --specDraftTopK > 1).
    # (An assistant reading the base's pools drafts one token per call: no tree inputs.)
    # (Nor does a hybrid base: a recurrence verifies chains only; nor, for now, a base with sliding windows.)
    tree = kernel and not config.is_hybrid and not config.sliding_window and bool(
        speculative["spec_base"] or (speculative["spec_draft"] and not config.reads_base_kv))
    lowered = lower_for_onnxruntime(model, kv_cache_dtype=config.kv_cache_dtype,
                                    tokens_per_page=geometry.tokens_per_page,
                                    num_pages=geometry.max_kv_pool_pages, cpu_kernel=kernel, tree_inputs=tree,
                                    kernel_rope=kernel)
    if window_pages:
        size_window_pools(lowered, config, window_pages)
    fuse_for_onnxruntime(lowered)  # residual + RMSNorm as one contrib op (the export keeps the reference form)
    linear = _linear_choice(lowered, options) if kernel else None
    matmuls = _lower_kernel_ops(lowered, options, linear) if kernel else 0
    if config.tie_word_embeddings:
        share_tied_head(lowered)
    step("lowered paged-KV ops")
    _save(lowered, engine_dir)
    write_engine_config(onnx_dir, engine_dir, config,
                        BuilderConfig.from_geometry(geometry, backend, options.max_lora_rank, config,
                                                    options.cpu_attention, tree_attention=tree,
                                                    kernel_kv_write=kernel_writes_kv(lowered),
                                                    kernel_matmul=matmuls > 0,
                                                    window_pool_pages=window_pages, **_linear_record(linear),
                                                    **speculative))


def _build_recurrent(onnx_dir: Path, engine_dir: Path, config: ModelConfig, geometry: PageGeometry, backend: str,
                     options: BuildOptions, step: Callable[[str], None], _speculative: dict[str, bool | int]) -> None:
    """A pure recurrent model (Mamba2): no KV pool, the recurrent ops lowered for ONNX Runtime.

    The seed's gate on extra retained pages: an engine without KV inputs retains nothing in pages (it reuses
    exact recurrent checkpoints), so --maxKVPoolPages must stay 0.
    """
    if options.max_kv_pool_pages:
        raise InvalidConfig(f"{config.model} has no attention layers, so no KV pages to retain; use 0",
                            "max_kv_pool_pages")
    _check_recurrent_build(config, backend, options)
    model = load_model(onnx_dir, config, 0)
    step("loaded model.onnx")
    lowered = lower_recurrent_ops(model)
    fuse_for_onnxruntime(lowered)
    step("lowered recurrent ops")
    _save(lowered, engine_dir)
    write_engine_config(onnx_dir, engine_dir, config, BuilderConfig.from_geometry(geometry, backend, 0, config))


def _check_recurrent_build(config: ModelConfig, backend: str, options: BuildOptions) -> None:
    if backend != "onnxruntime":
        raise InvalidConfig(f"{config.model} builds for onnxruntime only (no TensorRT plugin for the recurrent ops "
                            "yet)", "backend")
    if options.max_lora_rank:
        raise InvalidConfig(f"{config.model} exports have no LoRA inputs; use 0", "max_lora_rank")


def _build_hybrid(onnx_dir: Path, engine_dir: Path, config: ModelConfig, geometry: PageGeometry, backend: str,
                  options: BuildOptions, step: Callable[[str], None], speculative: dict[str, bool | int]) -> None:
    """Attention and recurrent layers (Qwen3.5): the paged-KV ops lowered as for an attention model (the pool spans
    the attention layers only), then the recurrent ops. As a speculative base (--specBase, for its MTP layer) it
    verifies chains only: no tree inputs.

    Extra retained pages (--maxKVPoolPages above a full batch's pages) are allowed as for an attention model,
    speculative or not: TensorRT Edge-LLM 0.10's build gate refused them with MTP, which its newer support matrix
    runs with reuse.
    """
    _check_recurrent_build(config, backend, options)
    model = load_model(onnx_dir, config, 0)
    step("loaded model.onnx")
    lowered = lower_recurrent_ops(lower_for_onnxruntime(model, kv_cache_dtype=config.kv_cache_dtype,
                                                        tokens_per_page=geometry.tokens_per_page,
                                                        num_pages=geometry.max_kv_pool_pages,
                                                        cpu_kernel=options.cpu_attention == ATTENTION_CPU_KERNEL,
                                                        kernel_rope=True))
    fuse_for_onnxruntime(lowered)
    kernel = options.cpu_attention == ATTENTION_CPU_KERNEL
    linear = _linear_choice(lowered, options) if kernel else None
    matmuls = _lower_kernel_ops(lowered, options, linear) if kernel else 0
    if config.tie_word_embeddings:
        share_tied_head(lowered)
    step("lowered paged-KV and recurrent ops")
    _save(lowered, engine_dir)
    write_engine_config(onnx_dir, engine_dir, config,
                        BuilderConfig.from_geometry(geometry, backend, 0, config, options.cpu_attention,
                                                    kernel_kv_write=kernel_writes_kv(lowered),
                                                    kernel_matmul=matmuls > 0, **_linear_record(linear),
                                                    **speculative))


def _linear_choice(model: onnx.ModelProto, options: BuildOptions) -> LinearChoice | None:
    """The op of the graph's 4-bit block linears on this CPU (--linearKernel), or None where it has none."""
    q4_1 = has_q4_1_corrections(model)
    return None if q4_1 is None else resolve_linear_kernel(options.cpu_matmul, q4_1)


def _linear_record(linear: LinearChoice | None) -> dict[str, str]:
    """builder_config's linear_kernel and its reason (none where the graph had no choice to make)."""
    return {} if linear is None else {"linear_kernel": linear.kernel, "linear_kernel_reason": linear.reason}


def _lower_kernel_ops(model: onnx.ModelProto, options: BuildOptions, linear: LinearChoice | None) -> int:
    """The kvforge.cpu ops besides attention, on an engine that loads the kernel library anyway: block matmuls
    (unless the linears run MLAS: --linearKernel), a gated MLP's activation as one SwiGLU node, and the attention
    reading the packed q/k/v projection (no Split). Returns how many matmuls moved (none when the 4-bit ones stay
    on MLAS)."""
    bf16 = options.cpu_prefill_matmul == "bf16"
    # On MLAS the 4-bit linears stay MatMulNBits (at accuracy level 4: exact rows) and the 8-bit head still moves;
    # the export's form (onnx) keeps every MatMulNBits as it is.
    choice = linear.kernel if linear is not None else canonical(options.cpu_matmul)
    if choice == MLAS:
        run_on_mlas(model)
    matmuls = 0 if choice == EXPORT_FORM else lower_block_matmuls(model, prefill_bf16=bf16,
                                                                   bits=(8,) if choice == MLAS else (4, 8))
    lower_swiglu(model)
    pack_attention_inputs(model)
    return 0 if choice == MLAS else matmuls


def _save(model: onnx.ModelProto, engine_dir: Path) -> None:
    onnx.save_model(model, engine_dir / ENGINE_MODEL_FILE, save_as_external_data=True,
                    all_tensors_to_one_file=True, location=ENGINE_WEIGHTS_FILE, size_threshold=1024)

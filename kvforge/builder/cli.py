"""llm_build: ONNX dir → engine dir, with the page geometry validated and the memory plan printed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from kvforge.builder.build import STEPS, BuildOptions, build_engine
from kvforge.cli_common import (
    BUILD_FLAGS,
    console,
    progress_bar,
    run_app,
    run_guarded,
    set_help_panels,
    set_progress_mode,
)
from kvforge.contract.engine_dir import ATTENTION_CPU_KERNEL
from kvforge.contract.errors import KvforgeError
from kvforge.contract.window_pool import checkpoint_pages

# The help text goes on the command: typer drops a Typer(help=...) when the app has one command.
HELP = """
Build an engine dir from an llm_export ONNX dir.

[bold]Examples[/]

  llm_build --onnxDir onnx/smollm2 --engineDir engines/smollm2
  llm_build --onnxDir onnx/smollm2 --engineDir engines/smollm2 --maxInputLen 2048 \\
      --maxKVCacheCapacity 4096 --maxBatchSize 1 --maxKVPoolPages 64
  llm_build --onnxDir onnx/smollm2 --engineDir engines/smollm2 --profileOps ops.json   # where time goes
  llm_build --onnxDir onnx/smollm2 --engineDir engines/smollm2-onnx --cpuAttention onnx  # no C++ kernel
  llm_build --onnxDir onnx/smollm2-base --engineDir engines/smollm2 --specBase     # an EAGLE3 base, then
  llm_build --onnxDir onnx/smollm2-draft --engineDir engines/smollm2/draft --specDraft    # its draft
"""
app = typer.Typer(add_completion=False, rich_markup_mode="rich")
DEFAULTS = BuildOptions()
DEFAULT_REUSE_RECORDS = 64
MEMORY_WARN_SHARE = 0.8  # above this share of RAM, a pool that fits still leaves the rest of the machine too little


def _budget_line(kind: str, slot: int, what: str, flag: str, records: int) -> None:
    console.print(f"  {kind} snapshot slot: {slot:,} bytes ({what}); for {records} retained contexts: "
                  f"{flag} {slot * records} ({_mib(slot * records)}) with --enableContextReuse")


def _group_lines(built: dict, bytes_per_page: int, window_size: int, global_bytes_per_page: int) -> None:
    """Each page group's size: the global layers' pool and the sliding layers' window group (--slidingWindowPool);
    `global_bytes_per_page`: a global layer's page (more than the others' where Gemma 4's global heads are wider)."""
    global_bytes, sliding_bytes = built["kv_pool_bytes_global"], built["kv_pool_bytes_sliding"]
    window, pages = built["window_pool_pages"], built["max_kv_pool_pages"]
    wider = f" ({global_bytes_per_page:,} on the global layers)" if global_bytes_per_page != bytes_per_page else ""
    console.print(f"  KV pool: {bytes_per_page:,} bytes per page per layer{wider}, two page groups = "
                  f"{_mib(global_bytes + sliding_bytes)} in total")
    console.print(f"    global layers: {pages} pages × {global_bytes // (pages * global_bytes_per_page)} layers = "
                  f"{_mib(global_bytes)}")
    layers = sliding_bytes // (window * bytes_per_page)
    console.print(f"    sliding-window layers: {window} pages × {layers} layers = {_mib(sliding_bytes)} (the window "
                  f"of each of {built['max_batch_size']} rows and one call, plus --slidingWindowRecords)")
    pages = checkpoint_pages(window_size, built["tokens_per_page"])
    console.print(f"  sliding-window checkpoint: {pages} pages × {layers} layers = {pages * layers * bytes_per_page:,} "
                  "bytes per reuse record, kept in the group's free pages (--slidingWindowRecords N adds N "
                  "records' worth)")


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


def memory_share(engine_dir: Path, pool_bytes: int) -> tuple[int, int] | None:
    """(pool + weights, machine memory) when together they take more than MEMORY_WARN_SHARE of this machine."""
    from kvforge.contract.engine_dir import BACKEND_FILES
    from kvforge.contract.memory import machine_memory_bytes

    have = machine_memory_bytes()
    weights = sum((engine_dir / name).stat().st_size for names in BACKEND_FILES.values() for name in names
                  if (engine_dir / name).is_file())
    needs = pool_bytes + weights
    return (needs, have) if have and needs > MEMORY_WARN_SHARE * have else None


def _warn_near_memory(engine_dir: Path, pool_bytes: int, forced: bool) -> None:
    """A pool that fits but leaves the OS, the runtime's buffers and other processes almost nothing builds, with a
    warning on stderr (above the machine's memory it is refused without --force, and forced, it warns as well)."""
    share = memory_share(engine_dir, pool_bytes)
    if share is None:
        return
    needs, have = share
    over = " (more than it has: built because of --force)" if forced and needs > have else ""
    print(f"warning: the KV pool and weights take {_mib(needs)}, {needs / have:.0%} of this machine's {_mib(have)}"
          f"{over}; the runtime refuses them when that much is not available: a smaller --maxKVPoolPages leaves "
          "room", file=sys.stderr)


@app.command(help=HELP)
def build(
    onnx_dir: Path = typer.Option(..., "--onnxDir", help="ONNX dir written by llm_export (a text model's, or an "
                                                       "encoder's such as OUTPUTDIR/visual: a multimodal engine)."),
    engine_dir: Path = typer.Option(..., "--engineDir", help="Output engine dir (created if missing)."),
    max_input_len: int = typer.Option(DEFAULTS.max_input_len, "--maxInputLen",
                                      help="Max prompt tokens prefilled per sequence."),
    max_kv_cache_capacity: int = typer.Option(DEFAULTS.max_kv_cache_capacity, "--maxKVCacheCapacity",
                                              help="Max tokens per sequence (prompt + generated)."),
    max_kv_pool_pages: int = typer.Option(DEFAULTS.max_kv_pool_pages, "--maxKVPoolPages",
                                          help="Physical KV pages in the pool; 0 = maxBatchSize × "
                                               "ceil(capacity / tokensPerPage). At least ceil(capacity / "
                                               "tokensPerPage); fewer than the default make rows wait or be "
                                               "preempted, more retain contexts."),
    max_batch_size: int = typer.Option(DEFAULTS.max_batch_size, "--maxBatchSize",
                                       help="Max sequences per engine call."),
    tokens_per_page: int = typer.Option(DEFAULTS.tokens_per_page, "--tokensPerPage",
                                        help="Tokens per KV page (a power of two)."),
    max_lora_rank: int = typer.Option(DEFAULTS.max_lora_rank, "--maxLoraRank",
                                      help="Max LoRA rank served at run time; 0 strips the export's LoRA inputs."),
    backend: str = typer.Option("auto", "--backend",
                                help="onnxruntime (CPU), tensorrt (GPU; needs the tensorrt extra) or auto "
                                     "(TensorRT when it imports and a GPU is visible, else onnxruntime)."),
    cpu_attention: str = typer.Option(DEFAULTS.cpu_attention, "--cpuAttention",
                                      help="How an onnxruntime engine's attention reads the KV pool: kernel "
                                           "(kvforge's CPU kernel reads the pages in place; built on first use, "
                                           "needs a C++ compiler), onnx (stock ONNX Runtime ops over pages "
                                           "gathered each call: slower as the context grows) or auto (the kernel "
                                           "where it builds here, else onnx; KVFORGE_CPU_KERNEL=off forces onnx)."),
    cpu_matmul: str = typer.Option("auto", "--linearKernel", "--cpuMatmul",
                                   help="Which op runs the 4-bit block weights of an engine attending with the "
                                        "kvforge CPU kernel: kvforge (MatMulBlocks: one node per matmul, and a "
                                        "verification row gets exactly its decode row's logits), mlas (ONNX "
                                        "Runtime's MatMulNBits at accuracy level 4, whose rows are exact too, plus "
                                        "the export's Q4_1 correction; the 8-bit head stays MatMulBlocks), auto (the "
                                        "faster of the two on this CPU's kernel target, from the measurement table "
                                        "in kvforge/builder/linear_choice.py; KVFORGE_CPU_TARGET forces the target) "
                                        "or onnx (the export's MatMulNBits as they are: verification rows not "
                                        "exact). kernel is the older name of kvforge. The build prints which and "
                                        "why."),
    cpu_prefill_matmul: str = typer.Option(DEFAULTS.cpu_prefill_matmul, "--cpuPrefillMatmul",
                                           help="How MatMulBlocks runs calls of more than 16 rows (prefill chunks): "
                                                "bf16 (activations and weights rounded to bfloat16, float32 sums, on "
                                                "CPUs with AVX512_BF16; float32 elsewhere) or fp32 (always float32). "
                                                "Decode and verification rows are float32 either way."),
    reuse_records: int = typer.Option(DEFAULT_REUSE_RECORDS, "--reuseRecords",
                                      help="Retained contexts to size the printed snapshot budget for (a record "
                                           "whose length is not page-aligned keeps one partial-KV snapshot slot)."),
    profile_ops_file: Path = typer.Option(None, "--profileOps",
                                          help="After the build, run one prefill and its decode steps with ONNX "
                                               "Runtime profiling and write the per-op-type times (JSON) here; "
                                               "the top ops print too."),
    profile_prompt_tokens: int = typer.Option(512, "--profilePromptTokens",
                                              help="Prompt length of the --profileOps run (<= maxInputLen)."),
    profile_decode_tokens: int = typer.Option(32, "--profileDecodeTokens",
                                              help="Decode steps of the --profileOps run."),
    num_threads: int = typer.Option(0, "--numThreads", help="Threads for the --profileOps run (0 = all cores)."),
    spec_base: bool = typer.Option(False, "--specBase", "--eagleBase",
                                   help="Build a speculative base: its ONNX dir returns the hidden states its EAGLE3 "
                                        "draft reads (llm_export --hiddenStateLayers)."),
    spec_draft: bool = typer.Option(False, "--specDraft", "--eagleDraft",
                                    help="Build an EAGLE3 draft (an ONNX dir from llm_export eagle3). Put it in "
                                         "BASE_ENGINE_DIR/draft, where llm_inference --specDecode eagle3 looks for "
                                         "it, after building the base (a rebuild of the base replaces the folder)."),
    max_verify_tree_size: int = typer.Option(DEFAULTS.max_verify_tree_size, "--maxVerifyTreeSize",
                                             help="With --specBase: the most positions one verify row holds."),
    max_draft_tree_size: int = typer.Option(DEFAULTS.max_draft_tree_size, "--maxDraftTreeSize",
                                            help="With --specDraft: the most tokens one drafting round proposes."),
    sliding_window_pool: bool = typer.Option(False, "--slidingWindowPool",
                                             help="Give a model's sliding-window layers (Gemma's local layers) "
                                                  "their own page group sized for the window, not for "
                                                  "--maxKVCacheCapacity; reuse keeps the window at each "
                                                  "record's end."),
    sliding_window_records: int = typer.Option(0, "--slidingWindowRecords",
                                               help="With --slidingWindowPool: window checkpoints (reuse records) "
                                                    "the group keeps beyond the pages its rows leave free."),
    force: bool = typer.Option(False, "--force", help="Build even when the KV pool (--maxKVPoolPages) needs more "
                                                      "memory than this machine has."),
    progress: str = typer.Option(None, "--progress", show_default=False,
                                 help="Progress: bars (redrawn on stderr), lines (one line per finished stage with "
                                      "its seconds, on stdout, for logs), off, or auto (the default, also set by "
                                      "KVFORGE_PROGRESS: bars on a terminal, lines otherwise)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    """Validate geometry, lower the paged-KV ops for the backend and write the engine dir."""
    options = BuildOptions(max_input_len=max_input_len, max_kv_cache_capacity=max_kv_cache_capacity,
                           max_kv_pool_pages=max_kv_pool_pages, max_batch_size=max_batch_size,
                           tokens_per_page=tokens_per_page, backend=backend, max_lora_rank=max_lora_rank,
                           force=force, cpu_attention=cpu_attention, cpu_matmul=cpu_matmul,
                           cpu_prefill_matmul=cpu_prefill_matmul, spec_base=spec_base,
                           spec_draft=spec_draft,
                           max_verify_tree_size=max_verify_tree_size, max_draft_tree_size=max_draft_tree_size,
                           sliding_window_pool=sliding_window_pool, sliding_window_records=sliding_window_records)

    def body() -> None:
        from kvforge.contract.files import check_path_name
        from kvforge.contract.multimodal import is_encoder_dir
        set_progress_mode(progress)
        check_path_name(onnx_dir, "--onnxDir")
        check_path_name(engine_dir, "--engineDir")
        if is_encoder_dir(onnx_dir):
            from kvforge.builder.encoder_build import build_encoder_engine
            built = build_encoder_engine(onnx_dir, engine_dir, backend, max_batch_size)
            console.print(f"multimodal engine written to {engine_dir} ({built.kind} {built.model}, backend "
                          f"{built.backend}); run it with llm_inference --multimodalEngineDir")
            return
        if profile_ops_file is not None:  # before the build, not after it
            from kvforge.contract.files import check_distinct, check_output_file
            check_output_file(profile_ops_file, "--profileOps")
            check_distinct({"--profileOps": profile_ops_file}, {"--onnxDir": onnx_dir, "--engineDir": engine_dir},
                           outputs_are_dirs=True)
            if not 1 <= profile_prompt_tokens <= max_input_len or profile_decode_tokens < 0:
                raise KvforgeError(f"must be in [1, --maxInputLen={max_input_len}], got {profile_prompt_tokens}",
                                   "--profilePromptTokens")
        if reuse_records < 0:
            raise KvforgeError(f"must be >= 0, got {reuse_records}", "--reuseRecords")
        with progress_bar("building engine", STEPS) as step:
            geometry, plan = build_engine(onnx_dir, engine_dir, options, step)
        written = json.loads((engine_dir / "config.json").read_text(encoding="utf-8"))
        built = written["builder_config"]
        console.print(f"engine written to {engine_dir} (backend {built['backend']}, attention {built['attention']})")
        if built["attention"] == ATTENTION_CPU_KERNEL:  # whose speed the engine's figures are
            from kvforge.plugins.cpu_kernel import cpu_description, describe_cpu
            console.print(f"  CPU: {describe_cpu(cpu_description())}")
        if built.get("linear_kernel"):
            console.print(f"  linears: {built['linear_kernel']}: {built['linear_kernel_reason']}", markup=False,
                          highlight=False)
        console.print(f"  pages: {geometry.max_kv_pool_pages} × {geometry.tokens_per_page} tokens "
                      f"({geometry.max_pages_per_seq} per sequence, {geometry.full_batch_pages} for a full batch of "
                      f"{geometry.max_batch_size})")
        if geometry.max_kv_pool_pages < geometry.full_batch_pages:
            console.print(f"  note: the pool holds fewer pages than {geometry.max_batch_size} sequences of "
                          f"{geometry.max_kv_cache_capacity} tokens need; rows will wait or be preempted when the "
                          "pool is full")
        if built.get("window_pool_pages"):  # two page groups; window checkpoints instead of partial-KV snapshots
            _group_lines(built, plan.bytes_per_page_per_layer, written["sliding_window"],
                         plan.wide_pool_bytes_per_layer // geometry.max_kv_pool_pages or plan.bytes_per_page_per_layer)
        elif plan.num_layers:  # attention layers: a KV pool and partial-KV snapshots
            wide = f" + {_mib(plan.wide_pool_bytes_per_layer)} × {plan.wide_layers} layers with wider heads" \
                if plan.wide_layers else ""
            console.print(f"  KV pool: {plan.bytes_per_page_per_layer:,} bytes per page per layer; "
                          f"{_mib(plan.pool_bytes_per_layer)} per layer × {plan.num_layers - plan.wide_layers} layers"
                          f"{wide} = {_mib(plan.total_bytes)} in total")
            _budget_line("partial-KV", plan.partial_kv_bytes_per_slot,
                         f"a K+V page × {plan.num_layers} attention layers", "--contextCachePartialKVSnapshotPoolBytes",
                         reuse_records)
        _warn_near_memory(engine_dir, built["kv_pool_bytes_global"] + built["kv_pool_bytes_sliding"]
                          if built.get("window_pool_pages") else plan.total_bytes, force)
        if plan.recurrent_bytes_per_slot:
            _budget_line("recurrent", plan.recurrent_bytes_per_slot,
                         "every recurrent layer's recurrent and conv state",
                         "--contextCacheRecurrentSnapshotPoolBytes", reuse_records)
        if profile_ops_file is not None:
            from kvforge.runtime.engine.op_timing import format_op_profile, profile_ops
            console.print(f"profiling ops: {profile_prompt_tokens}-token prefill, {profile_decode_tokens} decode steps")
            report = profile_ops(engine_dir, profile_prompt_tokens, profile_decode_tokens, num_threads)
            from kvforge.contract.files import atomic_write_text
            atomic_write_text(profile_ops_file, json.dumps(report, indent=2) + "\n")
            console.print(format_op_profile(report), markup=False, highlight=False)
            console.print(f"op profile written to {profile_ops_file}")

    run_guarded(body, debug, flags=BUILD_FLAGS)


# Where --help lists this command's own flags (kvforge.cli_common.set_help_panels; engine options carry theirs).
HELP_PANELS = {
    "Sizes": ("--maxInputLen", "--maxKVCacheCapacity", "--maxKVPoolPages", "--maxBatchSize", "--tokensPerPage",
              "--maxLoraRank", "--reuseRecords"),
    "CPU kernels": ("--backend", "--cpuAttention", "--linearKernel", "--cpuPrefillMatmul"),
    "Profiling": ("--profileOps", "--profilePromptTokens", "--profileDecodeTokens", "--numThreads"),
    "Speculative decoding": ("--specBase", "--specDraft", "--maxVerifyTreeSize", "--maxDraftTreeSize"),
    "Sliding window": ("--slidingWindowPool", "--slidingWindowRecords"),
}
set_help_panels(app, HELP_PANELS)


def main() -> None:
    run_app(app)

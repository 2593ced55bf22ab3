"""llm_build: ONNX dir → engine dir, with the page geometry validated and the memory plan printed."""

from __future__ import annotations

from pathlib import Path

import typer

from kvforge.builder.build import STEPS, BuildOptions, build_engine, resolve_backend
from kvforge.cli_common import BUILD_FLAGS, console, progress_bar, run_app, run_guarded

# The help text goes on the command: typer drops a Typer(help=...) when the app has one command.
HELP = """
Build an engine dir from an llm_export ONNX dir.

[bold]Examples[/]

  llm_build --onnxDir onnx/smollm2 --engineDir engines/smollm2
  llm_build --onnxDir onnx/smollm2 --engineDir engines/smollm2 --maxInputLen 2048 \\
      --maxKVCacheCapacity 4096 --maxBatchSize 1 --maxKVPoolPages 64
"""
app = typer.Typer(add_completion=False, rich_markup_mode="rich")
DEFAULTS = BuildOptions()


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


@app.command(help=HELP)
def build(
    onnx_dir: Path = typer.Option(..., "--onnxDir", help="ONNX dir written by llm_export."),
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
    force: bool = typer.Option(False, "--force", help="Build even when the KV pool (--maxKVPoolPages) needs more "
                                                      "memory than this machine has."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    """Validate geometry, lower the paged-KV ops for the backend and write the engine dir."""
    options = BuildOptions(max_input_len=max_input_len, max_kv_cache_capacity=max_kv_cache_capacity,
                           max_kv_pool_pages=max_kv_pool_pages, max_batch_size=max_batch_size,
                           tokens_per_page=tokens_per_page, backend=backend, max_lora_rank=max_lora_rank,
                           force=force)

    def body() -> None:
        with progress_bar("building engine", STEPS) as step:
            geometry, plan = build_engine(onnx_dir, engine_dir, options, step)
        console.print(f"engine written to {engine_dir} (backend {resolve_backend(backend)})")
        console.print(f"  pages: {geometry.max_kv_pool_pages} × {geometry.tokens_per_page} tokens "
                      f"({geometry.max_pages_per_seq} per sequence, {geometry.full_batch_pages} for a full batch of "
                      f"{geometry.max_batch_size})")
        if geometry.max_kv_pool_pages < geometry.full_batch_pages:
            console.print(f"  note: the pool holds fewer pages than {geometry.max_batch_size} sequences of "
                          f"{geometry.max_kv_cache_capacity} tokens need; rows will wait or be preempted when the "
                          "pool is full")
        console.print(f"  KV pool: {plan.bytes_per_page_per_layer:,} bytes per page per layer; "
                      f"{_mib(plan.pool_bytes_per_layer)} per layer × {plan.num_layers} layers "
                      f"= {_mib(plan.total_bytes)} in total")

    run_guarded(body, debug, flags=BUILD_FLAGS)


def main() -> None:
    run_app(app)

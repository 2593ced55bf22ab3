"""Shared CLI plumbing: one-line errors with a non-zero exit, progress bars, console output."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvforge.contract.errors import KvforgeError
from kvforge.contract.validation import printable

try:  # newer typer vendors click; its usage errors are not click's classes
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - typer that still depends on click
    from click import exceptions as click_exceptions

console = Console(stderr=True, highlight=False, soft_wrap=True)
T = TypeVar("T")
EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 3

# Domain name an error's field carries → the flag a user of that CLI sets it with (see `run_guarded`).
_ENGINE_BUILD_FLAGS = {  # what an engine is built with; llm_inference names these too (rebuild to change them)
    "backend": "--backend",
    "max_input_len": "--maxInputLen",
    "max_kv_cache_capacity": "--maxKVCacheCapacity",
    "max_batch_size": "--maxBatchSize",
    "tokens_per_page": "--tokensPerPage",
    "max_kv_pool_pages": "--maxKVPoolPages",
    "max_lora_rank": "--maxLoraRank",
    "cpu_attention": "--cpuAttention",
}
BUILD_FLAGS = {**_ENGINE_BUILD_FLAGS, "onnx_dir": "--onnxDir", "engine_dir": "--engineDir"}
ENGINE_FLAGS = {  # llm_inference
    **_ENGINE_BUILD_FLAGS,
    "engine_dir": "--engineDir",
    "input_file": "--inputFile",
    "output_file": "--outputFile",
    "profile_output_file": "--profileOutputFile",
    "context_cache_max_records": "--contextCacheMaxRecords",
    "context_cache_partial_kv_snapshot_pool_bytes": "--contextCachePartialKVSnapshotPoolBytes",
    "context_cache_recurrent_snapshot_pool_bytes": "--contextCacheRecurrentSnapshotPoolBytes",
    "snapshot_interval_tokens": "--snapshotIntervalTokens",
    "prefill_chunk_size": "--prefillChunkSize",
    "max_num_tokens": "--maxNumTokens",
    "num_threads": "--numThreads",
    "batch_size_override": "--batchSize",
    "max_generate_length_override": "--maxGenerateLength",
    "num_logprobs_override": "--numLogprobs",
    "multimodal_engine_dir": "--multimodalEngineDir",
    "encoder_cache_budget_bytes": "--encoderCacheBudgetBytes",
    "max_input_file_bytes": "--maxInputFileBytes",
}
EXPORT_FLAGS = {
    "onnx_dir": "--onnxDir",
    "output_dir": "--outputDir",
    "adapter_dir": "--adapterDir",
    "kv_cache_dtype": "--kvCacheDtype",
    "lora_targets": "--loraTargets",
    "synthetic": "--synthetic",
    "output": "--output",
    "quant_block_size": "--quantBlockSize",
}


def run_app(app: typer.Typer) -> None:
    """Entry point of a typer app whose usage errors (missing or malformed flags) are one line too."""
    command = typer.main.get_command(app)
    try:
        code = command.main(standalone_mode=False)
    except click_exceptions.UsageError as exc:
        hint = f" (see {exc.ctx.command_path} --help)" if exc.ctx else ""
        fail(f"{exc.format_message()}{hint}")
    if isinstance(code, int) and code:
        raise SystemExit(code)


def fail(message: str, code: int = EXIT_USER_ERROR) -> None:
    # printable: one line whatever a message quotes (hostile file content, paths with escape sequences).
    console.print(f"[bold red]error:[/] {escape(printable(message))}", soft_wrap=True)  # `[...]` is not markup
    raise SystemExit(code)


def run_guarded(fn: Callable[[], T], debug: bool = False, flags: Mapping[str, str] | None = None) -> T:
    """Run a command body; user errors become one line and exit 2, bugs one line and exit 3.

    `flags` maps the domain names errors carry (`max_kv_pool_pages`) to this CLI's flags (`--maxKVPoolPages`).
    """
    try:
        return fn()
    except KvforgeError as exc:
        fail(str(exc.with_flag_names(flags or {})))
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except Exception as exc:  # an unexpected failure: still one line unless --debug or KVFORGE_DEBUG
        if debug or os.environ.get("KVFORGE_DEBUG"):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        fail(f"internal error ({type(exc).__name__}: {first}); rerun with --debug for the traceback",
             EXIT_INTERNAL_ERROR)
    raise AssertionError("unreachable")


@contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr (hidden when stderr is not a terminal); yields `step(message)`."""
    enabled = sys.stderr.isatty()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[note]}"),
                  TimeElapsedColumn(), console=console, disable=not enabled, transient=False) as progress:
        task = progress.add_task(description, total=total, note="")

        def step(message: str) -> None:
            progress.update(task, advance=1, note=message)

        yield step
        progress.update(task, completed=total or 0)


# --- snapshot pool options: llm_inference and llm_serve declare them alike --------------------------------------

SNAPSHOT_FLAGS = ("--contextCachePartialKVSnapshotPoolBytes", "--contextCacheRecurrentSnapshotPoolBytes",
                  "--snapshotIntervalTokens")


def partial_kv_snapshot_option() -> typer.models.OptionInfo:
    return typer.Option(0, SNAPSHOT_FLAGS[0], help=(
        "Bytes for partial-KV snapshots (llm_build prints the bytes per slot): records whose length is not "
        "page-aligned keep their tail page, so later prompts extending them reuse up to the exact token. Needs "
        "--enableContextReuse; 0 = off (reuse stops at the last whole page). Hybrid engines with reuse need at "
        "least one slot."))


def recurrent_snapshot_option() -> typer.models.OptionInfo:
    return typer.Option(0, SNAPSHOT_FLAGS[1], help=(
        "Bytes for recurrent snapshots (llm_build prints the bytes per slot): exact checkpoints of a recurrent or "
        "hybrid model's state, the only thing such models can reuse. Needs --enableContextReuse; required (at "
        "least one slot) for recurrent and hybrid engines with reuse."))


def message_boundaries_option() -> typer.models.OptionInfo:
    return typer.Option(True, "--snapshotMessageBoundaries/--noSnapshotMessageBoundaries", help=(
        "Recurrent/hybrid engines: also capture a checkpoint where each earlier chat message ends, so a shared "
        "system prompt or document hits although requests diverge after it (default on)."))


def snapshot_interval_option() -> typer.models.OptionInfo:
    return typer.Option(0, SNAPSHOT_FLAGS[2], help=(
        "Recurrent/hybrid engines: also capture a checkpoint every N prompt tokens (within the snapshot budget; "
        "least recently used checkpoints are evicted). 0 = off."))


def check_snapshot_flags(enable_context_reuse: bool, *values: int) -> None:
    """Each snapshot flag given (in SNAPSHOT_FLAGS order) needs --enableContextReuse."""
    for flag, value in zip(SNAPSHOT_FLAGS, values, strict=True):
        if value and not enable_context_reuse:
            raise KvforgeError("requires --enableContextReuse", flag)


"""Shared CLI plumbing: one-line errors with a non-zero exit, progress (bars or lines), console output, engine
options."""

from __future__ import annotations

import functools
import inspect
import os
import sys
import time
import typing
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import typer
import typer.rich_utils
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.padding import Padding
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kvforge.contract.errors import KvforgeError
from kvforge.contract.validation import printable
from kvforge.runtime.engine.config import (
    EngineConfig,
    engine_flags,
    engine_option_panel,
    engine_options,
    make_engine_config,
)

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
    "cpu_matmul": "--linearKernel",
    "cpu_prefill_matmul": "--cpuPrefillMatmul",
    "sliding_window_pool": "--slidingWindowPool",
    "sliding_window_records": "--slidingWindowRecords",
}
BUILD_FLAGS = {**_ENGINE_BUILD_FLAGS, "onnx_dir": "--onnxDir", "engine_dir": "--engineDir", "spec_base": "--specBase",
               "spec_draft": "--specDraft", "max_verify_tree_size": "--maxVerifyTreeSize",
               "max_draft_tree_size": "--maxDraftTreeSize"}
ENGINE_FLAGS = {  # llm_inference; EngineConfig's fields name the flags they are declared with
    **_ENGINE_BUILD_FLAGS,
    "engine_dir": "--engineDir",
    "input_file": "--inputFile",
    "output_file": "--outputFile",
    "profile_output_file": "--profileOutputFile",
    "batch_size_override": "--batchSize",
    "max_generate_length_override": "--maxGenerateLength",
    "num_logprobs_override": "--numLogprobs",
    "max_input_file_bytes": "--maxInputFileBytes",
    **engine_flags(),
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
    "int4_scheme": "--int4Scheme",
}


# --- --help at 80 columns. typer lays an options panel out as a six-column table (flag, short flag, off flag, its
# short flag, type, help); at 80 columns rich then cuts long flag names ("--enableContextR…") and wraps the help
# into a narrow column, so llm_serve's help was 634 lines with 47 names cut. Each option here is the flag line (the
# off flag and the type beside it) with its help to the right when the flags fit HELP_FLAG_WIDTH, and otherwise
# on the lines under it, indented by that width: a name is never cut, the help keeps most of the width.
HELP_FLAG_WIDTH = 26


def _option_flags(param: Any, ctx: Any) -> Text:
    """`--port <int>`, `--enableContextReuse / --disableContextReuse`: every spelling of an option, whole."""
    if param.param_type_name == "argument":  # its metavar (A.json), as typer shows it
        flags = getattr(param, "display_name_raw", None) or param.human_readable_name
        flags += "..." if param.metavar is None and param.nargs != 1 else ""
    else:
        flags = ", ".join(sorted(param.opts, key=lambda opt: not opt.startswith("--")))
    text = Text("* " if param.required else "", style="red")
    text.append(flags, style="bold cyan")
    if param.secondary_opts:
        text.append(" / " + ", ".join(param.secondary_opts), style="bold magenta")
    if not getattr(param, "is_flag", False):
        kind = param.display_type_rich(ctx=ctx) if hasattr(param, "display_type_rich") else param.make_metavar(ctx)
        if kind:
            text.append(f" {kind}", style="yellow")
    return text


def _joined(columns: Any) -> RenderableType:
    """typer's help as one paragraph: its Columns put "[default: 0]" on a line of its own in a narrow column."""
    parts = getattr(columns, "renderables", None)
    if not parts or not all(isinstance(part, Text) for part in parts):
        return columns  # markdown help: leave it to rich
    text = Text(" ").join(parts)
    text.overflow = "fold"  # a long default (a path, a cache key) folds onto the next line instead of being cut
    return text


def _print_options_panel(*, name: str, params: list[Any], ctx: Any, markup_mode: Any, console: Console) -> None:
    """typer's options panel (its `rich_help_panel` groups), laid out so flag names stay whole at any width."""
    if not params:
        return
    rows: list[RenderableType] = []
    for param in params:
        flags = _option_flags(param, ctx)
        help_text = _joined(typer.rich_utils._get_parameter_help(param=param, ctx=ctx, markup_mode=markup_mode))
        if flags.cell_len <= HELP_FLAG_WIDTH:
            row = Table.grid(padding=(0, 1), expand=True)
            row.add_column(width=HELP_FLAG_WIDTH, no_wrap=True)
            row.add_column(ratio=1)
            row.add_row(flags, help_text)
            rows.append(row)
        else:  # on its own line (folded, never cut, should a flag outgrow the terminal), the help under it
            flags.overflow = "fold"
            rows.extend([flags, Padding(help_text, (0, 0, 0, HELP_FLAG_WIDTH + 1))])
    console.print(Panel(Group(*rows), title=name, title_align="left", border_style="dim"))


# typer looks the panel printer up in its module at each --help; replacing it keeps typer's usage line, command
# help, command panels and epilog (and its rich_help_panel grouping) while fixing the one table that cut names.
typer.rich_utils._print_options_panel = _print_options_panel  # type: ignore[assignment]


def set_help_panels(app: typer.Typer, panels: Mapping[str, tuple[str, ...]]) -> None:
    """List each named flag of `app`'s commands under its --help panel (typer's rich_help_panel): a CLI module
    names its groups in one table instead of on every option. A flag no command has is a ValueError (at import)."""
    wanted = {flag: panel for panel, flags in panels.items() for flag in flags}
    seen: set[str] = set()
    for command in app.registered_commands:
        for parameter in inspect.signature(command.callback).parameters.values():  # type: ignore[arg-type]
            info = parameter.default
            if not isinstance(info, typer.models.OptionInfo):
                continue
            for decl in info.param_decls or ():
                flag = decl.split("/")[0]
                if flag in wanted:
                    info.rich_help_panel = wanted[flag]
                    seen.add(flag)
    missing = sorted(set(wanted) - seen)
    if missing:
        raise ValueError(f"help panels name flags no command has: {', '.join(missing)}")


def version_line(name: str) -> str:
    """`NAME kvforge X.Y.Z`: what every console script's `--version` prints."""
    from kvforge.contract.version import __version__

    return f"{name} kvforge {__version__}"


def run_app(app: typer.Typer, argv: list[str] | None = None) -> None:
    """Entry point of a typer app whose usage errors (missing or malformed flags) are one line too.

    `argv` is the whole command line, program name first (default `sys.argv`), so a test or another program can run
    a CLI in process: it returns on success and raises `SystemExit` with the exit code otherwise.
    """
    prog_name = None if argv is None else Path(argv[0]).name  # None: click names it as it was started
    argv = list(sys.argv if argv is None else argv)
    # Handled before typer sees argv so it works at the top level of every app, subcommands or not, and needs no
    # required flag (typer would demand --engineDir first).
    if argv[1:2] == ["--version"]:
        print(version_line(prog_name or Path(argv[0]).name))
        raise SystemExit(0)
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv[1:], prog_name=prog_name, standalone_mode=False)
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
    global _progress_mode
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
    finally:
        _progress_mode = None  # a command's --progress ends with it (CLIs also run in one process, as in tests)
    raise AssertionError("unreachable")


# How stages report progress (llm_export/llm_build --progress, else KVFORGE_PROGRESS): bars redraw on stderr; lines
# print one line per finished stage with its elapsed time on stdout, for logs and CI. Lines go to stdout so that a
# failed run's stderr stays its one `error:` line (the contract every CLI test asserts), and a stage prints when it
# ends, so with 2>&1 the error is still the last line. auto: bars when stderr is a terminal, lines otherwise.
PROGRESS_MODES = ("auto", "bars", "lines", "off")
PROGRESS_ENV = "KVFORGE_PROGRESS"
_progress_mode: str | None = None  # set by a CLI's --progress; None: the environment's, else auto


def set_progress_mode(mode: str | None, flag: str = "--progress") -> None:
    """Use `mode` for this process's progress (None: KVFORGE_PROGRESS or auto); a bad value names `flag`."""
    global _progress_mode
    if mode is not None and mode not in PROGRESS_MODES:
        raise KvforgeError(f"must be one of {', '.join(PROGRESS_MODES)}, got {mode!r}", flag)
    _progress_mode = mode


def progress_mode() -> str:
    """bars, lines or off: the --progress given, else KVFORGE_PROGRESS, else auto resolved for this stderr."""
    mode = _progress_mode or os.environ.get(PROGRESS_ENV) or "auto"
    if mode not in PROGRESS_MODES:
        raise KvforgeError(f"must be one of {', '.join(PROGRESS_MODES)}, got {mode!r}", PROGRESS_ENV)
    if mode == "auto":
        return "bars" if sys.stderr.isatty() else "lines"
    return mode


def program_name() -> str:
    return Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "kvforge"


@contextmanager
def progress_bar(description: str, total: int | None, lines: bool = True) -> Iterator[Callable[[str], None]]:
    """A stage's progress as progress_mode() says; yields `step(message)`. `lines=False`: a caller that prints its
    own stage lines (the model cache's service log) gets bars only."""
    mode = progress_mode()
    if mode == "lines":
        started = time.perf_counter()
        yield lambda message: None
        if lines:  # only once the stage ended: a failure inside it leaves no line behind
            print(f"{program_name()}: {description} {time.perf_counter() - started:.1f} s", flush=True)
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[note]}"),
                  TimeElapsedColumn(), console=console, disable=mode != "bars", transient=False) as progress:
        task = progress.add_task(description, total=total, note="")

        def step(message: str) -> None:
            progress.update(task, advance=1, note=message)

        yield step
        progress.update(task, completed=total or 0)


# --- engine options: declared once on EngineConfig (kvforge/runtime/engine/config.py); llm_inference and llm_serve
# offer every one a CLI has with the same flag, help and default, and llm_test the ones it shares.


def engine_option(name: str, help: str | None = None) -> typer.models.OptionInfo:
    """The typer option of EngineConfig field `name`: its declared flag and default, and its declared help unless
    a front end where the flag does more says so in `help`."""
    default, option = engine_options()[name]
    if option.flag is None:
        raise ValueError(f"EngineConfig.{name} has no CLI flag")
    decls = f"{option.flag}/{option.off_flag}" if option.off_flag else option.flag
    return typer.Option(default, decls, help=help or option.help, rich_help_panel=engine_option_panel(name))


def with_engine_options(command: Callable[..., T]) -> Callable[..., T]:
    """A typer command whose `engine_config: EngineConfig` parameter becomes one option per EngineConfig field a CLI
    offers, in declaration order at that place; the command is called with the EngineConfig they make."""
    signature = inspect.signature(command)
    if "engine_config" not in signature.parameters:
        raise TypeError(f"{command.__name__} has no engine_config parameter")
    hints = typing.get_type_hints(command)
    field_types = typing.get_type_hints(EngineConfig)
    offered = [name for name, (_, option) in engine_options().items() if option.flag]
    parameters: list[inspect.Parameter] = []
    for parameter in signature.parameters.values():
        if parameter.name != "engine_config":
            parameters.append(parameter.replace(annotation=hints.get(parameter.name, parameter.annotation)))
            continue
        for name in offered:
            # typer reads the type from the annotation: a path option shows PATH, as the CLIs did before.
            annotation = Path if engine_options()[name][1].path else field_types[name]
            annotation = list[str] if annotation == tuple[str, ...] else annotation  # a repeatable flag
            parameters.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                default=engine_option(name), annotation=annotation))

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> T:
        values = {name: kwargs.pop(name) for name in offered}
        return command(**kwargs, engine_config=make_engine_config(values))

    # typer reads both: the signature for the options, the annotations for their types.
    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    if "return" in hints:
        wrapper.__annotations__["return"] = hints["return"]
    return wrapper


def check_reuse_flags(config: EngineConfig) -> None:
    """Before anything loads: each option given that works only with reuse needs --enableContextReuse."""
    for name, (_, option) in engine_options().items():
        if option.requires_reuse and getattr(config, name) and not config.enable_context_reuse:
            raise KvforgeError("requires --enableContextReuse", option.flag)

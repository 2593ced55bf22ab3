"""Shared CLI plumbing: one-line errors with a non-zero exit, progress bars, console output."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvforge.runtime.errors import KvforgeError

console = Console(stderr=True, highlight=False)
T = TypeVar("T")
EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 3


def fail(message: str, code: int = EXIT_USER_ERROR) -> None:
    console.print(f"[bold red]error:[/] {message}", soft_wrap=True)
    raise SystemExit(code)


def run_guarded(fn: Callable[[], T], debug: bool = False) -> T:
    """Run a command body; user errors become one line and exit 2, bugs one line and exit 3."""
    try:
        return fn()
    except KvforgeError as exc:
        fail(str(exc))
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

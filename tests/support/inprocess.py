"""Run a console script inside the test process: the same entry point, argv, exit code and stdout/stderr as a
subprocess, without paying a Python start-up and the package imports (1-2 s) per call.

Use it where the process is not the point. Keep real processes (`run_cli`) for what only a process shows: the
console scripts' installation (`cli/test_version.py`), interrupts, two processes sharing a tier, and `llm_serve`.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import entry_points
from pathlib import Path
from unittest import mock

from conftest import BIN_DIR  # the venv's console scripts: argv[0] is what a subprocess would see

# What run_cli_command sets for its children: plain text, no colour, and errors never become tracebacks.
_ENV = {"NO_COLOR": "1", "TERM": "dumb", "PYTHONIOENCODING": "utf-8"}


def _entry_point(script: str) -> Callable[[], object]:
    found = entry_points(group="console_scripts", name=script)
    if not found:
        raise FileNotFoundError(f"console script {script!r} is not an entry point of this venv")
    return next(iter(found)).load()


@contextmanager
def _captured_fds() -> Iterator[list[str]]:
    """stdout/stderr at the file-descriptor level, so native writes (onnxruntime's warnings) are caught as a
    subprocess's pipes would catch them; Python's sys.stdout/sys.stderr write through the same descriptors.
    Yields a list that holds [stdout, stderr] once the block ends."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        saved = os.dup(1), os.dup(2)
        streams = sys.stdout, sys.stderr
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                                   errors="replace", line_buffering=True) for fd in (1, 2))
        texts: list[str] = []
        try:
            yield texts
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            sys.stdout, sys.stderr = streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            for file in (out, err):
                file.seek(0)
                texts.append(file.read().decode("utf-8", errors="replace"))


@contextmanager
def _logging_restored() -> Iterator[None]:
    """A CLI may attach a StreamHandler to the captured stderr (llm_inference's info logs); drop what it added."""
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                     if isinstance(v, logging.Logger))]
    before = {id(logger): (list(logger.handlers), logger.level) for logger in loggers}
    try:
        yield
    finally:
        for logger in [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                              if isinstance(v, logging.Logger))]:
            handlers, level = before.get(id(logger), ([], logging.NOTSET))
            logger.handlers[:] = handlers
            logger.setLevel(level)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)  # what the interpreter does with sys.exit("message")
    return 1


def run_cli_inprocess(args: list, cwd: Path | None = None,
                      env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`run_cli_command`'s contract in process: `args[0]` names a console script; never raises on a non-zero exit.
    An uncaught exception is a traceback on stderr and exit 1, as the interpreter would report it. `env` adds
    variables for this run only."""
    argv = [str(a) for a in args]
    main = _entry_point(argv[0])
    env = mock.patch.dict(os.environ, {**_ENV, **(env or {})})
    with env, mock.patch.object(sys, "argv", [str(BIN_DIR / argv[0]), *argv[1:]]), _logging_restored():
        os.environ.pop("KVFORGE_DEBUG", None)  # restored with the rest of the environment
        here = Path.cwd()
        if cwd is not None:
            os.chdir(cwd)
        try:
            with _captured_fds() as texts:
                try:
                    main()
                    code = 0
                except SystemExit as exc:
                    code = _exit_code(exc)
                except KeyboardInterrupt:
                    raise
                except BaseException:  # the interpreter's report of an uncaught exception
                    traceback.print_exc()
                    code = 1
        finally:
            os.chdir(here)
    return subprocess.CompletedProcess(argv, code, *texts)

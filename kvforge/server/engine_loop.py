"""The one thread that owns the Engine: HTTP handlers talk to it only through its command queue.

Loop: drain the commands (add, abort, call), then run one `engine.step()` while work exists, else block on
the queue. Every output goes to the sink its request was submitted with (the handler's asyncio queue, fed
with `loop.call_soon_threadsafe`), so requests that arrive together share decode steps.

The engine thread only steps: a request's preparation (chat template, tokenization, media decoding and encoding,
limit checks) runs first on a small pool of its own (`prepare`), and only `engine.add_request` reaches this thread.
What preparation touches is safe beside a running step: the tokenizer and the template are read-only, the adapter
registry is loaded before the server starts, the encoder cache takes its own lock, and stage times go to the
metrics' (locked) histograms.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from kvforge.runtime.engine.engine import Engine, EngineRequest, EngineStats, RequestOutput

T = TypeVar("T")
PREPARE_WORKERS = 2  # requests prepared at once; more wait (and count as in flight) on the asyncio side
log = logging.getLogger("kvforge.server")


@dataclass(frozen=True, slots=True)
class Accepted:
    """The engine took the request: its prompt is tokenized and fits; outputs follow."""

    prompt_tokens: int


class EngineFailure(Exception):
    """The engine failed while running a step, or stopped, before the request finished."""


Sink = Callable[[Accepted | RequestOutput | Exception], None]


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    request: EngineRequest  # prepared off this thread (see `EngineLoop.prepare`)
    sink: Sink


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Call:
    fn: Callable[[Engine], Any]
    future: Future


_STOP = object()


class EngineLoop:
    def __init__(self, engine: Engine, prepare_workers: int = PREPARE_WORKERS) -> None:
        self.engine = engine  # stepped only by the loop's thread once start() has run
        self._preparers = ThreadPoolExecutor(prepare_workers, thread_name_prefix="kvforge-prepare")
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvforge-engine", daemon=True)
        self.reuse_enabled = engine.info.reuse_enabled
        self.snapshot = self._take_snapshot()

    # --- called from other threads --------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def prepare(self, build: Callable[[Engine], EngineRequest]) -> Future[EngineRequest]:
        """Run `build(engine)` (template, tokenize, encode media, check limits) on the preparation pool, never on the
        engine thread; it may read the engine's immutable parts only (inputs, engine_dir), not its queues."""
        return self._preparers.submit(build, self.engine)

    def submit(self, request_id: str, request: EngineRequest, sink: Sink) -> None:
        if not self._thread.is_alive():  # prepared while the server stopped: nobody would ever answer it
            sink(EngineFailure("the server is shutting down"))
            return
        self._commands.put(_Add(request_id, request, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def call(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Run `fn(engine)` on the engine thread between steps (audits, tests); its result comes in the future."""
        future: Future[T] = Future()
        self._commands.put(_Call(fn, future))
        return future

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is still in flight (its sinks get an EngineFailure) and end the thread."""
        self._preparers.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)

    # --- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        reason = "the server is shutting down"
        try:
            while not self._stopping:
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished() and not self._stopping:
                    self._step()
                self.snapshot = self._take_snapshot()
        except Exception:  # a bug outside a step: nobody may wait forever for this thread
            log.exception("the engine thread failed")
            reason = "the engine thread failed"
        finally:
            self._fail_all(reason)
            self._refuse_queued(reason)
            self.snapshot = self._take_snapshot()

    def _refuse_queued(self, reason: str) -> None:
        """Commands that arrived with or after the stop: answered, so no handler waits for a thread that is gone."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.sink(EngineFailure(reason))
            elif isinstance(command, _Call):
                command.future.set_exception(EngineFailure(reason))

    def _drain(self, block: bool) -> None:
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return
            block = False
            if command is _STOP:
                self._stopping = True
            elif isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                if self._sinks.pop(command.request_id, None) is not None:
                    self.engine.abort(command.request_id)
            else:
                self._run_call(command)

    def _add(self, command: _Add) -> None:
        if self._stopping:
            command.sink(EngineFailure("the server is shutting down"))
            return
        try:
            self.engine.add_request(command.request, command.request_id)
        except Exception as exc:  # KvforgeError: the request's fault (400); anything else reaches the handler too
            command.sink(exc)
            return
        self._sinks[command.request_id] = command.sink
        command.sink(Accepted(len(command.request.prompt_ids)))

    def _run_call(self, command: _Call) -> None:
        try:
            command.future.set_result(command.fn(self.engine))
        except Exception as exc:
            command.future.set_exception(exc)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("engine step failed; aborting the requests in flight")
            self._fail_all("the engine failed while running this request")
            return
        for output in outputs:
            sink = self._sinks.pop(output.request_id) if output.finished else self._sinks.get(output.request_id)
            if sink is None:
                continue
            if output.error is not None:  # the step failed this request alone; the others' outputs follow
                log.error("request %s failed in the engine: %s", output.request_id, output.error)
                sink(EngineFailure(f"the engine failed while running this request: {output.error}"))
                continue
            output.samples = list(output.samples)  # the sequence keeps appending to its own list
            sink(output)

    def _fail_all(self, message: str) -> None:
        for request_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("aborting %s failed", request_id)
            sink(EngineFailure(message))
        self._sinks.clear()

    def _take_snapshot(self) -> EngineStats:
        """The engine's counters, with the cache's profile block that /metrics exports (reuse on only: it walks
        the cache's records, which Engine.stats() leaves out)."""
        stats = self.engine.stats()
        return replace(stats, cache=self.engine.cache_profile()) if self.reuse_enabled else stats

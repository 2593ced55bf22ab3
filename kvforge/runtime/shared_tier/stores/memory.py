"""An in-process SharedStore with fault switches: engine-level tier tests and examples need no server (one process
only, so it shares nothing across processes; `open_store` never returns it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvforge.runtime.shared_tier.store import StoreError, StoreUnavailable


class MemoryStore:
    """A dict behind the SharedStore calls. `down` makes every call fail, `delay_s` makes every call slow, and
    `calls` counts calls by name (tests assert what the tier asked)."""

    def __init__(self, url: str = "memory://test") -> None:
        self.url = url
        self.data: dict[bytes, bytes] = {}
        self.down = False
        self.full = False
        self.delay_s = 0.0
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def _enter(self, name: str) -> None:
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.down:
            raise StoreUnavailable(f"{self.url} is down", "shared_cache")

    def connect(self) -> None:
        self._enter("connect")

    def put(self, items: Sequence[tuple[bytes, bytes]], *, replace: bool = False) -> None:
        self._enter("put")
        if self.full:
            raise StoreError("OOM command not allowed when used memory > 'maxmemory'", "shared_cache")
        with self._lock:
            for key, value in items:
                if replace:
                    self.data[bytes(key)] = bytes(value)
                else:
                    self.data.setdefault(bytes(key), bytes(value))

    def get(self, keys: Sequence[bytes], *, max_bytes: int | None = None) -> list[bytes | None]:
        self._enter("get")
        end = None if max_bytes is None else max_bytes + 1
        with self._lock:
            values = [self.data.get(bytes(key)) for key in keys]
        return [None if value is None else value[:end] for value in values]

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        self._enter("exists")
        with self._lock:
            return [bytes(key) in self.data for key in keys]

    def delete(self, keys: Sequence[bytes]) -> None:
        self._enter("delete")
        with self._lock:
            for key in keys:
                self.data.pop(bytes(key), None)

    def close(self) -> None:
        pass

"""Store servers for tier tests and benchmarks: a Redis on a free loopback port, a Mooncake master with a standalone
holder (only inside a private network namespace), and a TCP proxy that makes a store slow."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType

import pytest

START_TIMEOUT_S = 20.0
NETNS_HINT = ("run `make test-mooncake` (Mooncake clients listen on 0.0.0.0, so its tests run in a private "
              "network namespace: unshare -n)")
# Shared libraries (space-separated sonames) the Mooncake start check treats as missing, as if uninstalled: how
# tests/shared_tier/test_mooncake_skip.py checks the skip without removing a system package other runs need.
HIDE_LIBRARIES_ENV = "KVFORGE_TEST_HIDE_LIBRARIES"
_NOT_FOUND = re.compile(r"^\s*(\S+) => not found", re.MULTILINE)
_LOADER_ERROR = re.compile(r"error while loading shared libraries: ([^:\s]+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_port(port: int, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {START_TIMEOUT_S:g} s")


class _Managed:
    def __enter__(self):  # noqa: ANN204 - each subclass returns itself
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        raise NotImplementedError


def _end(process: subprocess.Popen | None, sig: int = signal.SIGTERM) -> None:
    if process is not None and process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


class RedisServer(_Managed):
    """`redis-server` on 127.0.0.1 at a free port, no persistence; `kill()` is kill -9 and `start()` brings it back
    on the same port (empty). Skips the test, saying why, when redis-server is not installed."""

    def __init__(self, work: Path, *, maxmemory: str | None = None, policy: str = "allkeys-lru") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run installs it)")
        self.binary, self.work, self.port = binary, work, free_port()
        self.extra = ["--maxmemory", maxmemory, "--maxmemory-policy", policy] if maxmemory else []
        work.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen([self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                         "--appendonly", "no", "--dir", str(self.work), *self.extra],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, self.process, "redis-server")

    def kill(self) -> None:
        _end(self.process, signal.SIGKILL)

    def stop(self) -> None:
        _end(self.process)


def in_private_netns() -> bool:
    """Inside `unshare -n` with only the loopback interface (what the Makefile's mooncake target sets up)."""
    # if_nameindex asks the kernel about this process's namespace (/sys/class/net would show the host's).
    interfaces = {name for _, name in socket.if_nameindex()}
    return os.environ.get("KVFORGE_NETNS") == "1" and interfaces == {"lo"}


def mooncake_binaries() -> Path:
    try:
        import mooncake
    except ImportError as exc:
        pytest.skip(f"Mooncake is not installed ({exc}); pip install 'kvforge[mooncake]' and apt-get install "
                    "libibverbs1")
    return Path(mooncake.__file__).parent


def missing_libraries(binary: Path) -> tuple[str, ...]:
    """Shared libraries `binary` links that the loader cannot find here (Mooncake's need libibverbs.so.1 even over
    TCP: without it mooncake_master exits 127 before it does anything), plus those HIDE_LIBRARIES_ENV hides."""
    hidden = set(os.environ.get(HIDE_LIBRARIES_ENV, "").split())
    return _missing_libraries(str(binary), frozenset(hidden))


@functools.cache
def _missing_libraries(binary: str, hidden: frozenset[str]) -> tuple[str, ...]:
    ldd = shutil.which("ldd")
    if ldd is not None:
        listing = subprocess.run([ldd, binary], capture_output=True, text=True, timeout=30).stdout
        linked = set(re.findall(r"^\s*(\S+\.so[.\d]*)", listing, re.MULTILINE))
        return tuple(sorted(set(_NOT_FOUND.findall(listing)) | (linked & hidden)))
    # No ldd: start the binary once; the dynamic loader names the first library it misses and exits 127.
    run = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    found = _LOADER_ERROR.search(run.stderr) if run.returncode == 127 else None
    return (found.group(1),) if found else ()


def mooncake_start_problem(bin_dir: Path) -> str | None:
    """Why Mooncake's master and holder cannot start here (a missing shared library, with the package that brings
    it), or None."""
    for name in ("mooncake_master", "mooncake_client"):
        missing = missing_libraries(bin_dir / name)
        if missing:
            package = " (apt-get install libibverbs1, or `make install` as root)" if any(
                lib.startswith("libibverbs") for lib in missing) else ""
            return f"{name} cannot start: {', '.join(missing)} is missing{package}"
    return None


class MooncakeServer(_Managed):
    """A Mooncake master and one standalone holder (`mooncake_client`, which owns the memory, so values outlive the
    processes that wrote them), P2P handshake metadata, TCP. Only in a private network namespace. Skips the test,
    saying why, when Mooncake is not installed or its binaries cannot start (a missing libibverbs1)."""

    def __init__(self, work: Path, *, segment: str = "512 MB") -> None:
        bin_dir = mooncake_binaries()
        problem = mooncake_start_problem(bin_dir)
        if problem:
            pytest.skip(problem)
        if not in_private_netns():
            pytest.skip(NETNS_HINT)
        self.bin = bin_dir
        self.work, self.segment = work, segment
        work.mkdir(parents=True, exist_ok=True)
        self.master_port, self.holder_port, self.metrics_port = free_port(), free_port(), free_port()
        self.master: subprocess.Popen | None = None
        self.holder: subprocess.Popen | None = None
        self.start_master()
        self.start_holder()

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.master_port}"

    def start_master(self) -> None:
        self.master = subprocess.Popen(
            [str(self.bin / "mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={self.master_port}",
             "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}"],
            stdout=(self.work / "master.log").open("ab"), stderr=subprocess.STDOUT)
        _wait_port(self.master_port, self.master, "mooncake_master")

    def start_holder(self) -> None:
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        self.holder = subprocess.Popen(
            [str(self.bin / "mooncake_client"), "--host=127.0.0.1", f"--port={self.holder_port}",
             f"--global_segment_size={self.segment}", f"--master_server_address=127.0.0.1:{self.master_port}",
             "--metadata_server=P2PHANDSHAKE", "--protocol=tcp"],
            stdout=(self.work / "holder.log").open("ab"), stderr=subprocess.STDOUT, env=env)
        _wait_port(self.holder_port, self.holder, "mooncake_client")
        time.sleep(0.5)  # it mounts its segment at the master right after it listens

    def kill_master(self) -> None:
        _end(self.master, signal.SIGKILL)

    def kill_holder(self) -> None:
        _end(self.holder, signal.SIGKILL)

    def stop(self) -> None:
        _end(self.holder)
        _end(self.master)


class SlowProxy(_Managed):
    """127.0.0.1:PORT forwarding to `target_port`, holding every chunk `delay_s` first (a store that answers late)."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port, self.delay_s = target_port, delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(1 << 16):
                time.sleep(self.delay_s)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self.stopped.set()
        self.listener.close()

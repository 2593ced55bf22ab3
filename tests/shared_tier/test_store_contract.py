"""One contract every shared-tier backend passes (Redis/Valkey, Mooncake Store), then each one's faults: a store
that dies, comes back, fills up or answers late fails a call within its timeout and then works again by itself."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.stores import MooncakeServer, RedisServer, SlowProxy

from kvforge.contract.errors import InvalidConfig
from kvforge.runtime.shared_tier.store import SharedStore, StoreError, StoreUnavailable, redact
from kvforge.runtime.shared_tier.stores import open_store

TIMEOUT_S = 0.2
SLACK_S = 0.5  # process scheduling on a loaded 2-core machine
BACKENDS = [pytest.param("redis", marks=pytest.mark.redis), pytest.param("mooncake", marks=pytest.mark.mooncake)]


@pytest.fixture(params=BACKENDS)
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, SharedStore]]:
    server = RedisServer(tmp_path / "redis") if request.param == "redis" else MooncakeServer(tmp_path / "mc")
    with server:
        store = open_store(server.url, TIMEOUT_S)
        try:
            yield server.url, store
        finally:
            store.close()


def test_round_trip_of_binary_values_in_order(served: tuple[str, SharedStore]) -> None:
    _, store = served
    items = [(bytes([0, 255, i]) * 5 + b"\x00", bytes([i]) * size)
             for i, size in enumerate([1, 100, 3 << 20, 7])]
    store.put(items)
    assert store.get([key for key, _ in items]) == [value for _, value in items]
    assert store.get([items[2][0], b"missing", items[0][0]]) == [items[2][1], None, items[0][1]]
    assert store.exists([b"missing", items[1][0]]) == [False, True]
    assert store.get([]) == [] and store.exists([]) == []


def test_first_writer_wins(served: tuple[str, SharedStore]) -> None:
    _, store = served
    store.put([(b"k" * 16, b"first")])
    store.put([(b"k" * 16, b"second")])
    assert store.get([b"k" * 16]) == [b"first"]


def test_delete_removes_and_ignores_absent_keys(served: tuple[str, SharedStore]) -> None:
    _, store = served
    store.put([(b"a", b"1"), (b"b", b"2")])
    store.get([b"a"])  # Mooncake leases an object on read: delete must still remove it
    store.delete([b"a", b"never-written"])
    assert store.exists([b"a", b"b"]) == [False, True]


def test_another_process_sees_the_values(served: tuple[str, SharedStore]) -> None:
    url, store = served
    code = ("import sys; from kvforge.runtime.shared_tier.stores import open_store; "
            f"s = open_store({url!r}, 5.0); s.put([(b'from-child', b'x' * 100000)]); "
            "v = s.get([b'from-parent'])[0]; s.close(); sys.exit(0 if v == b'y' * 7 else 3)")
    store.put([(b"from-parent", b"y" * 7)])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert store.get([b"from-child"]) == [b"x" * 100000]  # it outlived its writer


def test_open_store_checks_before_it_connects() -> None:
    for url in ("memcached://127.0.0.1:1", "http://127.0.0.1:6379", "127.0.0.1:6379"):
        with pytest.raises(InvalidConfig) as info:
            open_store(url)
        assert info.value.field == "shared_cache"
    with pytest.raises(InvalidConfig) as info:
        open_store("redis://127.0.0.1:6379/0", 0)
    assert info.value.field == "shared_cache_timeout_ms"
    open_store("redis://127.0.0.1:1/0")  # nothing listens there: not an error until a call
    assert redact("redis://user:hunter2@db:6379/0") == "redis://user:***@db:6379/0"
    assert "hunter2" not in open_store("redis://:hunter2@127.0.0.1:1/0").url


def _fails_fast(call, bound_s: float) -> BaseException:  # noqa: ANN001 - any store method
    started = time.perf_counter()
    with pytest.raises(StoreError) as info:
        call()
    assert time.perf_counter() - started < bound_s
    return info.value


@pytest.mark.redis
def test_redis_killed_then_restarted(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as redis:
        store = open_store(redis.url, TIMEOUT_S)
        store.put([(b"k", b"v")])
        redis.kill()
        error = _fails_fast(lambda: store.get([b"k"]), 2 * TIMEOUT_S + SLACK_S)
        assert isinstance(error, StoreUnavailable) and "127.0.0.1" in str(error)
        _fails_fast(lambda: store.put([(b"k", b"v")]), 2 * TIMEOUT_S + SLACK_S)
        redis.start()
        assert store.get([b"k"]) == [None]  # it reconnected by itself; the data went with the process
        store.put([(b"k", b"again")])
        assert store.get([b"k"]) == [b"again"]


@pytest.mark.redis
def test_redis_full_with_lru_eviction_keeps_accepting(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis", maxmemory="4mb", policy="allkeys-lru") as redis:
        store = open_store(redis.url, 2.0)
        for i in range(40):
            store.put([(f"key{i}".encode(), bytes(200_000))])
        present = store.exists([f"key{i}".encode() for i in range(40)])
        assert present[-1] and not all(present)  # the newest kept, older ones evicted


@pytest.mark.redis
def test_redis_full_without_eviction_refuses_writes_quickly(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis", maxmemory="2mb", policy="noeviction") as redis:
        store = open_store(redis.url, 2.0)
        with pytest.raises(StoreError) as info:
            for i in range(40):
                store.put([(f"key{i}".encode(), bytes(200_000))])
        assert not isinstance(info.value, StoreUnavailable) and "maxmemory" in str(info.value)
        assert store.exists([b"key0"]) == [True]  # reads still work


@pytest.mark.redis
def test_a_slow_redis_times_out(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as redis, SlowProxy(redis.port, delay_s=1.0) as proxy:
        store = open_store(f"redis://127.0.0.1:{proxy.port}/0", TIMEOUT_S)
        error = _fails_fast(lambda: store.get([b"k"]), 2 * TIMEOUT_S + SLACK_S)
        assert isinstance(error, StoreUnavailable)


@pytest.mark.mooncake
def test_mooncake_master_and_holder_faults(tmp_path: Path) -> None:
    """Mooncake's calls block while its master is away (kv-stores.md measured 4-6.5 s), so the bound here is
    generous; the tier's own deadline is what keeps requests from waiting on them."""
    with MooncakeServer(tmp_path / "mc") as mooncake:
        store = open_store(mooncake.url, TIMEOUT_S)
        store.put([(b"k", b"v")])
        mooncake.kill_holder()
        started = time.perf_counter()
        values = None
        with contextlib.suppress(StoreError):
            values = store.get([b"k"])
        assert values in (None, [None]) and time.perf_counter() - started < 30
        mooncake.start_holder()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the master drops the dead holder's segment after its client TTL
            try:
                store.put([(b"after", b"ok")])
                if store.get([b"after"]) == [b"ok"]:
                    break
            except StoreError:
                pass
            time.sleep(0.5)
        assert store.get([b"after"]) == [b"ok"]
        store.close()

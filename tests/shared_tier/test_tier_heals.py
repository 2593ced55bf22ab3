"""The tier heals and bounds what it reads: a value a read rejected is replaced by the next computed one (issue 42
point 7), and a read accepts at most a value's expected size, so an oversized value is a miss that never arrives
whole (point 11). On the store contract (memory and Redis) and through the engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from support.engine_driver import make_engine, run_file, top1_ids
from support.stores import MooncakeServer, RedisServer

from kvforge.runtime.engine import engine as engine_module
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.shared_tier.layout import CHECKPOINT_PREFIX, PAGE_PREFIX
from kvforge.runtime.shared_tier.store import SharedStore
from kvforge.runtime.shared_tier.stores import open_store
from kvforge.runtime.shared_tier.stores.memory import MemoryStore
from kvforge.runtime.shared_tier.values import ValueKind, decode

URL = "redis://in-process"  # a real scheme (checked before loading); open_store is patched to the memory store
DOC = "Foxes and dogs share one long document that both engines read. "
HYBRID = {"context_cache_recurrent_snapshot_pool_bytes": 1 << 22,
          "context_cache_partial_kv_snapshot_pool_bytes": 1 << 22, "snapshot_interval_tokens": 16}
CONFIGS = {"tiny-llama": {}, "tiny-qwen3_5": HYBRID}


class BoundedStore(MemoryStore):
    """A memory store that records the largest value a get handed back and whether every get was bounded."""

    def __init__(self) -> None:
        super().__init__()
        self.unbounded_gets = 0
        self.largest_read = 0

    def get(self, keys: Sequence[bytes], *, max_bytes: int | None = None) -> list[bytes | None]:
        values = super().get(keys, max_bytes=max_bytes)
        self.unbounded_gets += max_bytes is None
        self.largest_read = max([self.largest_read, *(len(v) for v in values if v is not None)])
        return values


@pytest.fixture(params=[pytest.param("memory"), pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("mooncake", marks=pytest.mark.mooncake)])
def contract_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SharedStore]:
    if request.param == "memory":
        yield MemoryStore()
        return
    with RedisServer(tmp_path / "redis") if request.param == "redis" else MooncakeServer(tmp_path / "mc") as server:
        store = open_store(server.url, 2.0)
        store.connect()
        try:
            yield store
        finally:
            store.close()


def test_replace_overwrites_and_plain_put_keeps_the_first(contract_store: SharedStore) -> None:
    contract_store.put([(b"k", b"first")])
    contract_store.put([(b"k", b"second")])
    assert contract_store.get([b"k"]) == [b"first"]
    contract_store.put([(b"k", b"healed")], replace=True)
    assert contract_store.get([b"k"]) == [b"healed"]


def test_a_bounded_get_never_hands_back_more_than_one_byte_past_the_bound(contract_store: SharedStore) -> None:
    big = bytes(range(256)) * 4096  # 1 MiB
    contract_store.put([(b"big", big), (b"small", b"abc")])
    big_read, small_read, absent = contract_store.get([b"big", b"small", b"absent"], max_bytes=100)
    assert big_read == big[:101] and small_read == b"abc" and absent is None
    assert contract_store.get([b"big"]) == [big]  # unbounded: whole


@pytest.fixture(scope="module")
def engines(tier_engine: Callable[..., Path]) -> dict[str, Path]:
    return {family: tier_engine(family) for family in CONFIGS}


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> BoundedStore:
    shared = BoundedStore()
    monkeypatch.setattr(engine_module, "open_store", lambda url, timeout_s: shared)
    return shared


def _data() -> dict[str, Any]:
    return {"temperature": 0, "max_generate_length": 6, "num_logprobs": 1,
            "requests": [{"messages": [{"role": "system", "content": DOC * 2},
                                       {"role": "user", "content": "What jumps?"}]}]}


def _tier_engine(path: Path, family: str) -> Engine:
    return make_engine(path, reuse=True, shared_cache=URL, **CONFIGS[family])


def _run(engine: Engine) -> tuple[tuple[str, list[int]], Any]:
    [response] = run_file(engine, _data())
    engine.close()  # flushes the writes
    return (response["output_text"], top1_ids(response)), engine.profile().get("context_cache", {}).get("shared_tier")


def _valid(store: MemoryStore, key: bytes, root: bytes, kind: ValueKind) -> bool:
    try:
        decode(store.data[key], root=root, key=key[1:], kind=kind)
    except Exception:
        return False
    return True


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("damage", ["flip", "truncate", "oversize"])
def test_a_rejected_value_is_replaced_by_the_next_computed_one(family: str, damage: str, engines: dict[str, Path],
                                                                store: BoundedStore) -> None:
    path = engines[family]
    cold, _ = _run(make_engine(path))
    first = _tier_engine(path, family)
    root = first.tier.root
    assert _run(first)[0] == cold
    prefix, kind = (PAGE_PREFIX, ValueKind.PAGE) if family == "tiny-llama" else (CHECKPOINT_PREFIX,
                                                                                  ValueKind.CHECKPOINT)
    damaged = sorted(key for key in store.data if key.startswith(prefix))
    assert damaged
    for key in damaged:
        value = store.data[key]
        store.data[key] = {"flip": value[:-40] + bytes([value[-40] ^ 1]) + value[-39:],
                           "truncate": value[:len(value) // 2],
                           "oversize": value + bytes(4 << 20)}[damage]
    answer, tier = _run(_tier_engine(path, family))
    assert answer == cold and tier["corrupt"] >= 1 and tier["loaded_tokens"] == 0
    # What the engine computed after the miss is now in the store, in place of each value it rejected (values it
    # never read, such as a checkpoint at the end of the generation, stay as they were until one is read).
    assert sum(_valid(store, key, root, kind) for key in damaged) >= tier["corrupt"]
    answer, tier = _run(_tier_engine(path, family))
    assert answer == cold and tier["hits"] == 1 and tier["loaded_tokens"] > 0 and tier["corrupt"] == 0
    # Every read was bounded: the 4 MiB values never came back whole.
    assert store.unbounded_gets == 0 and store.largest_read < 1 << 20

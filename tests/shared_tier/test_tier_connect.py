"""A store that cannot be reached: the tier says so in one line, once, and requests stay cold with rc 0 (issue 42
point 10); a dead Mooncake master costs start-up at most the engine's short wait, not the client's ~90 s set-up
(point 3), and Mooncake's own log lines stay off stderr (point 15)."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.engine_driver import make_engine, run_file, top1_ids
from support.stores import MooncakeServer, RedisServer, free_port

from kvforge.runtime.engine import engine as engine_module
from kvforge.runtime.shared_tier.store import StoreUnavailable
from kvforge.runtime.shared_tier.stores import open_store
from kvforge.runtime.shared_tier.stores.mooncake import MooncakeStore
from kvforge.runtime.shared_tier.tier import SharedTier

DATA = {"temperature": 0, "max_generate_length": 4, "num_logprobs": 1,
        "requests": [{"messages": [{"role": "user", "content": "Foxes and dogs share one document. " * 3}]}]}


@pytest.fixture(scope="module")
def engine_dir(tier_engine: Callable[..., Path]) -> Path:
    return tier_engine("tiny-llama")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


def _bare_tier(url: str) -> SharedTier:
    return SharedTier(open_store(url, 0.2), root=b"r" * 16, tokens_per_page=16, kv=None, states=None, state_rows={},
                      partial=None, recurrent=None, timeout_s=0.2)


@pytest.mark.redis
@pytest.mark.parametrize("how", ["closed port", "database out of range", "unknown host", "rediss to plain redis"])
def test_a_tier_that_never_connects_says_so_in_one_line_once(how: str, redis_url: str,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    port = redis_url.split(":")[2].split("/")[0]
    url = {"closed port": f"redis://127.0.0.1:{free_port()}/0", "database out of range": f"redis://127.0.0.1:{port}/99",
           "unknown host": "redis://no-such-host.invalid:6379/0",
           "rediss to plain redis": f"rediss://127.0.0.1:{port}/0"}[how]
    with caplog.at_level(logging.WARNING, logger="kvforge.shared_tier"):
        tier = _bare_tier(url)
        assert not tier.wait_connected(5.0)
        time.sleep(1.5)  # the first back-off (1 s) passes: the connect thread has tried again, and says nothing more
        tier.close(flush_timeout_s=0.1)
    lines = [record.getMessage() for record in caplog.records if record.name == "kvforge.shared_tier"]
    assert tier.profile()["errors"] >= 2
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "shared tier" in lines[0] and "is off" in lines[0] and url.split("/")[2].split(":")[0] in lines[0]


def test_llm_inference_with_an_unreachable_tier_answers_cold_and_prints_one_line(engine_dir: Path,
                                                                                 tmp_path: Path) -> None:
    request, output = tmp_path / "in.json", tmp_path / "out.json"
    request.write_text(json.dumps(DATA))
    url = f"redis://127.0.0.1:{free_port()}/0"
    proc = subprocess.run([str(Path(sys.executable).parent / "llm_inference"), "--engineDir", str(engine_dir),
                           "--inputFile", str(request), "--outputFile", str(output), "--numThreads", "2",
                           "--enableContextReuse", "--sharedCache", url], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "shared tier" in lines[0] and url in lines[0], proc.stderr
    [response] = json.loads(output.read_text())["responses"]
    [cold] = run_file(make_engine(engine_dir), DATA)
    assert top1_ids(response) == top1_ids(cold)


class SlowSetupClient:
    """Stands in for MooncakeDistributedStore: its set-up blocks as the real one does while the master is away."""

    setups = 0

    def setup(self, *args: object) -> int:
        type(self).setups += 1
        time.sleep(30)
        return -1

    def close(self) -> None:
        pass


@pytest.mark.serial  # a wall-clock bound: run alone, not beside another worker
def test_a_dead_mooncake_master_fails_fast_without_the_client_set_up() -> None:
    SlowSetupClient.setups = 0
    store = MooncakeStore(f"mooncake://127.0.0.1:{free_port()}", 0.05, client_class=SlowSetupClient)
    started = time.perf_counter()
    with pytest.raises(StoreUnavailable, match="master does not answer"):
        store.connect()
    assert time.perf_counter() - started < 2.0 and SlowSetupClient.setups == 0


def test_a_listening_mooncake_master_gets_the_client_set_up() -> None:
    class QuickClient(SlowSetupClient):
        def setup(self, *args: object) -> int:
            type(self).setups += 1
            return 0

    with socket.create_server(("127.0.0.1", 0)) as master:  # listening: the kernel completes the handshake
        store = MooncakeStore(f"mooncake://127.0.0.1:{master.getsockname()[1]}", 0.05, client_class=QuickClient)
        store.connect()
    assert QuickClient.setups == 1


@pytest.mark.serial  # a wall-clock bound: run alone, not beside another worker
def test_an_engine_with_a_dead_mooncake_master_starts_within_two_seconds(engine_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"mooncake://127.0.0.1:{free_port()}"
    monkeypatch.setattr(engine_module, "open_store",
                        lambda url, timeout_s: MooncakeStore(url, timeout_s, client_class=SlowSetupClient))
    started = time.perf_counter()
    engine = make_engine(engine_dir, reuse=True, shared_cache=url)
    assert time.perf_counter() - started < 2.0 + 1.0  # the engine's own wait for the tier is 2 s at most
    [response] = run_file(engine, DATA)
    [cold] = run_file(make_engine(engine_dir), DATA)
    assert top1_ids(response) == top1_ids(cold)
    engine.close()
    assert engine.profile()["context_cache"]["shared_tier"]["hits"] == 0


@pytest.mark.mooncake
def test_mooncake_prints_nothing_on_success_and_one_line_when_dead(engine_dir: Path, tmp_path: Path) -> None:
    request = tmp_path / "in.json"
    request.write_text(json.dumps(DATA))

    def inference(url: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(Path(sys.executable).parent / "llm_inference"), "--engineDir", str(engine_dir),
                               "--inputFile", str(request), "--outputFile", str(tmp_path / f"{time.time_ns()}.json"),
                               "--numThreads", "2", "--enableContextReuse", "--sharedCache", url],
                              capture_output=True, text=True, timeout=120, check=False)

    with MooncakeServer(tmp_path / "mc") as server:
        alive = inference(server.url)
        server.kill_master()
        started = time.perf_counter()
        dead = inference(server.url)
        dead_s = time.perf_counter() - started
    assert alive.returncode == 0 and alive.stderr == "", alive.stderr
    assert dead.returncode == 0 and len(dead.stderr.strip().splitlines()) == 1, dead.stderr
    assert dead_s < 30  # not the client's ~90 s of set-up retries

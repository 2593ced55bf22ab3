"""Two separate processes on one real store: the second answers from what the first computed, exactly as cold, on
an attention-only and on a hybrid engine; isolation and every store fault checked across the process boundary."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.stores import MooncakeServer, RedisServer, SlowProxy

HYBRID = ["--contextCacheRecurrentSnapshotPoolBytes", str(1 << 22), "--contextCachePartialKVSnapshotPoolBytes",
          str(1 << 22), "--snapshotIntervalTokens", "16"]
DOC = "Foxes and dogs share one long document that both processes read. " * 2
PROCESS_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def engines(tier_engine: Callable[..., Path]) -> dict[str, Path]:
    return {family: tier_engine(family) for family in ("tiny-llama", "tiny-qwen3_5")}


def _request_file(path: Path, salt: str | None = None, question: str = "What jumps?") -> Path:
    request: dict[str, Any] = {"messages": [{"role": "system", "content": DOC}, {"role": "user", "content": question}]}
    if salt is not None:
        request["cache_salt"] = salt
    path.write_text(json.dumps({"temperature": 0, "max_generate_length": 6, "num_logprobs": 1,
                                "requests": [request]}))
    return path


def _inference(engine_dir: Path, request_file: Path, work: Path, *flags: str) -> tuple[dict, dict, float]:
    """One llm_inference process: (its response, its profile, wall seconds)."""
    output, profile = work / f"out-{time.time_ns()}.json", work / f"profile-{time.time_ns()}.json"
    started = time.perf_counter()
    proc = subprocess.run([str(Path(sys.executable).parent / "llm_inference"), "--engineDir", str(engine_dir),
                           "--inputFile", str(request_file), "--outputFile", str(output), "--numThreads", "2",
                           "--profileOutputFile", str(profile), *flags], capture_output=True, text=True,
                          timeout=PROCESS_TIMEOUT_S, check=False)
    wall = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr
    [response] = json.loads(output.read_text())["responses"]
    return response, json.loads(profile.read_text()), wall


def _answer(response: dict) -> tuple[str, list[int]]:
    return response["output_text"], [step[0]["token_id"] for step in response["logprobs"]]


def _tier_flags(url: str, family: str, *more: str) -> list[str]:
    return ["--enableContextReuse", "--sharedCache", url, *(HYBRID if family == "tiny-qwen3_5" else []), *more]


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3_5"])
def test_a_second_process_answers_from_redis_as_cold(family: str, engines: dict[str, Path], tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as redis:
        requests = _request_file(tmp_path / "in.json")
        first, first_profile, _ = _inference(engines[family], requests, tmp_path, *_tier_flags(redis.url, family))
        assert first_profile["context_cache"]["shared_tier"]["writes"] > 0
        second, profile, _ = _inference(engines[family], requests, tmp_path, *_tier_flags(redis.url, family))
        cold, _, _ = _inference(engines[family], requests, tmp_path)
        tier = profile["context_cache"]["shared_tier"]
        assert tier["hits"] == 1 and tier["loaded_tokens"] > 0 and tier["errors"] == tier["corrupt"] == 0
        assert profile["prefill"]["reused_tokens"] == tier["loaded_tokens"]
        assert _answer(second) == _answer(cold) == _answer(first)


def test_isolation_across_processes(engines: dict[str, Path], tmp_path: Path) -> None:
    engine = engines["tiny-llama"]
    with RedisServer(tmp_path / "redis") as redis:
        flags = _tier_flags(redis.url, "tiny-llama")
        _inference(engine, _request_file(tmp_path / "a.json", salt="tenant-a"), tmp_path, *flags)
        other, profile, _ = _inference(engine, _request_file(tmp_path / "b.json", salt="tenant-b"), tmp_path, *flags)
        assert profile["context_cache"]["shared_tier"]["hits"] == 0
        assert _answer(other) == _answer(_inference(engine, tmp_path / "b.json", tmp_path)[0])


def test_a_killed_then_restarted_store_only_costs_hits(engines: dict[str, Path], tmp_path: Path) -> None:
    engine, requests = engines["tiny-llama"], _request_file(tmp_path / "in.json")
    cold = _answer(_inference(engine, requests, tmp_path)[0])
    with RedisServer(tmp_path / "redis") as redis:
        flags = _tier_flags(redis.url, "tiny-llama", "--sharedCacheTimeoutMs", "200")
        _inference(engine, requests, tmp_path, *flags)
        redis.kill()  # kill -9: the data is gone with it (no persistence configured)
        dead, profile, wall = _inference(engine, requests, tmp_path, *flags)
        assert _answer(dead) == cold and profile["context_cache"]["shared_tier"]["errors"] >= 1
        redis.start()  # the same port, empty
        empty, profile, _ = _inference(engine, requests, tmp_path, *flags)
        assert _answer(empty) == cold and profile["context_cache"]["shared_tier"]["hits"] == 0
        again, profile, _ = _inference(engine, requests, tmp_path, *flags)  # the one before wrote it back
        assert _answer(again) == cold and profile["context_cache"]["shared_tier"]["hits"] == 1


def _many(path: Path, count: int, reverse: bool = False) -> Path:
    order = range(count - 1, -1, -1) if reverse else range(count)
    requests = [{"messages": [{"role": "system", "content": f"Document {i}. " + DOC},
                              {"role": "user", "content": f"Question {i}?"}]} for i in order]
    path.write_text(json.dumps({"temperature": 0, "max_generate_length": 6, "num_logprobs": 1,
                                "requests": requests}))
    return path


def _answers(output: Path) -> list[tuple[str, list[int]]]:
    return [_answer(r) for r in json.loads(output.read_text())["responses"]]


def _inference_all(engine_dir: Path, request_file: Path, work: Path, *flags: str) -> tuple[list, dict]:
    output, profile = work / f"out-{time.time_ns()}.json", work / f"profile-{time.time_ns()}.json"
    proc = subprocess.run([str(Path(sys.executable).parent / "llm_inference"), "--engineDir", str(engine_dir),
                           "--inputFile", str(request_file), "--outputFile", str(output), "--numThreads", "2",
                           "--profileOutputFile", str(profile), *flags], capture_output=True, text=True,
                          timeout=PROCESS_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr
    return _answers(output), json.loads(profile.read_text())


def test_a_full_store_with_lru_eviction_stays_correct(engines: dict[str, Path], tmp_path: Path) -> None:
    engine, requests = engines["tiny-llama"], _many(tmp_path / "many.json", 24)  # ~1 MB of pages
    cold, _ = _inference_all(engine, requests, tmp_path)
    # An empty Redis 7 uses ~1.05 MB itself: room for about a third of the pages.
    with RedisServer(tmp_path / "redis", maxmemory="1400kb", policy="allkeys-lru") as redis:
        flags = _tier_flags(redis.url, "tiny-llama")
        first, profile = _inference_all(engine, requests, tmp_path, *flags)  # more than the store holds
        assert first == cold and profile["context_cache"]["shared_tier"]["errors"] == 0
        # Newest first: the documents that survived are asked before recomputing the others evicts them.
        second, profile = _inference_all(engine, _many(tmp_path / "reversed.json", 24, reverse=True), tmp_path,
                                         *flags)
        tier = profile["context_cache"]["shared_tier"]
        assert second == cold[::-1] and tier["errors"] == 0
        assert 0 < tier["hits"] < len(cold)  # what survived eviction loads; the rest computes


def test_a_store_killed_mid_run_never_fails_or_stalls_a_request(engines: dict[str, Path], tmp_path: Path) -> None:
    engine, requests = engines["tiny-llama"], _many(tmp_path / "many.json", 8)
    cold, _ = _inference_all(engine, requests, tmp_path)
    with RedisServer(tmp_path / "redis") as redis:
        flags = _tier_flags(redis.url, "tiny-llama", "--sharedCacheTimeoutMs", "100")
        _inference_all(engine, requests, tmp_path, *flags)
        killer = threading.Timer(2.0, redis.kill)  # once the engine has loaded and the run is under way
        killer.start()
        try:
            started = time.perf_counter()
            answers, profile = _inference_all(engine, requests, tmp_path, *flags)
            wall = time.perf_counter() - started
        finally:
            killer.cancel()
        assert answers == cold and wall < 60


def _rewrite_pages(url: str, change) -> int:  # noqa: ANN001 - bytes -> bytes
    import redis as redis_py

    client = redis_py.Redis.from_url(url)
    keys = [key for key in client.scan_iter(match=b"kvf:p*")]
    for key in keys:
        client.set(key, change(client.get(key)))
    client.close()
    return len(keys)


@pytest.mark.parametrize("damage", ["flipped-bit", "another-engine"])
def test_damaged_values_are_misses_across_processes(damage: str, engines: dict[str, Path], tmp_path: Path) -> None:
    from kvforge.runtime.shared_tier.values import ValueKind, decode, encode

    engine, requests = engines["tiny-llama"], _request_file(tmp_path / "in.json")
    cold = _answer(_inference(engine, requests, tmp_path)[0])

    def flip(value: bytes) -> bytes:
        return value[:100] + bytes([value[100] ^ 1]) + value[101:]

    def foreign(value: bytes) -> bytes:  # valid checksum, right key and tokens, another engine's root
        root, key = value[8:24], value[24:40]
        page = decode(value, root=root, key=key, kind=ValueKind.PAGE)
        return encode(ValueKind.PAGE, bytes(16), key, page.tokens, [a.copy() for a in page.arrays])

    with RedisServer(tmp_path / "redis") as redis:
        flags = _tier_flags(redis.url, "tiny-llama")
        _inference(engine, requests, tmp_path, *flags)
        assert _rewrite_pages(redis.url, flip if damage == "flipped-bit" else foreign) > 0
        answer, profile, _ = _inference(engine, requests, tmp_path, *flags)
        tier = profile["context_cache"]["shared_tier"]
        assert _answer(answer) == cold and tier["corrupt"] >= 1 and tier["loaded_tokens"] == 0


def test_a_slow_store_costs_at_most_its_timeout(engines: dict[str, Path], tmp_path: Path) -> None:
    engine, requests = engines["tiny-llama"], _request_file(tmp_path / "in.json")
    cold = _answer(_inference(engine, requests, tmp_path)[0])
    with RedisServer(tmp_path / "redis") as redis:
        _inference(engine, requests, tmp_path, *_tier_flags(redis.url, "tiny-llama"))
        with SlowProxy(redis.port, delay_s=2.0) as proxy:
            slow = f"redis://127.0.0.1:{proxy.port}/0"
            answer, profile, wall = _inference(engine, requests, tmp_path,
                                               *_tier_flags(slow, "tiny-llama", "--sharedCacheTimeoutMs", "100"))
        tier = profile["context_cache"]["shared_tier"]
        assert _answer(answer) == cold and tier["hits"] == 0 and tier["timeouts"] + tier["errors"] >= 1
        assert profile["context_cache"]["shared_tier"]["load_ms"] < 1000  # the request stopped waiting


@pytest.mark.mooncake
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen3_5"])
def test_a_second_process_answers_from_mooncake_as_cold(family: str, engines: dict[str, Path],
                                                         tmp_path: Path) -> None:
    with MooncakeServer(tmp_path / "mc") as mooncake:
        requests = _request_file(tmp_path / "in.json")
        first, _, _ = _inference(engines[family], requests, tmp_path, *_tier_flags(mooncake.url, family))
        second, profile, _ = _inference(engines[family], requests, tmp_path, *_tier_flags(mooncake.url, family))
        tier = profile["context_cache"]["shared_tier"]
        assert tier["hits"] == 1 and tier["loaded_tokens"] > 0 and tier["errors"] == tier["corrupt"] == 0
        assert _answer(second) == _answer(first) == _answer(_inference(engines[family], requests, tmp_path)[0])

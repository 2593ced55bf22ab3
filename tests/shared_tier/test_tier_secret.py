"""The tier secret (issue 42's trust model): with it every value carries a keyed MAC, so a value forged with a valid
checksum is a miss and answers stay cold-equal; with encryption the store holds no token ids in clear; the secret
itself shows up in no repr, profile or error."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.engine_driver import make_engine, run_file, top1_ids
from support.stores import free_port

from kvforge.contract.errors import InvalidConfig
from kvforge.runtime.engine import engine as engine_module
from kvforge.runtime.engine.config import EngineConfig
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.shared_tier.layout import PAGE_PREFIX, Layout
from kvforge.runtime.shared_tier.secret import SECRET_ENV, TierSecret, tier_secret
from kvforge.runtime.shared_tier.stores.memory import MemoryStore
from kvforge.runtime.shared_tier.values import ValueKind, ValueRejected, decode, encode

SECRET = "correct horse battery staple"
URL = "redis://in-process"
ROOT, KEY = b"r" * 16, b"k" * 16
TOKENS = np.arange(1000, 1016, dtype=np.int32)
DATA = {"temperature": 0, "max_generate_length": 6, "num_logprobs": 1,
        "requests": [{"messages": [{"role": "system", "content": "Foxes and dogs share one long document. " * 4},
                                   {"role": "user", "content": "What jumps?"}]}]}


# Encryption needs `cryptography` (the tier extra); without it those cases skip, saying so.
ENCRYPT = [False, pytest.param(True, marks=pytest.mark.skipif(importlib.util.find_spec("cryptography") is None,
                                                              reason="pip install 'kvforge[tier]' (cryptography)"))]


def _arrays() -> list[np.ndarray]:
    return [np.random.default_rng(0).standard_normal((2, 2, 16, 8)).astype(np.float16)]


@pytest.mark.parametrize("encrypt", ENCRYPT)
def test_a_value_round_trips_under_its_secret_only(encrypt: bool) -> None:
    codec = Layout(ROOT, TierSecret(SECRET, encrypt=encrypt)).page
    value = codec.encode(KEY, TOKENS, _arrays())
    decoded = codec.decode(value, KEY, like=_arrays(), tokens=TOKENS)
    assert np.array_equal(decoded.arrays[0], _arrays()[0])
    assert len(value) == codec.max_bytes(TOKENS.size, _arrays())
    for other in (Layout(ROOT, TierSecret("another secret", encrypt=encrypt)).page, Layout(ROOT, None).page):
        with pytest.raises(ValueRejected):
            other.decode(value, KEY, like=_arrays(), tokens=TOKENS)


def test_a_value_forged_with_a_valid_checksum_is_rejected() -> None:
    forged = encode(ValueKind.PAGE, ROOT, KEY, TOKENS, [np.zeros_like(_arrays()[0])])  # checksum, no MAC
    assert Layout(ROOT, None).page.decode(forged, KEY, like=_arrays(), tokens=TOKENS)  # accepted without a secret
    with pytest.raises(ValueRejected, match="MAC"):
        Layout(ROOT, TierSecret(SECRET, encrypt=False)).page.decode(forged, KEY, like=_arrays(), tokens=TOKENS)


def test_encryption_hides_the_tokens_and_binds_the_key() -> None:
    pytest.importorskip("cryptography", reason="pip install 'kvforge[tier]'")
    plain = Layout(ROOT, TierSecret(SECRET, encrypt=False)).page.encode(KEY, TOKENS, _arrays())
    codec = Layout(ROOT, TierSecret(SECRET, encrypt=True)).page
    sealed = codec.encode(KEY, TOKENS, _arrays())
    assert TOKENS.tobytes() in plain and TOKENS.tobytes() not in sealed and ROOT not in sealed
    with pytest.raises(ValueRejected):  # the same bytes moved under another key do not open
        codec.decode(sealed, b"x" * 16, like=_arrays(), tokens=TOKENS)


def test_the_secret_shows_in_no_repr_or_error(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SECRET not in repr(EngineConfig(shared_cache=URL, shared_cache_secret=SECRET))
    assert SECRET not in repr(TierSecret(SECRET, encrypt=False))
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert tier_secret(None, encrypt=False) is not None  # the environment variable is read
    monkeypatch.delenv(SECRET_ENV)
    assert tier_secret(None, encrypt=False) is None
    with pytest.raises(InvalidConfig) as info:
        tier_secret("   ", encrypt=False)
    assert info.value.field == "shared_cache_secret"
    with pytest.raises(InvalidConfig) as info:
        tier_secret(None, encrypt=True)
    assert info.value.field == "shared_cache_encrypt" and SECRET not in str(info.value)


@pytest.fixture(scope="module")
def engine_dir(tier_engine: Callable[..., Path]) -> Path:
    return tier_engine("tiny-llama")


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> MemoryStore:
    shared = MemoryStore()
    monkeypatch.setattr(engine_module, "open_store", lambda url, timeout_s: shared)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    return shared


def _run(engine: Engine) -> tuple[list[int], dict[str, Any]]:
    [response] = run_file(engine, DATA)
    engine.close()
    return top1_ids(response), engine.profile()


def _tier(profile: dict[str, Any]) -> dict[str, Any]:
    return profile["context_cache"]["shared_tier"]


@pytest.mark.parametrize("encrypt", ENCRYPT)
def test_processes_sharing_the_secret_share_the_tier_and_others_miss(encrypt: bool, engine_dir: Path,
                                                                     store: MemoryStore,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cold, _ = _run(make_engine(engine_dir))
    options = {"shared_cache": URL, "shared_cache_encrypt": encrypt}
    ids, profile = _run(make_engine(engine_dir, reuse=True, shared_cache_secret=SECRET, **options))
    assert ids == cold and _tier(profile)["writes"] > 0 and SECRET not in json.dumps(profile)
    if encrypt:
        assert not any(b"KVFT" in value for value in store.data.values())  # no header, tokens or K/V in clear
    monkeypatch.setenv(SECRET_ENV, SECRET)  # the same secret, from the environment
    ids, profile = _run(make_engine(engine_dir, reuse=True, **options))
    assert ids == cold and _tier(profile)["hits"] == 1 and _tier(profile)["corrupt"] == 0
    monkeypatch.delenv(SECRET_ENV)
    ids, profile = _run(make_engine(engine_dir, reuse=True, shared_cache=URL))  # no secret: every value refused
    assert ids == cold and _tier(profile)["hits"] == 0 and _tier(profile)["corrupt"] >= 1


def test_a_forged_page_changes_no_answer_with_a_secret(engine_dir: Path, store: MemoryStore) -> None:
    cold, _ = _run(make_engine(engine_dir))
    writer = make_engine(engine_dir, reuse=True, shared_cache=URL, shared_cache_secret=SECRET)
    mac_key = TierSecret(SECRET, encrypt=False).mac_key
    _run(writer)
    # Someone with write access but not the secret: every page keeps its key and tokens, its K/V is replaced, and
    # it carries a valid (unkeyed) checksum.
    for key in [key for key in store.data if key.startswith(PAGE_PREFIX)]:
        honest = decode(store.data[key], root=writer.tier.root, key=key[1:], kind=ValueKind.PAGE, mac_key=mac_key)
        store.data[key] = encode(ValueKind.PAGE, writer.tier.root, key[1:], honest.tokens,
                                 [np.full_like(array, 3) for array in honest.arrays])
    ids, profile = _run(make_engine(engine_dir, reuse=True, shared_cache=URL))
    assert _tier(profile)["hits"] == 1  # without a secret the forgery is loaded: this is the threat
    forged_answer = ids
    ids, profile = _run(make_engine(engine_dir, reuse=True, shared_cache=URL, shared_cache_secret=SECRET))
    assert ids == cold and _tier(profile)["loaded_tokens"] == 0 and _tier(profile)["corrupt"] >= 1
    assert forged_answer != cold


def _llm_inference(engine_dir: Path, work: Path, *flags: str) -> subprocess.CompletedProcess:
    (work / "in.json").write_text(json.dumps(DATA))
    return subprocess.run([str(Path(sys.executable).parent / "llm_inference"), "--engineDir", str(engine_dir),
                           "--inputFile", str(work / "in.json"), "--outputFile", str(work / "out.json"),
                           "--profileOutputFile", str(work / "profile.json"), "--numThreads", "2",
                           "--enableContextReuse", "--sharedCache", f"redis://127.0.0.1:{free_port()}/0", *flags],
                          capture_output=True, text=True, timeout=120, check=False)


def test_llm_inference_never_echoes_the_secret(engine_dir: Path, tmp_path: Path) -> None:
    proc = _llm_inference(engine_dir, tmp_path, "--sharedCacheSecret", SECRET)
    assert proc.returncode == 0, proc.stderr
    written = (tmp_path / "out.json").read_text() + (tmp_path / "profile.json").read_text()
    assert SECRET not in proc.stdout + proc.stderr + written
    for flags, named in ((["--sharedCacheSecret", " "], "--sharedCacheSecret"),
                         (["--sharedCacheEncrypt"], "--sharedCacheEncrypt")):
        proc = _llm_inference(engine_dir, tmp_path, *flags)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith(f"error: {named}:"), proc.stderr

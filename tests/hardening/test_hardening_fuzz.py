"""Fuzz: mutated request files and engine-dir configs end in exit 0 or 2 (one line), never 3, never a hang.

Runs in-process through the CLIs' own entry (run_app → run_guarded). The default suite runs
KVFORGE_FUZZ_EXAMPLES examples per target (default 40, a few seconds each); a release check runs more:

    KVFORGE_FUZZ_EXAMPLES=2000 .venv/bin/pytest -q tests/test_hardening_fuzz.py
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.hardening_support import copy_engine, edit_engine, invoke, request_file

from kvforge.runtime.cli import app as inference_app

EXAMPLES = int(os.environ.get("KVFORGE_FUZZ_EXAMPLES", "40"))
PER_RUN_LIMIT_S = 20.0  # bounded time: a hang (or an unbounded loop) fails the example
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("KVFORGE_FUZZ_RANDOM"),
                    suppress_health_check=list(HealthCheck), database=None)

VALID_REQUEST_FILE: dict[str, Any] = {
    "batch_size": 2, "temperature": 0.0, "top_p": 0.9, "top_k": 5, "max_generate_length": 3, "num_logprobs": 2,
    "apply_chat_template": True, "add_generation_prompt": True, "context_cache_lookup_policy": "use_cache",
    "context_cache_commit_policy": "including_generated_tokens", "available_lora_weights": {},
    "requests": [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
         "stop": ["\n"], "seed": 3, "logit_bias": {"7": 1.5}, "cache_salt": "t1"},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "max_generate_length": 2, "lora_name": ""},
    ],
}

ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64 + 1, 10**30, -(10**30)]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, -0.0, 1e308, -1e308, 1e-308]),
    st.text(max_size=12), st.sampled_from(["", "\x1b[31m", "<|im_start|>system", "$HOME", "\ud800", "null"]),
    st.lists(st.integers(-3, 300), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def paths_of(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every location in a JSON document (key or index paths), the root excluded."""
    found = []
    if isinstance(value, dict):
        for key, child in value.items():
            found += [(*prefix, key), *paths_of(child, (*prefix, key))]
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += [(*prefix, index), *paths_of(child, (*prefix, index))]
    return found


def mutate_document(data: st.DataObject, document: Any) -> str:
    """One to three structural mutations, then maybe a duplicate key; returns JSON text."""
    document = json.loads(json.dumps(document))
    for _ in range(data.draw(st.integers(1, 3))):
        paths = paths_of(document)
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        *parents, last = path
        container = document
        for step in parents:
            container = container[step]
        action = data.draw(st.sampled_from(["replace", "delete", "scale"]))
        if action == "delete":
            del container[last]
        elif action == "scale" and isinstance(container[last], (int, float)) and not isinstance(container[last], bool):
            container[last] = container[last] * data.draw(st.sampled_from([0, -1, 1000, 10**9, 0.5]))
        else:
            container[last] = data.draw(ODD_VALUES)
    text = json.dumps(document, ensure_ascii=data.draw(st.booleans()))
    if data.draw(st.integers(0, 4)) == 0 and text.startswith("{") and len(text) > 2:
        key = data.draw(st.sampled_from(["temperature", "requests", "format", "hidden_size", "batch_size"]))
        text = "{" + json.dumps(key) + ": 1, " + text[1:]  # a repeated key when the document already has it
    return text


def encode(data: st.DataObject, text: str) -> bytes:
    """The text as a file's bytes, sometimes in the wrong encoding, truncated, or with stray bytes."""
    kind = data.draw(st.sampled_from(["utf-8", "utf-8", "utf-8", "bom", "utf-16", "latin-1", "truncate", "junk"]))
    if kind == "bom":
        return b"\xef\xbb\xbf" + text.encode("utf-8", "surrogatepass")
    if kind == "utf-16":
        return text.encode("utf-16", "surrogatepass")
    if kind == "latin-1":
        return text.encode("latin-1", "replace")
    raw = text.encode("utf-8", "surrogatepass")
    if kind == "truncate":
        return raw[: data.draw(st.integers(0, max(0, len(raw) - 1)))]
    if kind == "junk":
        at = data.draw(st.integers(0, len(raw)))
        return raw[:at] + data.draw(st.sampled_from([b"\xff", b"\x00", b"\xc3", b"}", b"\\u"])) + raw[at:]
    return raw


def assert_contract(result, elapsed: float) -> None:
    event(f"exit {result.code}")  # see the mix with --hypothesis-show-statistics
    assert elapsed < PER_RUN_LIMIT_S, f"took {elapsed:.1f} s"
    # 3: the inputs passed every check and a request failed in the engine (a tampered config.json the graph
    # disagrees with); llm_inference then says so in one line (docs/commands/llm_inference.md "Exit codes").
    assert result.code in (0, 2, 3), f"exit {result.code}: {result.stderr}"
    if result.code == 2:
        result.one_line_error()
    elif result.code == 3:
        lines = result.stderr.strip("\n").splitlines()
        assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
        assert lines[0].startswith("error:") and "failed in the engine" in lines[0], lines[0]


@SETTINGS
@given(data=st.data())
def test_fuzz_request_files(tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                            data: st.DataObject) -> None:
    tmp = tmp_path_factory.mktemp("fuzz_request")
    input_file = tmp / "in.json"
    input_file.write_bytes(encode(data, mutate_document(data, VALID_REQUEST_FILE)))
    started = time.perf_counter()
    result = invoke(inference_app, "--engineDir", tiny_engine_dir, "--inputFile", input_file,
                    "--outputFile", tmp / "out.json", "--maxGenerateLength", "2")
    assert_contract(result, time.perf_counter() - started)
    assert (tmp / "out.json").exists() == (result.code == 0)


@pytest.fixture(scope="module")
def fuzz_engine(tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_engine(tiny_engine_dir, tmp_path_factory.mktemp("fuzz") / "engine")


@SETTINGS
@given(data=st.data())
def test_fuzz_engine_configs(tiny_engine_dir: Path, fuzz_engine: Path, tmp_path_factory: pytest.TempPathFactory,
                             data: st.DataObject) -> None:
    """config.json (model fields and builder_config) or tokenizer_config.json mutated, the manifest rewritten
    to match, so every check behind the manifest is reached."""
    name = data.draw(st.sampled_from(["config.json", "config.json", "tokenizer_config.json"]))
    original = json.loads((tiny_engine_dir / name).read_text(encoding="utf-8"))
    edit_engine(fuzz_engine, text={name: encode(data, mutate_document(data, original))})
    tmp = tmp_path_factory.mktemp("fuzz_config")
    started = time.perf_counter()
    result = invoke(inference_app, "--engineDir", fuzz_engine, "--inputFile", request_file(tmp / "in.json"),
                    "--outputFile", tmp / "out.json")
    assert_contract(result, time.perf_counter() - started)
    (fuzz_engine / name).write_bytes((tiny_engine_dir / name).read_bytes())

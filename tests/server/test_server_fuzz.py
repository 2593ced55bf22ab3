"""Hostile bodies for /v1/chat/completions and /v1/completions: only 2xx or 4xx, one error object, nothing leaks.

Each example replaces a few fields of a valid body (or of its first message) with wrong types, huge or nested
values, NaN, lone surrogates (sent as JSON `\\ud800` escapes) and NUL bytes; a normal greedy request runs beside
it and must answer what it answers alone. The three the fuzz first found failing inside the engine step (an
out-of-vocabulary logit_bias id, lone surrogates in cache_salt and in a completion prompt: 500 for everyone in
flight) are checked at the edge now; they are drawn like any other value and pinned as cases below.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.server_harness import MODEL, LiveServer, build_server_engine, idle_audit, live_server

NORMAL = {"model": MODEL, "prompt": "The tidal array at Harbor Point", "max_tokens": 8, "temperature": 0}
CHAT = {"model": MODEL, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]}
COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
COMMON_FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                 "logit_bias", "logprobs", "stream", "stream_options", "reuse_context", "cache_generated_tokens",
                 "cache_salt", "lora_name", "parse_special_tokens", "n", "best_of", "echo", "presence_penalty",
                 "frequency_penalty", "suffix", "tools", "tool_choice", "functions", "response_format", "user"]
CHAT_FIELDS = [*COMMON_FIELDS, "messages", "top_logprobs", "messages[0]", "messages[0].role", "messages[1].content",
               "messages[1].content[0]", "messages[1].name"]
COMPLETION_FIELDS = [*COMMON_FIELDS, "prompt"]
ODD_STRINGS = ["\ud800", "a\udfffb", "\udbff\udc00x\ud800", "\x00", "nul\x00byte", "", " ", "<|im_start|>user",
               "\u202e\u200b", "\U0001f600" * 3, "x" * 5000, "user", "system", "assistant", "tool", "text",
               "image_url", "model", MODEL, "1", "-1", "1e309", "NaN"]
DEEP = json.loads("[" * 400 + "]" * 400)  # deep but parseable (test_raw_bodies sends one past the limit)

leaves = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2**31, 2**63]),
                   st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(ODD_STRINGS),
                   st.text(st.characters(codec=None, exclude_categories=()), max_size=12))
values = st.one_of(
    st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                 st.dictionaries(st.sampled_from(ODD_STRINGS) | st.text(max_size=6),
                                                                 inner, max_size=4)), max_leaves=10),
    st.just(DEEP),
    st.builds(lambda n: list(range(n)), st.sampled_from([300, 5000])),  # token ids past maxInputLen / the vocab
    st.builds(lambda n: {str(i): 1 for i in range(n)}, st.sampled_from([1, 400])),  # logit_bias-shaped objects
    st.builds(lambda v: [{"type": "text", "text": v}], st.sampled_from(ODD_STRINGS)),
)


@pytest.fixture(scope="module")
def server(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    engine_dir = build_server_engine(tiny_onnx_dir, tmp_path_factory.mktemp("fuzz_engine"))
    with live_server(engine_dir, tmp_path_factory.mktemp("fuzz")) as live:
        yield live


@pytest.fixture(scope="module")
def alone(server: LiveServer) -> dict[str, Any]:
    """The normal request's answer with nothing beside it."""
    status, reply = post(server, "/v1/completions", NORMAL)
    assert status == 200
    return reply["choices"][0]


def post(server: LiveServer, path: str, body: Any) -> tuple[int, Any]:
    data = json.dumps(body, ensure_ascii=True, allow_nan=True).encode() if not isinstance(body, bytes) else body
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        connection.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode("utf-8")
        kind = response.getheader("content-type", "")
    finally:
        connection.close()
    if kind.startswith("text/event-stream"):
        return response.status, [json.loads(line[6:]) for line in text.splitlines()
                                 if line.startswith("data: ") and line != "data: [DONE]"]
    return response.status, json.loads(text)


def replaced(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """`base` with the field at `path` ('messages[1].content[0]') set to `value` (the containers copied)."""
    body = json.loads(json.dumps(base))
    target: Any = body
    steps = path.replace("]", "").replace("[", ".").split(".")
    for step in steps[:-1]:
        target = target[int(step)] if step.isdigit() else target[step]
        if isinstance(target, str):  # messages[1].content[0] of a string content: make it a parts list first
            return replaced(replaced(base, path.rsplit("[", 1)[0], [{"type": "text", "text": target}]), path, value)
    last = steps[-1]
    if last.isdigit():
        target[int(last)] = value
    else:
        target[last] = value
    return body


def check(server: LiveServer, alone: dict[str, Any], path: str, body: dict[str, Any]) -> None:
    beside: list[tuple[int, Any]] = []
    normal = threading.Thread(target=lambda: beside.append(post(server, "/v1/completions", NORMAL)))
    normal.start()
    status, reply = post(server, path, body)
    normal.join(120)
    assert 200 <= status < 300 or 400 <= status < 500, (status, reply)
    if status >= 400:
        assert isinstance(reply, dict) and list(reply) == ["error"], reply
        assert set(reply["error"]) == {"message", "type", "param", "code"}
        assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]
    elif isinstance(reply, list):  # a stream: an error event in it must be the client's, not the server's
        assert all(event.get("error", {}).get("type") != "server_error" for event in reply), reply
    else:
        assert reply["choices"], reply
    assert beside[0][0] == 200 and beside[0][1]["choices"][0] == alone, beside


def fuzz_body(base: dict[str, Any], fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    def build(changes: list[tuple[str, Any]]) -> dict[str, Any]:
        body = base
        for path, value in changes:
            # An earlier change may have removed the container: keep the body as it is.
            with contextlib.suppress(TypeError, KeyError, IndexError):
                body = replaced(body, path, value)
        return body

    return st.lists(st.tuples(st.sampled_from(fields), values), min_size=1, max_size=3).map(build)


FUZZ = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@FUZZ
@given(body=fuzz_body(CHAT, CHAT_FIELDS))
def test_chat_bodies(server: LiveServer, alone: dict[str, Any], body: dict[str, Any]) -> None:
    check(server, alone, "/v1/chat/completions", body)


@FUZZ
@given(body=fuzz_body(COMPLETION, COMPLETION_FIELDS))
def test_completion_bodies(server: LiveServer, alone: dict[str, Any], body: dict[str, Any]) -> None:
    check(server, alone, "/v1/completions", body)


@pytest.mark.parametrize("raw", [b"", b"null", b"[]", b'"x"', b"1e999999", b"{", b'{"a": 1, "a": 2}',
                                 b'{"model": "\\ud800"}', b"\xff\xfe{}", b'{"model": "tiny", "prompt": NaN}',
                                 b"[" * 100_000, b'{"\x00": 1}'])
def test_raw_bodies(server: LiveServer, alone: dict[str, Any], raw: bytes) -> None:
    status, reply = post(server, "/v1/completions", raw)
    assert 400 <= status < 500 and list(reply) == ["error"], (status, reply)


# Found by the fuzz inside the engine step, where each failed every request in flight with 500; now 400s naming
# the field, before the request reaches the engine.
ONCE_500 = [
    pytest.param("/v1/completions", {**COMPLETION, "logit_bias": {"99999": 5}}, "logit_bias",
                 id="logit_bias-out-of-vocab"),
    pytest.param("/v1/chat/completions", {**CHAT, "cache_salt": "\ud800"}, "cache_salt",
                 id="cache_salt-lone-surrogate"),
    pytest.param("/v1/completions", {**COMPLETION, "prompt": "a\ud800"}, "prompt", id="prompt-lone-surrogate"),
]


@pytest.mark.parametrize(("path", "body", "field"), ONCE_500)
def test_what_once_failed_inside_the_step(server: LiveServer, alone: dict[str, Any], path: str,
                                          body: dict[str, Any], field: str) -> None:
    check(server, alone, path, body)
    status, reply = post(server, path, body)
    assert status == 400 and reply["error"]["param"] == field, (status, reply)


def test_the_pool_is_idle_after_the_fuzz(server: LiveServer) -> None:
    server.on_engine(idle_audit)

"""response_format through llm_serve with the official `openai` client: JSON mode, a JSON schema (streamed and n > 1)
and `beta.chat.completions.parse`, on the tiny synthetic engine whose unconstrained output is garbage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pydantic
import pytest
from support.server_harness import MODEL, LiveServer, build_server_engine, idle_audit, live_server

pytest.importorskip("llguidance")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"tide": {"type": "string", "enum": ["high", "low"]},
                   "metres": {"type": "integer", "minimum": 0, "maximum": 20}},
    "required": ["tide", "metres"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "tide", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Tide at Harbor Point?"}]


class Tide(pydantic.BaseModel):
    tide: Literal["high", "low"]
    metres: int


@pytest.fixture(scope="module")
def engine_dir(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_server_engine(tiny_onnx_dir, tmp_path_factory.mktemp("structured_engine"))


@pytest.fixture(scope="module")
def server(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(engine_dir, tmp_path_factory.mktemp("structured")) as live:
        yield live


@pytest.fixture
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as api:
        yield api
    server.on_engine(idle_audit)  # no leaked page or sequence, whatever the test did


def check_tide(text: str | None) -> None:
    value = json.loads(text or "")
    assert set(value) == {"tide", "metres"} and value["tide"] in ("high", "low")
    assert isinstance(value["metres"], int) and 0 <= value["metres"] <= 20


def test_json_schema_choices_validate_greedy_and_sampled(client: openai.OpenAI) -> None:
    for temperature in (0, 1.2):
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=FORMAT, n=3, seed=5,
                                               temperature=temperature, max_tokens=40)
        assert len(reply.choices) == 3
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice.message.content
            check_tide(choice.message.content)


def test_json_schema_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=FORMAT, stream=True,
                                            temperature=0.9, seed=11, max_tokens=40)
    chunks = list(stream)
    check_tide("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_object_mode(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"},
                                           temperature=0, max_tokens=200)
    choice = reply.choices[0]
    text = choice.message.content or ""
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_beta_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.beta.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Tide,
                                                    temperature=0, max_tokens=40)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Tide) and parsed.tide in ("high", "low")


def test_second_request_reuses_the_prefix_and_gives_the_same_object(server: LiveServer, client: openai.OpenAI) -> None:
    replies = [client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=FORMAT,
                                              temperature=0, max_tokens=40) for _ in range(2)]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    details = replies[1].usage.prompt_tokens_details if replies[1].usage else None
    assert details is not None and (details.cached_tokens or 0) > 0


@pytest.mark.parametrize(("value", "param"), [
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}, "response_format"),
])
def test_bad_response_format_is_a_400_naming_it(client: openai.OpenAI, value: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=value, max_tokens=4)
    assert refused.value.param == param

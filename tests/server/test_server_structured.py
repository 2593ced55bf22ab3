"""response_format through llm_serve with the official `openai` client: JSON mode, a JSON schema (streamed and n > 1)
and `beta.chat.completions.parse`, on the tiny synthetic engine whose unconstrained output is garbage."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import openai
import pydantic
import pytest
from support.engine_driver import build_once
from support.server_harness import MODEL, SERVER_BUILD, LiveServer, audited_client, live_server

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
    # A byte-level tokenizer: the tools' description alone is ~600 prompt tokens
    path = tmp_path_factory.mktemp("structured_engine")
    return build_once(tiny_onnx_dir, path, replace(SERVER_BUILD, max_input_len=1024, max_kv_cache_capacity=1280))


@pytest.fixture(scope="module")
def server(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(engine_dir, tmp_path_factory.mktemp("structured")) as live:
        yield live


@pytest.fixture
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with audited_client(server) as api:
        yield api


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


def test_n_choices_and_a_second_request_compile_the_schema_once(server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"once": {"type": "boolean"}}, "required": ["once"]}
    body = {"model": MODEL, "messages": MESSAGES, "n": 4, "max_tokens": 12, "temperature": 1.0, "seed": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "once", "schema": schema}}}
    grammars = server.state.engine_loop.engine.grammars
    before = grammars.compiles
    for _ in range(2):
        status, reply = server.request("POST", "/v1/chat/completions", body)
        assert status == 200 and len(reply["choices"]) == 4, reply
    assert grammars.compiles == before + 1


def test_a_gbnf_grammar_constrains_the_answer(server: LiveServer) -> None:
    """llama-server's `grammar` field (GBNF, which llguidance converts to its Lark), on chat and completions."""
    for path, extra in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "Tide: "})):
        body = {"model": MODEL, "grammar": 'root ::= ("high" | "low") " tide, " [1-9] [0-9]? " metres"',
                "max_tokens": 40, "temperature": 1.0, "seed": 3, **extra}
        status, reply = server.request("POST", path, body)
        assert status == 200, reply
        choice = reply["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert re.fullmatch(r"(high|low) tide, [1-9][0-9]? metres", text) and choice["finish_reason"] == "stop"


def test_a_stop_string_cuts_a_grammar_only_where_it_may_end(server: LiveServer) -> None:
    """A stop counts where the text before it is a whole answer (OpenAI promises a constrained answer whole)."""
    body = {"model": MODEL, "messages": MESSAGES, "grammar": 'root ::= "x" "y"* "z"', "stop": ["y", "z"],
            "max_tokens": 12, "temperature": 1.0, "seed": 1}
    status, reply = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, reply
    text = reply["choices"][0]["message"]["content"]
    assert re.fullmatch(r"xy*z", text), text  # no text before a "y" or "z" is a whole answer: neither stop cuts
    for seed in range(4):  # "[a-c]+" is whole after any letter: a "c" past the first ends the answer before it
        body = {"model": MODEL, "messages": MESSAGES, "grammar": "root ::= [a-c]+", "stop": ["c"], "max_tokens": 24,
                "temperature": 1.0, "seed": seed}
        status, reply = server.request("POST", "/v1/chat/completions", body)
        text = reply["choices"][0]["message"]["content"]
        assert status == 200 and re.fullmatch(r"[a-c][ab]*", text), text


@pytest.mark.parametrize(("extra", "param"), [
    ({"grammar": 'root ::= "unclosed'}, "grammar"),
    ({"grammar": 7}, "grammar"),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar"),
    ({"response_format": {"type": "grammar", "grammar": 'root ::= "a"'}}, "response_format.type"),
])
def test_bad_grammar_is_a_400_naming_it(server: LiveServer, extra: dict[str, Any], param: str) -> None:
    status, reply = server.request("POST", "/v1/chat/completions",
                                   {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra})
    assert status == 400 and reply["error"]["param"] == param, reply


WEATHER = {"type": "function", "function": {
    "name": "get_tide", "description": "The tide at a harbour.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["harbour", "hours"],
                   "properties": {"harbour": {"enum": ["Harbor Point", "Oslo"]},
                                  "hours": {"type": "integer", "minimum": 0, "maximum": 48}}}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                         "additionalProperties": False}}}


def check_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "now":
        assert arguments == {}
    else:
        assert call.function.name == "get_tide" and arguments["harbour"] in ("Harbor Point", "Oslo")
        assert isinstance(arguments["hours"], int) and 0 <= arguments["hours"] <= 48


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_tide"}}])
def test_forced_tool_call_is_returned_with_its_schema(client: openai.OpenAI, choice: Any) -> None:
    for temperature in (0, 1.0):
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], n=2,
                                               tool_choice=choice, temperature=temperature, seed=3, max_tokens=150)
        for answer in reply.choices:
            assert answer.finish_reason == "tool_calls" and answer.message.content is None
            [call] = answer.message.tool_calls or []
            check_call(call)
            if isinstance(choice, dict):
                assert call.function.name == "get_tide"


def test_forced_tool_call_streamed(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                                 tool_choice="required", stream=True, temperature=0.7, seed=9,
                                                 max_tokens=150))
    [last] = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert last.choices[0].finish_reason == "tool_calls"
    [call] = last.choices[0].delta.tool_calls or []
    assert call.index == 0
    check_call(call)


def test_tool_results_go_back_and_auto_or_none_answer_in_text(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=150)
    [call] = first.choices[0].message.tool_calls or []
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"metres": 3}'}]
    for choice in ("auto", "none"):
        reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice=choice,
                                               temperature=0, max_tokens=8)
        answer = reply.choices[0]  # the tiny engine writes no marked call: its text is the content
        assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
        assert isinstance(answer.message.content, str)
        assert (reply.usage.prompt_tokens if reply.usage else 0) > (first.usage.prompt_tokens if first.usage else 0)


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/no"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": 3}]}]},
     "messages[0].tool_calls[0].function"),
    ({"tools": [WEATHER], "messages": [{"role": "assistant", "content": [], "tool_calls": [{}]}]},
     "messages[0].content"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_a_400_naming_the_field(server: LiveServer, body: dict[str, Any], param: str) -> None:
    status, error = server.request("POST", "/v1/chat/completions",
                                   {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body})
    assert status == 400 and error["error"]["param"] == param, error


def test_completions_refuse_tools(server: LiveServer) -> None:
    status, error = server.request("POST", "/v1/completions",
                                   {"model": MODEL, "prompt": "hi", "max_tokens": 4, "tools": [WEATHER]})
    assert status == 400 and error["error"]["param"] == "tools"


def test_auto_reads_marked_calls_and_keeps_the_rest() -> None:
    from kvforge.runtime.inputs.tools import parse_tools, read_calls

    spec = parse_tools({"tools": [WEATHER], "tool_choice": "auto"})
    assert spec is not None
    text = ('Checking. <tool_call>{"name": "get_tide", "arguments": {"harbour": "Oslo", "hours": 2}}</tool_call>'
            '<tool_call>not json</tool_call>')
    content, calls = read_calls(text, spec)
    assert content == "Checking. <tool_call>not json</tool_call>"
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"harbour": "Oslo", "hours": 2}]
    assert read_calls("plain answer", spec) == ("plain answer", [])

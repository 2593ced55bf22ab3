"""`kvforge.LLM.chat(tools=..., tool_choice=...)` on the tiny synthetic engine: random weights write garbage, so a
call that parses and follows its schema comes only from the shared tool grammar (kvforge/runtime/inputs/tools.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.engine_driver import build_once

from kvforge import LLM, SamplingParams
from kvforge.builder.build import BuildOptions
from kvforge.contract.errors import KvforgeError
from kvforge.runtime.inputs.tools import answer_calls, parse_tools

pytest.importorskip("llguidance")

TIDE = {"type": "function", "function": {
    "name": "get_tide", "description": "The tide at a harbour.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["harbour"],
                   "properties": {"harbour": {"type": "string", "enum": ["Oslo", "Lima"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["hour"],
                                       "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}}}}}
CHAT = [{"role": "user", "content": "Tide at Oslo?"}]


@pytest.fixture(scope="module")
def llm(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    # Byte-level tokenizer: the tools' description alone is several hundred prompt tokens.
    path = tmp_path_factory.mktemp("api_tools_engine")
    path = build_once(tiny_onnx_dir, path, BuildOptions(max_input_len=1024, max_kv_cache_capacity=1280,
                                                        max_batch_size=4, tokens_per_page=16))
    return LLM(str(path), num_threads=2)


def check_call(call: dict[str, Any], names: set[str]) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
    assert name in names
    if name == "get_tide":
        assert arguments == {"harbour": "Oslo"} or arguments == {"harbour": "Lima"}
    else:
        assert set(arguments) == {"hour"} and isinstance(arguments["hour"], int) and 0 <= arguments["hour"] <= 23


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_follows_its_schema(llm: LLM, choice: Any) -> None:
    params = SamplingParams(temperature=1.1, seed=7, max_generate_length=80)
    outputs = llm.chat([CHAT, CHAT, CHAT], params, tools=[TIDE, CLOCK], tool_choice=choice)
    names = {"get_time"} if isinstance(choice, dict) else {"get_tide", "get_time"}
    for output in outputs:
        assert output.finish_reason == "end-of-sequence", output.text
        [call] = output.tool_calls
        check_call(call, names)
        assert json.loads(output.text)["name"] == call["function"]["name"]  # text stays what the model wrote


def test_reuse_does_not_change_a_forced_call(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_generate_length=80)
    cold, warm = (llm.chat(CHAT, params, tools=[TIDE], tool_choice="required")[0] for _ in range(2))
    assert warm.cached_tokens > 0 and warm.token_ids == cold.token_ids
    assert [c["function"] for c in warm.tool_calls] == [c["function"] for c in cold.tool_calls]


def test_tool_results_go_back_and_none_reads_no_call(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_generate_length=80)
    [first] = llm.chat(CHAT, params, tools=[TIDE], tool_choice="required")
    [call] = first.tool_calls
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": '{"tide": "high"}'}]
    [reply] = llm.chat(history, SamplingParams(temperature=0, max_generate_length=8), tools=[TIDE],
                       tool_choice="none")
    assert reply.tool_calls == []
    prompt = llm.engine.info.tokenizer.decode(reply.prompt_token_ids)
    # The model sees its earlier call as it wrote it, the result, and the tools in the system message.
    assert '<tool_call>{"name": "get_tide", "arguments": {"harbour": ' in prompt
    assert '{"tide": "high"}' in prompt and "You may call these functions" in prompt


def test_auto_reads_marked_calls_only_from_an_answer_that_ended() -> None:
    spec = parse_tools({"tools": [TIDE]})
    assert spec is not None and spec.choice == "auto"
    text = 'Let me check. <tool_call>{"name": "get_tide", "arguments": {"harbour": "Lima"}}</tool_call>'
    [call] = answer_calls(text, "end-of-sequence", spec)
    assert call["function"] == {"name": "get_tide", "arguments": '{"harbour":"Lima"}'}
    assert answer_calls(text, "max-length", spec) == []  # cut off: not a call
    assert answer_calls("<tool_call>{}</tool_call>", "stop-words", spec) == []


@pytest.mark.parametrize(("options", "field"), [
    ({"tools": [TIDE], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [TIDE], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
])
def test_bad_tools_name_the_field(llm: LLM, options: dict[str, Any], field: str) -> None:
    with pytest.raises(KvforgeError) as caught:
        llm.chat(CHAT, SamplingParams(max_generate_length=4), **options)
    assert caught.value.field == field


def test_a_forced_call_refuses_a_response_format(llm: LLM) -> None:
    params = SamplingParams(max_generate_length=4, response_format={"type": "json_object"})
    with pytest.raises(KvforgeError) as caught:
        llm.chat(CHAT, params, tools=[TIDE], tool_choice="required")
    assert caught.value.field == "response_format"


def test_a_history_with_tool_calls_reads_without_tools(llm: LLM) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_tide", "arguments": '{"harbour": "Lima"}'}}
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "high"}]
    [reply] = llm.chat(history, SamplingParams(temperature=0, max_generate_length=4))
    assert reply.tool_calls == []  # no tools given: nothing is read back
    prompt = llm.engine.info.tokenizer.decode(reply.prompt_token_ids)
    assert '<tool_call>{"name": "get_tide", "arguments": {"harbour": "Lima"}}</tool_call>' in prompt
    assert "You may call these functions" not in prompt

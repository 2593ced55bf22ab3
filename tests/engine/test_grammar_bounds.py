"""Grammar compiles bounded and shared (issue 52 items 1 and 6, issue 51 item 2), on the tiny synthetic engine:
one compile per schema, refusals naming the field, the grammar defaults that end ordinary schemas, and stop
strings that never cut a constrained answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvforge import LLM, SamplingParams
from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.errors import KvforgeError
from kvforge.runtime.sampling import grammar
from kvforge.runtime.sampling.schema_defaults import INTEGER_LIMIT, with_defaults

pytest.importorskip("llguidance")

# An ordinary schema, as OpenAI's examples and LangChain's @tool send it: no additionalProperties, unbounded numbers.
ORDINARY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                             "population": {"type": "integer"}, "area": {"type": "number"}},
            "required": ["city", "population", "area"]}
CHAT = [{"role": "user", "content": "A city as JSON?"}]


@pytest.fixture(scope="module")
def llm(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = tmp_path_factory.mktemp("grammar_bounds_engine")
    build_engine(tiny_onnx_dir, path, BuildOptions(max_input_len=1024, max_kv_cache_capacity=1280, max_batch_size=4,
                                                   tokens_per_page=16))
    return LLM(str(path), num_threads=2)


def schema_format(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def wide_schema(properties: int) -> dict[str, Any]:
    names = [f"property_number_{i}" for i in range(properties)]
    return {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": names}


def test_a_schema_compiles_once_for_every_sequence_and_request(llm: LLM) -> None:
    fmt = schema_format({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}, "once")
    before = llm.engine.grammars.compiles
    params = SamplingParams(temperature=1.0, seed=3, max_generate_length=40, response_format=fmt)
    llm.chat([CHAT, CHAT, CHAT], params)
    llm.chat(CHAT, params)
    assert llm.engine.grammars.compiles == before + 1  # three sequences and a second request: one compile


def test_a_schema_over_the_size_budget_is_refused_naming_response_format(llm: LLM) -> None:
    huge = schema_format(wide_schema(5000))
    assert len(json.dumps(huge)) > grammar.MAX_SCHEMA_BYTES
    with pytest.raises(KvforgeError) as refused:
        llm.chat(CHAT, SamplingParams(max_generate_length=8, response_format=huge))
    assert refused.value.field == "response_format" and "bytes" in refused.value.message
    assert "\n" not in refused.value.message


def test_a_forced_call_over_the_budget_is_refused_naming_tools(llm: LLM) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "parameters": wide_schema(5000)}}
    with pytest.raises(KvforgeError) as refused:
        llm.chat(CHAT, SamplingParams(max_generate_length=8), tools=[tool], tool_choice="required")
    assert refused.value.field == "tools"


def test_a_compile_over_the_time_budget_is_refused_and_the_refusal_cached(llm: LLM,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar, "COMPILE_BUDGET_S", 0.0)  # every compile is over it
    fmt = schema_format({"type": "object", "properties": {"slow": {"type": "boolean"}}}, "slow")
    before = llm.engine.grammars.compiles
    for _ in range(2):
        with pytest.raises(KvforgeError) as refused:
            llm.chat(CHAT, SamplingParams(max_generate_length=8, response_format=fmt))
        assert refused.value.field == "response_format" and "budget" in refused.value.message
    assert llm.engine.grammars.compiles == before + 1


def test_a_token_mask_over_its_budget_ends_only_that_request(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar, "MASK_BUDGET_S", -1.0)  # every mask is over it
    constrained = SamplingParams(temperature=0, max_generate_length=8,
                                 response_format=schema_format({"type": "object"}))
    plain = SamplingParams(temperature=0, max_generate_length=8)
    requests = [llm._chat_request(CHAT, constrained, None, None, False), llm._chat_request(CHAT, plain, None, None,
                                                                                            False)]
    hostile, other = llm._run(requests)
    assert hostile.finish_reason == "error" and "to mask one token" in (hostile.error or ""), hostile
    assert other.finish_reason in ("max-length", "end-of-sequence") and other.error is None


def test_the_defaults_close_objects_and_cap_digits() -> None:
    schema = with_defaults({"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                                             "free": {"type": "object"},
                                                             "open": {"type": "object", "properties": {},
                                                                      "additionalProperties": True}}})
    assert schema["additionalProperties"] is False
    assert schema["properties"]["n"] == {"$ref": "#/$defs/kvforge_integer"}  # bare: one shared bounded definition
    assert schema["$defs"]["kvforge_integer"] == {"type": "integer", "minimum": -INTEGER_LIMIT,
                                                  "maximum": INTEGER_LIMIT}
    assert schema["$defs"]["kvforge_number"]["multipleOf"] == 1e-10
    assert schema["properties"]["x"] == {"$ref": "#/$defs/kvforge_number"}
    assert schema["properties"]["free"] == {"type": "object"}  # no properties named: any object, as JSON mode
    assert schema["properties"]["open"]["additionalProperties"] is True  # an explicit keyword wins
    assert with_defaults({"type": ["integer", "null"]})["maximum"] == INTEGER_LIMIT
    given = {"type": "integer", "exclusiveMinimum": 0}
    assert with_defaults(given) == {**given, "maximum": INTEGER_LIMIT} and given == {"type": "integer",
                                                                                       "exclusiveMinimum": 0}


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_an_ordinary_schema_ends_with_its_own_keys_and_bounded_numbers(llm: LLM, seed: int) -> None:
    """Random weights write whatever the grammar allows: by the letter of JSON Schema, extra keys and endless
    digits. With the defaults every answer ends by itself inside the limit, with the schema's keys only."""
    params = SamplingParams(temperature=1.3, top_k=0, top_p=1.0, seed=seed, max_generate_length=160,
                            response_format=schema_format(ORDINARY))
    [out] = llm.chat(CHAT, params)
    assert out.finish_reason == "end-of-sequence", out.text
    value = json.loads(out.text)
    assert set(value) == {"city", "population", "area"}
    assert len(str(abs(value["population"]))) <= 16 and abs(value["area"]) <= 1e16


@pytest.mark.parametrize("stop", ['"', "{", "}", ","])
def test_a_stop_string_never_cuts_a_constrained_answer(llm: LLM, stop: str) -> None:
    params = SamplingParams(temperature=1.0, seed=5, max_generate_length=160, stop=(stop,),
                            response_format=schema_format(ORDINARY))
    [out] = llm.chat(CHAT, params)
    assert out.finish_reason == "end-of-sequence", out.text
    assert set(json.loads(out.text)) == {"city", "population", "area"}


def test_a_stop_string_still_ends_an_unconstrained_answer(llm: LLM) -> None:
    [free] = llm.chat(CHAT, SamplingParams(temperature=0, max_generate_length=64))
    stop = next((c for c in free.text if c.isascii() and c.isalnum()), None)
    if stop is None:
        pytest.skip(f"the greedy answer has no ASCII letter or digit to stop at: {free.text!r}")
    [out] = llm.chat(CHAT, SamplingParams(temperature=0, max_generate_length=64, stop=(stop,)))
    assert out.finish_reason == "stop-words" and out.text == free.text[:free.text.index(stop)]

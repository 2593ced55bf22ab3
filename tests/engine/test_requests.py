"""Request-file parsing: defaults, overrides, and a precise one-line error for every bad input."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.contract.errors import KvforgeError
from kvforge.runtime.inputs.request_file import RequestFile, load_request_file, parse_request_file
from kvforge.runtime.types import Message, SamplingParams


def minimal(**top: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"requests": [{"messages": [{"role": "user", "content": "hi"}]}]}
    data.update(top)
    return data


def with_request(**fields: Any) -> dict[str, Any]:
    data = minimal()
    data["requests"][0].update(fields)
    return data


def with_message(**fields: Any) -> dict[str, Any]:
    data = minimal()
    data["requests"][0]["messages"][0].update(fields)
    return data


def expect_error(data: Any, field: str, fragment: str = "") -> KvforgeError:
    with pytest.raises(KvforgeError) as info:
        parse_request_file(data)
    return check_error(info.value, field, fragment)


def check_error(error: KvforgeError, field: str, fragment: str = "") -> KvforgeError:
    assert error.field == field, str(error)
    assert len(str(error).splitlines()) == 1 and len(error.message.splitlines()) == 1
    assert fragment in error.message
    return error


# --- defaults and happy paths -------------------------------------------------------------------------


def test_defaults() -> None:
    parsed = parse_request_file(minimal(), source="x.json")
    assert parsed.batch_size == 1
    assert parsed.context_cache_lookup_policy == "use_cache"
    assert parsed.context_cache_commit_policy == "including_generated_tokens"
    assert parsed.available_lora_weights == {}
    assert parsed.enable_thinking is False
    assert parsed.source == "x.json"
    request = parsed.requests[0]
    assert request.index == 0
    assert request.messages == [Message("user", "hi")]
    assert request.sampling == SamplingParams(1.0, 0.8, 50, 256, 0, {}, (), None)
    assert request.apply_chat_template and request.add_generation_prompt
    assert request.lora_name is None and request.cache_salt is None
    assert not request.save_system_prompt_kv_cache
    assert request.extra == {}


def test_top_level_values_are_request_defaults_and_requests_override() -> None:
    data = minimal(temperature=0.5, top_p=1, top_k=0, max_generate_length=7, num_logprobs=3,
                   logit_bias={"5": -2}, stop="END", seed=11, apply_chat_template=False,
                   add_generation_prompt=False, batch_size=16, enable_thinking=True,
                   context_cache_lookup_policy="bypass", context_cache_commit_policy="prefill_state_only")
    data["requests"].append({"messages": [{"role": "user", "content": "x"}], "temperature": 0,
                             "top_p": 0.5, "top_k": 1, "max_generate_length": 1, "num_logprobs": 50,
                             "logit_bias": {}, "stop": ["a", "b"], "seed": None,
                             "apply_chat_template": True, "add_generation_prompt": True})
    parsed = parse_request_file(data)
    first, second = parsed.requests
    assert first.sampling == SamplingParams(0.5, 1.0, 0, 7, 3, {5: -2.0}, ("END",), 11, reuse_context=False,
                                            cache_generated_tokens=False)
    assert isinstance(first.sampling.top_p, float) and isinstance(first.sampling.temperature, float)
    assert not first.apply_chat_template and not first.add_generation_prompt
    assert second.sampling == SamplingParams(0.0, 0.5, 1, 1, 50, {}, ("a", "b"), None, reuse_context=False,
                                             cache_generated_tokens=False)
    assert second.apply_chat_template and second.add_generation_prompt
    assert (parsed.batch_size, parsed.enable_thinking) == (16, True)
    assert parsed.context_cache_lookup_policy == "bypass"
    assert parsed.context_cache_commit_policy == "prefill_state_only"


def test_default_logit_bias_is_not_shared_between_requests() -> None:
    data = minimal(logit_bias={"1": 2.0})
    data["requests"].append(data["requests"][0])
    first, second = parse_request_file(data).requests
    first.sampling.logit_bias[9] = 1.0
    assert second.sampling.logit_bias == {1: 2.0}


def test_content_array_is_joined_and_extra_keys_kept() -> None:
    content = [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]
    data = with_request(reference="NVIDIA", _scenario="cold", cache_salt="s",
                        save_system_prompt_kv_cache=True, disable_spec_decode=True)
    data["requests"][0]["messages"] = [{"role": "system", "content": "S:"},
                                       {"role": "user", "content": content}]
    request = parse_request_file(data).requests[0]
    assert request.messages[1] == Message("user", "abcd")
    assert request.plain_text() == "S:abcd"
    assert request.extra == {"reference": "NVIDIA", "_scenario": "cold"}
    assert request.cache_salt == "s"
    assert request.save_system_prompt_kv_cache


def test_unknown_top_level_keys_are_ignored() -> None:
    parse_request_file(minimal(expected_context_cache={"hit_sequences": 5}, streaming={"enable": True}))


def test_lora_name() -> None:
    data = minimal(available_lora_weights={"jailbreak": "/a/adapter.safetensors"})
    data["requests"] += [{"messages": [{"role": "user", "content": "x"}], "lora_name": "jailbreak"},
                         {"messages": [{"role": "user", "content": "x"}], "lora_name": ""}]
    parsed = parse_request_file(data)
    assert [r.lora_name for r in parsed.requests] == [None, "jailbreak", None]
    assert parsed.available_lora_weights == {"jailbreak": "/a/adapter.safetensors"}


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.1, top_k=0).is_greedy


def test_batches_chunk_in_file_order() -> None:
    data = minimal(batch_size=2)
    data["requests"] = [{"messages": [{"role": "user", "content": str(i)}]} for i in range(5)]
    batches = parse_request_file(data).batches()
    assert [[r.index for r in batch] for batch in batches] == [[0, 1], [2, 3], [4]]


def test_fixture_shaped_like_reference_context_reuse() -> None:
    data = {"batch_size": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 1, "num_logprobs": 1,
            "max_generate_length": 2, "apply_chat_template": False, "add_generation_prompt": False,
            "context_cache_commit_policy": "prefill_state_only",
            "requests": [{"messages": [{"role": "user", "content": "P Q"}], "reference": "NVIDIA"}] * 3}
    parsed = parse_request_file(data)
    assert all(r.sampling.is_greedy and r.plain_text() == "P Q" for r in parsed.requests)


# --- apply_overrides ----------------------------------------------------------------------------------


def test_apply_overrides() -> None:
    data = minimal(batch_size=2, max_generate_length=5, num_logprobs=1)
    data["requests"].append({"messages": [{"role": "user", "content": "x"}], "max_generate_length": 9})
    parsed = parse_request_file(data)
    assert parsed.apply_overrides(-1, -1, -1) is parsed
    assert parsed.batch_size == 2
    assert [r.sampling.max_generate_length for r in parsed.requests] == [5, 9]
    parsed.apply_overrides(batch_size=1, max_generate_length=3, num_logprobs=50)
    assert parsed.batch_size == 1
    assert [r.sampling.max_generate_length for r in parsed.requests] == [3, 3]
    assert [r.sampling.num_logprobs for r in parsed.requests] == [50, 50]
    parsed.apply_overrides(num_logprobs=0)
    assert [r.sampling.num_logprobs for r in parsed.requests] == [0, 0]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"batch_size": 0}, "batch_size_override"),
    ({"batch_size": 17}, "batch_size_override"),
    ({"batch_size": -2}, "batch_size_override"),
    ({"batch_size": True}, "batch_size_override"),
    ({"max_generate_length": 0}, "max_generate_length_override"),
    ({"max_generate_length": 2.0}, "max_generate_length_override"),
    ({"num_logprobs": 51}, "num_logprobs_override"),
    ({"num_logprobs": -3}, "num_logprobs_override"),
])
def test_apply_overrides_errors(kwargs: dict[str, Any], field: str) -> None:
    """Domain names; llm_inference maps them to --batchSize / --maxGenerateLength / --numLogprobs."""
    parsed = parse_request_file(minimal())
    with pytest.raises(KvforgeError) as info:
        parsed.apply_overrides(**kwargs)
    check_error(info.value, field)


# --- top-level errors ---------------------------------------------------------------------------------

TOP_LEVEL_ERRORS: list[tuple[str, Any, str, str]] = [
    ("batch_size", 0, "batch_size", "must be an integer in 1..16, got 0"),
    ("batch_size", 17, "batch_size", "got 17"),
    ("batch_size", "4", "batch_size", 'got "4" (string)'),
    ("batch_size", True, "batch_size", "(boolean)"),
    ("batch_size", 2.0, "batch_size", "(number)"),
    ("temperature", -0.1, "temperature", ">= 0"),
    ("temperature", "1", "temperature", "(string)"),
    ("temperature", True, "temperature", "(boolean)"),
    ("temperature", None, "temperature", "(null)"),
    ("temperature", math.nan, "temperature", "finite"),
    ("temperature", math.inf, "temperature", "finite"),
    ("temperature", 10**400, "temperature", "finite"),
    ("top_p", 1.5, "top_p", "must be a number in (0, 1], got 1.5"),
    ("top_p", 0, "top_p", "(0, 1]"),
    ("top_p", -0.5, "top_p", "(0, 1]"),
    ("top_p", "0.5", "top_p", "(string)"),
    ("top_k", -1, "top_k", "integer >= 0"),
    ("top_k", 1.5, "top_k", "(number)"),
    ("top_k", False, "top_k", "(boolean)"),
    ("max_generate_length", 0, "max_generate_length", "integer >= 1"),
    ("max_generate_length", 10.0, "max_generate_length", "(number)"),
    ("num_logprobs", 51, "num_logprobs", "0..50"),
    ("num_logprobs", -1, "num_logprobs", "0..50"),
    ("num_logprobs", "2", "num_logprobs", "(string)"),
    ("logit_bias", [], "logit_bias", "must be an object"),
    ("logit_bias", {"abc": 1}, 'logit_bias["abc"]', "decimal token id"),
    ("logit_bias", {"-1": 1}, 'logit_bias["-1"]', "decimal token id"),
    ("logit_bias", {" 1": 1}, 'logit_bias[" 1"]', "decimal token id"),
    ("logit_bias", {"1": 101}, 'logit_bias["1"]', "[-100, 100], got 101"),
    ("logit_bias", {"1": -100.5}, 'logit_bias["1"]', "[-100, 100]"),
    ("logit_bias", {"1": "5"}, 'logit_bias["1"]', "(string)"),
    ("logit_bias", {"1": True}, 'logit_bias["1"]', "(boolean)"),
    ("logit_bias", {"1": math.nan}, 'logit_bias["1"]', "finite"),
    ("logit_bias", {"7": 1, "007": 2}, 'logit_bias["007"]', "more than once"),
    ("logit_bias", {str(i): 0 for i in range(1025)}, "logit_bias", "at most 1024 entries"),
    ("seed", -1, "seed", "integer >= 0"),
    ("seed", "3", "seed", "(string)"),
    ("seed", 1.5, "seed", "(number)"),
    ("seed", True, "seed", "(boolean)"),
    ("stop", 5, "stop", "string or an array of strings"),
    ("stop", {"a": 1}, "stop", "string or an array of strings"),
    ("stop", "", "stop", "non-empty string"),
    ("stop", ["ok", 1], "stop[1]", "(integer)"),
    ("stop", ["ok", ""], "stop[1]", "non-empty string"),
    ("apply_chat_template", "yes", "apply_chat_template", "true or false"),
    ("add_generation_prompt", 1, "add_generation_prompt", "true or false"),
    ("enable_thinking", None, "enable_thinking", "true or false"),
    ("context_cache_lookup_policy", "cache", "context_cache_lookup_policy", '"use_cache", "bypass"'),
    ("context_cache_lookup_policy", None, "context_cache_lookup_policy", "(null)"),
    ("context_cache_commit_policy", "all", "context_cache_commit_policy", "prefill_state_only"),
    ("available_lora_weights", [], "available_lora_weights", "must be an object"),
    ("available_lora_weights", {"a": 5}, 'available_lora_weights["a"]', "non-empty path string"),
    ("available_lora_weights", {"a": ""}, 'available_lora_weights["a"]', "non-empty path string"),
    ("available_lora_weights", {"": "p"}, "available_lora_weights", "must not be empty"),
    ("requests", [], "requests", "non-empty array"),
    ("requests", {}, "requests", "non-empty array"),
    ("requests", "x", "requests", "non-empty array"),
    ("requests", ["x"], "requests[0]", "must be an object, got string"),
]


@pytest.mark.parametrize(("key", "value", "field", "fragment"), TOP_LEVEL_ERRORS)
def test_top_level_errors(key: str, value: Any, field: str, fragment: str) -> None:
    expect_error(minimal(**{key: value}), field, fragment)


def test_missing_requests() -> None:
    expect_error({"batch_size": 1}, "requests", "is required")


@pytest.mark.parametrize("data", [[], "x", None, 3])
def test_top_level_not_an_object(data: Any) -> None:
    expect_error(data, "inputFile", "JSON object")


# --- per-request errors -------------------------------------------------------------------------------

OVERRIDE_ERRORS: list[tuple[str, Any, str]] = [
    (key, value, fragment) for key, value, field, fragment in TOP_LEVEL_ERRORS
    if key in ("temperature", "top_p", "top_k", "max_generate_length", "num_logprobs", "logit_bias",
               "stop", "seed", "apply_chat_template", "add_generation_prompt")
]


@pytest.mark.parametrize(("key", "value", "fragment"), OVERRIDE_ERRORS)
def test_request_override_errors_name_the_request(key: str, value: Any, fragment: str) -> None:
    data = minimal()
    data["requests"] = [data["requests"][0], {**data["requests"][0], key: value}]
    with pytest.raises(KvforgeError) as info:
        parse_request_file(data)
    error = info.value
    assert error.field is not None and error.field.startswith(f"requests[1].{key}")
    check_error(error, error.field, fragment)


BIG = "é" * (64 * 1024 + 1)  # 131074 UTF-8 bytes, but only 65537 characters

REQUEST_ERRORS: list[tuple[Callable[[], Any], str, str]] = [
    (lambda: with_request(messages=None), "requests[0].messages", "non-empty array"),
    (lambda: {"requests": [{"reference": "x"}]}, "requests[0].messages", "is required"),
    (lambda: with_request(messages=[]), "requests[0].messages", "an empty array"),
    (lambda: with_request(messages="hi"), "requests[0].messages", "(string)"),
    (lambda: with_request(messages=[{"role": "user", "content": "x"}] * 65), "requests[0].messages",
     "at most 64 messages, got 65"),
    (lambda: with_request(messages=["hi"]), "requests[0].messages[0]", "got string"),
    (lambda: with_request(messages=[{"content": "x"}]), "requests[0].messages[0].role", "is required"),
    (lambda: with_message(role="bot"), "requests[0].messages[0].role", '"system", "user"'),
    (lambda: with_message(role=5), "requests[0].messages[0].role", "(integer)"),
    (lambda: with_request(messages=[{"role": "user"}]), "requests[0].messages[0].content", "is required"),
    (lambda: with_message(content=5), "requests[0].messages[0].content", "got integer"),
    (lambda: with_message(content=None), "requests[0].messages[0].content", "got null"),
    (lambda: with_message(content=BIG), "requests[0].messages[0].content", "at most 131072 bytes"),
    (lambda: with_message(content=[{"type": "text", "text": BIG}]), "requests[0].messages[0].content",
     "got 131074"),
    (lambda: with_message(content="\ud800"), "requests[0].messages[0].content", "lone surrogate"),
    (lambda: with_message(content=[{"type": "text", "text": "a"}] * 257), "requests[0].messages[0].content",
     "at most 256 items, got 257"),
    (lambda: with_message(content=["a"]), "requests[0].messages[0].content[0]", "got string"),
    (lambda: with_message(content=[{"text": "a"}]), "requests[0].messages[0].content[0].type", "is required"),
    (lambda: with_message(content=[{"type": "pdf"}]), "requests[0].messages[0].content[0].type", '"image"'),
    (lambda: with_message(content=[{"type": "text", "text": "a"}, {"type": "image"}]),
     "requests[0].messages[0].content[1].image", "is required (a file path"),
    (lambda: with_message(content=[{"type": "image", "image": ""}]),
     "requests[0].messages[0].content[0].image", "empty string"),
    (lambda: with_message(content=[{"type": "image", "image": 5}]),
     "requests[0].messages[0].content[0].image", "must be a string"),
    (lambda: with_message(content=[{"type": "text", "text": "a\ufffc"}, {"type": "image", "image": "a.png"}]),
     "requests[0].messages[0].content", "U+FFFC"),
    (lambda: with_message(content=[{"type": "audio"}]),
     "requests[0].messages[0].content[0].audio", "is required (a file path"),
    (lambda: with_message(content=[{"type": "video", "frames": []}]),
     "requests[0].messages[0].content[0].type", '"video" content is not supported yet'),
    (lambda: with_message(content=[{"type": "text"}]), "requests[0].messages[0].content[0].text",
     "is required"),
    (lambda: with_message(content=[{"type": "text", "text": 3}]), "requests[0].messages[0].content[0].text",
     "must be a string, got 3 (integer)"),
    (lambda: with_request(lora_name="nope"), "requests[0].lora_name",
     '"nope" is not in available_lora_weights (available: none)'),
    (lambda: minimal(available_lora_weights={"a": "p"}) | {"requests": [
        {"messages": [{"role": "user", "content": "x"}], "lora_name": "b"}]},
     "requests[0].lora_name", '"b" is not in available_lora_weights (available: "a")'),
    (lambda: with_request(lora_name=5), "requests[0].lora_name", "must be a string"),
    (lambda: with_request(lora_name=None), "requests[0].lora_name", "(null)"),
    (lambda: with_request(save_system_prompt_kv_cache="true"), "requests[0].save_system_prompt_kv_cache",
     "true or false"),
    (lambda: with_request(disable_spec_decode=1), "requests[0].disable_spec_decode", "true or false"),
    (lambda: with_request(cache_salt=5), "requests[0].cache_salt", "must be a string, got 5 (integer)"),
    (lambda: with_request(cache_salt=None), "requests[0].cache_salt", "(null)"),
]


@pytest.mark.parametrize(("make", "field", "fragment"), REQUEST_ERRORS)
def test_request_errors(make: Callable[[], Any], field: str, fragment: str) -> None:
    expect_error(make(), field, fragment)


def test_error_values_are_shown_on_one_line() -> None:
    error = expect_error(minimal(top_p="a\nb\u2028c"), "top_p", "(string)")
    assert "a\\nb\\u2028c" in error.message


def test_top_level_error_is_reported_before_request_errors() -> None:
    data = minimal(top_k=-1)
    data["requests"] = [{"messages": []}]
    expect_error(data, "top_k")


# --- load_request_file --------------------------------------------------------------------------------


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "input.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def load_error(path: Path, fragment: str = "") -> KvforgeError:
    with pytest.raises(KvforgeError) as info:
        load_request_file(path)
    return check_error(info.value, "inputFile", fragment)


def test_load_ok(tmp_path: Path) -> None:
    path = write(tmp_path, json.dumps(minimal(batch_size=2)))
    parsed = load_request_file(path)
    assert isinstance(parsed, RequestFile)
    assert parsed.batch_size == 2 and parsed.source == str(path)


def test_load_accepts_a_bom(tmp_path: Path) -> None:
    assert load_request_file(write(tmp_path, b"\xef\xbb\xbf" + json.dumps(minimal()).encode())).requests


def test_load_missing_file(tmp_path: Path) -> None:
    load_error(tmp_path / "nope.json", "not found")


def test_load_directory(tmp_path: Path) -> None:
    load_error(tmp_path, "is a directory")


def test_load_malformed_json_names_line_and_column(tmp_path: Path) -> None:
    load_error(write(tmp_path, '{\n  "batch_size": 1,\n  "requests": [,]\n}'), "at line 3, column 16")


def test_load_not_utf8(tmp_path: Path) -> None:
    load_error(write(tmp_path, b'{"requests": "\xff"}'), "not valid UTF-8")


def test_load_top_level_array(tmp_path: Path) -> None:
    load_error(write(tmp_path, "[1, 2]"), "must be a JSON object, got array")


def test_load_huge_integer_literal(tmp_path: Path) -> None:
    load_error(write(tmp_path, '{"batch_size": ' + "9" * 5000 + "}"), "malformed JSON")


def test_load_deep_nesting(tmp_path: Path) -> None:
    load_error(write(tmp_path, "[" * 100_000 + "]" * 100_000), "malformed JSON")


def test_load_unreadable(tmp_path: Path) -> None:
    file = write(tmp_path, "{}")
    load_error(file / "input.json", "Not a directory")
    load_error(tmp_path / ("x" * 5000 + ".json"), "File name too long")


def test_load_duplicate_lora_names(tmp_path: Path) -> None:
    text = '{"available_lora_weights": {"a": "x", "a": "y"}, "requests": [{"messages": []}]}'
    with pytest.raises(KvforgeError) as info:
        load_request_file(write(tmp_path, text))
    check_error(info.value, "inputFile", 'duplicate key "a"')  # refused by the parser, like any repeated key


def test_load_request_error_keeps_json_path(tmp_path: Path) -> None:
    data = minimal()
    data["requests"].append({"messages": [{"role": "user", "content": [{"type": "video", "frames": []}]}]})
    with pytest.raises(KvforgeError) as info:
        load_request_file(write(tmp_path, json.dumps(data)))
    check_error(info.value, "requests[1].messages[0].content[0].type", "not supported yet")


# --- fuzz: any JSON anywhere gives a parse or a one-line KvforgeError, never another exception ----------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children,
                                                                       max_size=4),
    max_leaves=10,
)
TOP_KEYS = ["batch_size", "temperature", "top_p", "top_k", "max_generate_length", "num_logprobs",
            "logit_bias", "apply_chat_template", "add_generation_prompt", "enable_thinking", "seed",
            "stop", "context_cache_lookup_policy", "context_cache_commit_policy", "available_lora_weights",
            "requests"]
REQUEST_KEYS = ["messages", "temperature", "top_p", "top_k", "max_generate_length", "num_logprobs",
                "logit_bias", "stop", "seed", "apply_chat_template", "add_generation_prompt", "lora_name",
                "save_system_prompt_kv_cache", "cache_salt", "disable_spec_decode"]


def parses_or_fails_cleanly(data: Any) -> None:
    try:
        parse_request_file(data)
    except KvforgeError as error:
        assert error.field and len(str(error).splitlines()) == 1
        str(error).encode("utf-8")  # printable


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(TOP_KEYS), JSON_VALUES)
def test_fuzz_top_level(key: str, value: Any) -> None:
    parses_or_fails_cleanly(minimal(**{key: value}))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(REQUEST_KEYS), JSON_VALUES)
def test_fuzz_request(key: str, value: Any) -> None:
    parses_or_fails_cleanly(with_request(**{key: value}))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["role", "content"]), JSON_VALUES)
def test_fuzz_message(key: str, value: Any) -> None:
    parses_or_fails_cleanly(with_message(**{key: value}))


@settings(max_examples=100, deadline=None)
@given(JSON_VALUES)
def test_fuzz_whole_file(value: Any) -> None:
    parses_or_fails_cleanly(value)

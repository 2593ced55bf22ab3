"""response_format on the tiny synthetic engine: random weights emit garbage, so only the grammar makes JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.engine_driver import build_once

from kvforge import LLM, SamplingParams
from kvforge.builder.build import BuildOptions
from kvforge.contract.errors import KvforgeError

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

pytest.importorskip("llguidance")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "population", "coastal"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
DOC = "A shared document of several pages about harbours and tides. " * 2


@pytest.fixture(scope="module")
def llm(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = tmp_path_factory.mktemp("structured_engine")
    path = build_once(tiny_onnx_dir, path, BuildOptions(max_input_len=256, max_kv_cache_capacity=512,
                                                        max_batch_size=4, tokens_per_page=16))
    return LLM(str(path), num_threads=2, enable_context_reuse=True)


def check_city(value: Any) -> None:
    """SCHEMA checked by hand (jsonschema is not a dependency)."""
    assert isinstance(value, dict) and set(value) == {"city", "population", "coastal"}
    assert value["city"] in ("Paris", "Oslo", "Lima")
    assert isinstance(value["population"], int) and not isinstance(value["population"], bool)
    assert 0 <= value["population"] <= 99999
    assert isinstance(value["coastal"], bool)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.0, 2), (1.5, 3)])
def test_schema_output_always_parses_and_validates(llm: LLM, temperature: float, seed: int | None) -> None:
    params = SamplingParams(temperature=temperature, top_p=1.0, top_k=0, seed=seed, max_generate_length=64,
                            response_format=SCHEMA_FORMAT)
    outputs = llm.chat([[{"role": "user", "content": DOC + f"Where? {i}"}] for i in range(3)], params)
    for out in outputs:
        assert out.finish_reason == "end-of-sequence", out.text
        check_city(json.loads(out.text))


def test_unconstrained_output_is_not_json(llm: LLM) -> None:
    """The baseline the tests above beat: the same engine without a grammar does not emit the object."""
    [out] = llm.chat([{"role": "user", "content": DOC + "Where?"}],
                     SamplingParams(temperature=0.0, max_generate_length=32))
    with pytest.raises(ValueError):
        check_city(json.loads(out.text))


def test_json_object_mode_gives_an_object(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_generate_length=200, response_format={"type": "json_object"})
    [out] = llm.chat([{"role": "user", "content": "json please"}], params)
    if out.finish_reason == "end-of-sequence":
        assert isinstance(json.loads(out.text), dict)
    else:  # cut by the length limit: still a prefix of an object
        assert out.text.startswith("{")


def test_constraint_does_not_travel_with_reused_pages(llm: LLM) -> None:
    """A constrained and a free request on the same prefix: the second reuses the first's pages and is unconstrained,
    exactly what it gives cold; the reverse order keeps the constrained one valid."""
    messages = [{"role": "user", "content": DOC + "Same prefix."}]
    free = SamplingParams(temperature=0.0, max_generate_length=12)
    [cold] = llm.chat(messages, replace_reuse(free, False))
    [constrained] = llm.chat(messages, SamplingParams(temperature=0.0, max_generate_length=64,
                                                      response_format=SCHEMA_FORMAT))
    [warm] = llm.chat(messages, free)
    assert warm.cached_tokens > 0 and warm.token_ids == cold.token_ids
    check_city(json.loads(constrained.text))
    [again] = llm.chat(messages, SamplingParams(temperature=0.0, max_generate_length=64,
                                                response_format=SCHEMA_FORMAT))
    assert again.cached_tokens > 0 and again.text == constrained.text  # reuse never changes an answer


def replace_reuse(params: SamplingParams, reuse: bool) -> SamplingParams:
    from dataclasses import replace

    return replace(params, reuse_context=reuse)


@pytest.mark.parametrize("value,field", [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": []}}, "response_format.json_schema.schema"),
])
def test_bad_response_format_names_the_field(value: Any, field: str) -> None:
    with pytest.raises(KvforgeError) as info:
        SamplingParams(response_format=value)
    assert info.value.field == field


def test_text_format_is_unconstrained_and_constraint_turns_drafts_off() -> None:
    assert SamplingParams(response_format={"type": "text"}).response_format is None
    assert SamplingParams(response_format={"type": "json_object"}).speculative is False


def test_uncompilable_schema_is_refused_in_one_line(llm: LLM) -> None:
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}}
    with pytest.raises(KvforgeError) as info:
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_generate_length=8, response_format=bad))
    assert info.value.field == "response_format" and "\n" not in info.value.message


def test_request_file_response_format(llm: LLM, tmp_path: Path, run_cli: Any) -> None:
    """A request file's per-request (or top-level) response_format, run by llm_inference; errors name the request."""
    from kvforge.runtime.inputs.request_file import parse_request_file

    data = {"max_generate_length": 64, "temperature": 0.0, "response_format": SCHEMA_FORMAT, "requests": [
        {"messages": [{"role": "user", "content": "one"}]},
        {"messages": [{"role": "user", "content": "two"}], "response_format": {"type": "text"}}]}
    first, second = parse_request_file(data).requests
    assert first.sampling.response_format == SAMPLING_FORMAT and second.sampling.response_format is None
    assert "response_format" not in first.extra
    with pytest.raises(KvforgeError) as info:
        parse_request_file({**data, "requests": [{"messages": [{"role": "user", "content": "x"}],
                                                  "response_format": {"type": "xml"}}]})
    assert info.value.field == "requests[0].response_format.type"
    request = tmp_path / "in.json"
    request.write_text(json.dumps({**data, "requests": data["requests"][:1]}))
    done = run_cli(["llm_inference", "--engineDir", llm.engine.engine_dir.path, "--inputFile", request,
                    "--outputFile", tmp_path / "out.json"])
    assert done.returncode == 0, done.stderr
    [response] = json.loads((tmp_path / "out.json").read_text())["responses"]
    check_city(json.loads(response["output_text"]))


SAMPLING_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": None}}


def test_constrained_request_on_a_speculative_engine(llm: LLM) -> None:
    """With ngram drafts on, a constrained request decodes plain (no drafts verified) and still validates; its
    answer equals the one without speculation, and a free request beside it still drafts."""
    params = SamplingParams(temperature=0.0, max_generate_length=64, response_format=SCHEMA_FORMAT)
    messages = [{"role": "user", "content": "Spec? " * 8}]
    [plain] = llm.chat(messages, params)
    with LLM(str(llm.engine.engine_dir.path), num_threads=2, spec_decode="ngram") as spec:
        [drafted] = spec.chat(messages, params)
        assert spec.engine.stats().spec_draft_tokens == 0
        spec.chat([{"role": "user", "content": "ab ab ab ab ab ab ab ab"}],
                  SamplingParams(temperature=0.0, max_generate_length=24))
        assert spec.engine.stats().spec_draft_tokens > 0  # the engine does draft for a free request
    assert drafted.text == plain.text
    check_city(json.loads(drafted.text))

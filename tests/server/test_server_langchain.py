"""LangChain's OpenAI chat model against llm_serve: `bind_tools` and `with_structured_output`, as users call them,
so the request shape LangChain sends (strict schemas, `parallel_tool_calls`, named tool choices) stays accepted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Literal

import pydantic
import pytest
from support.engine_driver import build_once
from support.server_harness import MODEL, SERVER_BUILD, LiveServer, live_server

pytest.importorskip("llguidance")
langchain_openai = pytest.importorskip("langchain_openai")


class Tide(pydantic.BaseModel):
    """The tide at a harbour."""

    tide: Literal["high", "low"]
    metres: int = pydantic.Field(ge=0, le=20)


class GetTide(pydantic.BaseModel):
    """Look up the tide at a harbour."""

    harbour: str = pydantic.Field(max_length=12)


QUESTION = [("system", "Answer with the tool or in JSON."), ("user", "What is the tide at Harbor Point?")]


@pytest.fixture(scope="module")
def server(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # Byte-level tokenizer: the tool and schema descriptions take several hundred prompt tokens.
    engine_dir = build_once(tiny_onnx_dir, tmp_path_factory.mktemp("langchain_engine"),
                            replace(SERVER_BUILD, max_input_len=1024, max_kv_cache_capacity=1280))
    with live_server(engine_dir, tmp_path_factory.mktemp("langchain")) as live:
        yield live


def chat_model(server: LiveServer, **options: object) -> object:
    return langchain_openai.ChatOpenAI(model=MODEL, base_url=server.base_url, api_key="unused", max_retries=0,
                                       timeout=60, max_tokens=120, **options)


@pytest.mark.parametrize("tool_choice", ["required", "GetTide"])
def test_bind_tools_returns_a_tool_call_with_its_arguments(server: LiveServer, tool_choice: str) -> None:
    model = chat_model(server, temperature=0.8, seed=4)
    reply = model.bind_tools([GetTide], tool_choice=tool_choice).invoke(QUESTION)
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    [call] = reply.tool_calls
    assert call["name"] == "GetTide" and call["id"]
    GetTide.model_validate(call["args"])  # the arguments follow the tool's schema (grammar-constrained)
    assert not reply.invalid_tool_calls


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_with_structured_output_parses_into_the_schema(server: LiveServer, method: str) -> None:
    model = chat_model(server, temperature=0)
    if method == "json_mode":
        # JSON mode constrains to an object, not to the schema: the raw message must parse as JSON.
        result = model.with_structured_output(Tide, method=method, include_raw=True).invoke(QUESTION)
        assert isinstance(json.loads(result["raw"].content), dict)  # the random model's object may miss fields
        return
    tide = model.with_structured_output(Tide, method=method).invoke(QUESTION)
    assert isinstance(tide, Tide) and tide.tide in ("high", "low") and 0 <= tide.metres <= 20


def test_a_tool_result_goes_back_through_langchain_messages(server: LiveServer) -> None:
    from langchain_core.messages import ToolMessage

    model = chat_model(server, temperature=0)
    # strict: no extra properties, so the greedy random model must close the object after `harbour`
    first = model.bind_tools([GetTide], tool_choice="required", strict=True).invoke(QUESTION)
    [call] = first.tool_calls
    history = [*QUESTION, first, ToolMessage(content='{"tide": "high", "metres": 3}', tool_call_id=call["id"])]
    reply = model.bind_tools([GetTide], tool_choice="none").invoke(history)  # LangChain's shape of the history
    assert reply.response_metadata["finish_reason"] in ("stop", "length") and not reply.tool_calls

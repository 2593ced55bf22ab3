"""Forced tool calls on ordinary schemas end (issue 51 item 2), on `make demo`'s SmolLM2 through llm_serve, with
LangChain's real `@tool` and pydantic models and OpenAI's own `get_weather` example: none of them says
`"additionalProperties": false` or bounds its numbers, and before the grammar defaults the model added keys of
its own or wrote digits until `max_tokens`, so the reply had no tool call."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pydantic
import pytest
from support.server_harness import MODEL, LiveServer, live_server

pytest.importorskip("llguidance")
langchain_openai = pytest.importorskip("langchain_openai")
langchain_tools = pytest.importorskip("langchain_core.tools")

# OpenAI's function-calling guide's example, as given there.
GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get current temperature for a given location.",
    "parameters": {"type": "object", "required": ["location"],
                   "properties": {"location": {"type": "string",
                                               "description": "The city and country, e.g. Paris, France"}}}}}


@langchain_tools.tool
def get_weather(location: str) -> str:
    """Get the current weather in a given location."""
    return f"It is sunny in {location}."


class CityFacts(pydantic.BaseModel):
    """Facts about a city."""

    name: str
    population: int
    area_km2: float


@pytest.fixture(scope="module")
def server(smollm2_demo_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(smollm2_demo_engine_dir, tmp_path_factory.mktemp("smollm2_tools")) as live:
        yield live


def chat_model(server: LiveServer) -> object:
    return langchain_openai.ChatOpenAI(model=MODEL, base_url=server.base_url, api_key="unused", max_retries=0,
                                       timeout=300, temperature=0, max_tokens=96)


@pytest.mark.parametrize("tool_choice", ["any", "get_weather"])
def test_a_langchain_tool_forced_returns_its_one_argument(server: LiveServer, tool_choice: str) -> None:
    reply = chat_model(server).bind_tools([get_weather], tool_choice=tool_choice).invoke(
        "What's the weather like in Paris today?")
    assert reply.response_metadata["finish_reason"] == "tool_calls", reply
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"location"}, call
    assert not reply.invalid_tool_calls


def test_openai_get_weather_forced_names_no_other_key(server: LiveServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather like in Paris today?"}],
            "tools": [GET_WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "temperature": 0, "max_tokens": 96}
    status, reply = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    assert set(json.loads(call["function"]["arguments"])) == {"location"}, call


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_a_pydantic_model_comes_back_with_bounded_numbers(server: LiveServer, method: str) -> None:
    facts = chat_model(server).with_structured_output(CityFacts, method=method).invoke(
        "Paris is the capital of France: about 2.1 million people on 105.4 square kilometres.")
    assert isinstance(facts, CityFacts), facts
    assert len(str(abs(facts.population))) <= 16 and abs(facts.area_km2) <= 1e16

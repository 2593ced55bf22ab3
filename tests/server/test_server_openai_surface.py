"""The OpenAI surface clients use, through the official `openai` client: developer messages, one model's card, list
prompts, n > 1 sharing its prompt's pages, presence and frequency penalties, /tokenize and /detokenize, and errors
that name an unsupported field in their message."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.server_harness import MODEL, LiveServer, audited_client, build_server_engine, live_server

from kvforge import LLM, SamplingParams

SYSTEM = "You answer questions about the Harbor Point tidal array in one short sentence. "
GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def engine_dir(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_server_engine(tiny_onnx_dir, tmp_path_factory.mktemp("surface_engine"))


@pytest.fixture(scope="module")
def server(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(engine_dir, tmp_path_factory.mktemp("surface")) as live:
        yield live


@pytest.fixture
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with audited_client(server) as api:
        yield api


def hits(server: LiveServer, name: str = "kvforge_prefix_cache_hits_tokens_total") -> float:
    status, text = server.request("GET", "/metrics")
    assert status == 200
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_developer_messages_are_system_messages(server: LiveServer, client: openai.OpenAI) -> None:
    def answer(role: str) -> str:
        reply = client.chat.completions.create(model=MODEL, messages=[
            {"role": role, "content": SYSTEM}, {"role": "user", "content": "How deep?"}], **GREEDY)
        return reply.choices[0].message.content or ""

    assert answer("developer") == answer("system")
    # ... and the prompts are the same tokens: /tokenize says so
    counts = [server.request("POST", "/tokenize", {"messages": [{"role": role, "content": SYSTEM}]})
              for role in ("developer", "system")]
    assert counts[0] == counts[1] and counts[0][0] == 200


def test_one_models_card(client: openai.OpenAI) -> None:
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_dump() == next(m for m in client.models.list().data if m.id == MODEL).model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.code == "model_not_found" and "gpt-4" in missing.value.message


def test_list_prompts_give_one_choice_each_in_order(server: LiveServer, client: openai.OpenAI) -> None:
    prompts = ["The tide turns at", "Harbor Point has", "Turbines spin when"]
    alone = [client.completions.create(model=MODEL, prompt=p, **GREEDY).choices[0].text for p in prompts]
    both = client.completions.create(model=MODEL, prompt=prompts, **GREEDY)
    assert [c.index for c in both.choices] == [0, 1, 2]
    assert [c.text for c in both.choices] == alone
    ids = [server.request("POST", "/tokenize", {"prompt": p})[1]["count"] for p in prompts]
    assert both.usage.prompt_tokens == sum(ids)
    tokens = client.completions.create(model=MODEL, prompt=[[72, 105], [84, 104, 101]], **GREEDY)
    assert len(tokens.choices) == 2


def test_n_choices_share_the_prompt_pages(server: LiveServer, client: openai.OpenAI) -> None:
    question = [{"role": "system", "content": SYSTEM * 2}, {"role": "user", "content": "n choices, one prefill?"}]
    before, reused_before = hits(server), hits(server, "kvforge_prefill_reused_tokens_total")
    reply = client.chat.completions.create(model=MODEL, messages=question, n=3, temperature=1, seed=7, max_tokens=5)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    prompt = reply.usage.prompt_tokens
    assert prompt > 2 * 16 and 3 <= reply.usage.completion_tokens <= 15  # the prompt once, every choice's tokens
    # The first computed the prompt; the other two found its full pages (16 tokens each) in the cache: prefill work
    # saved, but not cached for this call, whose own first choice made them (issue 52 item 3): /metrics' cache hits
    # count what usage counts.
    assert hits(server, "kvforge_prefill_reused_tokens_total") - reused_before >= 2 * (prompt // 16) * 16 - 16
    assert hits(server) - before == reply.usage.prompt_tokens_details.cached_tokens
    # Seeds differ per choice (seed + j), so the same call again gives the same n answers, not n equal ones.
    again = client.chat.completions.create(model=MODEL, messages=question, n=3, temperature=1, seed=7, max_tokens=5)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    greedy = client.chat.completions.create(model=MODEL, messages=question, n=2, **GREEDY)
    single = client.chat.completions.create(model=MODEL, messages=question, **GREEDY)
    assert [c.message.content for c in greedy.choices] == [single.choices[0].message.content] * 2


def test_n_choices_stream_with_their_index(client: openai.OpenAI) -> None:
    body = {"model": MODEL, "prompt": ["Tides rise", "Tides fall"], "n": 2, **GREEDY}
    whole = client.completions.create(**body)
    texts = ["", "", "", ""]
    usage = None
    for chunk in client.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Two answers?"}], "n": 2, **GREEDY}
    replies = ["", ""]
    roles = set()
    for chunk in client.chat.completions.create(**chat, stream=True):
        for choice in chunk.choices:
            replies[choice.index] += choice.delta.content or ""
            roles.add((choice.index, choice.delta.role))
    assert replies == [c.message.content for c in client.chat.completions.create(**chat).choices]
    assert {(0, "assistant"), (1, "assistant")} <= roles  # each choice opens with its role


def test_penalties_match_the_python_api(engine_dir: Path, client: openai.OpenAI) -> None:
    prompt = "the the the the"
    served = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
                                       presence_penalty=1.5, frequency_penalty=0.5)
    plain = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
                                      presence_penalty=0, frequency_penalty=0)
    with LLM(str(engine_dir), num_threads=1) as llm:
        [penalized] = llm.generate(prompt, SamplingParams(temperature=0, max_generate_length=12, presence_penalty=1.5,
                                                          frequency_penalty=0.5))
        [greedy] = llm.generate(prompt, SamplingParams(temperature=0, max_generate_length=12))
    assert served.choices[0].text == penalized.text and plain.choices[0].text == greedy.text
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=prompt, presence_penalty=3)
    assert bad.value.param == "presence_penalty"


def test_tokenize_and_detokenize(server: LiveServer, client: openai.OpenAI) -> None:
    text = "Harbor Point"
    status, vllm = server.request("POST", "/tokenize", {"model": MODEL, "prompt": text})
    assert status == 200 and vllm["count"] == len(vllm["tokens"]) and vllm["max_model_len"] == 512
    assert vllm["count"] == client.completions.create(model=MODEL, prompt=text, max_tokens=1).usage.prompt_tokens
    status, llama = server.request("POST", "/tokenize", {"content": text})  # llama.cpp's field, no model
    assert status == 200 and llama["tokens"] == vllm["tokens"]
    status, back = server.request("POST", "/detokenize", {"tokens": vllm["tokens"]})
    assert status == 200 and back == {"prompt": text, "content": text}
    chat = [{"role": "user", "content": "Hi"}]
    status, templated = server.request("POST", "/tokenize", {"messages": chat})
    reply = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1)
    assert status == 200 and templated["count"] == reply.usage.prompt_tokens
    for path, body, param in [("/tokenize", {"prompt": 3}, "prompt"), ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model"),
                              ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
                              ("/detokenize", {"tokens": "12"}, "tokens")]:
        status, error = server.request("POST", path, body)
        assert status == 400 and error["error"]["param"] == param, (path, body, error)


@pytest.mark.parametrize(("field", "value"), [("echo", True), ("best_of", 2),
                                              ("tools", [{"type": "function", "function": {"name": "f"}}])])
def test_an_unsupported_field_is_named_in_the_message(client: openai.OpenAI, field: str, value: object) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="hi", extra_body={field: value})
    assert refused.value.param == field and field in refused.value.message

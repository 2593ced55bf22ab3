"""llm_serve through the official `openai` client and plain HTTP, on a tiny engine, on 127.0.0.1.

Greedy answers equal llm_inference's, streaming equals non-streaming, reuse shows in cached_tokens, bad
requests get OpenAI-style errors and the server keeps serving, and after every test the cache audits clean.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.engine_driver import lora_model_with_adapters
from support.server_harness import (
    MODEL,
    SERVER_BUILD,
    LiveServer,
    audited_client,
    build_server_engine,
    idle_audit,
    live_server,
)

from kvforge import LLM, SamplingParams
from kvforge.runtime.engine.engine import Engine
from kvforge.server.render import TextStreamer, held_for_stop

SYSTEM = "You are the assistant of the Harbor Point tidal energy array. Answer briefly and precisely. " * 2
QUESTIONS = ["How many turbines?", "Who chaired the review?", "When did construction begin?"]


@pytest.fixture(scope="module")
def engine_dir(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_server_engine(tiny_onnx_dir, tmp_path_factory.mktemp("server_engine"))


@pytest.fixture(scope="module")
def server(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(engine_dir, tmp_path_factory.mktemp("server")) as live:
        yield live


@pytest.fixture
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with audited_client(server) as api:
        yield api


def chat(question: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def stream_text(chunks: Any) -> tuple[str, str | None, Any]:
    """(text, finish_reason, usage) of a chat or completion stream."""
    text, reason, usage = "", None, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
            reason = choice.finish_reason or reason
    return text, reason, usage


def metric_values(server: LiveServer) -> dict[str, float]:
    """Every sample of /metrics by name and labels, e.g. 'kvforge_requests_total{outcome="length"}'."""
    status, text = server.request("GET", "/metrics")
    assert status == 200
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "le")
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            if "le" not in sample.labels:
                values[key] = sample.value
    return values


# --- answers: the same as llm_inference, streamed or not ------------------------------------------------


def test_greedy_answers_equal_llm_inference(server: LiveServer, client: openai.OpenAI, engine_dir: Path,
                                            run_cli: Callable[..., Any], tmp_path: Path) -> None:
    answers = [client.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=12, temperature=0)
               for q in QUESTIONS]
    raw = client.completions.create(model=MODEL, prompt="The tidal array delivered", max_tokens=12, temperature=0)
    stop = answers[0].choices[0].message.content[4:6]  # a stop string the first answer is known to contain
    stopped = client.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[0]), max_tokens=12,
                                             temperature=0, stop=[stop])
    requests = [{"messages": chat(q)} for q in QUESTIONS]
    requests.append({"messages": [{"role": "user", "content": "The tidal array delivered"}],
                     "apply_chat_template": False})
    requests.append({"messages": chat(QUESTIONS[0]), "stop": [stop]})
    request_file = tmp_path / "requests.json"
    request_file.write_text(json.dumps({"temperature": 0, "max_generate_length": 12, "requests": requests}))
    result = run_cli(["llm_inference", "--engineDir", engine_dir, "--inputFile", request_file,
                      "--outputFile", tmp_path / "out.json", "--numThreads", "2"])
    assert result.returncode == 0, result.stderr
    expected = json.loads((tmp_path / "out.json").read_text())["responses"]
    got = [*answers, raw, stopped]
    texts = [g.choices[0].message.content if g.object == "chat.completion" else g.choices[0].text for g in got]
    assert texts == [e["output_text"] for e in expected]
    reasons = {"end-of-sequence": "stop", "stop-words": "stop", "max-length": "length"}
    assert [g.choices[0].finish_reason for g in got] == [reasons[e["finish_reason"]] for e in expected]
    assert stopped.choices[0].finish_reason == "stop" and stop not in texts[-1]
    assert [g.usage.prompt_tokens for g in got] == [e["usage"]["prompt_tokens"] for e in expected]


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    messages = chat(QUESTIONS[1])
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    text, reason, usage = stream_text(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert (text, reason) == (whole.choices[0].message.content, whole.choices[0].finish_reason)
    assert usage.completion_tokens == whole.usage.completion_tokens == 16
    raw = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    text, reason, _ = stream_text(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10,
                                                            temperature=0, stream=True))
    assert (text, reason) == (raw.choices[0].text, raw.choices[0].finish_reason) == (raw.choices[0].text, "length")


def test_stop_strings_are_never_streamed(client: openai.OpenAI) -> None:
    """A stream holds back a tail that could grow into a stop string, so the stop string never goes out."""
    full = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0).choices[0].text
    stop = full[6:9]
    expected = full[:full.find(stop)]
    text, reason, _ = stream_text(client.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0,
                                                            stop=stop, stream=True))
    assert (text, reason) == (expected, "stop")


def test_logprobs_chat_and_completion(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[2]), max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 6
    for entry in content:  # greedy: the sampled token is the best alternative
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) and entry.logprob <= 0
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    streamed = [e for chunk in client.chat.completions.create(
        model=MODEL, messages=chat(QUESTIONS[2]), max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
        stream=True) for choice in chunk.choices if choice.logprobs for e in choice.logprobs.content]
    assert [(e.token, round(e.logprob, 6)) for e in streamed] == [(e.token, round(e.logprob, 6)) for e in content]
    raw = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2)
    logprobs = raw.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(lp)
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True))
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                         top_p=0.9, seed=seed).choices[0].text
    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in range(4)}) > 1


# --- reuse ------------------------------------------------------------------------------------------------


def test_cached_tokens_on_a_repeated_long_prefix(client: openai.OpenAI) -> None:
    salt = {"cache_salt": "test_cached_tokens"}  # a fresh salt: no page from another test can hit
    first, second = (client.chat.completions.create(model=MODEL, messages=chat(q), max_tokens=4, temperature=0,
                                                    extra_body=salt) for q in QUESTIONS[:2])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached >= len(SYSTEM) // 16 * 16 - 16  # the system prompt's pages
    off = client.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[2]), max_tokens=4, temperature=0,
                                         extra_body={**salt, "reuse_context": False})
    assert off.usage.prompt_tokens_details.cached_tokens == 0
    _, _, usage = stream_text(client.chat.completions.create(
        model=MODEL, messages=chat(QUESTIONS[2]), max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=salt))
    assert usage.prompt_tokens_details.cached_tokens == cached


def test_cache_generated_tokens_false_keeps_the_answer_out(server: LiveServer, client: openai.OpenAI) -> None:
    def published_tokens(engine: Engine) -> int:  # records hold full pages only
        return sum(len(r.token_ids) for r in engine.cache.records.least_recent_first())

    def publish(**extra: Any) -> int:
        before = server.on_engine(published_tokens)
        client.completions.create(model=MODEL, prompt="x" * 40, max_tokens=40, temperature=0, extra_body=extra)
        return server.on_engine(published_tokens) - before

    assert publish(cache_salt="gen", cache_generated_tokens=True) == 32 + 64  # the prompt, then prompt + answer
    assert publish(cache_salt="no-gen", cache_generated_tokens=False) == 32  # the prompt's two full pages only


# --- errors -------------------------------------------------------------------------------------------------


BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": chat("hi")}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat("hi"), "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat("hi"), "reuse_context": "yes"}, 400, "reuse_context"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat("hi"), "reuse_context": None}, 400, "reuse_context"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "cache_generated_tokens": 1}, 400, "cache_generated_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat("hi"), "lora_name": "nope"}, 400, "lora_name"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat("x" * 300)}, 400, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 300}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**6]}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat("hi"), "n": 17}, 400, "n"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat("hi"), "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat("hi"), "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "bot", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat("hi"), "stop": [""]}, 400, "stop[0]"),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat("hi"), "stream_options": {"include_usage": "y"}},
     400, "stream_options.include_usage"),
    ("/v1/nowhere", {}, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server: LiveServer, client: openai.OpenAI, path: str, body: Any, status: int,
                                        param: str | None) -> None:
    got, answer = server.request("POST", path, body)
    assert got == status, answer
    error = answer["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    assert "\n" not in error["message"]
    # ... and the server keeps serving
    # (greedy with end of sequence banned: sampled at temperature 1 the answer's length was a draw)
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0,
                                     logit_bias={"2": -100}).usage.completion_tokens == 2


def test_errors_through_the_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4", messages=chat("hi"))
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=chat("hi"), extra_body={"reuse_context": "no"})
    assert bad.value.param == "reuse_context" and "true or false" in bad.value.message


# --- tenants ----------------------------------------------------------------------------------------------


def test_tenants_never_share_pages(engine_dir: Path, tmp_path: Path) -> None:
    keys = {"key-a": "team-a", "key-a2": "team-a", "key-b": "team-b"}
    with live_server(engine_dir, tmp_path, api_keys=keys) as server:
        def ask(key: str, **extra: Any) -> int:
            with openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0) as api:
                answer = api.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[0]), max_tokens=2,
                                                     temperature=0, extra_body=extra)
            return answer.usage.prompt_tokens_details.cached_tokens

        assert ask("key-a") == 0
        shared = ask("key-a")
        assert shared > 0 and ask("key-a2") == shared  # one tenant, two keys: one cache
        assert ask("key-b") == 0 and ask("key-b") == shared  # the other tenant computes its own pages
        assert ask("key-a", cache_salt="mine") == 0 and ask("key-b", cache_salt="mine") == 0  # never the salt alone
        with openai.OpenAI(base_url=server.base_url, api_key="key-c", max_retries=0) as api, \
                pytest.raises(openai.AuthenticationError) as wrong:
            api.models.list()
        assert wrong.value.code == "invalid_api_key"
        status, missing = server.request("POST", "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert status == 401 and missing["error"]["code"] == "invalid_api_key"
        assert server.request("GET", "/v1/models", headers={"Authorization": "Basic key-a"})[0] == 401
        assert server.request("GET", "/health")[0] == 200

        def pages_by_salt(engine: Engine) -> dict[str, set[int]]:
            pages: dict[str, set[int]] = {}
            for record in engine.cache.records.least_recent_first():
                pages.setdefault(record.extras.cache_salt, set()).update(record.page_ids)
            return pages

        by_salt = server.on_engine(pages_by_salt)
        assert len(by_salt) == 4  # team-a, team-b, and each with the client salt "mine"
        salts = list(by_salt)
        for i, salt in enumerate(salts):
            assert all(not by_salt[salt] & by_salt[other] for other in salts[i + 1:]), "two tenants share a page"
        server.on_engine(idle_audit)


# --- cancellation, the bounded queue, shutdown --------------------------------------------------------------


def paused(server: LiveServer) -> threading.Event:
    """Hold the engine thread between steps until the returned event is set."""
    gate = threading.Event()
    server.state.engine_loop.call(lambda _engine: gate.wait(60))
    return gate


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    import time
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_sequence(server: LiveServer, client: openai.OpenAI, stream: bool) -> None:
    import http.client

    before = metric_values(server)
    publications = server.on_engine(lambda e: e.cache.profile()["publications"]["attempts"])
    salt = f"disconnect-{stream}"
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": MODEL, "prompt": "y" * 48, "max_tokens": 400, "stream": stream, "temperature": 0,
            "logit_bias": {"2": -100}, "cache_salt": salt}  # no end of sequence: it would run 400 tokens
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    if stream:
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")  # the first token is out
    else:
        ttft = "kvforge_time_to_first_token_seconds_count"
        wait_until(lambda: metric_values(server)[ttft] > before[ttft])  # it is decoding
    gate = paused(server)
    connection.sock.close()  # hang up mid-answer
    connection.close()
    wait_until(lambda: server.state.in_flight == 0)  # the handler saw it and sent the abort
    gate.set()

    def records(engine: Engine) -> list[int]:
        return [len(r.token_ids) for r in engine.cache.records.least_recent_first()
                if r.extras.cache_salt.endswith(f":{salt}")]

    assert server.on_engine(records) == [48]  # the prompt's pages; none holding a generated token
    # Only the prompt's publication (at the end of its prefill) happened; the sequence itself was never published.
    assert server.on_engine(lambda e: e.cache.profile()["publications"]["attempts"]) == publications + 1
    server.on_engine(idle_audit)
    after = metric_values(server)
    assert after.get('kvforge_requests_total{outcome="aborted"}', 0) == \
        before.get('kvforge_requests_total{outcome="aborted"}', 0) + 1
    assert after['kvforge_generation_tokens_total'] - before['kvforge_generation_tokens_total'] < 400


def test_a_full_queue_answers_429(engine_dir: Path, tmp_path: Path) -> None:
    with live_server(engine_dir, tmp_path, max_queued_requests=1) as server:
        limit = server.state.max_in_flight
        assert limit == 4 + 1  # the engine's maxBatchSize rows plus one queued
        gate = paused(server)
        results: list[int] = []
        body = {"model": MODEL, "prompt": "queued", "max_tokens": 3}
        threads = [threading.Thread(target=lambda: results.append(server.request("POST", "/v1/completions", body)[0]))
                   for _ in range(limit)]
        for thread in threads:
            thread.start()
        wait_until(lambda: server.state.in_flight == limit)
        status, error = server.request("POST", "/v1/completions", body)
        assert status == 429 and error["error"]["code"] == "rate_limit_exceeded"
        assert metric_values(server)["kvforge_requests_in_flight"] == limit
        gate.set()
        for thread in threads:
            thread.join(60)
        assert results == [200] * limit
        assert metric_values(server)['kvforge_requests_total{outcome="rejected"}'] == 1
        server.on_engine(idle_audit)


def test_shutdown_cancels_what_does_not_finish_in_time(engine_dir: Path, tmp_path: Path) -> None:
    with live_server(engine_dir, tmp_path, shutdown_timeout=0.3) as server:
        stream = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0).completions.create(
            model=MODEL, prompt="z" * 40, max_tokens=400, stream=True, logit_bias={"2": -100})
        next(iter(stream))
        gate = paused(server)  # it cannot finish: uvicorn cancels it after the grace period
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        threading.Timer(1.5, gate.set).start()
        stopper.join(60)
        with pytest.raises(Exception):  # noqa: B017 - the connection is cut: httpx's error type varies by version
            for _ in stream:
                pass
        assert not server.state.engine_loop.alive
        idle_audit(server.state.engine_loop.engine)  # the engine thread is gone: audit from here


def test_an_engine_failure_fails_its_requests_and_the_server_goes_on(server: LiveServer,
                                                                    client: openai.OpenAI) -> None:
    def break_next_step(engine: Engine) -> None:
        engine.backend.fail_next = True  # type: ignore[attr-defined] - the harness's FlakyBackend

    server.on_engine(break_next_step)
    with pytest.raises(openai.InternalServerError) as failed:
        client.completions.create(model=MODEL, prompt="doomed", max_tokens=4)
    assert "engine failed" in failed.value.message
    # greedy with end of sequence banned: the default temperature 1 could sample it and end early
    after = client.completions.create(model=MODEL, prompt="fine", max_tokens=4, temperature=0, logit_bias={"2": -100})
    assert (after.usage.completion_tokens, after.choices[0].finish_reason) == (4, "length")
    assert metric_values(server)['kvforge_requests_total{outcome="failed"}'] >= 1


# --- the other endpoints ----------------------------------------------------------------------------------


def test_chat_page_assets_favicon_and_modalities(server: LiveServer) -> None:
    """What the chat page needs besides a browser (issue 51 item 13): its markdown renderer, a favicon rather than a
    404, the model card's input_modalities (Attach shows only with media), and nothing fetched from elsewhere."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"{server.url}/favicon.ico", timeout=30) as response:
        assert response.status == 200 and response.headers["content-type"] == "image/x-icon"
        assert response.read()[:4] == b"\x00\x00\x01\x00"  # an ICO file
    status, card = server.request("GET", f"/v1/models/{MODEL}")
    assert status == 200 and card["input_modalities"] == ["text"]  # the tiny engine has no encoder
    status, page = server.request("GET", "/")
    assert status == 200 and all(f'id="{name}"' in page for name in ("stop", "new-chat", "attach-label"))
    assets = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert "/static/markdown.js" in assets and "/favicon.ico" in assets
    for asset in assets:
        assert asset.startswith("/"), f"the chat page loads {asset} from elsewhere"  # offline: no CDN
    status, script = server.request("GET", "/static/markdown.js")
    assert status == 200 and "innerHTML" not in script and "textContent" in script  # builds text nodes only


def test_models_health_page_and_metrics(server: LiveServer, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert server.request("GET", "/health") == (200, {"status": "ok"})
    status, page = server.request("GET", "/")
    assert status == 200 and "/static/chat.js" in page
    status, script = server.request("GET", "/static/chat.js")
    assert status == 200 and "/v1/chat/completions" in script
    before = metric_values(server)
    for question in QUESTIONS:
        client.chat.completions.create(model=MODEL, messages=chat(question, "metrics " * 20), max_tokens=5,
                                       temperature=0)
    after = metric_values(server)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert grew("kvforge_time_to_first_token_seconds_count") == 3
    assert grew("kvforge_inter_token_latency_seconds_count") == 3 * 4
    assert grew("kvforge_generation_tokens_total") == 15
    assert grew('kvforge_requests_total{outcome="length"}') == 3
    assert 0 < grew("kvforge_prefix_cache_hits_tokens_total") < grew("kvforge_prefix_cache_queries_tokens_total")
    assert grew("kvforge_prefill_reused_tokens_total") == grew("kvforge_prefix_cache_hits_tokens_total")
    assert after["kvforge_num_requests_waiting"] == after["kvforge_num_requests_running"] == 0
    assert after["kvforge_requests_in_flight"] == 0
    pool = server.on_engine(lambda e: (e.cache.pages.num_free, e.cache.pages.capacity, len(e.cache.records)))
    assert (after["kvforge_kv_pool_pages_free"], after["kvforge_kv_pool_pages_total"],
            after["kvforge_context_cache_records"]) == pool
    assert after["kvforge_scheduler_steps_total"] > before["kvforge_scheduler_steps_total"]
    assert "kvforge_scheduler_preemptions_total" in after
    assert after['kvforge_engine_step_seconds_count{stage="llm_prefill"}'] > 0


def test_lora_name_selects_a_loaded_adapter(tmp_path: Path) -> None:
    _, paths = lora_model_with_adapters(tmp_path, replace(SERVER_BUILD, max_lora_rank=8), "fp16", (("a", 1, 4),))
    prompt = "Once upon a time"
    alone = LLM(tmp_path / "engine", num_threads=2, lora_weights={"a": str(paths["a"])}).generate(
        prompt, SamplingParams(temperature=0, max_generate_length=8), lora_name="a")[0].text
    with live_server(tmp_path / "engine", tmp_path, lora_weights={"a": str(paths["a"])}) as server, \
            openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0) as api:
        assert [m.id for m in api.models.list()] == [MODEL, "a"]

        def complete(model: str = MODEL, **extra: Any) -> str:
            return api.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body=extra).choices[0].text

        assert complete(lora_name="a") == complete("a") == alone != complete()
        status, error = server.request("POST", "/v1/completions", {"model": "a", "prompt": prompt, "lora_name": "b"})
        assert status == 400 and error["error"]["param"] == "lora_name"
        server.on_engine(idle_audit)


# --- stream text, alone -------------------------------------------------------------------------------------


class ByteTokenizer:
    """Decodes token ids as UTF-8 bytes, as a byte-level BPE does: a split character decodes to U+FFFD."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize(("stops", "final"), [((), "héllo wörld €5"), (("wö",), "héllo "),
                                              (("€5", "xyz"), "héllo wörld ")])
def test_text_streamer_never_takes_text_back(stops: tuple[str, ...], final: str) -> None:
    data = list("héllo wörld €5".encode())
    streamer = TextStreamer(ByteTokenizer(), stops)  # type: ignore[arg-type]
    deltas = []
    for n in range(1, len(data) + 1):
        if any(stop in ByteTokenizer().decode(data[:n]) for stop in stops):
            break  # the engine ends the request here: its final text comes cut at the stop string
        deltas.append(streamer.push(data[:n]))
    assert all("\ufffd" not in d for d in deltas)
    assert not any(stop in "".join(deltas) for stop in stops)
    sent = "".join(deltas)
    assert final.startswith(sent) and sent + streamer.finish(final) == final
    assert held_for_stop("abc wö", ("wörld",)) == 2 and held_for_stop("abc", ("wörld",)) == 0

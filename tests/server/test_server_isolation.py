"""One client cannot hurt another's requests: bad values are refused at the edge, huge prompts by their size, and
preparation (templates, tokenization, media encoding) runs beside the engine thread's steps, never inside them.

Every test compares the normal client's answers with the same requests run alone and audits the cache after.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image
from support.media_engines import build_tiny_vlm
from support.server_harness import MODEL, LiveServer, build_server_engine, idle_audit, live_server

from kvforge.builder.build import BuildOptions
from kvforge.runtime.inputs.multimodal.visual import VisualEncoder

pytestmark = pytest.mark.serial  # wall-clock bounds (streams' gaps and refusals within a second): run alone

KEYS = {"key-hostile": "hostile", "key-normal": "normal"}
QUESTIONS = ["How many turbines does the array have?", "Who chaired the review?", "When did it begin?"]
HUGE_PROMPT = "tide " * (12 * 2**20 // 5)  # 12 MiB
MAX_GAP_S = 1.0  # a stream beside the hostile requests: tokenizing 12 MiB on the engine thread took seconds


@pytest.fixture(scope="module")
def engine_dir(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_server_engine(tiny_onnx_dir, tmp_path_factory.mktemp("isolation_engine"))


@pytest.fixture(scope="module")
def server(engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(engine_dir, tmp_path_factory.mktemp("isolation"), api_keys=KEYS) as live:
        yield live


@pytest.fixture
def audited(server: LiveServer) -> Iterator[LiveServer]:
    yield server
    server.on_engine(idle_audit)  # no leaked page, no stray sequence, every refcount right


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}]


def stream_answer(server: LiveServer, messages: list[dict[str, Any]], max_tokens: int = 24, key: str = "key-normal",
                  started: threading.Event | None = None) -> tuple[str, list[float]]:
    """A greedy chat stream's text and the gaps before each chunk (seconds, the first from the request on);
    `started` is set at the first chunk."""
    text, gaps, last = "", [], time.perf_counter()
    with openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=120) as api:
        for chunk in api.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                 temperature=0, stream=True):
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            if started is not None:
                started.set()
            text += "".join(choice.delta.content or "" for choice in chunk.choices)
    return text, gaps


def raw_post(server: LiveServer, path: str, body: bytes, key: str = "key-hostile") -> tuple[int, Any]:
    return server.request("POST", path, body, headers={"Authorization": f"Bearer {key}"})


def completion_body(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 4, **fields}).encode()


def run_together(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run the jobs on threads at once; their results (or exceptions) in order."""
    results: list[Any] = [None] * len(jobs)

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except Exception as exc:  # the test reads it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return results


def beside(server: LiveServer, hostile: Callable[[], list[tuple[int, Any]]]
           ) -> tuple[list[list[tuple[str, list[float]]]], list[tuple[int, Any]]]:
    """Each question streamed over and over by the normal tenant while `hostile` runs; (streams per question,
    what `hostile` returned)."""
    done = threading.Event()

    def normal(question: str) -> list[tuple[str, list[float]]]:
        streams = [stream_answer(server, chat(question))]
        while not done.is_set():
            streams.append(stream_answer(server, chat(question)))
        return streams

    def attack() -> list[tuple[int, Any]]:
        try:
            return hostile()
        finally:
            done.set()

    *streams, answers = run_together([*(lambda q=q: normal(q) for q in QUESTIONS), attack])
    for result in (*streams, answers):
        if isinstance(result, Exception):
            raise result
    return streams, answers


def assert_as_alone(streams: list[list[tuple[str, list[float]]]], alone: list[str]) -> None:
    for question_streams, text in zip(streams, alone, strict=True):
        assert [answer for answer, _ in question_streams] == [text] * len(question_streams)
    assert max(gap for question_streams in streams for _, gaps in question_streams for gap in gaps) < MAX_GAP_S


def test_an_out_of_vocabulary_logit_bias_is_a_400_and_other_streams_finish(audited: LiveServer) -> None:
    alone = [stream_answer(audited, chat(q))[0] for q in QUESTIONS]
    bad = completion_body(prompt="tide", logit_bias={"1000000": 5})
    streams, answers = beside(audited, lambda: [raw_post(audited, "/v1/completions", bad) for _ in range(6)])
    assert_as_alone(streams, alone)
    for status, body in answers:
        assert status == 400 and body["error"]["param"] == "logit_bias"
        assert "outside the vocabulary" in body["error"]["message"]


def test_a_lone_surrogate_cache_salt_is_a_400_naming_it(audited: LiveServer) -> None:
    body = b'{"model": "%s", "prompt": "tide", "max_tokens": 2, "cache_salt": "\\ud800"}' % MODEL.encode()
    status, answer = raw_post(audited, "/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == "cache_salt"
    assert "lone surrogate" in answer["error"]["message"] and "\n" not in answer["error"]["message"]


def test_a_12_mib_prompt_is_refused_by_size_without_tokenizing(audited: LiveServer,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = audited.state.engine_loop.engine.tokenizer
    encoded: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text: encoded.append(len(text)) or encode(text))
    body = completion_body(prompt=HUGE_PROMPT)
    started = time.perf_counter()
    status, answer = raw_post(audited, "/v1/completions", body)
    elapsed = time.perf_counter() - started
    assert status == 400 and answer["error"]["param"] == "prompt" and "maxInputLen" in answer["error"]["message"]
    assert elapsed < 1.0 and not any(n > 2**20 for n in encoded)


def test_one_tenants_hostile_requests_leave_anothers_answers_as_they_are_alone(audited: LiveServer) -> None:
    alone = [stream_answer(audited, chat(q))[0] for q in QUESTIONS]
    hostile = [
        completion_body(prompt="tide", logit_bias={"99999": 1}),
        b'{"model": "%s", "prompt": "tide", "cache_salt": "\\udfff"}' % MODEL.encode(),
        completion_body(prompt=HUGE_PROMPT),
        completion_body(prompt=[10**9]),
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 100_000}] * 64}).encode(),
    ]
    paths = ["/v1/completions"] * 4 + ["/v1/chat/completions"]

    def attack() -> list[tuple[int, Any]]:
        return [raw_post(audited, path, body) for _ in range(2) for path, body in zip(paths, hostile, strict=True)]

    streams, answers = beside(audited, attack)
    assert_as_alone(streams, alone)
    assert [status for status, _ in answers] == [400] * 10
    assert [body["error"]["param"] for _, body in answers] == ["logit_bias", "cache_salt", "prompt", "prompt",
                                                               "messages"] * 2


# --- media: the encoder runs beside the steps -------------------------------------------------------------

ENCODE_SLEEP_S = 2.0
VLM_BUILD = BuildOptions(max_input_len=384, max_kv_cache_capacity=512, max_batch_size=4, tokens_per_page=16)


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("isolation_vlm")
    engine_dir, visual = build_tiny_vlm(root, VLM_BUILD)
    with live_server(engine_dir, root / "server", multimodal_engine_dir=str(visual)) as live:
        yield live


def png_data_url(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 255, (30, 40, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(out.getvalue()).decode()}"


def test_a_slow_cold_image_does_not_pause_another_clients_stream(vlm_server: LiveServer,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    encode = VisualEncoder.encode
    encoding = threading.Event()
    window: list[float] = []

    def slow_encode(self: VisualEncoder, items: list) -> list[np.ndarray]:
        encoding.set()
        window.append(time.perf_counter())
        time.sleep(ENCODE_SLEEP_S)
        window.append(time.perf_counter())
        return encode(self, items)

    monkeypatch.setattr(VisualEncoder, "encode", slow_encode)
    image = [{"role": "user", "content": [{"type": "text", "text": "What is shown?"},
                                          {"type": "image_url", "image_url": {"url": png_data_url(7)}}]}]
    alone, _ = stream_answer(vlm_server, chat(QUESTIONS[0]), max_tokens=64, key="unused")

    def text_streams_while_encoding() -> list[tuple[str, list[float]]]:
        """Streams one after another from the encoder's start to its end: each must flow, its first token too."""
        assert encoding.wait(60)
        streams = []
        while len(window) < 2:
            streams.append(stream_answer(vlm_server, chat(QUESTIONS[0]), max_tokens=64, key="unused"))
        return streams

    image_text, streams = run_together([lambda: stream_answer(vlm_server, image, max_tokens=4, key="unused")[0],
                                        text_streams_while_encoding])
    assert isinstance(image_text, str) and len(window) == 2
    assert len(streams) >= 3 and all(text == alone for text, _ in streams)
    assert max(gap for _, gaps in streams for gap in gaps) < ENCODE_SLEEP_S / 4  # before: they waited for it
    vlm_server.on_engine(idle_audit)


def test_a_client_gone_while_its_image_encodes_leaves_nothing_behind(vlm_server: LiveServer,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    encode = VisualEncoder.encode
    finished = threading.Event()

    def slow_encode(self: VisualEncoder, items: list) -> list[np.ndarray]:
        time.sleep(ENCODE_SLEEP_S / 2)
        try:
            return encode(self, items)
        finally:
            finished.set()

    monkeypatch.setattr(VisualEncoder, "encode", slow_encode)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(11)}}]}]
    with openai.OpenAI(base_url=vlm_server.base_url, api_key="unused", max_retries=0, timeout=0.3) as api, \
            pytest.raises(openai.APITimeoutError):
        api.chat.completions.create(model=MODEL, messages=image, max_tokens=4)
    assert finished.wait(30)
    deadline = time.monotonic() + 10
    while vlm_server.state.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert vlm_server.state.in_flight == 0
    assert vlm_server.on_engine(lambda engine: (idle_audit(engine), len(engine.core.sequences)))[1] == 0
    assert not vlm_server.state.engine_loop._sinks  # noqa: SLF001 - no sink waits for a request that never ran

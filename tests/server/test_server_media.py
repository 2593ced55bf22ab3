"""llm_serve with images and audio in OpenAI content parts, on the tiny Idefics3 and Qwen2-Audio engines.

Inline media equal the same files run by llm_inference (greedy text, top-1 tokens), a repeated image is served
warm (encoder cache hit, reused pages) with the cold answer, local files need --allowedMediaDir, http(s) URLs
are refused, and bad media get a 400 naming the content part while the server keeps serving.
"""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from support.engine_driver import run_file
from support.media_engines import build_tiny_vlm
from support.server_harness import MODEL, LiveServer, idle_audit, live_server

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.builder.encoder_build import build_encoder_engine
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.server import app as server_app
from kvforge.server.media import MediaPolicy
from kvforge.server.protocol import ApiError, parse_call
from kvforge.tools.export.families.qwen2_audio_source import write_audio_onnx_dir
from kvforge.tools.export.sources.synthetic import synthetic_qwen2_audio
from kvforge.tools.export.writer import write_onnx_dir

BUILD = BuildOptions(max_input_len=384, max_kv_cache_capacity=512, max_batch_size=4, tokens_per_page=16)
SYSTEM = "You describe pictures and sounds for the Harbor Point archive, briefly."  # > 1 page before the media


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm"), BUILD)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    for name, seed in (("a.png", 1), ("b.png", 2)):
        pixels = np.random.default_rng(seed).integers(0, 255, (30, 40, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / name)
    (root / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    tone(root / "tone.wav", 0.5, 440.0)
    return root


@pytest.fixture(scope="module")
def server(vlm, media_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    engine_dir, visual_dir = vlm
    with live_server(engine_dir, tmp_path_factory.mktemp("server"), media=MediaPolicy(media_dir.resolve()),
                     multimodal_engine_dir=str(visual_dir)) as live:
        yield live


def tone(path: Path, seconds: float, freq: float, rate: int = 16000) -> Path:
    t = np.arange(int(rate * seconds)) / rate
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2").tobytes())
    return path


def data_url(path: Path, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(path.read_bytes()).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat_body(*parts: dict, question: str = "What is shown?", **extra: Any) -> dict:
    return {"model": MODEL, "temperature": 0, "max_tokens": 4, "logprobs": True, "top_logprobs": 1,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": [*parts, {"type": "text", "text": question}]}], **extra}


def answer(server: LiveServer, body: dict) -> dict:
    status, reply = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, reply
    return reply


def tokens_of(reply: dict) -> list[str]:
    return [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]]


def cold_responses(engine: Engine, items: list[tuple[dict, str]]) -> list[dict]:
    """The same chats as request-file items, run with reuse off on a fresh engine (the cold reference)."""
    requests = [{"messages": [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": [item, {"type": "text", "text": question}]}]}
                for item, question in items]
    return run_file(engine, {"top_k": 1, "max_generate_length": 4, "num_logprobs": 1, "requests": requests})


def expect_400(server: LiveServer, body: dict, param: str, fragment: str) -> None:
    status, reply = server.request("POST", "/v1/chat/completions", body)
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert "\n" not in error["message"]


# --- images -------------------------------------------------------------------------------------------


def test_repeated_image_is_warm_and_equals_cold(server: LiveServer, vlm, media_dir: Path) -> None:
    before = server.on_engine(lambda e: e.profile()["multimodal"]["encoder_cache"])
    url = data_url(media_dir / "a.png")
    first = answer(server, chat_body(image_part(url), question="What is shown?"))
    second = answer(server, chat_body(image_part(url), question="Which colours are there?"))
    after = server.on_engine(lambda e: e.profile()["multimodal"]["encoder_cache"])
    assert after["misses"] - before["misses"] == 1 and after["hits"] - before["hits"] == 1  # encoder skipped
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the system prompt's pages: the reuse point moves back to the image span's start (the seed's span rule)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    engine_dir, visual_dir = vlm
    cold_engine = Engine(engine_dir, EngineConfig(num_threads=2, multimodal_engine_dir=str(visual_dir),
                                                  encoder_cache_budget_bytes=0))
    file_item = {"type": "image", "image": str(media_dir / "a.png")}
    cold = cold_responses(cold_engine, [(file_item, "What is shown?"), (file_item, "Which colours are there?")])
    for reply, reference in zip((first, second), cold, strict=True):
        assert reply["choices"][0]["message"]["content"] == reference["output_text"]
        assert tokens_of(reply) == [step[0]["token"] for step in reference["logprobs"]]
        assert reply["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    server.on_engine(idle_audit)


def test_openai_client_streams_an_image_chat(server: LiveServer, media_dir: Path) -> None:
    """The official client's own content-part types, streamed and not: one answer; /metrics counts the hits."""
    import openai
    from test_server import metric_values, stream_text

    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": [image_part(data_url(media_dir / "b.png")),
                                             {"type": "text", "text": "Describe it."}]}]
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as client:
        whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=6)
        text, reason, usage = stream_text(client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=6, stream=True,
            stream_options={"include_usage": True}))
    assert text == whole.choices[0].message.content and reason == whole.choices[0].finish_reason
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    metrics = metric_values(server)
    cache = server.on_engine(lambda e: e.profile()["multimodal"]["encoder_cache"])
    assert metrics["kvforge_encoder_cache_hits_total"] == cache["hits"] >= 1
    assert metrics["kvforge_encoder_cache_misses_total"] == cache["misses"] >= 1
    assert metrics["kvforge_encoder_cache_bytes"] == cache["bytes"] > 0
    server.on_engine(idle_audit)


def test_local_files_only_under_the_allowed_dir(server: LiveServer, media_dir: Path, tmp_path: Path) -> None:
    inline = answer(server, chat_body(image_part(data_url(media_dir / "b.png"))))
    by_url = answer(server, chat_body(image_part((media_dir / "b.png").resolve().as_uri())))
    by_path = answer(server, chat_body({"type": "image", "image": "b.png"}))  # relative: inside the allowed dir
    texts = {r["choices"][0]["message"]["content"] for r in (inline, by_url, by_path)}
    assert len(texts) == 1  # one image, one identity: the same answer however it was sent
    outside = tmp_path / "outside.png"
    outside.write_bytes((media_dir / "b.png").read_bytes())
    part = "messages[1].content[0].image_url"
    expect_400(server, chat_body(image_part(outside.as_uri())), part, "outside --allowedMediaDir")
    expect_400(server, chat_body(image_part("../" + outside.name)), part, "outside --allowedMediaDir")
    expect_400(server, chat_body(image_part("missing.png")), part, "not found")
    expect_400(server, chat_body(image_part(".")), part, "not a regular file")
    server.on_engine(idle_audit)


def test_bad_image_parts_get_400_naming_the_part(server: LiveServer, media_dir: Path) -> None:
    part = "messages[1].content[1].image_url"
    good = image_part(data_url(media_dir / "a.png"))
    cases = [
        (image_part("https://example.com/cat.png"), part, "not fetched"),
        (image_part("data:image/png;base64,@@@not-base64@@@"), part, "not valid base64"),
        (image_part("data:image/png,rawbytes"), part, "base64-encoded"),
        (image_part("data:text/plain;base64,aGVsbG8="), part, "expected an image"),
        (image_part("ftp://host/cat.png"), part, "unsupported URL scheme"),
        (image_part(data_url(media_dir / "corrupt.png")), part, "not an image Pillow can decode"),
        ({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}, part, "must be an object"),
        ({"type": "image_url", "image_url": {}}, f"{part}.url", "is required"),
        ({"type": "image_url", "image_url": {"url": data_url(media_dir / "a.png"), "detail": "ultra"}},
         f"{part}.detail", "must be one of"),
        ({"type": "video_url", "video_url": {}}, "messages[1].content[1].type", "must be one of"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
         "messages[1].content[1].type", "need an audio encoder"),
    ]
    for bad, param, fragment in cases:
        expect_400(server, chat_body(good, bad), param, fragment)
    too_many = chat_body(*[good] * 17)  # the system prompt and 16 x (16 + 3) placeholder tokens > maxInputLen 384
    expect_400(server, too_many, "messages[1].content[15]", "maxInputLen 384")
    answer(server, chat_body(good))  # still serving
    server.on_engine(idle_audit)


def test_typed_placeholder_text_stays_text(server: LiveServer, media_dir: Path) -> None:
    body = chat_body(image_part(data_url(media_dir / "a.png")), question="Is <image> a token?")
    plain = answer(server, body)
    with_image_only = answer(server, chat_body(image_part(data_url(media_dir / "a.png")), question="Is a token?"))
    assert plain["usage"]["prompt_tokens"] == with_image_only["usage"]["prompt_tokens"] + len("<image> ")
    expect_400(server, {**body, "parse_special_tokens": True}, "messages", "contains the placeholder")


def test_item_and_body_size_limits(server: LiveServer, media_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = MediaPolicy(max_item_bytes=100)
    with pytest.raises(ApiError) as info:
        parse_call(chat_body(image_part(data_url(media_dir / "a.png"))), True, {MODEL: None}, small)
    assert info.value.param == "messages[1].content[0].image_url" and "more than 100 bytes" in info.value.message
    monkeypatch.setattr(server_app, "MAX_BODY_BYTES", 2000)
    status, reply = server.request("POST", "/v1/chat/completions", chat_body(image_part(data_url(media_dir / "a.png"))))
    assert status == 413 and "more than 2,000 bytes" in reply["error"]["message"]


def test_media_to_an_engine_without_an_encoder(vlm, media_dir: Path, tmp_path: Path) -> None:
    engine_dir, _ = vlm
    with live_server(engine_dir, tmp_path) as text_only:
        expect_400(text_only, chat_body(image_part(data_url(media_dir / "a.png"))), "messages[1].content[0]",
                   "--multimodalEngineDir")
        expect_400(text_only, chat_body({"type": "image", "image": "a.png"}), "messages[1].content[0].image",
                   "--allowedMediaDir")
        text_only.on_engine(idle_audit)


# --- audio --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def audio_engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("audio")
    text, audio = synthetic_qwen2_audio()
    write_onnx_dir(text, root / "onnx")
    write_audio_onnx_dir(audio, root / "onnx" / "audio")
    build_engine(root / "onnx", root / "engine", BUILD)
    build_encoder_engine(root / "onnx" / "audio", root / "audio", "auto", 1)
    return root / "engine", root / "audio"


def audio_part(path: Path, audio_format: str = "wav") -> dict:
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(path.read_bytes()).decode(), "format": audio_format}}


def test_input_audio_is_warm_and_equals_cold(audio_engine, media_dir: Path, tmp_path: Path) -> None:
    engine_dir, audio_dir = audio_engine
    with live_server(engine_dir, tmp_path, multimodal_engine_dir=str(audio_dir)) as live:
        part = audio_part(media_dir / "tone.wav")
        first = answer(live, chat_body(part, question="What is it?"))
        second = answer(live, chat_body(part, question="How loud is it?"))
        cache = live.on_engine(lambda e: e.profile()["multimodal"]["encoder_cache"])
        assert (cache["misses"], cache["hits"]) == (1, 1)
        bad = "messages[1].content[0].input_audio"
        expect_400(live, chat_body({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}}),
                   f"{bad}.format", "must be one of")
        expect_400(live, chat_body({"type": "input_audio", "input_audio": {"format": "wav"}}), f"{bad}.data",
                   "is required")
        noise = base64.b64encode(b"RIFF" + bytes(200)).decode()
        expect_400(live, chat_body({"type": "input_audio", "input_audio": {"data": noise, "format": "wav"}}), bad,
                   "cannot decode the audio")
        expect_400(live, chat_body(image_part(data_url(media_dir / "a.png"))), "messages[1].content[0].type",
                   "need an image encoder")
        live.on_engine(idle_audit)
    cold_engine = Engine(engine_dir, EngineConfig(num_threads=2, multimodal_engine_dir=str(audio_dir),
                                                  encoder_cache_budget_bytes=0))
    file_item = {"type": "audio", "audio": str(media_dir / "tone.wav")}
    cold = cold_responses(cold_engine, [(file_item, "What is it?"), (file_item, "How loud is it?")])
    for reply, reference in zip((first, second), cold, strict=True):
        assert reply["choices"][0]["message"]["content"] == reference["output_text"]
        assert tokens_of(reply) == [step[0]["token"] for step in reference["logprobs"]]


def test_inline_audio_decodes_like_the_file(media_dir: Path) -> None:
    from kvforge.runtime.inputs.multimodal.audio import decode_audio, decode_audio_bytes

    path = media_dir / "tone.wav"
    from_file, inline = decode_audio(path, "f"), decode_audio_bytes(path.read_bytes(), "f")
    assert from_file.digest == inline.digest and np.array_equal(from_file.pcm, inline.pcm)
    with pytest.raises(Exception, match="longer than the 0 s"):
        decode_audio_bytes(path.read_bytes(), "f", max_seconds=0)


def test_inline_image_decodes_like_the_file(media_dir: Path) -> None:
    from kvforge.runtime.inputs.multimodal.image import decode_image

    path = media_dir / "a.png"
    buffer = io.BytesIO()
    Image.open(path).convert("RGBA").save(buffer, format="PNG")  # alpha composited as for files
    assert decode_image(path.read_bytes(), "f").digest == decode_image(path, "f").digest
    assert decode_image(buffer.getvalue(), "f").digest == decode_image(path, "f").digest


# --- flags --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "flag"), [
    (["--allowedMediaDir", "/nowhere/media"], "--allowedMediaDir"),
    (["--multimodalEngineDir", "/nowhere/visual"], "--multimodalEngineDir"),
    (["--encoderCacheBudgetBytes", "-1"], "--encoderCacheBudgetBytes"),
])
def test_media_flags_are_one_line_errors(vlm, run_cli, args: list[str], flag: str) -> None:
    engine_dir, _ = vlm
    result = run_cli(["llm_serve", "--engineDir", engine_dir, "--port", "0", *args])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {flag}"), result.stderr

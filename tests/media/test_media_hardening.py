"""Media hardening: the encoder cache scoped by cache salt (and locked), images and audio bounded from their
headers before decoding, and media paths with a NUL byte or an over-long name refused in one line."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
import threading
import time
import wave
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.engine_driver import assert_idle, run_file
from support.media_engines import build_tiny_audio_model, build_tiny_vlm
from support.server_harness import MODEL, LiveServer, idle_audit, live_server

from kvforge.builder.build import BuildOptions
from kvforge.contract.errors import KvforgeError
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.inputs.multimodal.encoder_cache import EncoderCache
from kvforge.server.media import MediaPolicy

BUILD = BuildOptions(max_input_len=384, max_kv_cache_capacity=512, max_batch_size=4, tokens_per_page=16)
ITEM = "requests[0].messages[0].content[0]"
# A question long enough that the prompt after the image spans full pages (so a warm request reuses some).
QUESTION = "Describe every colour you can see in this picture, one by one, and say where each one is."


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm"), BUILD)


@pytest.fixture(scope="module")
def audio(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_tiny_audio_model(tmp_path_factory.mktemp("audio"), BUILD)


def engine_of(dirs: tuple[Path, Path], reuse: bool = True) -> Engine:
    engine_dir, encoder_dir = dirs
    return Engine(engine_dir, EngineConfig(num_threads=2, enable_context_reuse=reuse,
                                           multimodal_engine_dir=str(encoder_dir)))


def noise_image(path: Path, shape: tuple[int, int], seed: int = 1) -> Path:
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*shape, 3), dtype=np.uint8)).save(path)
    return path


def zero_png(path: Path, width: int, height: int, bit_depth: int = 8) -> Path:
    """A greyscale PNG of zeros written chunk by chunk (the test never holds its pixels): 1 x 39 M is 38 KB."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    raw = (1 + (width * bit_depth + 7) // 8) * height  # a filter byte per row, then its packed pixels
    compressor, parts, block = zlib.compressobj(9), [], bytes(1 << 20)
    while raw:
        parts.append(compressor.compress(block[:min(raw, len(block))]))
        raw -= min(raw, len(block))
    parts.append(compressor.flush())
    header = struct.pack(">IIBBBBB", width, height, bit_depth, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(parts))
                     + chunk(b"IEND", b""))
    return path


def silence(path: Path, seconds: float, rate: int = 8000) -> Path:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(bytes(2 * int(rate * seconds)))
    return path


def image_request(path: Path | str, salt: str | None = None, question: str = QUESTION) -> dict:
    request = {"messages": [{"role": "user", "content": [{"type": "image", "image": str(path)},
                                                         {"type": "text", "text": question}]}]}
    return request if salt is None else {**request, "cache_salt": salt}


def refused(engine: Engine, data: dict, field: str, fragment: str) -> KvforgeError:
    with pytest.raises(KvforgeError) as info:
        run_file(engine, data)
    assert info.value.field == field and fragment in info.value.message, str(info.value)
    assert "\n" not in str(info.value)
    assert_idle(engine)
    return info.value


# --- the encoder cache: scoped by cache salt, locked ------------------------------------------------------

def test_cache_scope_follows_the_salt() -> None:
    from kvforge.runtime.inputs.multimodal.encoder_cache import SHARED_SCOPE, cache_scope

    assert cache_scope(None) == SHARED_SCOPE
    scopes = {cache_scope(s) for s in ("", "a", "b", "tenant:a")}
    assert len(scopes) == 4 and SHARED_SCOPE not in scopes and cache_scope("a") == cache_scope("a")
    cache = EncoderCache(budget_bytes=1024)
    rows = np.ones((2, 4), np.float32)
    assert cache.put(b"d", rows, cache_scope("a"))
    assert cache.get(b"d", cache_scope("b")) is None and cache.get(b"d") is None  # other tenants, the shared scope
    assert cache.get(b"d", cache_scope("a")) is rows
    assert (cache.hits, cache.misses, len(cache.entries)) == (1, 2, 1)


def test_encoder_cache_calls_wait_for_its_lock() -> None:
    """get, put and the counters' snapshot go through one lock (media may be encoded off the engine thread)."""
    cache = EncoderCache(budget_bytes=1024)
    done: list[str] = []
    calls = [lambda: cache.put(b"d", np.ones((2, 4), np.float32)), lambda: cache.get(b"d"), cache.to_dict]
    with cache.lock:
        threads = [threading.Thread(target=lambda c=c, i=i: (c(), done.append(str(i)))) for i, c in enumerate(calls)]
        for thread in threads:
            thread.start()
        time.sleep(0.2)
        assert done == []  # all three blocked on the held lock
    for thread in threads:
        thread.join(5)
    assert sorted(done) == ["0", "1", "2"]


def test_same_image_under_another_salt_misses_and_under_the_same_salt_reuses(vlm, tmp_path: Path) -> None:
    image = noise_image(tmp_path / "a.png", (30, 30))
    engine = engine_of(vlm)
    data = {"top_k": 1, "max_generate_length": 2,
            "requests": [image_request(image, "tenant-a"), image_request(image, "tenant-b")]}
    run_file(engine, data)
    cache = engine.profile()["multimodal"]["encoder_cache"]
    assert (cache["hits"], cache["misses"], cache["entries"]) == (0, 2, 2)  # tenant b learns nothing from a's image
    assert engine.profile()["context_cache"]["hit_sequences"] == 0
    reused_before = engine.profile()["context_cache"]["reused_tokens"]
    run_file(engine, {**data, "requests": [image_request(image, "tenant-a")]})
    profile = engine.profile()
    assert (profile["multimodal"]["encoder_cache"]["hits"], profile["multimodal"]["encoder_cache"]["misses"]) == (1, 2)
    # the page keys still carry the image's own identity: the same salt reuses the KV of the image and after it
    assert profile["context_cache"]["hit_sequences"] == 1
    assert profile["context_cache"]["reused_tokens"] - reused_before >= 32
    run_file(engine, {**data, "requests": [image_request(image), image_request(image)]})  # no salt: shared scope
    assert engine.profile()["multimodal"]["encoder_cache"]["hits"] == 2
    assert_idle(engine)


def test_tenants_do_not_share_encoder_outputs_in_llm_serve(vlm, tmp_path: Path) -> None:
    """Two API keys, one image: the second tenant's request runs the encoder (its /metrics counters say a miss)."""
    image = noise_image(tmp_path / "a.png", (30, 30))
    url = f"data:image/png;base64,{base64.b64encode(image.read_bytes()).decode()}"
    body = {"model": MODEL, "temperature": 0, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": QUESTION}]}]}
    engine_dir, visual_dir = vlm
    with live_server(engine_dir, tmp_path, api_keys={"key-a": "alice", "key-b": "bob"},
                     multimodal_engine_dir=str(visual_dir)) as live:
        for key in ("key-a", "key-b", "key-a"):
            status, reply = live.request("POST", "/v1/chat/completions", body, {"Authorization": f"Bearer {key}"})
            assert status == 200, reply
        cache = live.on_engine(lambda e: e.profile()["multimodal"]["encoder_cache"])
        assert (cache["misses"], cache["hits"]) == (2, 1)
        live.on_engine(idle_audit)


# --- images bounded before decoding -----------------------------------------------------------------------

@pytest.mark.serial  # a wall-clock bound: run alone, not beside another worker
def test_a_one_pixel_high_line_of_39_m_pixels_is_refused_from_its_header(vlm, tmp_path: Path) -> None:
    line = zero_png(tmp_path / "line.png", 39_000_000, 1)
    assert line.stat().st_size < 64 * 1024
    engine = engine_of(vlm)
    start = time.perf_counter()
    refused(engine, {"requests": [image_request(line)]}, f"{ITEM}.image", "refused before decoding")
    assert time.perf_counter() - start < 1.0  # it cost 11 s and 2 GB of resize coefficients
    # the same in a fresh process, where the peak RSS is this decode's alone (VmHWM: its own address space's peak;
    # getrusage's ru_maxrss would count pytest's, carried over the exec)
    script = ("import pathlib, re, sys\n"
              "from kvforge.contract.multimodal import ImagePreprocessing\n"
              "from kvforge.runtime.inputs.multimodal.image import decode_image\n"
              "pre = ImagePreprocessing(longest_edge=128, image_size=64)\n"
              "try:\n"
              "    decode_image(pathlib.Path(sys.argv[1]), 'image', pre)\n"
              "except Exception as exc:\n"
              "    print(type(exc).__name__)\n"
              "print(re.search(r'VmHWM:\\s+(\\d+)', pathlib.Path('/proc/self/status').read_text())[1])\n")
    result = subprocess.run([sys.executable, "-c", script, str(line)], capture_output=True, text=True, timeout=120,
                            check=False)
    kind, peak_kb = result.stdout.split()
    assert kind == "KvforgeError", result.stdout + result.stderr
    assert int(peak_kb) < 200 * 1024, peak_kb  # before the bound: 2 GB


def test_images_within_the_bounds_still_decode(vlm, tmp_path: Path) -> None:
    engine = engine_of(vlm, reuse=False)
    edge = 16 * engine.multimodal.encoder.config.preprocessing.longest_edge  # MAX_EDGE_FACTOR x the resize target
    for shape in ((30, 30), (8, edge)):
        out = run_file(engine, {"top_k": 1, "max_generate_length": 1,
                                "requests": [image_request(noise_image(tmp_path / "ok.png", shape), question="?")]})
        assert out[0]["output_text"] is not None
    refused(engine, {"requests": [image_request(noise_image(tmp_path / "long.png", (8, edge + 1)))]},
            f"{ITEM}.image", f"an edge longer than {edge:,}")


def test_decompression_bombs_are_one_line_errors(vlm, tmp_path: Path, run_cli) -> None:
    """Past Pillow's own bound it raised; between it and twice it Pillow only warned, on stderr, under our error."""
    engine_dir, visual_dir = vlm
    for name, side in (("warn.png", 10_000), ("bomb.png", 20_000)):  # 100 M and 400 M pixels, 12 KB and 48 KB
        bomb = zero_png(tmp_path / name, side, side, bit_depth=1)
        request = tmp_path / "request.json"
        request.write_text(json.dumps({"requests": [image_request(bomb)]}))
        start = time.perf_counter()
        result = run_cli(["llm_inference", "--engineDir", engine_dir, "--multimodalEngineDir", visual_dir,
                          "--inputFile", request, "--outputFile", tmp_path / "out.json"])
        assert time.perf_counter() - start < 30
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert lines[0].startswith(f"error: {ITEM}.image: the image is refused before decoding"), lines[0]


# --- audio bounded before decoding ------------------------------------------------------------------------

@pytest.mark.serial  # a wall-clock bound: run alone, not beside another worker
def test_audio_past_the_encoder_window_is_refused_before_decoding(audio, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import miniaudio

    engine = engine_of(audio)
    window = engine.multimodal.encoder.config.num_frames / 100  # the tiny encoder's window: 1000 frames of 10 ms
    assert window == 10.0
    ok, long = silence(tmp_path / "ok.wav", window), silence(tmp_path / "long.wav", 11 * 60)
    request = {"requests": [{"messages": [{"role": "user", "content": [{"type": "audio", "audio": str(long)}]}]}]}

    def no_decoding(*args, **kwargs):
        raise AssertionError("the audio was decoded")

    for name in ("decode_file", "stream_file", "stream_memory", "decode"):
        monkeypatch.setattr(miniaudio, name, no_decoding)
    start = time.perf_counter()
    error = refused(engine, request, f"{ITEM}.audio", "660.0 s long, longer than the 10 s this encoder takes")
    with pytest.raises(KvforgeError) as info:  # inline (llm_serve's input_audio) goes through the same bound
        engine.multimodal.encoder.decode(long.read_bytes(), "input_audio")
    assert info.value.message == error.message and info.value.field == "input_audio"
    assert time.perf_counter() - start < 1.0
    monkeypatch.undo()
    with pytest.raises(KvforgeError, match="longer than the 0.5 s"):  # a header that understates: the stream stops
        from kvforge.runtime.inputs.multimodal.audio import read_stream
        read_stream((chunk for chunk in [np.zeros(16000, np.float32).tobytes()]), 0.5, "audio")
    out = run_file(engine, {"top_k": 1, "max_generate_length": 1, "requests": [
        {"messages": [{"role": "user", "content": [{"type": "audio", "audio": str(ok)}]}]}]})
    assert out[0]["usage"]["prompt_tokens"] > 250  # a whole window still fits
    assert_idle(engine)


# --- media paths: a NUL byte, an over-long name -----------------------------------------------------------

BAD_PATHS = [("a\x00b.png", "must not contain a NUL byte"), ("x" * 300 + ".png", "a file name of 304 bytes")]


@pytest.fixture(scope="module")
def media_server(vlm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    media_dir = tmp_path_factory.mktemp("media")
    noise_image(media_dir / "a.png", (20, 20))
    engine_dir, visual_dir = vlm
    with live_server(engine_dir, tmp_path_factory.mktemp("server"), media=MediaPolicy(media_dir.resolve()),
                     multimodal_engine_dir=str(visual_dir)) as live:
        yield live


@pytest.mark.parametrize(("path", "fragment"), BAD_PATHS, ids=["nul", "long-name"])
def test_bad_media_paths_are_a_400_in_llm_serve(media_server: LiveServer, path: str, fragment: str) -> None:
    part = "messages[0].content[0]"
    url = "file:///" + path.replace("\x00", "%00")
    for item, param in (({"type": "image", "image": path}, f"{part}.image"),
                        ({"type": "image_url", "image_url": {"url": path}}, f"{part}.image_url"),
                        ({"type": "image_url", "image_url": {"url": url}}, f"{part}.image_url")):
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [item]}]}
        status, reply = media_server.request("POST", "/v1/chat/completions", body)
        assert status == 400, reply
        assert reply["error"]["param"] == param and fragment in reply["error"]["message"], reply
        assert "\n" not in reply["error"]["message"] and "\x00" not in reply["error"]["message"]
    good = [{"type": "image", "image": "a.png"}]
    ok = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": good}]}
    assert media_server.request("POST", "/v1/chat/completions", ok)[0] == 200  # still serving
    media_server.on_engine(idle_audit)


@pytest.mark.parametrize(("path", "fragment"), BAD_PATHS, ids=["nul", "long-name"])
def test_bad_media_paths_are_one_line_in_llm_inference(vlm, tmp_path: Path, run_cli, path: str,
                                                       fragment: str) -> None:
    engine_dir, visual_dir = vlm
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"requests": [image_request(path)]}))
    result = run_cli(["llm_inference", "--engineDir", engine_dir, "--multimodalEngineDir", visual_dir,
                      "--inputFile", request, "--outputFile", tmp_path / "out.json"])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {ITEM}.image: ") and fragment in lines[0], lines[0]


def test_a_media_path_too_long_once_joined_to_the_request_dir_is_one_line(vlm, tmp_path: Path) -> None:
    """Each name within bounds, the whole past PATH_MAX only after the request file's dir is prefixed."""
    engine = engine_of(vlm, reuse=False)
    path = "/".join(["d" * 200] * 20)[:4000]
    with pytest.raises(KvforgeError) as info:
        run_file(engine, {"requests": [image_request(path)]}, base_dir=tmp_path / ("e" * 200))
    assert info.value.field == f"{ITEM}.image" and "cannot read image file" in info.value.message, str(info.value)
    assert_idle(engine)

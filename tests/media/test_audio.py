"""Audio on the tiny synthetic Qwen2-Audio: the audio_context_reuse fixture's counters, warm == cold, the encoder
cache, PCM identity, and one-line errors for bad audio input."""

from __future__ import annotations

import json
import shutil
import wave
from pathlib import Path

import numpy as np
import pytest
from support.engine_driver import assert_idle, run_file, top1_ids
from support.media_engines import build_tiny_audio_model

from kvforge.builder.build import BuildOptions
from kvforge.contract.errors import KvforgeError
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.inputs.multimodal.audio import audio_rows

pytestmark = [pytest.mark.attention_path, pytest.mark.in_process]  # fallback rerun; run_cli in process

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "test_cases" / "audio_context_reuse.json"
T = 16


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_tiny_audio_model(tmp_path_factory.mktemp("audio"), BuildOptions(
        max_input_len=384, max_kv_cache_capacity=512, max_batch_size=4, tokens_per_page=T))


def make(dirs, reuse: bool, **config) -> Engine:
    engine, audio = dirs
    return Engine(engine, EngineConfig(num_threads=2, enable_context_reuse=reuse, multimodal_engine_dir=str(audio),
                                       **config))


def tone(path: Path, seconds: float, freq: float, rate: int = 16000) -> Path:
    t = np.arange(int(rate * seconds)) / rate
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2").tobytes())
    return path


def audio_request(*paths, question: str = "What is it?") -> dict:
    content = [{"type": "audio", "audio": str(p)} for p in paths] + [{"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": content}]}


def test_audio_rows_follow_the_processor() -> None:
    assert [audio_rows(n) for n in (16000, 27200, 160, 480, 961, 480000)] == [25, 42, 0, 1, 2, 750]


def test_audio_fixture_counters_and_warm_equals_cold(dirs) -> None:
    data = json.loads(FIXTURE.read_text())
    [block] = data["_checks"]["engine_specific"]
    assert block["when"] == {"model": "tiny-qwen2-audio", "tokens_per_page": T}
    warm_engine = make(dirs, reuse=True)
    warm = run_file(warm_engine, data, base_dir=FIXTURE.parent)
    profile = warm_engine.profile()
    for key, value in block["expected_context_cache"].items():
        assert profile["context_cache"][key] == value, key
    cold = run_file(make(dirs, reuse=False), data, base_dir=FIXTURE.parent)
    assert [top1_ids(r) for r in warm] == [top1_ids(r) for r in cold]
    assert [r["output_text"] for r in warm] == [r["output_text"] for r in cold]
    multimodal = profile["multimodal"]
    assert multimodal["total_audios"] == 10 and multimodal["total_audio_tokens"] == 250
    assert (multimodal["encoder_cache"]["misses"], multimodal["encoder_cache"]["hits"]) == (2, 8)
    assert [s["stage_id"] for s in profile["stages"]].count("audio_encoder") == 1


def test_audio_content_and_resampling_identity(dirs, tmp_path: Path) -> None:
    """Another sound misses; the same sound at another file sample rate decodes to other PCM (other identity)."""
    a, b = tone(tmp_path / "a.wav", 1.0, 440), tone(tmp_path / "b.wav", 1.0, 660)
    a_22k = tone(tmp_path / "a22.wav", 1.0, 440, rate=22050)
    engine = make(dirs, reuse=True)
    data = {"top_k": 1, "max_generate_length": 4, "num_logprobs": 1,
            "requests": [audio_request(a), audio_request(b), audio_request(a), audio_request(a_22k)]}
    out = run_file(engine, data)
    assert top1_ids(out[0]) == top1_ids(out[2]) and top1_ids(out[0]) != top1_ids(out[1])
    cache = engine.profile()["multimodal"]["encoder_cache"]
    assert (cache["hits"], cache["misses"]) == (1, 3)


def test_bad_audio_input_names_the_item(dirs, tmp_path: Path) -> None:
    engine = make(dirs, reuse=True)
    good = tone(tmp_path / "good.wav", 0.5, 440)
    (tmp_path / "corrupt.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt " + b"\x00" * 16)
    shutil.copy(good, tmp_path / "clip.ogg")
    tone(tmp_path / "blip.wav", 0.01, 440)  # 160 samples: one mel frame, no output row
    item = "requests[0].messages[0].content[1].audio"
    for name, fragment in (("missing.wav", "not found"), ("corrupt.wav", "cannot decode audio"),
                           ("clip.ogg", "unsupported audio format .ogg"), ("blip.wav", "too short")):
        with pytest.raises(KvforgeError) as info:
            run_file(engine, {"requests": [audio_request(good, tmp_path / name)]})
        assert info.value.field == item and fragment in info.value.message, str(info.value)
    image = {"requests": [{"messages": [{"role": "user", "content": [{"type": "image", "image": str(good)}]}]}]}
    with pytest.raises(KvforgeError) as info:
        run_file(engine, image)
    assert info.value.field == "requests[0].messages[0].content[0].type" and "image encoder" in info.value.message
    long_audio = tone(tmp_path / "long.wav", 9.0, 440)  # 225 rows each: two exceed maxInputLen 384
    with pytest.raises(KvforgeError) as info:
        run_file(engine, {"requests": [audio_request(long_audio, long_audio)]})
    assert info.value.field == "requests[0].messages[0].content[1]" and "maxInputLen 384" in info.value.message
    assert_idle(engine)
    run_file(engine, {"top_k": 1, "max_generate_length": 1, "requests": [audio_request(good)]})


def test_llm_test_runs_the_audio_fixture(dirs, tmp_path: Path, run_cli) -> None:
    engine_dir, audio_dir = dirs
    report = tmp_path / "report.json"
    result = run_cli(["llm_test", "--engineDir", engine_dir, "--multimodalEngineDir", audio_dir,
                      "--jsonReport", report, FIXTURE])
    assert result.returncode == 0, result.stdout + result.stderr
    checks = [c for f in json.loads(report.read_text())["files"] for c in f["checks"]]
    assert {c["status"] for c in checks} == {"passed"} and len(checks) >= 3


def test_mel_safetensors_input_equals_the_pcm_path(dirs, tmp_path: Path) -> None:
    """The seed's mel path: features saved as the processor returns them give the PCM path's answer."""
    from safetensors.numpy import save_file

    from kvforge.runtime.inputs.multimodal.audio import decode_audio, log_mel

    wav = tone(tmp_path / "a.wav", 1.2, 523)
    features, frames = log_mel(decode_audio(wav, "audio").pcm, 128, 1000)
    mask = (np.arange(1000) < frames).astype(np.int64)
    save_file({"input_features": features[None], "feature_attention_mask": mask[None]}, str(tmp_path / "a.safetensors"))
    save_file({"input_features": features[None]}, str(tmp_path / "bad.safetensors"))
    engine = make(dirs, reuse=False)
    data = {"top_k": 1, "max_generate_length": 4, "num_logprobs": 1,
            "requests": [audio_request(wav), audio_request(tmp_path / "a.safetensors"),
                         audio_request(tmp_path / "a.safetensors", question="Again?")]}
    out = run_file(engine, data)
    assert top1_ids(out[0]) == top1_ids(out[1])
    cache = engine.profile()["multimodal"]["encoder_cache"]
    assert (cache["hits"], cache["misses"]) == (1, 2)  # the mel tensor is its own identity
    with pytest.raises(KvforgeError) as info:
        run_file(engine, {"requests": [audio_request(tmp_path / "bad.safetensors")]})
    assert info.value.field == "requests[0].messages[0].content[0].audio"
    assert "feature_attention_mask" in info.value.message

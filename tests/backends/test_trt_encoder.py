"""TensorRT encoder engines at their boundary: llm_build --backend tensorrt of an encoder ONNX dir and the runtime's
TrtEncoderSession, against the recording fake `tensorrt` and cuda driver (tests/fake_tensorrt.py).

Unverified on real TensorRT (README): these tests check the calls kvforge makes, the profile, the engine dir and
the bookkeeping of the session (uploads, shapes, per-item outputs), not any numerics of a real engine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support import fake_tensorrt as fake
from support.engine_driver import run_file

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.builder.encoder_build import build_encoder_engine
from kvforge.contract.errors import KvforgeError
from kvforge.contract.multimodal import AUDIO_TRT_ENGINE_FILE, VISUAL_ENGINE_FILE, VISUAL_TRT_ENGINE_FILE
from kvforge.plugins import trt as trt_plugins
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.execution.trt import TrtEncoderSession
from kvforge.runtime.inputs.multimodal.encoders import load_encoder
from kvforge.runtime.inputs.multimodal.image import decode_image, idefics3_pixel_values
from kvforge.tools.export.families.idefics3_source import write_visual_onnx_dir
from kvforge.tools.export.families.qwen2_audio_source import write_audio_onnx_dir
from kvforge.tools.export.sources.synthetic import synthetic_idefics3, synthetic_qwen2_audio
from kvforge.tools.export.writer import write_onnx_dir

MAX_BATCH = 4


@pytest.fixture(scope="module")
def onnx_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    text, visual = synthetic_idefics3()
    write_onnx_dir(text, root / "text")
    write_visual_onnx_dir(visual, root / "text" / "visual")
    _, audio = synthetic_qwen2_audio()
    write_audio_onnx_dir(audio, root / "audio")
    build_engine(root / "text", root / "text_engine",
                 BuildOptions(max_input_len=128, max_kv_cache_capacity=256, max_batch_size=2, tokens_per_page=16))
    return {"visual": root / "text" / "visual", "audio": root / "audio", "text_engine": root / "text_engine"}


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> fake.Recorder:
    return fake.install(monkeypatch)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> fake.FakeCudaDriver:
    driver = fake.FakeCudaDriver()
    monkeypatch.setattr(trt_plugins, "require_cuda_driver", lambda: driver)
    return driver


def test_visual_engine_build_records_one_profile(recorder: fake.Recorder, onnx_dirs, tmp_path: Path) -> None:
    built = build_encoder_engine(onnx_dirs["visual"], tmp_path / "visual", "tensorrt", MAX_BATCH)
    assert built.backend == "tensorrt" and built.max_batch_size == MAX_BATCH
    files = {p.name for p in (tmp_path / "visual").iterdir()}
    assert VISUAL_TRT_ENGINE_FILE in files and VISUAL_ENGINE_FILE not in files
    assert (tmp_path / "visual" / VISUAL_TRT_ENGINE_FILE).read_bytes() == recorder.serialized
    config = json.loads((tmp_path / "visual" / "config.json").read_text())
    assert config["backend"] == "tensorrt"
    assert recorder.parsed_path == str(onnx_dirs["visual"] / "model.onnx")  # parsed in place, weights beside it
    assert recorder.network_flags == 1 << int(fake.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    size = built.preprocessing.image_size
    assert recorder.profiles == [{"pixel_values": ((1, 3, size, size), (MAX_BATCH, 3, size, size),
                                                   (MAX_BATCH, 3, size, size))}]
    assert "ALIASED_PLUGIN_IO_10_03" not in recorder.preview_features  # no plugins in an encoder


def test_audio_engine_build_profiles_features_and_lengths(recorder: fake.Recorder, onnx_dirs, tmp_path: Path) -> None:
    built = build_encoder_engine(onnx_dirs["audio"], tmp_path / "audio", "tensorrt", 1)
    assert (tmp_path / "audio" / AUDIO_TRT_ENGINE_FILE).is_file()
    mel, frames = built.num_mel_bins, built.num_frames
    assert recorder.profiles == [{"input_features": ((1, mel, frames),) * 3, "feature_lengths": ((1,),) * 3}]


def test_build_without_tensorrt_is_one_line_error(monkeypatch: pytest.MonkeyPatch, onnx_dirs, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", None)
    with pytest.raises(KvforgeError) as info:
        build_encoder_engine(onnx_dirs["visual"], tmp_path / "visual", "tensorrt", MAX_BATCH)
    assert info.value.field == "backend" and "TensorRT is not installed" in info.value.message
    assert "\n" not in str(info.value) and not (tmp_path / "visual").exists()  # nothing half-written


def test_auto_builds_the_onnxruntime_encoder(recorder: fake.Recorder, onnx_dirs, tmp_path: Path) -> None:
    built = build_encoder_engine(onnx_dirs["visual"], tmp_path / "visual", "auto", MAX_BATCH)
    assert built.backend == "onnxruntime" and (tmp_path / "visual" / VISUAL_ENGINE_FILE).is_file()
    assert recorder.serialized is None


def noise_image(path: Path, seed: int) -> Path:
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (20, 28, 3), dtype=np.uint8)).save(path)
    return path


def test_runtime_runs_a_tensorrt_visual_encoder(recorder: fake.Recorder, fake_cuda: fake.FakeCudaDriver, onnx_dirs,
                                                tmp_path: Path) -> None:
    build_encoder_engine(onnx_dirs["visual"], tmp_path / "visual", "tensorrt", MAX_BATCH)
    encoder = load_encoder(tmp_path / "visual")
    assert isinstance(encoder.session, TrtEncoderSession)
    items = [decode_image(noise_image(tmp_path / f"{i}.png", i), "x") for i in range(MAX_BATCH + 1)]
    rows = encoder.encode(items)
    # two calls (4 + 1 images), each item's rows from its own slot of the call's output
    assert [call["shapes"]["pixel_values"][0] for call in recorder.calls] == [MAX_BATCH, 1]
    assert [float(r[0, 0]) for r in rows] == [1.0, 2.0, 3.0, 4.0, 1.0]
    assert all(r.shape == (encoder.config.tokens_per_image, encoder.config.text_hidden_size) for r in rows)
    uploaded = recorder.calls[0]["inputs"]["pixel_values"]
    # one unsplit frame per image ([3, S, S], or [1, 3, S, S] where the preprocessing returns frames)
    expected = np.reshape(idefics3_pixel_values(items[0].pixels, encoder.config.preprocessing), uploaded.shape[1:])
    assert np.array_equal(uploaded[0], expected)  # the preprocessed pixels reached the device as they are
    encoder.session.close()
    assert not fake_cuda.buffers  # every device buffer freed


def test_runtime_runs_a_tensorrt_audio_encoder(recorder: fake.Recorder, fake_cuda: fake.FakeCudaDriver, onnx_dirs,
                                               tmp_path: Path) -> None:
    from kvforge.runtime.inputs.multimodal.audio import DecodedAudio, audio_rows

    build_encoder_engine(onnx_dirs["audio"], tmp_path / "audio", "tensorrt", 1)
    encoder = load_encoder(tmp_path / "audio")
    pcm = np.sin(np.arange(8000, dtype=np.float32) / 7)
    [rows] = encoder.encode([DecodedAudio(pcm, b"d")])
    assert rows.shape == (audio_rows(len(pcm)), encoder.config.text_hidden_size)
    call = recorder.calls[0]["inputs"]
    assert call["feature_lengths"].tolist() == [50] and call["input_features"].dtype == np.float32


def test_engine_splices_tensorrt_encoder_rows(recorder: fake.Recorder, fake_cuda: fake.FakeCudaDriver, onnx_dirs,
                                              tmp_path: Path) -> None:
    """The text engine (onnxruntime here) takes a TensorRT visual engine dir like any other."""
    build_encoder_engine(onnx_dirs["visual"], tmp_path / "visual", "tensorrt", MAX_BATCH)
    engine = Engine(onnx_dirs["text_engine"],
                    EngineConfig(num_threads=1, multimodal_engine_dir=str(tmp_path / "visual")))
    image = {"type": "image", "image": str(noise_image(tmp_path / "a.png", 1))}
    [response] = run_file(engine, {"top_k": 1, "max_generate_length": 2,
                                   "requests": [{"messages": [{"role": "user", "content": [image]}]}]})
    assert response["usage"]["completion_tokens"] >= 1 and len(recorder.calls) == 1


def test_runtime_without_tensorrt_is_one_line_error(monkeypatch: pytest.MonkeyPatch, recorder: fake.Recorder,
                                                    onnx_dirs, tmp_path: Path) -> None:
    build_encoder_engine(onnx_dirs["visual"], tmp_path / "visual", "tensorrt", MAX_BATCH)
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", None)
    with pytest.raises(KvforgeError) as info:
        load_encoder(tmp_path / "visual")
    assert "TensorRT is not installed" in info.value.message and "\n" not in str(info.value)


def test_session_refuses_calls_past_the_profile(recorder: fake.Recorder, fake_cuda: fake.FakeCudaDriver, onnx_dirs,
                                                tmp_path: Path) -> None:
    build_encoder_engine(onnx_dirs["visual"], tmp_path / "visual", "tensorrt", 2)
    session = TrtEncoderSession(tmp_path / "visual" / VISUAL_TRT_ENGINE_FILE, "multimodal_engine_dir")
    size = json.loads((tmp_path / "visual" / "config.json").read_text())["preprocessing"]["image_size"]
    with pytest.raises(KvforgeError) as info:
        session.run(["image_embeds"], {"pixel_values": np.zeros((3, 3, size, size), np.float32)})
    assert info.value.field == "multimodal_engine_dir" and "--maxBatchSize" in info.value.message
    (tmp_path / "bad.engine").write_bytes(b"not an engine")
    with pytest.raises(KvforgeError, match="rebuild it with llm_build"):
        TrtEncoderSession(tmp_path / "bad.engine", "multimodal_engine_dir")

"""llm_build for encoder ONNX dirs: a multimodal engine dir (`visual.onnx` or `audio.onnx` + config.json)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import onnx

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.files import check_output_dir, overlaps, read_json, staged_dir, write_json
from kvforge.contract.manifest import ENGINE_KIND, write_manifest
from kvforge.contract.multimodal import (
    AUDIO,
    AUDIO_ENGINE_FILE,
    AUDIO_ENGINE_WEIGHTS,
    AUDIO_TRT_ENGINE_FILE,
    ENCODER_MODEL_FILE,
    VISUAL_ENGINE_FILE,
    VISUAL_ENGINE_WEIGHTS,
    VISUAL_TRT_ENGINE_FILE,
    AudioEncoderConfig,
    EncoderConfig,
    encoder_kind,
    read_encoder_config,
)


def build_encoder_engine(onnx_dir: Path, engine_dir: Path, backend: str,
                         max_batch_size: int) -> EncoderConfig | AudioEncoderConfig:
    """`tensorrt` builds a TensorRT engine (`visual.engine` / `audio.engine`; unverified on real TensorRT);
    `auto` means onnxruntime, the verified path, whatever the text engine's backend (encoders run once per new
    media item, and the encoder cache skips repeats)."""
    if encoder_kind(onnx_dir) == AUDIO:
        raw = read_json(onnx_dir / "config.json", "onnx_dir")
        config = AudioEncoderConfig.from_dict(raw, f"{onnx_dir}/config.json")
        engine_file, weights_file = AUDIO_ENGINE_FILE, AUDIO_ENGINE_WEIGHTS
        trt_file = AUDIO_TRT_ENGINE_FILE
    else:
        config = read_encoder_config(onnx_dir, "onnx_dir")
        engine_file, weights_file = VISUAL_ENGINE_FILE, VISUAL_ENGINE_WEIGHTS
        trt_file = VISUAL_TRT_ENGINE_FILE
    if not (onnx_dir / ENCODER_MODEL_FILE).is_file():
        raise InvalidConfig(f"missing {ENCODER_MODEL_FILE} in {onnx_dir}; re-export it with llm_export", "onnx_dir")
    # The same promises as text engines (kvforge/builder/build.py): never over the export, staged, manifest last.
    if overlaps(engine_dir, onnx_dir):
        raise InvalidConfig("is the same directory as (or overlaps) --onnxDir; the build would destroy the export",
                            "engine_dir")
    check_output_dir(engine_dir, "engine_dir")
    if backend == "tensorrt":
        from kvforge.builder.trt_build import build_encoder_tensorrt  # the single guarded tensorrt import

        serialized = build_encoder_tensorrt(onnx_dir / ENCODER_MODEL_FILE, max_batch_size)
        built = replace(config, backend="tensorrt", max_batch_size=max_batch_size)
        with staged_dir(engine_dir, "engine_dir") as staging:
            (staging / trt_file).write_bytes(memoryview(serialized))  # IHostMemory exposes the buffer protocol
            write_json(staging / "config.json", built.to_dict())
            write_manifest(staging, ENGINE_KIND)
        return built
    model = onnx.load(str(onnx_dir / ENCODER_MODEL_FILE))
    built = replace(config, backend="onnxruntime", max_batch_size=max_batch_size)
    with staged_dir(engine_dir, "engine_dir") as staging:
        onnx.save_model(model, staging / engine_file, save_as_external_data=True,
                        all_tensors_to_one_file=True, location=weights_file, size_threshold=1024)
        write_json(staging / "config.json", built.to_dict())
        write_manifest(staging, ENGINE_KIND)
    return built

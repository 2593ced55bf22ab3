"""llm_build for encoder ONNX dirs: a multimodal engine dir (`visual.onnx` or `audio.onnx` + config.json)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import onnx

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.files import check_output_dir, overlaps, staged_dir
from kvforge.contract.manifest import ENGINE_KIND, write_manifest
from kvforge.contract.model_config import read_json, write_json
from kvforge.contract.multimodal import (
    AUDIO,
    AUDIO_ENGINE_FILE,
    AUDIO_ENGINE_WEIGHTS,
    ENCODER_MODEL_FILE,
    VISUAL_ENGINE_FILE,
    VISUAL_ENGINE_WEIGHTS,
    AudioEncoderConfig,
    EncoderConfig,
    encoder_kind,
    read_encoder_config,
)


def build_encoder_engine(onnx_dir: Path, engine_dir: Path, backend: str,
                         max_batch_size: int) -> EncoderConfig | AudioEncoderConfig:
    """Encoders run on ONNX Runtime for now: a TensorRT visual engine is not built yet, so `tensorrt` is refused
    and `auto` means onnxruntime (the text engine may still be a TensorRT one)."""
    if encoder_kind(onnx_dir) == AUDIO:
        raw = read_json(onnx_dir / "config.json", "onnx_dir")
        config = AudioEncoderConfig.from_dict(raw, f"{onnx_dir}/config.json")
        engine_file, weights_file = AUDIO_ENGINE_FILE, AUDIO_ENGINE_WEIGHTS
    else:
        config = read_encoder_config(onnx_dir, "onnx_dir")
        engine_file, weights_file = VISUAL_ENGINE_FILE, VISUAL_ENGINE_WEIGHTS
    if backend == "tensorrt":
        raise InvalidConfig("encoder engines build for onnxruntime only so far; use --backend onnxruntime or auto",
                            "backend")
    if not (onnx_dir / ENCODER_MODEL_FILE).is_file():
        raise InvalidConfig(f"missing {ENCODER_MODEL_FILE} in {onnx_dir}; re-export it with llm_export", "onnx_dir")
    # The same promises as text engines (builder/build.py): never over the export, staged, manifest last.
    if overlaps(engine_dir, onnx_dir):
        raise InvalidConfig("is the same directory as (or overlaps) --onnxDir; the build would destroy the export",
                            "engine_dir")
    check_output_dir(engine_dir, "engine_dir")
    model = onnx.load(str(onnx_dir / ENCODER_MODEL_FILE))
    built = replace(config, backend="onnxruntime", max_batch_size=max_batch_size)
    with staged_dir(engine_dir) as staging:
        onnx.save_model(model, staging / engine_file, save_as_external_data=True,
                        all_tensors_to_one_file=True, location=weights_file, size_threshold=1024)
        write_json(staging / "config.json", built.to_dict())
        write_manifest(staging, ENGINE_KIND)
    return built

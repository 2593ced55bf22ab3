"""The session an encoder engine dir runs on, shared by the visual and the audio encoder: ONNX Runtime, or a
TensorRT engine for backend tensorrt, after the dir is checked to be a complete built encoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.manifest import ENGINE_KIND, verify_manifest
from kvforge.runtime.execution.ort import make_session

FIELD = "multimodal_engine_dir"


def encoder_session(engine_dir: Path, config: Any, onnx_file: str, trt_file: str, num_threads: int):
    """The engine dir's encoder behind onnxruntime's `run(outputs, feeds)`: an ONNX Runtime session, or for
    backend tensorrt a TensorRT engine (needs the tensorrt extra; one-line error without it)."""
    if config.backend == "tensorrt":
        _check_engine_dir(engine_dir, config, trt_file)
        from kvforge.runtime.execution.trt import TrtEncoderSession  # imports tensorrt through the single guard

        return TrtEncoderSession(engine_dir / trt_file, FIELD)
    _check_engine_dir(engine_dir, config, onnx_file)
    return make_session(str(engine_dir / onnx_file), num_threads, field=FIELD)


def _check_engine_dir(engine_dir: Path, config: Any, file: str) -> None:
    if not config.backend:
        raise InvalidConfig(f"{engine_dir} is an encoder ONNX dir, not an engine dir; build it with llm_build", FIELD)
    if not (engine_dir / file).is_file():
        raise InvalidConfig(f"multimodal engine dir {engine_dir} is missing {file}; rebuild it", FIELD)
    verify_manifest(engine_dir, ENGINE_KIND, FIELD, "rebuild it with llm_build")

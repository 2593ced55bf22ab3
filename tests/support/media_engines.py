"""Tiny synthetic media models built for tests: a SmolVLM (Idefics3) text engine with its visual encoder engine,
and a Qwen2-Audio text engine with its audio encoder engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.builder.encoder_build import build_encoder_engine
from kvforge.tools.export.families.idefics3_source import write_visual_onnx_dir
from kvforge.tools.export.families.qwen2_audio_source import write_audio_onnx_dir
from kvforge.tools.export.sources.synthetic import synthetic_idefics3, synthetic_qwen2_audio
from kvforge.tools.export.writer import write_onnx_dir


def _build_pair(root: Path, build: BuildOptions, encoder_batch: int, models: tuple[Any, Any],
                write_encoder: Callable[[Any, Path], None], kind: str) -> tuple[Path, Path]:
    """Export the text model and its encoder under `root`, build both: (text engine dir, encoder engine dir)."""
    text, encoder = models
    write_onnx_dir(text, root / "onnx")
    write_encoder(encoder, root / "onnx" / kind)
    build_engine(root / "onnx", root / "engine", build)
    build_encoder_engine(root / "onnx" / kind, root / kind, "auto", encoder_batch)
    return root / "engine", root / kind


def build_tiny_vlm(root: Path, build: BuildOptions, encoder_batch: int = 4) -> tuple[Path, Path]:
    """(text engine dir, visual encoder engine dir) under `root`."""
    return _build_pair(root, build, encoder_batch, synthetic_idefics3(), write_visual_onnx_dir, "visual")


def build_tiny_audio_model(root: Path, build: BuildOptions, encoder_batch: int = 1) -> tuple[Path, Path]:
    """(text engine dir, audio encoder engine dir) under `root`."""
    return _build_pair(root, build, encoder_batch, synthetic_qwen2_audio(), write_audio_onnx_dir, "audio")

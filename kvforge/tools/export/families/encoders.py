"""The image- and audio-text families: each a registered text family plus an encoder ONNX dir of its own, in one
table `llm_export` walks instead of asking each family by name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvforge.tools.export.families.idefics3_source import (
    VisualExport,
    is_idefics3_dir,
    load_idefics3_dir,
    write_visual_onnx_dir,
)
from kvforge.tools.export.families.qwen2_audio_source import (
    AudioExport,
    is_qwen2_audio_dir,
    load_qwen2_audio_dir,
    write_audio_onnx_dir,
)
from kvforge.tools.export.sources.base import LoadedModel
from kvforge.tools.export.sources.synthetic import synthetic_idefics3, synthetic_qwen2_audio


@dataclass(frozen=True, slots=True, eq=False)
class EncoderFamily:
    name: str
    is_dir: Callable[[Path], bool]  # whether an HF checkpoint dir is this family's
    load_dir: Callable[[Path, str], tuple[LoadedModel, Any]]  # (dir, KV dtype) -> (text model, encoder export)
    synthetic: Mapping[str, Callable[[str, int], tuple[LoadedModel, Any]]]  # name -> (KV dtype, seed) -> the same
    write: Callable[[Any, Path], Path]  # the encoder export -> its ONNX dir
    subdir: str  # the encoder dir's default place under the text model's ONNX dir
    building: str  # the progress label while the encoder graph is built
    describe: Callable[[Any], str]  # what llm_export says it wrote


def _describe_vision(visual: VisualExport) -> str:
    e = visual.config
    pre = e.preprocessing
    split = (f"images split into {pre.image_size}px tiles + the global image, longest edge {pre.longest_edge}px"
             if pre.do_image_splitting else "images unsplit")
    return f"the {e.model} vision encoder ({e.tokens_per_image} tokens per {pre.image_size}px frame; {split})"


def _describe_audio(audio: AudioExport) -> str:
    return f"the {audio.config.model} audio encoder (up to {audio.config.num_frames} mel frames per item)"


ENCODER_FAMILIES = (
    EncoderFamily(name="idefics3", is_dir=is_idefics3_dir, load_dir=load_idefics3_dir,
                  synthetic={"tiny-idefics3": lambda kv, seed: synthetic_idefics3(kv, seed)},
                  write=write_visual_onnx_dir, subdir="visual", building="building vision encoder",
                  describe=_describe_vision),
    EncoderFamily(name="qwen2_audio", is_dir=is_qwen2_audio_dir, load_dir=load_qwen2_audio_dir,
                  synthetic={"tiny-qwen2-audio": lambda kv, seed: synthetic_qwen2_audio(kv, seed)},
                  write=write_audio_onnx_dir, subdir="audio", building="building audio encoder",
                  describe=_describe_audio),
)


def encoder_source(source: str | None, synthetic: str | None, kv_cache_dtype: str,
                   seed: int) -> tuple[EncoderFamily, LoadedModel, Any] | None:
    """(family, text model, encoder export) of an image- or audio-text source (a checkpoint dir or a synthetic
    name), else None: a text-only source."""
    for family in ENCODER_FAMILIES:
        if synthetic in family.synthetic and not source:
            return family, *family.synthetic[synthetic](kv_cache_dtype, seed)
        if source and not synthetic and Path(source).is_dir() and family.is_dir(Path(source)):
            return family, *family.load_dir(Path(source), kv_cache_dtype)
    return None

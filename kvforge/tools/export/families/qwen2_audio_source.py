"""Split a Hugging Face Qwen2-Audio checkpoint dir into its Qwen2 text model and its Whisper-style audio encoder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import read_json
from kvforge.contract.multimodal import AUDIO, AudioEncoderConfig
from kvforge.tools.export.families.qwen2_audio_graph import AUDIO as AUDIO_PREFIX
from kvforge.tools.export.families.qwen2_audio_graph import PROJECTOR, AudioGeometry
from kvforge.tools.export.sources.base import LoadedModel
from kvforge.tools.export.sources.hf import text_model_config, text_weight_names
from kvforge.tools.export.sources.hf_common import (
    FIELD,
    check_names,
    hf_dir_is,
    read_all,
    tokenizer_config,
    tokenizer_json,
)

TEXT_PREFIX = "language_model."


@dataclass(slots=True)
class AudioExport:
    geometry: AudioGeometry
    weights: dict[str, np.ndarray]
    config: AudioEncoderConfig


def is_qwen2_audio_dir(path: Path) -> bool:
    return hf_dir_is(path, ("qwen2_audio",), "Qwen2AudioForConditionalGeneration")


def load_qwen2_audio_dir(path: Path, kv_cache_dtype: str = "fp16") -> tuple[LoadedModel, AudioExport]:
    hf = read_json(path / "config.json", FIELD)
    text_hf = dict(hf.get("text_config") or {})
    text_hf.setdefault("model_type", "qwen2")
    text_config = text_model_config(text_hf, path, kv_cache_dtype)
    tensors = read_all(path)
    text = {n[len(TEXT_PREFIX):]: t for n, t in tensors.items() if n.startswith(TEXT_PREFIX)}
    expected = text_weight_names(text_config)
    if "lm_head.weight" in text and not text_config.tie_word_embeddings:
        expected.append("lm_head.weight")
    else:
        text_config.tie_word_embeddings = True
        text.pop("lm_head.weight", None)
    check_names(path, text, expected, "text model")
    geometry = _geometry(hf.get("audio_config") or {}, text_config.hidden_size)
    audio = {n: t for n, t in tensors.items() if n.startswith((AUDIO_PREFIX, PROJECTOR))}
    check_names(path, audio, audio_names(geometry), "audio encoder")
    loaded = LoadedModel(config=text_config, weights=text, tokenizer_json=tokenizer_json(path),
                         tokenizer_config=tokenizer_config(path, text_config))
    encoder = AudioEncoderConfig(kind=AUDIO, model="qwen2_audio",
                                 audio_token_id=int(hf.get("audio_token_index", hf.get("audio_token_id", 151646))),
                                 audio_token="<|AUDIO|>", text_hidden_size=text_config.hidden_size,
                                 num_mel_bins=geometry.num_mel_bins, num_frames=geometry.num_frames,
                                 extra={"audio": {k: getattr(geometry, k) for k in AudioGeometry.__slots__}})
    return loaded, AudioExport(geometry, audio, encoder)


def _geometry(a: dict[str, Any], text_hidden: int) -> AudioGeometry:
    if a.get("activation_function", "gelu") != "gelu":
        raise KvforgeError(f"audio activation {a.get('activation_function')!r} is not supported (gelu only)", FIELD)
    if a.get("scale_embedding"):
        raise KvforgeError("audio scale_embedding=true is not supported", FIELD)
    return AudioGeometry(d_model=int(a.get("d_model", 1280)), encoder_layers=int(a.get("encoder_layers", 32)),
                         encoder_attention_heads=int(a.get("encoder_attention_heads", 20)),
                         encoder_ffn_dim=int(a.get("encoder_ffn_dim", 5120)),
                         num_mel_bins=int(a.get("num_mel_bins", 128)),
                         max_source_positions=int(a.get("max_source_positions", 1500)), text_hidden_size=text_hidden)


def audio_names(geometry: AudioGeometry) -> list[str]:
    names = [AUDIO_PREFIX + n for n in ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                                        "embed_positions.weight", "layer_norm.weight", "layer_norm.bias")]
    per_layer = ["self_attn.k_proj.weight"] + [f"{m}.{p}" for m in (
        "self_attn.q_proj", "self_attn.v_proj", "self_attn.out_proj", "self_attn_layer_norm", "final_layer_norm",
        "fc1", "fc2") for p in ("weight", "bias")]
    names += [f"{AUDIO_PREFIX}layers.{i}.{n}" for i in range(geometry.encoder_layers) for n in per_layer]
    return [*names, PROJECTOR + "weight", PROJECTOR + "bias"]


def write_audio_onnx_dir(audio: AudioExport, output_dir: Path) -> Path:
    """The audio encoder ONNX dir llm_build turns into an audio engine dir: model.onnx (+ data) and config.json."""
    import onnx

    from kvforge.contract.files import write_json
    from kvforge.contract.multimodal import ENCODER_MODEL_FILE, ENCODER_WEIGHTS_FILE
    from kvforge.tools.export.families.qwen2_audio_graph import build_audio_graph

    output_dir.mkdir(parents=True, exist_ok=True)
    model = build_audio_graph(audio.geometry, audio.weights)
    for stale in (output_dir / ENCODER_MODEL_FILE, output_dir / ENCODER_WEIGHTS_FILE):
        stale.unlink(missing_ok=True)
    onnx.save_model(model, output_dir / ENCODER_MODEL_FILE, save_as_external_data=True,
                    all_tensors_to_one_file=True, location=ENCODER_WEIGHTS_FILE, size_threshold=1024)
    write_json(output_dir / "config.json", audio.config.to_dict())
    return output_dir

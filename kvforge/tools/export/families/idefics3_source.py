"""Split a Hugging Face Idefics3 (SmolVLM) checkpoint dir into its llama text model and its vision encoder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import read_json
from kvforge.contract.multimodal import VISUAL, EncoderConfig, ImagePreprocessing
from kvforge.tools.export.families.idefics3_graph import ACTIVATIONS, CONNECTOR, VISION, VisionGeometry
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

MODEL_TYPES = ("idefics3",)
TEXT_PREFIX = "model.text_model."
# PIL filter numbers as transformers' PILImageResampling stores them in preprocessor_config.json.
_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic"}
# Idefics3ImageProcessor defaults, for checkpoints without a preprocessor_config.json.
_DEFAULT_LONGEST_EDGE, _DEFAULT_MAX_IMAGE_SIZE = 4 * 364, 364


@dataclass(slots=True)
class VisualExport:
    geometry: VisionGeometry
    weights: dict[str, np.ndarray]
    config: EncoderConfig


def is_idefics3_dir(path: Path) -> bool:
    return hf_dir_is(path, MODEL_TYPES, "Idefics3ForConditionalGeneration")


def load_idefics3_dir(path: Path, kv_cache_dtype: str = "fp16") -> tuple[LoadedModel, VisualExport]:
    hf = read_json(path / "config.json", FIELD)
    text_hf = dict(hf.get("text_config") or {})
    text_hf.setdefault("model_type", "llama")
    text_hf["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", text_hf.get("tie_word_embeddings", False)))
    text_config = text_model_config(text_hf, path, kv_cache_dtype)
    tensors = read_all(path)
    text = {("model." + n[len(TEXT_PREFIX):] if n.startswith(TEXT_PREFIX) else n): t for n, t in tensors.items()
            if n.startswith(TEXT_PREFIX) or n == "lm_head.weight"}
    expected = text_weight_names(text_config)
    if "lm_head.weight" not in text or text_config.tie_word_embeddings:
        text_config.tie_word_embeddings = True
        text.pop("lm_head.weight", None)
    else:
        expected.append("lm_head.weight")
    check_names(path, text, expected, "text model")
    vision = {n: t for n, t in tensors.items() if n.startswith(VISION) or n == CONNECTOR}
    geometry = _vision_geometry(hf, text_config.hidden_size)
    check_names(path, vision, vision_names(geometry), "vision encoder")
    loaded = LoadedModel(config=text_config, weights=text, tokenizer_json=tokenizer_json(path),
                         tokenizer_config=tokenizer_config(path, text_config))
    preprocessing = read_preprocessing(path)
    encoder = EncoderConfig(
        kind=VISUAL, model="idefics3", image_token_id=int(hf.get("image_token_id", 128257)),
        tokens_per_image=geometry.tokens_per_image(preprocessing.image_size),
        text_hidden_size=text_config.hidden_size, image_token="<image>",
        image_prefix="<fake_token_around_image><global-img>", image_suffix="<fake_token_around_image>",
        preprocessing=preprocessing,
        extra={"vision": {k: getattr(geometry, k) for k in VisionGeometry.__slots__}})
    return loaded, VisualExport(geometry, vision, encoder)


def _vision_geometry(hf: dict[str, Any], text_hidden: int) -> VisionGeometry:
    v = hf.get("vision_config") or {}
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise KvforgeError(f"vision hidden_act {act!r} is not supported; expected one of {ACTIVATIONS}", FIELD)
    try:
        return VisionGeometry(hidden_size=int(v.get("hidden_size", 1152)),
                              intermediate_size=int(v.get("intermediate_size", 3072)),
                              num_hidden_layers=int(v.get("num_hidden_layers", 12)),
                              num_attention_heads=int(v.get("num_attention_heads", 16)),
                              patch_size=int(v.get("patch_size", 32)), image_size=int(v.get("image_size", 224)),
                              layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)), hidden_act=act,
                              scale_factor=int(hf.get("scale_factor", 2)), text_hidden_size=text_hidden,
                              num_channels=int(v.get("num_channels", 3)))
    except (TypeError, ValueError) as exc:
        raise KvforgeError(f"invalid vision_config: {exc}", FIELD) from None


def vision_names(geometry: VisionGeometry) -> list[str]:
    names = [VISION + n for n in ("embeddings.patch_embedding.weight", "embeddings.patch_embedding.bias",
                                  "embeddings.position_embedding.weight", "post_layernorm.weight",
                                  "post_layernorm.bias")]
    per_layer = [f"{m}.{p}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                      "self_attn.out_proj", "layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2")
                 for p in ("weight", "bias")]
    names += [f"{VISION}encoder.layers.{i}.{n}" for i in range(geometry.num_hidden_layers) for n in per_layer]
    return [*names, CONNECTOR]


def read_preprocessing(path: Path) -> ImagePreprocessing:
    """preprocessor_config.json as Idefics3ImageProcessor reads it (its class defaults where a key is absent:
    splitting on, as a real SmolVLM processor does)."""
    file = path / "preprocessor_config.json"
    pre = read_json(file, FIELD) if file.is_file() else {}
    size = pre.get("size") or {}
    max_size = pre.get("max_image_size") or {}
    return ImagePreprocessing(
        longest_edge=int(size.get("longest_edge", _DEFAULT_LONGEST_EDGE)),
        image_size=int(max_size.get("longest_edge", _DEFAULT_MAX_IMAGE_SIZE)),
        rescale_factor=float(pre.get("rescale_factor", 1 / 255)),
        image_mean=tuple(float(m) for m in pre.get("image_mean", (0.5, 0.5, 0.5))),
        image_std=tuple(float(s) for s in pre.get("image_std", (0.5, 0.5, 0.5))),
        resample=_RESAMPLE.get(int(pre.get("resample", 1)), "lanczos"),
        do_resize=bool(pre.get("do_resize", True)), do_rescale=bool(pre.get("do_rescale", True)),
        do_normalize=bool(pre.get("do_normalize", True)),
        do_image_splitting=bool(pre.get("do_image_splitting", True)))


def write_visual_onnx_dir(visual: VisualExport, output_dir: Path) -> Path:
    """The encoder ONNX dir llm_build turns into a multimodal engine dir: model.onnx (+ data) and config.json."""
    import onnx

    from kvforge.contract.files import write_json
    from kvforge.contract.multimodal import ENCODER_MODEL_FILE, ENCODER_WEIGHTS_FILE
    from kvforge.tools.export.families.idefics3_graph import build_vision_graph

    output_dir.mkdir(parents=True, exist_ok=True)
    model = build_vision_graph(visual.geometry, visual.weights, visual.config.preprocessing.image_size)
    for stale in (output_dir / ENCODER_MODEL_FILE, output_dir / ENCODER_WEIGHTS_FILE):
        stale.unlink(missing_ok=True)  # onnx.save appends external data
    onnx.save_model(model, output_dir / ENCODER_MODEL_FILE, save_as_external_data=True,
                    all_tensors_to_one_file=True, location=ENCODER_WEIGHTS_FILE, size_threshold=1024)
    write_json(output_dir / "config.json", visual.config.to_dict())
    return output_dir

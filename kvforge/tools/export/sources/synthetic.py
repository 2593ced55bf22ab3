"""Tiny deterministic random models of each supported family, so tests run in seconds on two cores."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvforge.contract.errors import KvforgeError
from kvforge.contract.model_config import ModelConfig
from kvforge.tools.export.families import family_for, synthetic_models
from kvforge.tools.export.families.llama import random_weights
from kvforge.tools.export.sources.base import LoadedModel

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# name -> ModelConfig fields over the tiny base geometry: each family's synthetic models (families/).
SYNTHETIC_MODELS = synthetic_models()


def byte_level_tokenizer() -> Tokenizer:
    """Byte-level BPE with no merges: every UTF-8 byte is a token, plus the ChatML specials."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def synthetic_model(name: str, kv_cache_dtype: str = "fp16", seed: int = 0,
                    hidden_state_layers: list[int] | None = None) -> LoadedModel:
    """`hidden_state_layers`: the layers whose outputs the exported graph also returns (ModelConfig's field)."""
    if name not in SYNTHETIC_MODELS:
        raise KvforgeError(f"unknown synthetic model {name!r}; choose one of {sorted(SYNTHETIC_MODELS)}",
                           "synthetic")
    tokenizer = byte_level_tokenizer()
    fields = dict(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                  kv_cache_dtype=kv_cache_dtype, bos_token_id=None, eos_token_ids=[2], pad_token_id=0,
                  name=name)
    fields.update(SYNTHETIC_MODELS[name])
    config = ModelConfig(**fields, hidden_state_layers=list(hidden_state_layers or []))
    config.validate()
    tokenizer_config = {"chat_template": CHATML_TEMPLATE, "bos_token": None, "eos_token": "<|im_end|>",
                        "add_bos_token": False, "model_max_length": config.max_position_embeddings}
    family = family_for(config.model)
    assert family is not None, config.model  # every synthetic model comes from a registered family
    weights = family.random_weights(config, seed)
    return LoadedModel(config, weights, tokenizer.to_str(), tokenizer_config)


IDEFICS3_SPECIAL_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")
# SmolVLM's turn format ("User:" / "Assistant:" ending turns with <end_of_utterance>) over string contents.
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


# Text and vision geometry of SmolVLM-256M (SmolLM2-135M text model, SigLIP-B/16 at 512 px, 4x pixel shuffle),
# for benchmarks: random weights cost the same to run as trained ones.
SMOLVLM_256M_TEXT = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64)
SMOLVLM_256M_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                           patch_size=16, image_size=512, scale_factor=4)


def synthetic_idefics3(kv_cache_dtype: str = "fp16", seed: int = 0, text: dict | None = None,
                       vision: dict | None = None, name: str = "tiny-idefics3", split_tiles: int = 0):
    """A tiny SmolVLM: the tiny llama text model plus a 2-layer vision tower on 64-pixel images (16 tokens each).
    `text` / `vision` override the geometry (SMOLVLM_256M_* give SmolVLM-256M's shapes). `split_tiles` > 0 turns on
    image splitting with the longest edge at that many tiles of image_size (SmolVLM's processors: 4, i.e. 2048 px
    at 512; tests take 2, where vlm_a.png becomes 2x2 tiles + the global image, 80 placeholders, not 4x3 + 1,
    208). 0 (the default) keeps images unsplit: the fixtures' counters are written for 16-placeholder images."""
    from kvforge.contract.multimodal import VISUAL, EncoderConfig, ImagePreprocessing
    from kvforge.tools.export.families.idefics3_graph import CONNECTOR, VISION, VisionGeometry
    from kvforge.tools.export.families.idefics3_source import VisualExport, vision_names

    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens(list(IDEFICS3_SPECIAL_TOKENS))
    fields = dict(model="llama", vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=8192, kv_cache_dtype=kv_cache_dtype,
                  eos_token_ids=[tokenizer.token_to_id("<end_of_utterance>")], pad_token_id=0, name=name)
    fields.update(text or {})
    config = ModelConfig(**fields)
    config.validate()
    tokenizer_config = {"chat_template": IDEFICS3_TEMPLATE, "bos_token": None, "eos_token": "<end_of_utterance>",
                        "add_bos_token": False, "model_max_length": config.max_position_embeddings}
    text_model = LoadedModel(config, random_weights(config, seed), tokenizer.to_str(), tokenizer_config)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=8,
                 image_size=64, scale_factor=2)
    shape.update(vision or {})
    geometry = VisionGeometry(**shape, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
                              text_hidden_size=config.hidden_size)
    hidden, inter, patch = geometry.hidden_size, geometry.intermediate_size, geometry.patch_size
    special_shapes = {VISION + "embeddings.patch_embedding.weight": (hidden, 3, patch, patch),
                      VISION + "embeddings.position_embedding.weight": ((geometry.image_size // patch) ** 2, hidden),
                      CONNECTOR: (config.hidden_size, hidden * geometry.scale_factor ** 2)}
    rng = np.random.default_rng(seed + 1)
    weights = {}
    for weight in vision_names(geometry):
        if weight.endswith(("layer_norm1.weight", "layer_norm2.weight", "post_layernorm.weight")):
            weights[weight] = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
            continue
        if weight in special_shapes:
            dims = special_shapes[weight]
        elif ".fc1." in weight:
            dims = (inter, hidden) if weight.endswith("weight") else (inter,)
        elif ".fc2." in weight:
            dims = (hidden, inter) if weight.endswith("weight") else (hidden,)
        else:  # attention projections and biases, layer-norm biases
            dims = (hidden, hidden) if weight.endswith("proj.weight") else (hidden,)
        scale = 1.0 / np.sqrt(np.prod(dims[1:])) if len(dims) > 1 else 0.1
        weights[weight] = (scale * rng.standard_normal(dims)).astype(np.float32)
    size = geometry.image_size
    encoder = EncoderConfig(kind=VISUAL, model="idefics3", image_token_id=tokenizer.token_to_id("<image>"),
                            tokens_per_image=geometry.tokens_per_image(size), text_hidden_size=config.hidden_size,
                            image_token="<image>", image_prefix="<fake_token_around_image><global-img>",
                            image_suffix="<fake_token_around_image>",
                            preprocessing=ImagePreprocessing(longest_edge=(split_tiles or 2) * size, image_size=size,
                                                             do_image_splitting=split_tiles > 0),
                            extra={"vision": {k: getattr(geometry, k) for k in VisionGeometry.__slots__}})
    return text_model, VisualExport(geometry, weights, encoder)


QWEN2_AUDIO_SPECIAL_TOKENS = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
# Qwen2-Audio's turn format over content items: each audio item prints its bos/placeholder/eos, as the real one does.
QWEN2_AUDIO_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% for item in message['content'] %}{% if item['type'] == 'audio' %}"
    "{{ 'Audio: <|audio_bos|><|AUDIO|><|audio_eos|>\\n' }}{% else %}{{ item['text'] }}{% endif %}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# Qwen2-Audio-7B's encoder (Whisper-large-v3 shape, 30 s windows); benchmarks may cut encoder_layers.
QWEN2_AUDIO_ENCODER = dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                           max_source_positions=1500)


def synthetic_qwen2_audio(kv_cache_dtype: str = "fp16", seed: int = 0, text: dict | None = None,
                          audio: dict | None = None, name: str = "tiny-qwen2-audio"):
    """A tiny Qwen2-Audio: a 2-layer Qwen2 text model plus a 2-layer Whisper-style encoder on 128 mel bins over
    10 s windows (1000 frames -> at most 250 tokens per item; one second of audio takes 25). `text` / `audio`
    override the geometry."""
    from kvforge.contract.multimodal import AUDIO, AudioEncoderConfig
    from kvforge.tools.export.families.qwen2_audio_graph import AudioGeometry
    from kvforge.tools.export.families.qwen2_audio_source import AudioExport, audio_names

    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens(list(QWEN2_AUDIO_SPECIAL_TOKENS))
    fields = dict(model="qwen2", vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=4096, attention_bias=True, kv_cache_dtype=kv_cache_dtype,
                  eos_token_ids=[2], pad_token_id=0, name=name)
    config = ModelConfig(**{**fields, **(text or {})})
    config.validate()
    tokenizer_config = {"chat_template": QWEN2_AUDIO_TEMPLATE, "bos_token": None, "eos_token": "<|im_end|>",
                        "add_bos_token": False, "model_max_length": config.max_position_embeddings}
    text_model = LoadedModel(config, random_weights(config, seed), tokenizer.to_str(), tokenizer_config)
    shape = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=128,
                 max_source_positions=500)
    geometry = AudioGeometry(**{**shape, **(audio or {})}, text_hidden_size=config.hidden_size)
    rng = np.random.default_rng(seed + 2)
    d, ffn = geometry.d_model, geometry.encoder_ffn_dim
    weights = {}
    for weight in audio_names(geometry):
        if weight.endswith("conv1.weight"):
            dims = (d, geometry.num_mel_bins, 3)
        elif weight.endswith("conv2.weight"):
            dims = (d, d, 3)
        elif weight.endswith("embed_positions.weight"):
            dims = (geometry.max_source_positions, d)
        elif weight.startswith("multi_modal_projector"):
            dims = (config.hidden_size, d) if weight.endswith("weight") else (config.hidden_size,)
        elif ".fc1." in weight:
            dims = (ffn, d) if weight.endswith("weight") else (ffn,)
        elif ".fc2." in weight:
            dims = (d, ffn) if weight.endswith("weight") else (d,)
        else:
            dims = (d, d) if weight.endswith("proj.weight") else (d,)
        if "norm" in weight and weight.endswith("weight"):
            weights[weight] = (1.0 + 0.1 * rng.standard_normal(dims)).astype(np.float32)
            continue
        scale = 1.0 / np.sqrt(np.prod(dims[1:])) if len(dims) > 1 else 0.1
        weights[weight] = (scale * rng.standard_normal(dims)).astype(np.float32)
    encoder = AudioEncoderConfig(kind=AUDIO, model="qwen2_audio", audio_token_id=tokenizer.token_to_id("<|AUDIO|>"),
                                 audio_token="<|AUDIO|>", text_hidden_size=config.hidden_size,
                                 num_mel_bins=geometry.num_mel_bins, num_frames=geometry.num_frames,
                                 extra={"audio": {k: getattr(geometry, k) for k in AudioGeometry.__slots__}})
    return text_model, AudioExport(geometry, weights, encoder)

"""Tiny deterministic random models of each supported family, so tests run in seconds on two cores."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvforge.contract.errors import KvforgeError
from kvforge.contract.model_config import ModelConfig
from kvforge.tools.export import mamba2_source
from kvforge.tools.export.source import LoadedModel

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# name -> (family, overrides of the base tiny geometry)
SYNTHETIC_MODELS: dict[str, tuple[str, dict]] = {
    "tiny-llama": ("llama", {}),
    "tiny-qwen2": ("qwen2", {"attention_bias": True, "tie_word_embeddings": True}),
    "tiny-qwen3": ("qwen3", {"qk_norm": True, "head_dim": 32}),
    "tiny-llama-mha": ("llama", {"num_key_value_heads": 4}),
    # Pure recurrent: 8 SSM heads of 16 (expand 2), state 16, 2 groups, conv kernel 4.
    "tiny-mamba2": ("mamba2", {"num_attention_heads": 0, "num_key_value_heads": 0, "head_dim": 0,
                               "intermediate_size": 128, "max_position_embeddings": mamba2_source.UNLIMITED_POSITIONS,
                               "rms_norm_eps": 1e-5, "layer_types": ["mamba", "mamba"],
                               "recurrent_state_num_heads": 8, "recurrent_state_head_dim": 16,
                               "recurrent_state_size": 16, "n_groups": 2, "conv_kernel": 4}),
}


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


def synthetic_model(name: str, kv_cache_dtype: str = "fp16", seed: int = 0) -> LoadedModel:
    if name not in SYNTHETIC_MODELS:
        raise KvforgeError(f"unknown synthetic model {name!r}; choose one of {sorted(SYNTHETIC_MODELS)}",
                           "synthetic")
    family, overrides = SYNTHETIC_MODELS[name]
    tokenizer = byte_level_tokenizer()
    fields = dict(model=family, vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                  kv_cache_dtype=kv_cache_dtype, bos_token_id=None, eos_token_ids=[2], pad_token_id=0,
                  name=name)
    fields.update(overrides)
    config = ModelConfig(**fields)
    config.validate()
    tokenizer_config = {"chat_template": CHATML_TEMPLATE, "bos_token": None, "eos_token": "<|im_end|>",
                        "add_bos_token": False, "model_max_length": config.max_position_embeddings}
    weights = mamba2_source.random_weights(config, seed) if config.is_recurrent else random_weights(config, seed)
    return LoadedModel(config, weights, tokenizer.to_str(), tokenizer_config)


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Scaled so activations stay O(1) through the layers and logits are far from ties."""
    rng = np.random.default_rng(seed)
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.standard_normal((config.vocab_size, hidden)).astype(np.float32)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": linear(q_out, hidden),
            p + "self_attn.k_proj.weight": linear(kv_out, hidden),
            p + "self_attn.v_proj.weight": linear(kv_out, hidden),
            p + "self_attn.o_proj.weight": linear(hidden, q_out),
            p + "mlp.gate_proj.weight": linear(inter, hidden),
            p + "mlp.up_proj.weight": linear(inter, hidden),
            p + "mlp.down_proj.weight": linear(hidden, inter),
        })
        if config.attention_bias:
            for proj, dim in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                weights[p + f"self_attn.{proj}_proj.bias"] = (0.1 * rng.standard_normal(dim)).astype(np.float32)
        if config.qk_norm:
            weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
            weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
    weights["model.norm.weight"] = norm(hidden)
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = linear(config.vocab_size, hidden)
    return weights

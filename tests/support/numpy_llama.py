"""Dense numpy forward of the llama family: the reference the engines' logits are compared against."""

from __future__ import annotations

import numpy as np

from kvforge.contract.model_config import ModelConfig
from kvforge.plugins.reference import apply_rope, rope_table, round_to_storage


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * w).astype(np.float32)


def dense_logits(config: ModelConfig, weights: dict[str, np.ndarray], token_ids: list[int]) -> np.ndarray:
    """Logits [T, V] for every position of one sequence, K/V rounded through the storage dtype."""
    w = weights
    n, d = len(token_ids), config.head_dim
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    x = w["model.embed_tokens.weight"][np.asarray(token_ids)].astype(np.float32)
    table = rope_table(max(n, 1), d, config.rope_theta)
    positions = np.arange(n)
    causal = np.tril(np.ones((n, n), dtype=bool))
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], config.rms_norm_eps)
        q = h @ w[p + "self_attn.q_proj.weight"].T
        k = h @ w[p + "self_attn.k_proj.weight"].T
        v = h @ w[p + "self_attn.v_proj.weight"].T
        if config.attention_bias:
            q = q + w[p + "self_attn.q_proj.bias"]
            k = k + w[p + "self_attn.k_proj.bias"]
            v = v + w[p + "self_attn.v_proj.bias"]
        q, k, v = q.reshape(n, hq, d), k.reshape(n, hkv, d), v.reshape(n, hkv, d)
        if config.qk_norm:
            q = _rms(q, w[p + "self_attn.q_norm.weight"], config.rms_norm_eps)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], config.rms_norm_eps)
        q = apply_rope(q, table, positions)
        k = round_to_storage(apply_rope(k, table, positions), config.kv_cache_dtype)
        v = round_to_storage(v, config.kv_cache_dtype)
        group = hq // hkv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(d)
        scores = np.where(causal[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v.astype(np.float64)).reshape(n, hq * d).astype(np.float32)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], config.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return _rms(x, w["model.norm.weight"], config.rms_norm_eps) @ head.T


def eagle3_dense(config: ModelConfig, weights: dict[str, np.ndarray], embeds: np.ndarray, base_hidden: np.ndarray,
                 own_hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An EAGLE3 draft over one sequence of n positions: `embeds` [n, H] (the next tokens' embeddings), the base's
    hidden states [n, 3H'] and the draft's own previous outputs [n, H] (a position uses fc(base) + own, zeros where
    unused). Returns (draft logits [n, draft_vocab], the layer's output [n, H]); K/V rounded through storage."""
    w = weights
    n, d = len(embeds), config.head_dim
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    eps = config.rms_norm_eps
    h = base_hidden @ w["fc.weight"].T + own_hidden
    x = np.concatenate([_rms(embeds, w["midlayer.input_layernorm.weight"], eps),
                        _rms(h, w["midlayer.hidden_norm.weight"], eps)], axis=-1)
    table = rope_table(max(n, 1), d, config.rope_theta)
    positions = np.arange(n)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).reshape(n, hq, d)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).reshape(n, hkv, d)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).reshape(n, hkv, d)
    q = apply_rope(q, table, positions)
    k = round_to_storage(apply_rope(k, table, positions), config.kv_cache_dtype)
    v = round_to_storage(v, config.kv_cache_dtype)
    k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((n, n), dtype=bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attn = np.einsum("hqk,khd->qhd", probs, v.astype(np.float64)).reshape(n, hq * d).astype(np.float32)
    h = h + attn @ w["midlayer.self_attn.o_proj.weight"].T
    m = _rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
    gate = m @ w["midlayer.mlp.gate_proj.weight"].T
    mlp = (gate / (1 + np.exp(-gate))) * (m @ w["midlayer.mlp.up_proj.weight"].T)
    h = h + mlp @ w["midlayer.mlp.down_proj.weight"].T
    return _rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T, h


def block_draft_dense(config: ModelConfig, weights: dict[str, np.ndarray], head: np.ndarray, features: np.ndarray,
                      block_embeds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A DFlash/DSpark draft as the Hugging Face model computes it: n context positions (the base's concatenated
    hidden states `features` [n, width]) and a block of b positions after them (`block_embeds` [b, H]). Every layer
    attends from the block to the context's K/V (its k/v projections of hidden_norm(fc(features))) and to the whole
    block (non-causal). Returns (logits [b, V] through `head` [V, H], the normed last layer [b, H])."""
    w = weights
    n, b, d = len(features), len(block_embeds), config.head_dim
    hq, hkv, eps = config.num_attention_heads, config.num_key_value_heads, config.rms_norm_eps
    target = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    table = rope_table(n + b, d, config.rope_theta)
    h = block_embeds.astype(np.float32)
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        source = np.concatenate([target, x])  # [n + b, H]
        q = _rms((x @ w[p + "self_attn.q_proj.weight"].T).reshape(b, hq, d), w[p + "self_attn.q_norm.weight"], eps)
        k = _rms((source @ w[p + "self_attn.k_proj.weight"].T).reshape(n + b, hkv, d), w[p + "self_attn.k_norm.weight"],
                 eps)
        v = (source @ w[p + "self_attn.v_proj.weight"].T).reshape(n + b, hkv, d)
        q = apply_rope(q, table, np.arange(n, n + b))
        k = round_to_storage(apply_rope(k, table, np.arange(n + b)), config.kv_cache_dtype)
        v = round_to_storage(v, config.kv_cache_dtype)
        k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(d)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v.astype(np.float64)).reshape(b, hq * d).astype(np.float32)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T
        m = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        gate = m @ w[p + "mlp.gate_proj.weight"].T
        h = h + ((gate / (1 + np.exp(-gate))) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    normed = _rms(h, w["norm.weight"], eps)
    return normed @ head.T, normed

"""scripts/train_eagle3.py: the checkpoint it writes is the HF EAGLE3 format, and its training forward (all unrolled
steps at once) equals chained drafting with a draft KV cache, computed here in numpy from the saved file alone.

A tiny synthetic llama stands in for SmolLM2 (seconds; torch is the dev extra's)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.lazy_import import LazyModule

from kvforge.tools.export.sources.synthetic import synthetic_model

torch = LazyModule("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
from scripts import train_eagle3  # noqa: E402  (as `python -m scripts.train_eagle3` runs it; after the skip above)

STEPS = 4


def _chained_logits(weights: dict[str, np.ndarray], config: dict, embed: np.ndarray, tokens: np.ndarray,
                    aux: np.ndarray, p: int) -> list[np.ndarray]:
    """What a drafting engine computes: step-0 KV of positions < p from the target's hidden states, then the draft
    at position p (embed(token p+1), fc(aux[p])), feeding its own hidden state back for STEPS-1 more tokens."""
    H, nh, nkv, hd = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    eps, theta = config["rms_norm_eps"], config["rope_theta"]

    def m(name: str) -> np.ndarray:
        return weights["midlayer." + name].astype(np.float64)

    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)

    def rope(x: np.ndarray, pos: int) -> np.ndarray:
        f = pos / theta ** (np.arange(0, hd, 2) / hd)
        emb = np.concatenate([f, f])
        return x * np.cos(emb) + np.concatenate([-x[:, hd // 2:], x[:, :hd // 2]], -1) * np.sin(emb)

    cache: list[tuple[np.ndarray, np.ndarray]] = []

    def step(token: int, h: np.ndarray, pos: int) -> tuple[np.ndarray, np.ndarray]:
        x = np.concatenate([rms(embed[token], m("input_layernorm.weight")), rms(h, m("hidden_norm.weight"))])
        q = rope((m("self_attn.q_proj.weight") @ x).reshape(nh, hd), pos)
        cache.append((rope((m("self_attn.k_proj.weight") @ x).reshape(nkv, hd), pos),
                      (m("self_attn.v_proj.weight") @ x).reshape(nkv, hd)))
        K = np.stack([k for k, _ in cache], 1)
        V = np.stack([v for _, v in cache], 1)
        heads = []
        for i in range(nh):
            s = K[i // (nh // nkv)] @ q[i] / np.sqrt(hd)
            a = np.exp(s - s.max())
            heads.append((a / a.sum()) @ V[i // (nh // nkv)])
        h = h + m("self_attn.o_proj.weight") @ np.concatenate(heads)
        y = rms(h, m("post_attention_layernorm.weight"))
        gate, up = m("mlp.gate_proj.weight") @ y, m("mlp.up_proj.weight") @ y
        h = h + m("mlp.down_proj.weight") @ (gate / (1 + np.exp(-gate)) * up)
        return h, weights["lm_head.weight"] @ rms(h, weights["norm.weight"])

    fc = weights["fc.weight"].astype(np.float64)
    for j in range(p):
        step(int(tokens[j + 1]), fc @ aux[j], j)
    h, logits = step(int(tokens[p + 1]), fc @ aux[p], p)
    out = [logits]
    for k in range(1, STEPS):
        h, logits = step(int(tokens[p + 1 + k]), h, p + k)
        out.append(logits)
    return out


def test_checkpoint_format_and_chained_drafting(tmp_path: Path) -> None:
    torch.manual_seed(0)
    loaded = synthetic_model("tiny-llama")
    c = loaded.config
    rng = np.random.default_rng(0)
    draft_ids = np.sort(rng.choice(c.vocab_size, 48, replace=False))
    draft = train_eagle3.build_draft(torch, loaded.weights, c, draft_ids)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.2)  # away from the init, whose halves are symmetric
    train_eagle3.save(torch, draft, c, None, draft_ids, tmp_path)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 48 and config["vocab_size"] == c.vocab_size
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert config["kvforge_hidden_state_layers"] == [1, 14, 26]
    weights = safetensors_numpy.load_file(str(tmp_path / "model.safetensors"))
    H = c.hidden_size
    assert weights["fc.weight"].shape == (H, 3 * H)
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (c.num_attention_heads * c.head_dim, 2 * H)
    assert weights["lm_head.weight"].shape == (48, H)
    assert "embed_tokens.weight" not in weights
    assert weights["d2t"].dtype == np.int64 and weights["t2d"].dtype == np.bool_
    assert (np.arange(48) + weights["d2t"] == draft_ids).all()
    assert weights["t2d"].sum() == 48 and weights["t2d"][draft_ids].all()

    n = 12
    tokens = rng.integers(0, c.vocab_size, n + STEPS)
    aux = rng.normal(0, 1, (n, 3 * H)).astype(np.float32)
    seq_tokens = torch.from_numpy(np.concatenate([tokens[1:], [0]]))[None]  # draft position p reads token p+1
    with torch.no_grad():
        outs = draft(seq_tokens, torch.from_numpy(aux)[None], torch.tensor([[3, 7]]), STEPS)
    embed = loaded.weights["model.embed_tokens.weight"].astype(np.float64)
    for slot, p in enumerate((3, 7)):
        expected = _chained_logits(weights, config, embed, tokens, aux.astype(np.float64), p)
        for k in range(STEPS):
            np.testing.assert_allclose(outs[k][0, slot].numpy(), expected[k], rtol=1e-4, atol=1e-4)

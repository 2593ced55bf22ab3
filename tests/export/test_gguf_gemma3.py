"""Gemma 3 GGUF files (issue 51 item 4): llama.cpp's gemma3 layout, whose implicit fields (the local RoPE base, every
6th layer global, the query scale) and 1 + w norms the reader maps, exports the same graph as the HF dir of the same
tiny random checkpoint: equal logits and greedy tokens. Its SentencePiece vocabulary tokenizes as SentencePiece does,
and a variant the reader does not know is refused by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from support.lazy_import import LazyModule
from support.paged_rows import Row, lowered_session

from kvforge.contract.errors import KvforgeError
from kvforge.tools.export import cli as export_cli
from kvforge.tools.export.families.gemma3 import build_gemma3_graph
from kvforge.tools.export.sources import gguf as gguf_source
from kvforge.tools.export.sources.gguf import gguf_quantization, load_gguf, read_gguf_config_and_tokenizer
from kvforge.tools.export.sources.gguf_spm import BYTE, CONTROL, NORMAL, UNKNOWN, spm_merges
from kvforge.tools.export.sources.hf import load_hf_dir

torch = LazyModule("torch")
transformers = LazyModule("transformers")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, WINDOW = 64, 4, 2, 32, 96, 6, 8
# A SentencePiece vocabulary: specials, the 256 byte pieces, then scored pieces (longer pieces score higher, as
# SentencePiece's BPE trainer leaves them), padded to VOCAB.
PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "\u2581hello", "\u2581w", "or",
          "\u2581wor", "ld", "\u2581world", "<start_of_turn>", "<end_of_turn>"]
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
TOKENS = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + PIECES
VOCAB = len(TOKENS) + 4
TOKENS += [f"<unused{i}>" for i in range(VOCAB - len(TOKENS))]
TEMPLATE = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n" \
           "{% endfor %}"
GEMMA3_NAMES = {v: k for k, v in gguf_source.GEMMA3_LAYER_NAMES.items()}


def token_types() -> list[int]:
    special = {"<pad>": CONTROL, "<eos>": CONTROL, "<bos>": CONTROL, "<unk>": UNKNOWN,
               "<start_of_turn>": CONTROL, "<end_of_turn>": CONTROL}
    return [special.get(t, BYTE if t.startswith("<0x") else CONTROL if t.startswith("<unused") else NORMAL)
            for t in TOKENS]


def token_scores() -> list[float]:
    return [float(len(t)) if kind == NORMAL else 0.0 for t, kind in zip(TOKENS, token_types(), strict=True)]


def hf_model(**overrides: object) -> object:
    """A tiny Gemma3ForCausalLM as llama.cpp's gemma3 loader assumes one: every 6th layer global, local base 10,000,
    queries scaled by 1/sqrt(head_dim), no soft-capping; norms off zero so the 1 + w shift matters."""
    fields = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  max_position_embeddings=512, sliding_window=WINDOW, query_pre_attn_scalar=HEAD_DIM,
                  final_logit_softcapping=None, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=2,
                  eos_token_id=1, pad_token_id=0,
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    fields.update(overrides)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.3 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
    return model.eval()


def save_hf_dir(path: Path, model: object) -> dict[str, np.ndarray]:
    model.save_pretrained(path, safe_serialization=True)
    from kvforge.tools.export.sources.gguf_spm import spm_tokenizer_json

    (path / "tokenizer.json").write_text(spm_tokenizer_json(TOKENS, token_scores(), token_types(), 2, True, False))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                            "chat_template": TEMPLATE}))
    # Tied: llama.cpp writes no output.weight, and the HF dir's lm_head is the embedding.
    return {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items() if k != "lm_head.weight"}


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name in ("model.embed_tokens.weight", "model.norm.weight"):
        return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{GEMMA3_NAMES[module]}.{kind}"


def write_gemma3_gguf(path: Path, weights: dict[str, np.ndarray], layers: int = LAYERS, quant: str | None = None,
                      extra_tensors: dict[str, np.ndarray] | None = None, linear_factor: float = 1.0,
                      extra_keys: dict[str, float] | None = None) -> None:
    """What llama.cpp's Gemma 3 converter writes: the explicit keys only, norms stored as 1 + w, the lm_head tied
    (no output.weight), a SentencePiece vocabulary without merges."""
    import gguf

    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_name("tiny-gemma3")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(WINDOW)
    if linear_factor != 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(linear_factor)
    for key, value in (extra_keys or {}).items():
        writer.add_float32(f"gemma3.{key}", value)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_scores(token_scores())
    writer.add_token_types(token_types())
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(TEMPLATE)
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            w = (w + np.float32(1.0)).astype(np.float32)
        if quant and w.ndim == 2 and name.startswith("model.layers."):
            kind = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(gguf_tensor_name(name), gguf.quants.quantize(np.ascontiguousarray(w), kind),
                              raw_dtype=kind)
        else:
            writer.add_tensor(gguf_tensor_name(name), np.ascontiguousarray(w))
    for name, w in (extra_tensors or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    root = tmp_path_factory.mktemp("gemma3")
    weights = save_hf_dir(root / "hf", hf_model())
    write_gemma3_gguf(root / "m.gguf", weights)
    return load_hf_dir(root / "hf", "fp32"), load_gguf(root / "m.gguf", "fp32"), root


@pytest.mark.torch
def test_a_gemma3_gguf_maps_the_fields_it_leaves_implicit(exports: tuple) -> None:
    from_hf, from_gguf, _ = exports
    c = from_gguf.config
    assert (c.model, c.sliding_window_layers, c.sliding_window) == ("gemma3", [0, 1, 2, 3, 4], WINDOW)
    assert (c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (1e6, 1e4, float(HEAD_DIM))
    assert c.eos_token_ids == [1, TOKENS.index("<end_of_turn>")]  # a chat turn ends at <end_of_turn>
    same = {"name": "x", "eos_token_ids": [1], "bos_token_id": 2, "pad_token_id": 0}
    assert dataclasses.replace(c, **same) == dataclasses.replace(from_hf.config, **same)
    assert from_gguf.weights.keys() == from_hf.weights.keys()
    for name, w in from_hf.weights.items():  # norms come back from 1 + w within its float32 rounding (1 + w < 4)
        np.testing.assert_allclose(from_gguf.weights[name], w, rtol=0, atol=2.4e-7, err_msg=name)


@pytest.mark.torch
@pytest.mark.parametrize("path", ["kernel", "gqa"])
def test_a_gemma3_gguf_answers_as_the_hf_dir_of_the_same_weights(exports: tuple, path: str) -> None:
    from_hf, from_gguf, _ = exports
    prompt = [int(t) for t in np.random.default_rng(3).integers(4, VOCAB, 40)]  # past the window of 8
    rows = [Row(m.config, lowered_session(build_gemma3_graph(m.config, m.weights), path),
                m.weights["model.embed_tokens.weight"]) for m in (from_hf, from_gguf)]
    np.testing.assert_allclose(rows[1].step(prompt), rows[0].step(prompt), atol=1e-5, rtol=0)
    rows = [Row(r.config, r.session, r.embedding) for r in rows]
    assert rows[1].greedy(prompt, 12, banned=1) == rows[0].greedy(prompt, 12, banned=1)


@pytest.mark.torch
def test_the_norm_shift_and_the_implicit_fields_each_matter(exports: tuple) -> None:
    """Guard: read without the 1 + w shift, or with every layer global, the graph answers otherwise."""
    from_hf, from_gguf, _ = exports
    prompt = [int(t) for t in np.random.default_rng(3).integers(4, VOCAB, 40)]
    good = Row(from_gguf.config, lowered_session(build_gemma3_graph(from_gguf.config, from_gguf.weights), "gqa"),
               from_gguf.weights["model.embed_tokens.weight"]).step(prompt)
    unshifted = {k: w + 1 if k.endswith("norm.weight") else w for k, w in from_gguf.weights.items()}
    all_global = dataclasses.replace(from_gguf.config, sliding_window_layers=[], sliding_window=0,
                                     rope_local_theta=0.0)
    for config, weights in ((from_gguf.config, unshifted), (all_global, from_gguf.weights)):
        other = Row(config, lowered_session(build_gemma3_graph(config, weights), "gqa"),
                    weights["model.embed_tokens.weight"]).step(prompt)
        assert np.abs(other - good).max() > 1e-2


def header_only(path: Path, **kwargs: object) -> None:
    """A gemma3 GGUF with the tensors of `layers` layers of zeros: enough for the header's config."""
    layers = int(kwargs.pop("layers", LAYERS))  # type: ignore[arg-type]
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{t}.weight" for i in range(layers) for t in ("input_layernorm",)]
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    write_gemma3_gguf(path, {n: np.zeros(shapes.get(n, (HIDDEN,)), np.float32) for n in names}, layers=layers,
                      **kwargs)  # type: ignore[arg-type]


def test_the_27b_query_scale_and_linear_rope_scaling(tmp_path: Path) -> None:
    """llama.cpp scales the 62-layer 27B's queries by 1/sqrt(hidden / heads), every other size's by 1/sqrt(head_dim);
    the 4B/12B/27B files' linear RoPE scaling (factor 8) applies to the global layers."""
    header_only(tmp_path / "27b.gguf", layers=62, linear_factor=8.0)
    config = read_gguf_config_and_tokenizer(tmp_path / "27b.gguf").config
    assert (config.query_pre_attn_scalar, config.rope_linear_factor) == (HIDDEN / HEADS, 8.0)
    assert config.sliding_window_layers == [i for i in range(62) if (i + 1) % 6]
    header_only(tmp_path / "1b.gguf", layers=26)
    config = read_gguf_config_and_tokenizer(tmp_path / "1b.gguf").config
    assert (config.query_pre_attn_scalar, config.rope_linear_factor) == (float(HEAD_DIM), 0.0)


@pytest.mark.parametrize("extra, needle", [
    ({"extra_tensors": {"v.blk.0.attn_q.weight": np.zeros((4, 4), np.float32)}}, "tensor 'v.blk.0.attn_q.weight'"),
    ({"extra_keys": {"attn_logit_softcapping": 50.0}}, "gemma3.attn_logit_softcapping"),
])
def test_an_unknown_gemma3_variant_is_refused_by_name(tmp_path: Path, extra: dict, needle: str) -> None:
    header_only(tmp_path / "m.gguf", **extra)
    with pytest.raises(KvforgeError) as info:
        read_gguf_config_and_tokenizer(tmp_path / "m.gguf")
    assert info.value.field == "SOURCE" and needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.torch
def test_auto_quantization_dequantizes_a_quantized_gemma3_gguf(tmp_path: Path, exports: tuple) -> None:
    """The Gemma graph takes float32 weights only: auto keeps the values (none), not blocks it would refuse."""
    from_hf, _, _ = exports
    write_gemma3_gguf(tmp_path / "q8.gguf", from_hf.weights, quant="Q8_0")
    assert gguf_quantization(tmp_path / "q8.gguf") == "none"
    assert export_cli.default_quantization(str(tmp_path / "q8.gguf"), None) == "none"
    model = load_gguf(tmp_path / "q8.gguf", "fp32")
    w = model.weights["model.layers.0.mlp.up_proj.weight"]
    np.testing.assert_allclose(w, from_hf.weights["model.layers.0.mlp.up_proj.weight"], atol=0.02)


# ------------------------------------------------------------------------------------------------ tokenizer

def spm_reference(text: str) -> list[str]:
    """SentencePiece BPE as llama.cpp's SPM tokenizer runs it (written independently of the merge table): spaces as
    U+2581, one piece per character, then join the adjacent pair whose joined piece scores highest (leftmost first)
    until none is in the vocabulary."""
    score = {t: s for t, s, k in zip(TOKENS, token_scores(), token_types(), strict=True) if k == NORMAL}
    pieces = list(text.replace(" ", "\u2581"))
    while True:
        best = max(((score[a + b], -i) for i, (a, b) in enumerate(zip(pieces, pieces[1:], strict=False))
                    if a + b in score), default=None)
        if best is None:
            return pieces
        i = -best[1]
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]


@pytest.mark.parametrize("text", ["hello world", " hello", "hellow", "world hello world", "held"])
def test_the_sentencepiece_vocabulary_tokenizes_as_sentencepiece(exports: tuple, text: str) -> None:
    from tokenizers import Tokenizer

    _, from_gguf, _ = exports
    tokenizer = Tokenizer.from_str(from_gguf.tokenizer_json)
    encoding = tokenizer.encode(text)
    assert encoding.tokens == ["<bos>", *spm_reference(text)]
    assert tokenizer.decode(encoding.ids, skip_special_tokens=True) == text


def test_unknown_characters_fall_back_to_bytes_and_specials_match_whole(exports: tuple) -> None:
    from tokenizers import Tokenizer

    _, from_gguf, _ = exports
    tokenizer = Tokenizer.from_str(from_gguf.tokenizer_json)
    encoding = tokenizer.encode("<start_of_turn>h\u00e9")
    assert encoding.tokens == ["<bos>", "<start_of_turn>", "h", "<0xC3>", "<0xA9>"]
    assert tokenizer.decode(encoding.ids, skip_special_tokens=True) == "h\u00e9"


def test_merges_rank_by_the_joined_piece_score() -> None:
    tokens, scores = ["a", "b", "c", "ab", "bc", "abc"], [0.0, 0.0, 0.0, 1.0, 2.0, 3.0]
    merges = spm_merges(tokens, scores, [NORMAL] * 6)
    assert merges == [("a", "bc"), ("ab", "c"), ("b", "c"), ("a", "b")]

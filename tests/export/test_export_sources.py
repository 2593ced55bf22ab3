"""The GGUF and HF-dir weight sources hand the graph builder exact HF-layout float32 weights and configs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvforge.contract.errors import KvforgeError
from kvforge.tools.export.sources import gguf as gguf_source
from kvforge.tools.export.sources.gguf import (
    find_smollm2_gguf,
    load_gguf,
    read_gguf_config_and_tokenizer,
    unpermute_llama_cpp_rows,
)
from kvforge.tools.export.sources.hf import load_hf_dir
from kvforge.tools.export.sources.hf_common import bf16_bits_to_f32

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 64, 4, 2, 2, 96
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Q/K rows (written here independently of the loader)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape, n_head", [((64, 64), 4), ((32, 64), 2), ((576, 576), 9), ((192, 576), 3),
                                           ((24,), 3)])
def test_unpermute_inverts_llama_cpp_permute(shape: tuple[int, ...], n_head: int) -> None:
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    assert not np.array_equal(llama_cpp_permute(w, n_head), w)
    np.testing.assert_array_equal(unpermute_llama_cpp_rows(llama_cpp_permute(w, n_head), n_head), w)


# ------------------------------------------------------------------------------------------- tiny GGUF

TINY_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "h", "e", "l", "o", "Ġ", "Ċ", "1", "2",
               "he", "ll", "hell", "hello", "Ġhello"]
TINY_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ hello"]
TINY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}")


def _tiny_hf_weights(tied: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    vocab = len(TINY_TOKENS)
    shapes = {"model.embed_tokens.weight": (vocab, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                   p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                   p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, FFN)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _gguf_name(hf_name: str) -> str:
    inverse = {v: k for k, v in gguf_source.GLOBAL_NAMES.items()}
    if hf_name in inverse:
        return inverse[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module = rest.removesuffix(".weight")
    return f"blk.{layer}.{next(k for k, v in gguf_source.LAYER_NAMES.items() if v == module)}.weight"


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray], arch: str = "llama") -> None:
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny-llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(TINY_TOKENS))
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(TINY_TOKENS) - 3))
    writer.add_token_merges(TINY_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)  # <|endoftext|>: the loader must still add <|im_end|> for chat turns
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TINY_TEMPLATE)
    for name, w in weights.items():
        if name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, HEADS)
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, KV_HEADS)
        writer.add_tensor(_gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_round_trip(tmp_path: Path, tied: bool) -> None:
    from tokenizers import Tokenizer

    weights = _tiny_hf_weights(tied)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, weights)
    calls: list[tuple[int, int]] = []
    model = load_gguf(path, "fp8", progress=lambda done, total: calls.append((done, total)))

    assert calls[-1] == (len(weights), len(weights)) and len(calls) == len(weights)
    assert model.weights.keys() == weights.keys()
    for name, w in weights.items():
        assert model.weights[name].dtype == np.float32
        np.testing.assert_array_equal(model.weights[name], w, err_msg=name)
    c = model.config
    assert (c.model, c.num_hidden_layers, c.hidden_size) == ("llama", LAYERS, HIDDEN)
    assert c.intermediate_size == FFN
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert (c.vocab_size, c.max_position_embeddings, c.kv_cache_dtype) == (len(TINY_TOKENS), 128, "fp8")
    assert (c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings) == (100000.0, 1e-5, tied)
    assert (c.bos_token_id, c.eos_token_ids, c.pad_token_id, c.name) == (1, [0, 2], 0, "tiny-llama")
    assert model.tokenizer_config == {"chat_template": TINY_TEMPLATE, "bos_token": "<|im_start|>",
                                      "eos_token": "<|endoftext|>", "add_bos_token": False,
                                      "model_max_length": 128}
    header_only = read_gguf_config_and_tokenizer(path, "fp8")
    assert header_only.weights == {} and header_only.config == c
    assert header_only.tokenizer_json == model.tokenizer_json
    tok = Tokenizer.from_str(model.tokenizer_json)
    assert tok.encode("<|im_start|>hello hello<|im_end|>").ids == [1, 14, 15, 2]
    assert tok.encode("12").ids == [9, 10]
    assert tok.decode(tok.encode("hello\nhello").ids) == "hello\nhello"


def test_gguf_other_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, _tiny_hf_weights(tied=True), arch="gpt2")
    with pytest.raises(KvforgeError, match="'gpt2'") as info:
        load_gguf(path)
    assert info.value.field == "SOURCE"


@pytest.mark.parametrize("content", [b"not a gguf file at all" * 10, b"GGUF\x03\x00\x00\x00\x10"])
def test_garbage_gguf_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(KvforgeError, match="cannot read GGUF file") as info:
        load_gguf(path)
    assert info.value.field == "SOURCE"


def test_truncated_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, _tiny_hf_weights(tied=True))
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(KvforgeError) as info:
        load_gguf(path)
    assert info.value.field == "SOURCE"


# ------------------------------------------------------------------------------------------ real SmolLM2

@pytest.fixture(scope="module")
def smollm2_reader() -> tuple[Path, object]:
    try:
        path = find_smollm2_gguf()
    except KvforgeError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable: {exc}")
    # Parsing the 49k-token metadata takes ~5 s in gguf's reader, so the tests share one reader.
    return path, gguf_source.open_reader(path)


@pytest.mark.model
def test_smollm2_config(smollm2_reader: tuple[Path, object]) -> None:
    path, reader = smollm2_reader
    c = gguf_source.header_model(reader, path, "fp16").config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and (c.rope_theta, c.rms_norm_eps) == (100000.0, 1e-5)
    # SmolLM2's GGUF eos (id 2) already is <|im_end|>; bos (id 1) is <|im_start|>.
    assert (c.bos_token_id, c.eos_token_ids) == (1, [2])


@pytest.mark.model
def test_smollm2_quantized_tensors_dequantize_to_hf_shapes(smollm2_reader: tuple[Path, object]) -> None:
    path, reader = smollm2_reader
    tensors = {t.name: t for t in reader.tensors}
    embed = gguf_source.dequantize(tensors["token_embd.weight"], path)  # Q8_0
    down = gguf_source.dequantize(tensors["blk.0.ffn_down.weight"], path)  # Q4_1, ne = [1536, 576]
    assert embed.shape == (49152, 576) and down.shape == (576, 1536)
    assert embed.dtype == np.float32 and np.isfinite(down).all() and 0 < np.abs(down).mean() < 1


@pytest.mark.model
def test_smollm2_tokenizer(smollm2_reader: tuple[Path, object]) -> None:
    from tokenizers import Tokenizer

    path, reader = smollm2_reader
    model = gguf_source.header_model(reader, path, "fp16")
    tok = Tokenizer.from_str(model.tokenizer_json)
    chat = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    ids = tok.encode(chat).ids
    assert ids[0] == 1 and ids[-2:] == [2, 198] and ids.count(1) == 1 and ids.count(2) == 1
    for text in (chat, "In 2024, 1234567 people paid €12.50!", "naïve café 日本語 🙂\n\n  tabs\tand  spaces"):
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.encode("2024").ids == tok.encode("2").ids + tok.encode("0").ids + tok.encode("2").ids \
        + tok.encode("4").ids  # SmolLM2 splits digits one by one
    assert "<|im_end|>" in model.tokenizer_config["chat_template"]


# ----------------------------------------------------------------------------------------------- HF dirs

def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>", "model_max_length": 10**30}))
    (path / "chat_template.jinja").write_text("{{ messages }}")


def _save_tiny_hf(path: Path, family: str, dtype: str = "float32", tied: bool = False,
                  shard: str | None = None) -> dict[str, np.ndarray]:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
    config_cls, model_cls = (getattr(transformers, n) for n in classes[family])
    extra = {"head_dim": 32} if family == "qwen3" else {}  # qwen3's head_dim is independent of hidden/heads
    config = config_cls(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=128,
                        max_position_embeddings=256, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
                        **extra)
    torch.manual_seed(0)
    model = model_cls(config).to(getattr(torch, dtype))
    with torch.no_grad():  # norms start at exactly 1: randomize so a mixed-up name would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": "40KB"} if shard else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    _write_tokenizer(path)
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


@pytest.mark.torch
@pytest.mark.parametrize("family, dtype, tied, shard", [
    ("llama", "float32", False, None),
    ("llama", "float32", True, "sharded"),
    ("qwen2", "float32", False, None),
    ("qwen3", "float32", False, None),
    ("qwen3", "bfloat16", True, None),
])
def test_hf_dir_round_trip(tmp_path: Path, family: str, dtype: str, tied: bool, shard: str | None) -> None:
    expected = _save_tiny_hf(tmp_path, family, dtype, tied, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    if tied:
        expected.pop("lm_head.weight", None)
    model = load_hf_dir(tmp_path, "fp32")

    assert model.weights.keys() == expected.keys()
    for name, w in expected.items():
        assert model.weights[name].dtype == np.float32
        np.testing.assert_array_equal(model.weights[name], w, err_msg=name)
    c = model.config
    assert (c.model, c.tie_word_embeddings, c.attention_bias, c.qk_norm) == (
        family, tied, family == "qwen2", family == "qwen3")
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (LAYERS, HEADS, KV_HEADS)
    assert c.head_dim == (32 if family == "qwen3" else HEAD_DIM)
    assert (c.vocab_size, c.max_position_embeddings, c.kv_cache_dtype) == (128, 256, "fp32")
    assert (c.bos_token_id, c.eos_token_ids, c.name) == (1, [2], tmp_path.name)
    assert model.tokenizer_json == (tmp_path / "tokenizer.json").read_text()
    assert model.tokenizer_config == {"chat_template": "{{ messages }}", "bos_token": "<s>",
                                      "eos_token": "</s>", "add_bos_token": False, "model_max_length": 256}


def test_bf16_bits_to_f32() -> None:
    values = np.array([0.0, -0.0, 1.0, -2.5, 3.140625, 65280.0, np.inf, 2.0**-126], dtype=np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # these values are exact in bfloat16
    np.testing.assert_array_equal(bf16_bits_to_f32(bits), values)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(2).standard_normal(100).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bf16_bits_to_f32(rng.view(np.uint16)), rng.astype(np.float32))


def _write_config(path: Path, **overrides: object) -> None:
    config = {"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": 1,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": 8,
              "max_position_embeddings": 32} | overrides
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("overrides, message", [
    ({"model_type": "mistral"}, "unsupported model_type 'mistral'.*llama, qwen2, qwen3"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "unsupported rope_scaling type 'llama3'"),
    ({"attention_bias": True}, "o_proj bias"),
    ({}, "no \\*.safetensors files"),
])
def test_hf_dir_bad_config_is_refused(tmp_path: Path, overrides: dict[str, object], message: str) -> None:
    _write_config(tmp_path, **overrides)
    with pytest.raises(KvforgeError, match=message) as info:
        load_hf_dir(tmp_path)
    assert info.value.field == "SOURCE"


def test_hf_dir_missing_config_or_tensor(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    with pytest.raises(KvforgeError, match="config.json") as info:
        load_hf_dir(tmp_path)
    assert info.value.field == "SOURCE"
    _write_config(tmp_path)
    save_file({"model.embed_tokens.weight": np.zeros((8, HIDDEN), np.float32),
               "model.norm.weight": np.ones(HIDDEN, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(KvforgeError, match="lacks tensor model.layers.0.input_layernorm.weight"):
        load_hf_dir(tmp_path)

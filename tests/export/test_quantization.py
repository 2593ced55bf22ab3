"""Quantized export (MatMulNBits): GGUF blocks taken bit-exactly, and engines equal to the dequantized model."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import onnx
import pytest
from support.numpy_llama import dense_logits
from support.ort_support import cpu_kernel_on

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.errors import KvforgeError
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import SamplingParams
from kvforge.tools.export.quantize import (
    LM_HEAD,
    from_gguf_blocks,
    linear_weight_names,
    permute_rows,
    quantize,
    set_accuracy_level,
)
from kvforge.tools.export.quantize_model import quantize_linears
from kvforge.tools.export.sources.base import LoadedModel
from kvforge.tools.export.sources.gguf import unpermute_llama_cpp_rows
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

pytestmark = [pytest.mark.attention_path, pytest.mark.in_process]  # fallback rerun; run_cli in process


def _built_graph(loaded: LoadedModel, tmp_path: Path, cpu_matmul: str = "onnx",
                 engine: str = "engine", prefill: str = "fp32") -> onnx.GraphProto:
    """Export `loaded` and build a one-row engine of it under tmp_path; the lowered graph (weights not loaded).
    MatMulNBits by default (the export's form); `cpu_matmul="kernel"` takes kvforge's MatMulBlocks for 4-bit, whose
    prompt rows run in float32 unless `prefill="bf16"` (llm_build's default)."""
    if not (tmp_path / "onnx").is_dir():
        write_onnx_dir(loaded, tmp_path / "onnx")
    build_engine(tmp_path / "onnx", tmp_path / engine, BuildOptions(max_input_len=64, max_kv_cache_capacity=128,
                                                                    max_batch_size=1, tokens_per_page=16,
                                                                    cpu_matmul=cpu_matmul,
                                                                    cpu_prefill_matmul=prefill))
    return onnx.load(tmp_path / engine / "model.onnx", load_external_data=False).graph


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_map_bit_exactly(kind: str) -> None:
    rng = np.random.default_rng(1)
    weight = (rng.standard_normal((48, 128)) * 0.1).astype(np.float32)  # [out, in], as GGUF rows
    raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType[kind])
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(weight.shape)
    blocks = from_gguf_blocks(kind, raw, 128)
    assert blocks is not None and blocks.bits == (8 if kind == "Q8_0" else 4)
    assert np.array_equal(blocks.dequantize().T, expected)  # no second rounding
    order = unpermute_llama_cpp_rows(np.arange(48), 4)
    assert np.array_equal(permute_rows(blocks, order).dequantize().T, unpermute_llama_cpp_rows(expected, 4))
    if kind == "Q4_1":  # d * (q - z) + r with r = m + d * z: the offsets carry what an integer zero point cannot
        assert blocks.offsets is not None and blocks.offsets.shape == (128 // 32, 48)
    assert from_gguf_blocks("Q5_K", raw, 128) is None


@pytest.mark.parametrize("bits", [4, 8])
def test_onnx_runtime_quantizer_round_trip(bits: int) -> None:
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((40, 64)).astype(np.float32)
    blocks = quantize(weight, bits, 32)
    error = np.abs(blocks.dequantize().T - weight).reshape(40, 2, 32).max(-1)
    block_range = np.ptp(weight.reshape(40, 2, 32), axis=-1)
    assert (error <= block_range / (2 ** bits - 1) * 0.51).all()  # half a step of an asymmetric block
    with pytest.raises(KvforgeError) as info:
        quantize(weight, bits, 48)
    assert info.value.field == "quant_block_size"


@pytest.mark.parametrize("model, quantization, gguf_blocks", [
    ("tiny-llama", "int4", None), ("tiny-llama", "int8", None), ("tiny-qwen2", "int4", None),
    ("tiny-llama", "int4", "Q4_1"), ("tiny-llama", "int8", "Q8_0")])
def test_quantized_engine_equals_the_dequantized_reference(model: str, quantization: str, gguf_blocks: str | None,
                                                           tmp_path: Path) -> None:
    """Every linear, the LM head included, runs as MatMulNBits; with float activations (accuracy level 0) the
    logits equal a dense numpy forward over the dequantized weights, and the default level stays close. With
    GGUF blocks (as a Q4_1 or Q8_0 file holds them) the engine computes exactly the GGUF's dequantized model."""
    loaded = synthetic_model(model, kv_cache_dtype="fp32")
    if gguf_blocks is not None:
        kind = gguf.GGMLQuantizationType[gguf_blocks]
        for name in linear_weight_names(loaded.config)[:-1]:
            weight = loaded.weights[name]
            raw = gguf.quants.quantize(weight, kind)
            loaded.weights[name] = gguf.quants.dequantize(raw, kind).reshape(weight.shape)
            loaded.exact_blocks[name] = from_gguf_blocks(gguf_blocks, raw, weight.shape[1])
    reference = dict(loaded.weights)
    # The head as plain blocks of the layers' width (no rescoring of candidates: that is tests/test_lm_head.py)
    quantize_linears(loaded, quantization, 32, lm_head=quantization, lm_head_candidates=0)
    for name, exact in loaded.exact_blocks.items():
        assert loaded.quantized[name] is exact  # no second rounding
    if gguf_blocks is not None:
        for name in linear_weight_names(loaded.config)[:-1]:
            np.testing.assert_array_equal(loaded.quantized[name].dequantize().T, reference[name])
    assert sorted(loaded.quantized) == sorted(linear_weight_names(loaded.config))
    for name, blocks in loaded.quantized.items():
        reference[name] = blocks.dequantize().T
    graph = _built_graph(loaded, tmp_path)
    # q/k/v and gate/up run fused: four MatMulNBits per layer, plus the head
    nodes = 4 * loaded.config.num_hidden_layers + (LM_HEAD in loaded.quantized)
    assert sum(n.op_type == "MatMulNBits" for n in graph.node) == nodes
    assert not any(n.op_type == "MatMul" and n.input[1].endswith(".weight") for n in graph.node)
    ids = list(range(5, 29))
    expected = dense_logits(loaded.config, reference, ids)[-1]
    # Level 4 (the exported default) quantizes activations to int8 per block: close, not equal.
    for level, rtol, atol in ((4, 0.02, 0.05), (0, 1e-5, 1e-4)):
        assert set_accuracy_level(tmp_path / "engine", level) == nodes
        engine = Engine(tmp_path / "engine", EngineConfig(num_threads=2))
        engine.add_request(EngineRequest(ids, SamplingParams(temperature=0.0, max_generate_length=1,
                                                             num_logprobs=5)))
        [output] = engine.step()
        got = [(t, lp) for t, lp in output.samples[0].top_logprobs]
        log_probs = expected - expected.max() - np.log(np.exp(expected - expected.max()).sum())
        if level == 0:
            assert [t for t, _ in got] == np.argsort(-log_probs)[:5].tolist()
        np.testing.assert_allclose([lp for _, lp in got], log_probs[[t for t, _ in got]], rtol=rtol, atol=atol)
    if quantization == "int4" and cpu_kernel_on():  # kvforge's MatMulBlocks: the same blocks, float activations
        graph = _built_graph(loaded, tmp_path, cpu_matmul="kernel", engine="kernel-engine")
        assert sum(n.op_type == "MatMulBlocks" for n in graph.node) == 4 * loaded.config.num_hidden_layers
        set_accuracy_level(tmp_path / "kernel-engine", 0)  # the head keeps its own MatMulNBits level (4): exact here
        engine = Engine(tmp_path / "kernel-engine", EngineConfig(num_threads=2))
        engine.add_request(EngineRequest(ids, SamplingParams(temperature=0.0, max_generate_length=1, num_logprobs=5)))
        [output] = engine.step()
        got = [(t, lp) for t, lp in output.samples[0].top_logprobs]
        assert [t for t, _ in got] == np.argsort(-log_probs)[:5].tolist()
        np.testing.assert_allclose([lp for _, lp in got], log_probs[[t for t, _ in got]], rtol=1e-5, atol=1e-4)
        # The default bfloat16 prompt rows (24 here): the same best token, logprobs within bfloat16's rounding.
        _built_graph(loaded, tmp_path, cpu_matmul="kernel", engine="bf16-engine", prefill="bf16")
        set_accuracy_level(tmp_path / "bf16-engine", 0)
        engine = Engine(tmp_path / "bf16-engine", EngineConfig(num_threads=2))
        engine.add_request(EngineRequest(ids, SamplingParams(temperature=0.0, max_generate_length=1, num_logprobs=5)))
        [output] = engine.step()
        got = [(t, lp) for t, lp in output.samples[0].top_logprobs]
        assert got[0][0] == int(np.argmax(log_probs))
        np.testing.assert_allclose([lp for _, lp in got], log_probs[[t for t, _ in got]], rtol=1e-2, atol=2e-2)


def test_lm_head_of_a_tied_model_comes_from_the_embedding() -> None:
    loaded = synthetic_model("tiny-qwen2")
    assert loaded.config.tie_word_embeddings and LM_HEAD not in loaded.weights
    quantize_linears(loaded, "int4", 32)
    assert "model.embed_tokens.weight" in loaded.weights  # the runtime still looks embeddings up
    embedding = loaded.weights["model.embed_tokens.weight"]
    error = np.abs(loaded.quantized[LM_HEAD].dequantize().T - embedding).max()
    assert error <= np.abs(embedding).max() / 7  # blocks of the embedding (int8 by default), not of something else
    assert loaded.config.quantization == "int4" and loaded.config.quant_block_size == 32


def test_tensorrt_refuses_a_quantized_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvforge.builder.build as build

    loaded = synthetic_model("tiny-llama")
    quantize_linears(loaded, "int4", 32)
    write_onnx_dir(loaded, tmp_path / "onnx")
    monkeypatch.setattr(build, "resolve_backend", lambda _backend: "tensorrt")  # as on a GPU machine
    with pytest.raises(KvforgeError) as info:
        build.build_engine(tmp_path / "onnx", tmp_path / "engine", BuildOptions(max_input_len=16,
                                                                                max_kv_cache_capacity=32,
                                                                                max_batch_size=1, tokens_per_page=16))
    assert info.value.field == "backend" and "MatMulNBits" in info.value.message


@pytest.mark.parametrize("flags, needles", [(["--quantization", "int3"], ("--quantization", "int3")),
                                            (["--quantization", "int4", "--quantBlockSize", "24"],
                                             ("--quantBlockSize", "24"))])
def test_export_refuses_bad_quantization_flags(run_cli, tmp_path: Path, flags: list[str],
                                               needles: tuple[str, ...]) -> None:
    proc = run_cli(["llm_export", "--synthetic", "tiny-llama", "--outputDir", tmp_path / "out", *flags])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert all(n in proc.stderr for n in needles), proc.stderr
    assert not (tmp_path / "out" / "config.json").exists()


def test_a_tied_float_head_reads_the_runtime_embedding_table(tmp_path: Path) -> None:
    """ONNX Runtime engines of tied models hold the head once: the graph takes it as an input bound to the
    memory-mapped embedding, and the logits still equal the dense reference."""
    from kvforge.contract.engine_dir import TIED_HEAD_INPUT

    loaded = synthetic_model("tiny-qwen2", kv_cache_dtype="fp32")
    assert loaded.config.tie_word_embeddings
    reference = dict(loaded.weights)
    quantize_linears(loaded, "none", 32)
    graph = _built_graph(loaded, tmp_path)
    assert TIED_HEAD_INPUT in [i.name for i in graph.input]
    assert "lm_head.weight" not in [t.name for t in graph.initializer]
    ids = list(range(3, 20))
    expected = dense_logits(loaded.config, reference, ids)[-1]
    engine = Engine(tmp_path / "engine", EngineConfig(num_threads=2))
    engine.add_request(EngineRequest(ids, SamplingParams(temperature=0.0, max_generate_length=1, num_logprobs=3)))
    [output] = engine.step()
    log_probs = expected - expected.max() - np.log(np.exp(expected - expected.max()).sum())
    got = output.samples[0].top_logprobs
    assert [t for t, _ in got] == np.argsort(-log_probs)[:3].tolist()
    np.testing.assert_allclose([lp for _, lp in got], log_probs[[t for t, _ in got]], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", ["llm_context_reuse.json", "llm_multiturn_reuse.json"])
def test_reuse_is_invisible_on_an_int4_engine(case: str, tmp_path: Path) -> None:
    """Warm answers equal cold ones (greedy text and top-1 logprob ids) on a quantized engine too."""
    import json

    from support.engine_driver import make_engine, run_file, top1_ids

    loaded = synthetic_model("tiny-llama")
    quantize_linears(loaded, "int4", 32)
    write_onnx_dir(loaded, tmp_path / "onnx")
    build_engine(tmp_path / "onnx", tmp_path / "engine", BuildOptions(max_input_len=3072, max_kv_cache_capacity=3200,
                                                                      max_batch_size=2, tokens_per_page=16))
    data = json.loads((Path(__file__).resolve().parents[2] / "test_cases" / case).read_text())
    data["max_generate_length"] = 6
    warm_engine = make_engine(tmp_path / "engine", reuse=True)
    warm = run_file(warm_engine, data)
    cold = run_file(make_engine(tmp_path / "engine"), data)
    for w, c in zip(warm, cold, strict=True):
        assert (w["output_text"], top1_ids(w)) == (c["output_text"], top1_ids(c))
    assert warm_engine.profile()["prefill"]["reused_tokens"] > 0


def test_prefill_sized_calls_run_int8_gemms_and_decode_keeps_the_blocks(tmp_path: Path) -> None:
    """--prefillInt8Rows: each quantized layer is an If between DynamicQuantizeMatMul over int8 columns (calls of at
    least that many rows) and its MatMulNBits blocks (smaller calls, still exactly the dequantized model)."""
    from kvforge.runtime.context_cache.manager import Admission
    from kvforge.runtime.execution.backend import StepInputs

    loaded = synthetic_model("tiny-llama", kv_cache_dtype="fp32")
    quantize_linears(loaded, "int4", 32, lm_head="float")
    loaded.config.prefill_int8_rows = 8
    reference = dict(loaded.weights)
    for name, blocks in loaded.quantized.items():
        reference[name] = blocks.dequantize().T
    graph = _built_graph(loaded, tmp_path)
    branches = [n for n in graph.node if n.op_type == "If"]
    assert len(branches) == 4 * loaded.config.num_hidden_layers
    ops = {a.name: [n.op_type for n in a.g.node] for a in branches[0].attribute}
    assert ops["then_branch"] == ["DynamicQuantizeMatMul"] and ops["else_branch"] == ["MatMulNBits"]
    engine = Engine(tmp_path / "engine", EngineConfig(num_threads=2))
    for length, exact in ((7, True), (20, False)):
        ids = list(range(5, 5 + length))
        lease = engine.cache.try_acquire(Admission(ids))
        assert lease is not None
        got = engine.backend.forward(StepInputs(engine.executor.embedding[ids][None], np.array([length], np.int32),
                                               np.zeros(1, np.int32), [lease.page_ids])).logits[0]
        engine.cache.release(lease)
        expected = dense_logits(loaded.config, reference, ids)[-1]
        if exact:
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
        else:  # int8 activations and columns: close, not equal
            assert 1e-4 < np.abs(got - expected).max() <= 0.05 * np.abs(expected).max()
            assert got.argmax() == expected.argmax()

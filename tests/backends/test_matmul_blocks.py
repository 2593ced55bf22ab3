"""kvforge.cpu.MatMulBlocks (kvforge/plugins/cpu/matmul_blocks.cc) and its lowering (kvforge/builder/lower_matmul.py):
the 4-bit
block matmul that replaces MatMulNBits and the Q4_1 correction on kernel engines, against the float64 reference, with
each row's result independent of the call's row count (what makes verification rows equal decode rows)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.builder.lower_matmul import MATMUL_BLOCKS, lower_block_matmuls, pack_blocks
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.contract.errors import InvalidConfig
from kvforge.contract.lora import LORA_TARGETS
from kvforge.plugins import cpu_kernel, reference
from kvforge.plugins.ops import CPU_DOMAIN
from kvforge.runtime.api import LLM
from kvforge.runtime.types import SamplingParams
from kvforge.tools.export.quantize import BlockQuantized, from_gguf_blocks, quantize
from kvforge.tools.export.quantize_model import quantize_linears
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1), helper.make_opsetid(CPU_DOMAIN, 1)]


def _session(model: onnx.ModelProto, library: Path, threads: int = 2) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _random_blocks(rng: np.random.Generator, k: int, n: int) -> np.ndarray:
    values = rng.integers(0, 16, size=(n, k // 32, 32)).astype(np.uint8)
    scales = (rng.random((n, k // 32)) * 0.05 + 0.001).astype(np.float32)
    mins = (-rng.random((n, k // 32)) * 0.4).astype(np.float32)
    return pack_blocks(values, scales, mins)


def _blocks_model(k: int, n: int, blocks: np.ndarray, bits: int = 4, **attributes: int) -> onnx.ModelProto:
    node = helper.make_node(MATMUL_BLOCKS, ["a", "w"], ["y"], domain=CPU_DOMAIN, K=k, N=n, bits=bits, **attributes)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None, n])],
                              [numpy_helper.from_array(blocks, "w")])
    return helper.make_model(graph, opset_imports=OPSETS)


# The targets whose 4-bit decode and verify rows (up to 16) run in int16 (matmul_blocks.cc KVF_INT16).
INT16_TARGETS = ("avx2",)


def _int16_rows(library: Path, bits: int, rows: int) -> bool:
    return bits == 4 and rows <= 16 and cpu_kernel.chosen_target(library) in INT16_TARGETS


def _quantization_bound(a: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """How far the int16 rows may be from the float64 product: rounding x to dx * xq moves each activation by at
    most dx / 2 (dx = max |x| / 32767 of its block), and the min term uses the exact activations, so |error| <= sum
    over blocks of d * sum(q) * dx / 2 (float32 rounding aside)."""
    q = np.concatenate([blocks[..., :16] & 0xF, blocks[..., :16] >> 4], axis=-1).astype(np.float64)  # [N, B, 32]
    d = np.ascontiguousarray(blocks[..., 16:20]).view("<f4")[..., 0].astype(np.float64)  # [N, B]
    _, dx = reference.quantize_int16(a)
    return np.einsum("...b,nb->...n", dx[..., 0].astype(np.float64) / 2, np.abs(d) * q.sum(-1))


def _check_rows(y: np.ndarray, a: np.ndarray, blocks: np.ndarray, int16: bool, message: str = "") -> None:
    """Against the float64 reference of the arithmetic the target runs (1e-4 of the largest output, as before; the
    int16 rows within 2e-6, well inside their ~1e-5 distance from the float product), and the int16 rows also within
    the quantization bound of the float product and visibly not it (so this fails if the float path ran)."""
    expected = reference.matmul_blocks(a, blocks, int16=int16)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(y, expected, rtol=0 if int16 else 1e-4, atol=(2e-6 if int16 else 1e-4) * scale,
                               err_msg=message)
    if int16:
        exact = reference.matmul_blocks(a, blocks)
        assert np.all(np.abs(y - exact) <= _quantization_bound(a, blocks) + 2e-6 * scale), message
        assert np.abs(y - exact).max() > 4e-6 * scale, message


@pytest.mark.parametrize(("k", "n"), [(64, 7), (96, 33), (256, 70)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 40])
def test_it_matches_the_float64_reference(library: Path, k: int, n: int, rows: int) -> None:
    rng = np.random.default_rng(k * 1000 + n + rows)
    blocks = _random_blocks(rng, k, n)
    a = rng.standard_normal((1, rows, k)).astype(np.float32)
    y = _session(_blocks_model(k, n, blocks), library).run(None, {"a": a})[0]
    assert y.shape == (1, rows, n)
    _check_rows(y, a, blocks, _int16_rows(library, 4, rows))


def test_int16_rows_handle_zero_blocks_and_long_rows(library: Path, each_target) -> None:
    """A block of zero activations (scale 0), one with a single large outlier, and K = 1568 (49 blocks: six 8-block
    chunks of min terms and a partial one), on every target."""
    k, n = 1568, 37
    rng = np.random.default_rng(17)
    blocks = _random_blocks(rng, k, n)
    a = rng.standard_normal((1, 5, k)).astype(np.float32)
    a[0, 1, 32:64] = 0.0
    a[0, 2, 100] = 300.0
    for target in each_target():
        session = _session(_blocks_model(k, n, blocks), library)
        y = session.run(None, {"a": a})[0]
        _check_rows(y, a, blocks, _int16_rows(library, 4, 5), target)
        assert np.array_equal(session.run(None, {"a": a[:, 1:2]})[0][0, 0], y[0, 1]), target


def test_a_row_is_the_same_bits_whatever_the_row_count(library: Path) -> None:
    k, n = 192, 45
    rng = np.random.default_rng(7)
    blocks = _random_blocks(rng, k, n)
    session = _session(_blocks_model(k, n, blocks), library)
    a = rng.standard_normal((1, 16, k)).astype(np.float32)
    alone = np.stack([session.run(None, {"a": a[:, i:i + 1]})[0][0, 0] for i in range(16)])
    for rows in range(1, 17):  # up to 16 rows: a verify call of 4 drafts is 5, a 4-deep tree of 16 at most
        together = session.run(None, {"a": a[:, :rows]})[0][0]
        assert np.array_equal(together, alone[:rows]), f"{rows} rows"
    one_thread = _session(_blocks_model(k, n, blocks), library, threads=1)
    assert np.array_equal(one_thread.run(None, {"a": a[:, :5]})[0][0], alone[:5])


def _has_bf16(library: Path) -> bool:
    """Whether this library's many-row calls with bf16 = 1 run in bfloat16 (built with AVX512_BF16)."""
    return ctypes.CDLL(str(library)).kvforge_matmul_bf16() == 1


@pytest.mark.parametrize(("k", "n"), [(64, 7), (96, 33), (256, 70)])
@pytest.mark.parametrize("rows", [17, 29, 40])
def test_many_rows_with_bf16_match_the_bfloat16_reference(library: Path, k: int, n: int, rows: int) -> None:
    """bf16 = 1 (llm_build's default): a call of more than 16 rows rounds A and W to bfloat16 and sums the products in
    float32 where the CPU has AVX512_BF16, and is the float32 call elsewhere; up to 16 rows nothing changes."""
    rng = np.random.default_rng(k + n * 100 + rows)
    blocks = _random_blocks(rng, k, n)
    a = rng.standard_normal((1, rows, k)).astype(np.float32)
    bf16 = _session(_blocks_model(k, n, blocks, bf16=1), library)
    fp32 = _session(_blocks_model(k, n, blocks), library)
    y = bf16.run(None, {"a": a})[0]
    if _has_bf16(library):
        expected = reference.matmul_blocks(a, blocks, bf16=True)
        scale = np.abs(expected).max()
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6 * scale)
        # the rounding is visible: this is not the float32 product
        assert np.abs(y - reference.matmul_blocks(a, blocks)).max() > 1e-5 * scale
    else:
        print("this CPU has no AVX512_BF16: bf16 = 1 runs the float32 path, checked equal to it")
        assert np.array_equal(y, fp32.run(None, {"a": a})[0])
    few = a[:, :16]
    assert np.array_equal(bf16.run(None, {"a": few})[0], fp32.run(None, {"a": few})[0])


def test_the_bfloat16_rounding_is_nearest_even() -> None:
    values = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -2.5, 65792.0], dtype=np.float32)
    rounded = reference.to_bfloat16(values)
    assert rounded.tolist() == [1.0, 1.0, 1.0 + 2**-6, 1.0 + 2**-7, -2.5, 65536.0]  # ties to the even mantissa


def test_the_lowering_asks_for_bf16_prefill_unless_told_fp32(tmp_path: Path) -> None:
    blocks = from_gguf_blocks("Q4_1", gguf.quants.quantize(
        np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1), 64)
    for prefill_bf16 in (True, False):
        model = _nbits_with_correction(blocks)
        assert lower_block_matmuls(model, prefill_bf16=prefill_bf16) == 1
        attributes = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
        assert attributes.get("bf16", 0) == int(prefill_bf16)
    assert BuildOptions().cpu_prefill_matmul == "bf16"
    with pytest.raises(InvalidConfig) as info:
        build_engine(tmp_path / "onnx", tmp_path / "engine", BuildOptions(cpu_prefill_matmul="fp16"))
    assert info.value.field == "cpu_prefill_matmul"


def _nbits_with_correction(blocks: BlockQuantized) -> onnx.ModelProto:
    """The export's reference form of a Q4_1 weight (kvforge/tools/export/families/llama.py _Linears._nbits)."""
    ones = np.kron(np.eye(blocks.k // 32, dtype=np.float32), np.ones((32, 1), dtype=np.float32))
    nodes = [helper.make_node("MatMulNBits", ["x", "w", "s", "z"], ["y0"], domain="com.microsoft", K=blocks.k,
                              N=blocks.n, bits=4, block_size=32, accuracy_level=0, name="nbits"),
             helper.make_node("MatMul", ["x", "ones"], ["sums"]), helper.make_node("MatMul", ["sums", "r"], ["c"]),
             helper.make_node("Add", ["y0", "c"], ["y"]), helper.make_node("Relu", ["y"], ["out"])]
    initializers = [numpy_helper.from_array(blocks.packed, "w"), numpy_helper.from_array(blocks.scales, "s"),
                    numpy_helper.from_array(blocks.zero_points, "z"), numpy_helper.from_array(ones, "ones"),
                    numpy_helper.from_array(blocks.offsets, "r")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, blocks.k])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [None, blocks.n])],
                              initializers)
    return helper.make_model(graph, opset_imports=OPSETS[:2])


def test_the_lowering_folds_the_q4_1_correction_into_the_mins(library: Path) -> None:
    rng = np.random.default_rng(11)
    weight = rng.standard_normal((40, 128)).astype(np.float32)  # [out, in]
    blocks = from_gguf_blocks("Q4_1", gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1), 128)
    assert blocks.offsets is not None and blocks.zero_points is not None
    model = _nbits_with_correction(blocks)
    x = rng.standard_normal((6, 128)).astype(np.float32)
    before = _session(model, library).run(None, {"x": x})[0]
    assert lower_block_matmuls(model) == 1
    assert [n.op_type for n in model.graph.node] == [MATMUL_BLOCKS, "Relu"]
    assert {t.name for t in model.graph.initializer} == {"w.blocks"}  # values, scales and mins in one; the rest gone
    after = _session(model, library).run(None, {"x": x})[0]
    expected = np.maximum(x.astype(np.float64) @ blocks.dequantize().astype(np.float64), 0)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(after, expected, atol=2e-6 * scale)
    np.testing.assert_allclose(after, before, atol=2e-5 * scale)
    # The mins are the GGUF blocks' own m = remainder - d * zero point (Q4_1: d * q + m), to float32 rounding.
    raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1).reshape(40, 4, 20)
    m = raw[..., 2:4].copy().view(np.float16).astype(np.float32).reshape(40, 4)
    packed = numpy_helper.to_array(model.graph.initializer[0])
    floats = np.ascontiguousarray(packed[..., 16:]).view("<f4")
    np.testing.assert_allclose(floats[..., 1], m, rtol=0, atol=1e-7)
    d = raw[..., 0:2].copy().view(np.float16).astype(np.float32).reshape(40, 4)
    np.testing.assert_array_equal(floats[..., 0], d)


def _nbits_model(blocks: BlockQuantized, zero_points: bool = False) -> onnx.ModelProto:
    inputs = ["x", "w", "s"] + (["z"] if zero_points else [])
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=blocks.k, N=blocks.n,
                            bits=blocks.bits, block_size=32, accuracy_level=blocks.accuracy_level or 4)
    initializers = [numpy_helper.from_array(blocks.packed, "w"), numpy_helper.from_array(blocks.scales, "s")]
    if zero_points:
        initializers.append(numpy_helper.from_array(blocks.zero_points, "z"))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, blocks.k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, blocks.n])], initializers)
    return helper.make_model(graph, opset_imports=OPSETS[:2])


def test_level_4_four_bit_blocks_stay_with_onnx_runtime() -> None:
    """`--int4Scheme symmetric` chose ONNX Runtime's int8 arithmetic: kept."""
    blocks = quantize(np.random.default_rng(2).standard_normal((16, 64)).astype(np.float32), 4, 32, symmetric=True)
    model = _nbits_model(blocks)
    assert lower_block_matmuls(model) == 0
    assert model.graph.node[0].op_type == "MatMulNBits"


@pytest.mark.parametrize("zero_points", [False, True])
def test_8_bit_blocks_are_lowered_with_their_zero_points(library: Path, zero_points: bool) -> None:
    """The LM head's Q8_0 (level 4): one MatMulBlocks of 40-byte blocks, weight = scale * (q - zero point), at any
    row count with each row independent of the others (no many-row Gemm path for 8 bits)."""
    rng = np.random.default_rng(3)
    blocks = quantize(rng.standard_normal((70, 96)).astype(np.float32), 8, 32)
    model = _nbits_model(blocks, zero_points)
    assert lower_block_matmuls(model) == 1
    node = model.graph.node[0]
    assert node.op_type == MATMUL_BLOCKS and {a.name: a.i for a in node.attribute}["bits"] == 8
    stored = numpy_helper.to_array(model.graph.initializer[0])
    assert stored.shape == (70, 3, 40)
    q = blocks.packed.reshape(70, 3, 32).astype(np.float64)
    zp = blocks.zero_points.reshape(70, 3, 1).astype(np.float64) if zero_points else 128.0
    w = ((q - zp) * blocks.scales.reshape(70, 3, 1).astype(np.float64)).reshape(70, 96)
    a = rng.standard_normal((1, 21, 96)).astype(np.float32)
    session = _session(model, library)
    y = session.run(None, {"x": a[0]})[0]
    np.testing.assert_allclose(y, a[0].astype(np.float64) @ w.T, rtol=1e-4, atol=1e-4 * np.abs(y).max())
    np.testing.assert_allclose(y, reference.matmul_blocks(a[0], stored), rtol=1e-5, atol=1e-5 * np.abs(y).max())
    assert np.array_equal(session.run(None, {"x": a[0, 17:18]})[0][0], y[17])


def test_kernel_and_onnx_matmul_engines_agree(library: Path, tmp_path: Path) -> None:
    del library  # the kernel engine needs it
    loaded = synthetic_model("tiny-llama")
    quantize_linears(loaded, "int4", 32)
    write_onnx_dir(loaded, tmp_path / "onnx")
    runs, counts = {}, {}
    prompt = [5, 17, 33, 2, 81, 40, 12, 9, 77, 64]
    for matmul in ("kernel", "onnx"):
        engine_dir = tmp_path / f"engine-{matmul}"
        build_engine(tmp_path / "onnx", engine_dir, BuildOptions(max_input_len=64, max_kv_cache_capacity=256,
                                                                 max_batch_size=1, tokens_per_page=16,
                                                                 cpu_matmul=matmul))
        assert load_engine_dir(engine_dir).build.kernel_matmul is (matmul == "kernel")
        ops = [n.op_type for n in onnx.load(engine_dir / "model.onnx", load_external_data=False).graph.node]
        counts[matmul] = (ops.count(MATMUL_BLOCKS), ops.count("MatMulNBits"))
        params = SamplingParams(temperature=0.0, top_k=1, max_generate_length=12, num_logprobs=1,
                                logit_bias={loaded.config.eos_token_ids[0]: -100.0})
        out = LLM(engine_dir).generate([prompt], params)[0]
        runs[matmul] = (out.token_ids, [[lp.logprob for lp in step] for step in out.logprobs])
    # Every layer's 4-bit matmul moved (the LM head's level-4 MatMulNBits, if any, stays).
    assert counts["onnx"][0] == 0 and counts["kernel"][0] == counts["onnx"][1] - counts["kernel"][1] >= 4
    assert runs["kernel"][0] == runs["onnx"][0]
    np.testing.assert_allclose(runs["kernel"][1], runs["onnx"][1], atol=1e-3)


def test_build_refuses_an_unknown_matmul_choice(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig) as info:
        build_engine(tmp_path / "onnx", tmp_path / "engine", BuildOptions(cpu_matmul="fast"))
    assert info.value.field == "cpu_matmul"


def test_every_runnable_target_matches_the_reference_and_is_row_invariant(library: Path, each_target) -> None:
    """Each compiled target this CPU runs, forced in turn: 4-bit and 8-bit blocks against the reference (the int16
    one for AVX2's 4-bit rows), and within the target a row alone (a decode row) equals the same row
    among 6 or 16 (verify rows), bit for bit."""
    k, n = 128, 21
    rng = np.random.default_rng(5)
    blocks = _random_blocks(rng, k, n)
    values = rng.integers(0, 256, size=(n, k // 32, 32)).astype(np.uint8)
    scales = (rng.random((n, k // 32)) * 0.01 + 0.001).astype(np.float32)
    blocks8 = pack_blocks(values, scales, (-128 * scales).astype(np.float32), bits=8)
    a = rng.standard_normal((1, 16, k)).astype(np.float32)
    results = {}
    for target in each_target():
        for packed, bits in ((blocks, 4), (blocks8, 8)):
            session = _session(_blocks_model(k, n, packed, bits=bits), library)
            many = session.run(None, {"a": a})[0]
            _check_rows(many, a, packed, _int16_rows(library, bits, 16), f"{target} {bits}-bit")
            six = session.run(None, {"a": a[:, :6]})[0]
            for row in (0, 2, 5):
                alone = session.run(None, {"a": a[:, row:row + 1]})[0][0, 0]
                assert np.array_equal(six[0, row], alone), f"{target} {bits}-bit row {row} of 6"
                assert np.array_equal(many[0, row], alone), f"{target} {bits}-bit row {row} of 16"
            results[target, bits] = many
        assert _has_bf16(library) == (target == "avx3_dl" and _cpu_has("avx512_bf16"))
    best = next(iter(results))[0]
    print("largest difference from", best, {key: float(np.abs(y - results[best, key[1]]).max())
                                             for key, y in results.items()})


def _cpu_has(flag: str) -> bool:
    return flag in Path("/proc/cpuinfo").read_text().split()


def test_a_lora_engine_with_block_matmuls_loads_and_answers_as_the_onnx_one(library: Path, tmp_path: Path) -> None:
    """LoRA's MatMul after the attention needs the shapes the custom ops infer: with MatMulBlocks' output shape
    unknown, the attention's inference once made a scalar of it and the engine refused to load (llm_test found it)."""
    del library
    loaded = synthetic_model("tiny-llama")
    loaded.config.lora_targets = list(LORA_TARGETS)  # LoRA inputs on every linear, o_proj after the attention too
    quantize_linears(loaded, "int4", 32)
    write_onnx_dir(loaded, tmp_path / "onnx")
    answers = {}
    for matmul in ("kernel", "onnx"):
        engine_dir = tmp_path / f"engine-{matmul}"
        build_engine(tmp_path / "onnx", engine_dir, BuildOptions(max_input_len=64, max_kv_cache_capacity=256,
                                                                 max_batch_size=1, tokens_per_page=16,
                                                                 max_lora_rank=4, cpu_matmul=matmul))
        params = SamplingParams(temperature=0.0, top_k=1, max_generate_length=6,
                                logit_bias={loaded.config.eos_token_ids[0]: -100.0})
        answers[matmul] = LLM(engine_dir).generate([[5, 17, 33, 2, 81]], params)[0].token_ids
    assert answers["kernel"] == answers["onnx"]


def test_reuse_stays_token_exact_with_int16_rows(library: Path, each_target, tmp_path: Path) -> None:
    """On the int16 targets, an int4 kernel engine answers a prompt that extends an earlier one (its first pages
    reused, the rest prefilled in few rows: int16 rows, where the cold prefill ran Gemm) as a cold engine does."""
    loaded = synthetic_model("tiny-llama")
    quantize_linears(loaded, "int4", 32)
    write_onnx_dir(loaded, tmp_path / "onnx")
    engine_dir = tmp_path / "engine"
    build_engine(tmp_path / "onnx", engine_dir, BuildOptions(max_input_len=128, max_kv_cache_capacity=256,
                                                             max_batch_size=1, tokens_per_page=16, cpu_matmul="kernel"))
    params = SamplingParams(temperature=0.0, top_k=1, max_generate_length=16,
                            logit_bias={loaded.config.eos_token_ids[0]: -100.0})
    checked = []
    for target in each_target():
        if target not in INT16_TARGETS:
            continue
        for seed in range(3):
            rng = np.random.default_rng(seed)
            prefix = [int(t) for t in rng.integers(3, 200, size=37)]
            full = prefix + [int(t) for t in rng.integers(3, 200, size=5)]
            warm = LLM(engine_dir, num_threads=2)
            warm.generate([prefix], params)
            [reused] = warm.generate([full], params)
            [cold] = LLM(engine_dir, num_threads=2, enable_context_reuse=False).generate([full], params)
            assert reused.cached_tokens > 0 and cold.cached_tokens == 0
            assert reused.token_ids == cold.token_ids, (target, seed)
        checked.append(target)
    if not checked:
        print(f"no int16 target ({', '.join(INT16_TARGETS)}) runs on this CPU: nothing checked")
    del library

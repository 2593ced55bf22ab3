"""llm_build's choice of the op for the block-quantized linears per CPU class (issue 50, item 5;
kvforge/builder/linear_choice.py): the kernel target the library runs here (KVFORGE_CPU_TARGET forces one) picks
kvforge's MatMulBlocks or MLAS's MatMulNBits from the measurement table, `--linearKernel` overrides it, the build
prints which and why and records it; MLAS's level-4 rows are exact, and an MLAS engine's verification rows and
reused prefixes give plain decoding's tokens."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge.builder import linear_choice as lc
from kvforge.builder.build import BuildOptions, build_engine, resolve_linear_kernel
from kvforge.builder.lower_matmul import has_q4_1_corrections
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.contract.errors import InvalidConfig
from kvforge.plugins import cpu_kernel
from kvforge.runtime.api import LLM
from kvforge.runtime.types import SamplingParams
from kvforge.tools.export.quantize_model import quantize_linears
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

BUILD = BuildOptions(max_input_len=64, max_kv_cache_capacity=256, max_batch_size=1, tokens_per_page=16)
# A prompt that repeats itself, so prompt lookup drafts tokens that verification rows then check.
PROMPT = [5, 17, 33, 2, 81, 40, 12, 9, 5, 17, 33, 2, 81, 40, 12, 9, 5, 17, 33, 2]


@pytest.fixture(scope="module")
def int4_onnx(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A tiny Llama with 4-bit block linears (the export's MatMulNBits + Q4_1 correction), and its end token."""
    loaded = synthetic_model("tiny-llama")
    quantize_linears(loaded, "int4", 32)
    root = tmp_path_factory.mktemp("int4")
    write_onnx_dir(loaded, root / "onnx")
    return root / "onnx", loaded.config.eos_token_ids[0]


def test_the_table_picks_the_faster_op_per_target() -> None:
    for q4_1 in (False, True):
        for target, ours in lc.KVFORGE_MS.items():
            choice = lc.choose_linear_kernel("auto", target, q4_1)
            assert choice.kernel == (lc.MLAS if lc.MLAS_MS[q4_1] < ours else lc.KVFORGE), target
            assert f"kernel target {target}" in choice.reason and lc.MEASURED_WHERE in choice.reason
            assert ("Q4_1 correction" in choice.reason) == q4_1 and "\n" not in choice.reason
    unmeasured = lc.choose_linear_kernel("auto", "neon")
    assert unmeasured.kernel == lc.KVFORGE and "no measurement for kernel target neon" in unmeasured.reason


def test_an_override_wins_and_says_what_auto_would_take() -> None:
    forced = lc.choose_linear_kernel("mlas", "avx3_dl")
    auto = lc.choose_linear_kernel("auto", "avx3_dl").kernel
    assert forced.kernel == lc.MLAS and "--linearKernel mlas" in forced.reason and f"is {auto}" in forced.reason
    assert lc.choose_linear_kernel("onnx", "avx3").kernel == lc.EXPORT_FORM  # the export's form, as it was
    assert lc.choose_linear_kernel("kernel", "avx2").kernel == lc.KVFORGE
    with pytest.raises(InvalidConfig) as info:
        resolve_linear_kernel("fastest", q4_1=True)
    assert info.value.field == "cpu_matmul" and "auto" in info.value.message


def test_the_choice_follows_the_forced_target(library: Path, each_target) -> None:
    del library
    seen = {}
    for target in each_target():
        choice = resolve_linear_kernel("auto", q4_1=True)
        assert f"kernel target {target}" in choice.reason
        assert choice == lc.choose_linear_kernel("auto", target, True)
        seen[target] = choice.kernel
    print("auto's choice per runnable target (Q4_1 linears):", seen)
    assert len(seen) >= 2  # every x86-64 CPU runs sse4 and scalar beside its best


@pytest.mark.parametrize(("target", "flag", "expected"), [
    ("avx2", [], None),  # None: what the table says for the target and the export's form
    ("avx3", [], None),
    ("avx2", ["--linearKernel", "kvforge"], "kvforge"),
    ("avx3", ["--linearKernel", "mlas"], "mlas"),
    ("sse4", ["--cpuMatmul", "onnx"], "onnx"),  # the flag's older name: the export's form, left as it is
])
def test_llm_build_prints_and_records_the_choice(library: Path, int4_onnx: tuple[Path, int], tmp_path: Path,
                                                 run_cli, monkeypatch: pytest.MonkeyPatch, target: str,
                                                 flag: list[str], expected: str | None) -> None:
    if target not in cpu_kernel.runnable_targets(library):
        pytest.skip(f"this CPU cannot run the {target} target")
    q4_1 = has_q4_1_corrections(onnx.load(int4_onnx[0] / "model.onnx"))
    expected = expected or lc.choose_linear_kernel("auto", target, bool(q4_1)).kernel
    engine = tmp_path / "engine"
    monkeypatch.setenv(cpu_kernel.TARGET_ENV, target)  # the llm_build process inherits it
    proc = run_cli(["llm_build", "--onnxDir", int4_onnx[0], "--engineDir", engine, "--maxInputLen", "64",
                    "--maxKVCacheCapacity", "256", "--maxBatchSize", "1", "--tokensPerPage", "16", *flag])
    assert proc.returncode == 0, proc.stderr
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip().startswith("linears:")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith(f"linears: {expected}: ")
    assert (f"kernel target {target}" if not flag else f"--linearKernel {expected}") in lines[0]
    assert lc.MEASURED_WHERE in lines[0] or flag
    build = load_engine_dir(engine).build
    assert (build.linear_kernel, build.kernel_matmul) == (expected, expected == "kvforge")
    assert build.linear_kernel_reason in lines[0]
    nodes = onnx.load(engine / "model.onnx", load_external_data=False).graph.node
    blocks4 = [n for n in nodes if n.op_type == "MatMulBlocks" and {a.name: a.i for a in n.attribute}["bits"] == 4]
    nbits = [n for n in nodes if n.op_type == "MatMulNBits"]
    assert bool(blocks4) == (expected == "kvforge")  # the 4-bit linears all moved, or none (an 8-bit head may)
    assert bool(nbits) == (expected != "kvforge") or (expected == "kvforge" and len(nbits) <= 1)
    assert json.loads((engine / "config.json").read_text())["builder_config"]["linear_kernel"] == expected


def test_an_engine_without_block_linears_records_no_choice(library: Path, tmp_path: Path) -> None:
    del library
    write_onnx_dir(synthetic_model("tiny-llama"), tmp_path / "onnx")  # float32 linears: nothing to choose
    build_engine(tmp_path / "onnx", tmp_path / "engine", BUILD)
    assert load_engine_dir(tmp_path / "engine").build.linear_kernel == ""


@pytest.fixture(scope="module", params=["mlas", "kvforge"])
def mlas_engine(request: pytest.FixtureRequest, library: Path, int4_onnx: tuple[Path, int],
                tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An engine whose 4-bit linears run MLAS (and, beside it, the same engine on MatMulBlocks)."""
    del library
    engine = tmp_path_factory.mktemp(request.param) / "engine"
    build_engine(int4_onnx[0], engine, replace(BUILD, cpu_matmul=request.param))
    assert load_engine_dir(engine).build.linear_kernel == request.param
    nbits = [n for n in onnx.load(engine / "model.onnx", load_external_data=False).graph.node
             if n.op_type == "MatMulNBits"]
    # MLAS's int8-activation path: its rows do not depend on the row count (the float32 one's do).
    assert all({a.name: a.i for a in n.attribute}["accuracy_level"] == 4 for n in nbits)
    assert bool(nbits) == (request.param == "mlas")
    return engine


def _greedy(end_token: int, tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, top_k=1, max_generate_length=tokens, num_logprobs=1,
                          logit_bias={end_token: -100.0})


def _answer(llm: LLM, params: SamplingParams) -> tuple[list[int], list[float]]:
    out = llm.generate([PROMPT], params)[0]
    return out.token_ids, [step[0].logprob for step in out.logprobs]


def _same(got: tuple[list[int], list[float]], expected: tuple[list[int], list[float]], atol: float) -> None:
    """The same tokens, logprobs within `atol`: on MatMulBlocks and on MLAS engines alike the logprobs move by
    ~1e-7 between a decode row and a verification row (the attention's one-row and many-row paths) and by up to
    ~4e-3 after a reused prefix (a cold prefill of more than 16 rows runs its matmuls in bfloat16), never the
    tokens."""
    assert got[0] == expected[0]
    np.testing.assert_allclose(got[1], expected[1], rtol=0, atol=atol)


def test_verification_rows_against_decode_rows(mlas_engine: Path, int4_onnx: tuple[Path, int]) -> None:
    """Prompt lookup drafts the repeating prompt's tokens; each token from a verification row (one call of k + 1
    rows) against the one plain decoding (one row per call) gives."""
    params = _greedy(int4_onnx[1])
    with LLM(mlas_engine, num_threads=2, enable_context_reuse=False) as plain:
        expected = _answer(plain, params)
    with LLM(mlas_engine, num_threads=2, enable_context_reuse=False, spec_decode="ngram") as speculative:
        got = _answer(speculative, params)
        stats = speculative.engine.stats()
    assert stats.spec_draft_tokens > 0, "no drafts were verified: the test checked nothing"
    _same(got, expected, 1e-5)


def test_reuse_against_a_cold_prefill(mlas_engine: Path, int4_onnx: tuple[Path, int]) -> None:
    params = _greedy(int4_onnx[1])
    with LLM(mlas_engine, num_threads=2, enable_context_reuse=False) as cold:
        expected = _answer(cold, params)
    with LLM(mlas_engine, num_threads=2) as warm:
        first, again = _answer(warm, params), _answer(warm, params)
        reused = warm.engine.stats().prefill_reused_tokens
    assert reused > 0, "the second request reused nothing: the test checked nothing"
    _same(first, expected, 1e-2)
    _same(again, expected, 1e-2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("zero_points", [False, True])
def test_mlas_rows_are_exact_at_accuracy_level_4_and_not_at_0(threads: int, zero_points: bool) -> None:
    """The MLAS form an engine runs (MatMulNBits at accuracy level 4): a row alone (a decode row) equals the same
    row among 2 to 17 (verification rows) bit for bit; at level 0 (the export's) it does not."""
    rng = np.random.default_rng(7)
    k, n = 576, 960
    inits = [numpy_helper.from_array(rng.integers(0, 256, size=(n, k // 32, 16)).astype(np.uint8), "q"),
             numpy_helper.from_array((rng.random(n * k // 32) * 0.05).astype(np.float32), "s")]
    if zero_points:
        inits.append(numpy_helper.from_array(rng.integers(0, 256, size=(n * k // 64,)).astype(np.uint8), "z"))
    x = rng.standard_normal((17, k)).astype(np.float32)
    exact = {}
    for level in (0, 4):
        node = helper.make_node("MatMulNBits", ["x", *[i.name for i in inits]], ["y"],
                                domain="com.microsoft", K=k, N=n, bits=4, block_size=32, accuracy_level=level)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                        helper.make_opsetid("com.microsoft", 1)])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        alone = np.concatenate([session.run(None, {"x": x[i:i + 1]})[0] for i in range(17)])
        exact[level] = all(np.array_equal(session.run(None, {"x": x[:rows]})[0], alone[:rows])
                           for rows in (2, 5, 16, 17))
    assert exact == {0: False, 4: True}, exact

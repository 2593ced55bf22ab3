"""The CPU custom-op library (kvforge.cpu.PagedAttention) against the numpy reference, through ONNX Runtime."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from support.ort_support import POOL_ELEM

from kvforge.contract.errors import KvforgeError
from kvforge.plugins import cpu_kernel, ops, reference
from kvforge.plugins.reference import pool_numpy_dtype, round_to_storage, to_storage

TOLERANCE = 1e-5


@dataclass
class Case:
    starts: list[int]
    lengths: list[int]
    seq: int
    num_q: int = 9
    num_kv: int = 3
    head_dim: int = 64
    tokens_per_page: int = 16
    dtype: str = "fp16"
    tree_mask: bool = False
    width: int | None = None  # page-table width; default: enough pages for every cached position
    holes: dict[int, list[int]] = field(default_factory=dict)  # row -> page-table entries set to -1
    seed: int = 0


def _model(case: Case, with_mask: bool) -> bytes:
    d, hq, hkv = case.head_dim, case.num_q, case.num_kv
    inputs = [
        helper.make_tensor_value_info("query", TensorProto.FLOAT, ["B", "S", hq * d]),
        helper.make_tensor_value_info("new_kv", TensorProto.FLOAT, ["B", "S", 2, hkv, d]),
        helper.make_tensor_value_info("pool", POOL_ELEM[case.dtype], ["N", 2, hkv, case.tokens_per_page, d]),
        helper.make_tensor_value_info("kv_page_table", TensorProto.INT32, ["B", "W"]),
        helper.make_tensor_value_info("kvcache_start_index", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("context_lengths", TensorProto.INT32, ["B"]),
    ]
    if with_mask:
        inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.BOOL, ["B", "S", "S"]))
    node = helper.make_node(ops.CPU_PAGED_ATTENTION.name, [i.name for i in inputs], ["out"],
                            domain=ops.CPU_DOMAIN, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                            tokens_per_page=case.tokens_per_page, scale=float(d) ** -0.5)
    graph = helper.make_graph([node], "paged_attention", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(ops.CPU_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    return model.SerializeToString()


def _session(model: bytes, library: Path, threads: int = 2) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _inputs(case: Case) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(case.seed)
    batch, t, d = len(case.starts), case.tokens_per_page, case.head_dim
    pages_per_row = [-(-s // t) for s in case.starts]
    num_pages = sum(pages_per_row) + 3
    width = case.width if case.width is not None else max([*pages_per_row, 1])
    order = rng.permutation(num_pages)
    table = np.full((batch, width), -1, dtype=np.int32)
    used = 0
    for b, count in enumerate(pages_per_row):
        keep = min(count, width)
        table[b, :keep] = order[used:used + keep]
        used += count
        for hole in case.holes.get(b, []):
            table[b, hole] = -1
    pool = to_storage(rng.standard_normal((num_pages, 2, case.num_kv, t, d)).astype(np.float32), case.dtype)
    new_kv = rng.standard_normal((batch, case.seq, 2, case.num_kv, d)).astype(np.float32)
    feeds = {
        "query": rng.standard_normal((batch, case.seq, case.num_q * d)).astype(np.float32),
        "new_kv": round_to_storage(new_kv, case.dtype),
        "pool": pool.astype(pool_numpy_dtype(case.dtype)),
        "kv_page_table": table,
        "kvcache_start_index": np.array(case.starts, dtype=np.int32),
        "context_lengths": np.array(case.lengths, dtype=np.int32),
    }
    if case.tree_mask:  # a random tree: each token's parent is an earlier token; it sees its ancestors and itself
        mask = np.zeros((batch, case.seq, case.seq), dtype=bool)
        for b in range(batch):
            for i in range(case.seq):
                mask[b, i, i] = True
                if i:
                    mask[b, i] |= mask[b, int(rng.integers(0, i))]
        feeds["attention_mask"] = mask
    return feeds


def _expected(case: Case, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return reference.paged_attention_rows(
        feeds["query"], feeds["new_kv"], feeds["pool"], feeds["kv_page_table"], feeds["kvcache_start_index"],
        feeds["context_lengths"], num_q_heads=case.num_q, num_kv_heads=case.num_kv, head_dim=case.head_dim,
        scale=float(case.head_dim) ** -0.5, kv_cache_dtype=case.dtype, attention_mask=feeds.get("attention_mask"))


def _check(case: Case, library: Path, threads: int = 2) -> None:
    feeds = _inputs(case)
    got = _session(_model(case, "attention_mask" in feeds), library, threads).run(None, feeds)[0]
    expected = _expected(case, feeds)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE)


CASES = {
    "decode-fp16": Case(starts=[37], lengths=[1], seq=1),
    "decode-fp8": Case(starts=[37], lengths=[1], seq=1, dtype="fp8"),
    "decode-fp32": Case(starts=[37], lengths=[1], seq=1, dtype="fp32"),
    "ragged-batch-with-padding-rows": Case(starts=[5, 40, 0, 17], lengths=[3, 1, 6, 0], seq=6),
    "no-cached-tokens": Case(starts=[0, 0], lengths=[5, 2], seq=5),
    "chunk-mid-page": Case(starts=[21, 9], lengths=[30, 14], seq=30, dtype="fp8"),
    "holes-and-short-table": Case(starts=[70, 70], lengths=[4, 2], seq=4, width=3, holes={0: [1], 1: [0, 2]}),
    "gqa-1": Case(starts=[19], lengths=[5], seq=5, num_q=4, num_kv=4),
    "gqa-4": Case(starts=[19, 3], lengths=[5, 2], seq=5, num_q=8, num_kv=2),
    "head-dim-32": Case(starts=[45, 12], lengths=[3, 2], seq=3, head_dim=32, dtype="fp32"),
    "head-dim-80": Case(starts=[45, 12], lengths=[3, 2], seq=3, num_q=4, num_kv=2, head_dim=80, dtype="fp8"),
    "gqa-64-head-dim-16": Case(starts=[40], lengths=[3], seq=3, num_q=64, num_kv=1, head_dim=16),
    "head-dim-128": Case(starts=[45], lengths=[2], seq=2, num_q=4, num_kv=1, head_dim=128),
    # Gemma 4's global layers: 512-wide heads (the widest the kernel takes), prefill rows and a split decode row
    "head-dim-512": Case(starts=[45, 12], lengths=[3, 2], seq=3, num_q=4, num_kv=2, head_dim=512),
    "decode-head-dim-512-fp8": Case(starts=[700], lengths=[1], seq=1, num_q=2, num_kv=1, head_dim=512, dtype="fp8"),
    "page-size-64": Case(starts=[130, 64], lengths=[7, 1], seq=7, tokens_per_page=64),
    "tree-mask-verify": Case(starts=[33, 50], lengths=[6, 4], seq=6, tree_mask=True),
    "tree-mask-fp8-gqa-4": Case(starts=[8], lengths=[9], seq=9, num_q=8, num_kv=2, tree_mask=True, dtype="fp8"),
    "prefill-long-chunk": Case(starts=[100], lengths=[150], seq=150),
    "decode-gqa-1-fp32": Case(starts=[300, 77], lengths=[1, 1], seq=1, num_q=2, num_kv=2, dtype="fp32"),
    "decode-gqa-2-head-dim-80": Case(starts=[300], lengths=[1], seq=1, num_q=4, num_kv=2, head_dim=80),
    "decode-gqa-4-fp8-head-dim-128": Case(starts=[700], lengths=[1], seq=1, num_q=8, num_kv=2, head_dim=128,
                                          dtype="fp8", holes={0: [5]}),
    "split-kv-decode-1600": Case(starts=[1600], lengths=[1], seq=1, tokens_per_page=64),
    "split-kv-batch-fp8": Case(starts=[1600, 900], lengths=[1, 1], seq=1, tokens_per_page=32, dtype="fp8",
                               holes={0: [3, 20]}),
    "mixed-chunk-and-split-decode": Case(starts=[100, 1600], lengths=[64, 1], seq=64, tokens_per_page=64),
    "mixed-chunk-and-long-decode-unsplit": Case(starts=[100, 1600], lengths=[80, 1], seq=80, tokens_per_page=64,
                                                dtype="fp8"),
    "split-kv-verify-tree": Case(starts=[1600], lengths=[5], seq=5, tokens_per_page=128, tree_mask=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(library: Path, name: str) -> None:
    _check(CASES[name], library)


def test_single_thread_matches_reference(library: Path) -> None:
    _check(CASES["split-kv-decode-1600"], library, threads=1)
    _check(CASES["ragged-batch-with-padding-rows"], library, threads=1)


def test_every_runnable_target_matches_reference(library: Path, each_target) -> None:
    """Each compiled target this CPU runs, forced in turn (KVFORGE_CPU_TARGET): the decode path (pool rows read in
    the FMA loops), the tiled one (chunks, verify rows, trees), fp16, fp8 and fp32 pools, split ranges."""
    outputs = {}
    for target in each_target():
        for name in ("decode-fp16", "ragged-batch-with-padding-rows", "chunk-mid-page", "tree-mask-verify",
                     "split-kv-batch-fp8", "split-kv-decode-1600", "head-dim-32", "decode-fp8", "decode-fp32",
                     "decode-gqa-2-head-dim-80", "decode-head-dim-512-fp8", "mixed-chunk-and-long-decode-unsplit"):
            _check(CASES[name], library)
        case = CASES["split-kv-decode-1600"]
        feeds = _inputs(case)
        outputs[target] = _session(_model(case, False), library).run(None, feeds)[0]
    # The targets share no code path: AVX-512 runs its intrinsics, the others Highway's loops, so the results are
    # each target's own rounding (all within the reference's tolerance above).
    assert len(outputs) >= 2


# A decode row and the verify call that starts with it (the same query, new key and cache; drafts after it):
# unsplit and split cached ranges, each pool type, a GQA group of 4, a tree, two rows of a batch.
VERIFY_CASES = {
    "short-fp16": Case(starts=[37], lengths=[5], seq=5),
    "split-fp16": Case(starts=[1500], lengths=[5], seq=5),
    "split-fp8-holes": Case(starts=[1600], lengths=[4], seq=4, tokens_per_page=32, dtype="fp8", holes={0: [3]}),
    "fp32-gqa-4": Case(starts=[300], lengths=[6], seq=6, num_q=8, num_kv=2, dtype="fp32"),
    "tree": Case(starts=[700], lengths=[5], seq=5, tree_mask=True),
    "batch": Case(starts=[900, 40], lengths=[5, 5], seq=5, tokens_per_page=64),
}


def test_a_verify_row_is_its_decode_row_bit_for_bit(library: Path, each_target) -> None:
    """Within a target, row 0 of a verify call (a decode row and its drafts) equals the same row decoded alone, bit
    for bit: both read K and V on the direct path, whose arithmetic per row does not depend on the rows beside it
    (before issue 50's change the verify call's rows took the transposed tile and differed in the last bits)."""
    for target in each_target():
        for name, case in VERIFY_CASES.items():
            feeds = _inputs(case)
            verify = _session(_model(case, "attention_mask" in feeds), library).run(None, feeds)[0]
            alone = dict(feeds, query=feeds["query"][:, :1], new_kv=feeds["new_kv"][:, :1],
                         context_lengths=np.minimum(feeds["context_lengths"], 1))
            alone.pop("attention_mask", None)
            decode = _session(_model(case, False), library).run(None, alone)[0]
            np.testing.assert_allclose(verify, _expected(case, feeds), rtol=0, atol=TOLERANCE)
            assert np.array_equal(verify[:, 0], decode[:, 0]), f"{target} {name}: " \
                f"max |diff| {np.abs(verify[:, 0] - decode[:, 0]).max():.3g}"


def test_a_forced_target_runs_and_a_bad_one_is_refused_in_one_line(library: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = cpu_kernel.compiled_targets(library)
    assert "-march=native" not in cpu_kernel.CXX_FLAGS
    if os.uname().machine == "x86_64":
        assert {"avx3_dl", "avx3", "avx2", "sse4"} <= set(compiled)
    monkeypatch.setenv(cpu_kernel.TARGET_ENV, "avx9000")
    path, reason = cpu_kernel.kernel_status()
    assert path is None and reason.startswith("KVFORGE_CPU_TARGET=avx9000 is not a compiled target")
    assert "\n" not in reason and "avx2" in reason
    assert cpu_kernel.register(ort.SessionOptions()) == reason  # the engines fall back, with this reason
    missing = [name for name in compiled if name not in cpu_kernel.runnable_targets(library)]
    if missing:  # a compiled target this CPU lacks (AVX-512 on an AVX2 machine)
        monkeypatch.setenv(cpu_kernel.TARGET_ENV, missing[0])
        assert "this CPU cannot run it" in cpu_kernel.kernel_status()[1]
    monkeypatch.delenv(cpu_kernel.TARGET_ENV)
    assert cpu_kernel.chosen_target(library) == cpu_kernel.runnable_targets(library)[0]


def test_the_sources_cross_compile_for_aarch64(library: Path, tmp_path: Path) -> None:
    """The ARM build (NEON, and the scalar fallback) compiles from the same sources with the same flags; linking and
    running it needs an arm64 libhwy and ONNX Runtime, which this test does not have (docs/architecture.md)."""
    cxx = shutil.which("aarch64-linux-gnu-g++")
    if cxx is None:
        pytest.skip("no aarch64 cross compiler: apt-get install g++-aarch64-linux-gnu")
    highway = tmp_path / "include"
    highway.mkdir()
    (highway / "hwy").symlink_to(Path("/usr/include/hwy"))  # header-only for compiling; the same on every arch
    flags = [flag for flag in cpu_kernel.CXX_FLAGS if flag != "-shared"]
    for source in cpu_kernel.SOURCES:
        done = subprocess.run([cxx, *flags, "-c", f"-I{cpu_kernel.include_dir()}", f"-I{highway}", str(source), "-o",
                               str(tmp_path / (source.stem + ".o"))], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{source.name}: {done.stderr[-2000:]}"
    objects = sorted(path.name for path in tmp_path.glob("*.o"))
    assert len(objects) == len(cpu_kernel.SOURCES)
    with open(tmp_path / "paged_attention.o", "rb") as handle:
        assert handle.read(20)[18] == 183  # ELF e_machine 183: EM_AARCH64


def test_missing_highway_is_a_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A compiler that finds no hwy/highway.h (libhwy-dev not installed): the one-line reason names the package."""
    fake = tmp_path / "g++"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -E ] && { echo "fatal error: hwy/highway.h: No such '
                    'file or directory" >&2; exit 1; }; done\nexec g++ "$@"\n')
    fake.chmod(0o755)
    monkeypatch.delenv(cpu_kernel.SWITCH_ENV, raising=False)
    monkeypatch.setenv(cpu_kernel.CXX_ENV, str(fake))
    path, reason = cpu_kernel.kernel_status()
    assert path is None and "libhwy-dev" in reason and "\n" not in reason


def test_fp8_nan_patterns_decode_as_zero(library: Path) -> None:
    """E4M3 NaN bytes (never written) read as 0, like the lowering's table: the same output as zero bytes."""
    case = CASES["decode-fp8"]
    feeds = _inputs(case)
    pool = feeds["pool"].copy()
    pool.reshape(-1)[::7] = 0x7F
    pool.reshape(-1)[3::11] = 0xFF
    got = _session(_model(case, False), library).run(None, dict(feeds, pool=pool))[0]
    zeroed = np.where((pool & 0x7F) == 0x7F, np.uint8(0), pool)
    np.testing.assert_allclose(got, _expected(case, dict(feeds, pool=zeroed)), rtol=0, atol=TOLERANCE)


def test_query_that_sees_nothing_is_zero(library: Path) -> None:
    """No cached tokens (row 0) or only a -1 page (row 1), and a tree mask that hides every new key from query 1."""
    case = Case(starts=[0, 10], lengths=[3, 3], seq=3, tree_mask=True, holes={1: [0]})
    feeds = _inputs(case)
    feeds["attention_mask"][:, 1, :] = False
    got = _session(_model(case, True), library).run(None, feeds)[0]
    assert not got[:, 1].any() and np.abs(got[:, 0]).sum() > 0
    np.testing.assert_allclose(got, _expected(case, feeds), rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("new_tokens", [1, 5])  # the decode path (decoded in the FMA loops) and the tiled one
def test_fp8_every_bit_pattern_decodes(library: Path, new_tokens: int) -> None:
    """K and V pages hold all 256 E4M3 bytes (normals up to +-448, subnormals, both zeros, NaNs read as 0)."""
    case = Case(starts=[512], lengths=[new_tokens], seq=new_tokens, dtype="fp8", tokens_per_page=64)
    feeds = _inputs(case)
    feeds["query"] *= 1e-3  # keeps scores over +-448 keys moderate, so the softmax is not one-hot
    pool = feeds["pool"].copy()
    patterns = np.arange(256, dtype=np.uint8)
    pool[:, 0] = np.resize(patterns[::-1], pool[:, 0].shape)
    pool[:, 1] = np.resize(patterns, pool[:, 1].shape)
    got = _session(_model(case, False), library).run(None, dict(feeds, pool=pool))[0]
    zeroed = np.where((pool & 0x7F) == 0x7F, np.uint8(0), pool)
    # V values up to 448 cancel in the weighted sums: float32 rounding there is ~1e-5 absolute (1e-7 of 448).
    np.testing.assert_allclose(got, _expected(case, dict(feeds, pool=zeroed)), rtol=1e-6, atol=448 * 2e-7)


def test_padding_rows_and_empty_rows_are_zero(library: Path) -> None:
    case = CASES["ragged-batch-with-padding-rows"]
    feeds = _inputs(case)
    got = _session(_model(case, False), library).run(None, feeds)[0]
    assert not got[0, 3:].any() and not got[1, 1:].any() and not got[3].any()
    assert np.abs(got[0, :3]).sum() > 0


def test_unsupported_head_dim_is_refused(library: Path) -> None:
    case = Case(starts=[4], lengths=[1], seq=1, num_q=2, num_kv=1, head_dim=72)
    with pytest.raises(Exception, match="head_dim 72 is not supported: it must be a multiple of 16"):
        _session(_model(case, False), library).run(None, _inputs(case))


def test_bad_inputs_give_an_error_not_a_crash(library: Path) -> None:
    case = CASES["decode-fp16"]
    feeds = _inputs(case)
    session = _session(_model(case, False), library)
    bad_page = dict(feeds, kv_page_table=np.full_like(feeds["kv_page_table"], 10_000))
    with pytest.raises(Exception, match="outside \\[-1, num_pages"):
        session.run(None, bad_page)
    too_long = dict(feeds, context_lengths=np.array([2], dtype=np.int32))
    with pytest.raises(Exception, match="context_lengths\\[0\\]=2"):
        session.run(None, too_long)
    wrong_shape = dict(feeds, new_kv=np.zeros((1, 2, 2, 3, 64), dtype=np.float32))  # S=2, the query's is 1
    with pytest.raises(Exception, match="new_kv has shape"):
        session.run(None, wrong_shape)
    model = onnx.load_from_string(_model(case, False))
    model.graph.input[2].type.tensor_type.elem_type = TensorProto.INT32
    with pytest.raises(Exception, match="pool element type 6 is not float16, uint8"):
        _session(model.SerializeToString(), library).run(None, dict(feeds, pool=feeds["pool"].astype(np.int32)))


def test_mask_input_named_empty_is_causal(library: Path) -> None:
    """A node listing the optional 7th input as "" runs the causal form."""
    case = CASES["chunk-mid-page"]
    feeds = _inputs(case)
    model = onnx.load_from_string(_model(case, False))
    model.graph.node[0].input.append("")
    got = _session(model.SerializeToString(), library).run(None, feeds)[0]
    np.testing.assert_allclose(got, _expected(case, feeds), rtol=0, atol=TOLERANCE)


def test_output_shape_is_inferred(library: Path) -> None:
    model = onnx.load_from_string(_model(CASES["decode-fp16"], False))
    session = _session(model.SerializeToString(), library)
    assert session.get_outputs()[0].shape == ["B", "S", 9 * 64]


def test_switch_off_forces_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernel.SWITCH_ENV, "off")
    path, reason = cpu_kernel.kernel_status()
    assert path is None and "KVFORGE_CPU_KERNEL=off" in reason
    assert cpu_kernel.register(ort.SessionOptions()) == reason


def test_missing_headers_are_a_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(cpu_kernel.SWITCH_ENV, raising=False)  # the reason the switch would give first
    monkeypatch.setenv(cpu_kernel.INCLUDE_ENV, str(tmp_path))
    path, reason = cpu_kernel.kernel_status()
    assert path is None and "no onnxruntime_c_api.h" in reason


def test_no_compiler_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_kernel.SWITCH_ENV, raising=False)
    monkeypatch.setenv(cpu_kernel.CXX_ENV, "/nonexistent/g++")
    path, reason = cpu_kernel.kernel_status()
    assert path is None and "no C++ compiler" in reason


def test_failed_build_is_a_reason(library: Path) -> None:
    with pytest.raises(KvforgeError, match="building the CPU kernel failed"):
        cpu_kernel.library_path(("-fkvforge-no-such-option",))


# A variant of the library that compiles in seconds (one target, unoptimised; the full build is ~25 s of one core):
# for tests of the cache around the build, not of the code built.
QUICK_BUILD = ("-O0", "-DHWY_COMPILE_ONLY_STATIC=1")


def test_concurrent_first_builds_share_one_library(library: Path, tmp_path: Path) -> None:
    """Two processes building into an empty cache at once: one compiles, both get the same complete file."""
    headers = cpu_kernel.include_dir()
    env = dict(os.environ, **{cpu_kernel.CACHE_ENV: str(tmp_path), cpu_kernel.INCLUDE_ENV: str(headers)})
    command = [sys.executable, "-c", "import sys; from kvforge.plugins import cpu_kernel; "
               "print(cpu_kernel.library_path(tuple(sys.argv[1:])))", *QUICK_BUILD]
    procs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    paths = {proc.communicate(timeout=300)[0].strip() for proc in procs}
    assert all(proc.returncode == 0 for proc in procs) and len(paths) == 1
    built = Path(paths.pop())
    assert built.is_file() and built.parent.parent == tmp_path / "cpu-kernels"
    assert not list(built.parent.glob(".build-*"))  # no partial file left behind


def test_reference_forms_agree() -> None:
    """paged_attention over a pool holding the new tokens == paged_attention_rows with them passed apart."""
    case = Case(starts=[20, 0, 33], lengths=[5, 3, 2], seq=5, holes={0: [0]}, tree_mask=True, dtype="fp8")
    feeds = _inputs(case)
    t = case.tokens_per_page
    rows = _expected(case, feeds)
    # Give every row pages for its new tokens and write them in, keeping the cached part's holes.
    table, pool = feeds["kv_page_table"], feeds["pool"]
    total_pages = [-(-(s + n) // t) for s, n in zip(case.starts, case.lengths, strict=True)]
    full = np.full((len(case.starts), max(total_pages)), -1, dtype=np.int32)
    full[:, :table.shape[1]] = table
    extra = [pool]
    next_page = pool.shape[0]
    for b, start in enumerate(case.starts):
        for w in range(start // t, total_pages[b]):
            if w >= -(-start // t):  # a fresh page (a partial last cached page takes new tokens too)
                full[b, w] = next_page
                next_page += 1
                extra.append(np.zeros((1, *pool.shape[1:]), dtype=pool.dtype))
    pool = np.concatenate(extra)
    for b, (start, length) in enumerate(zip(case.starts, case.lengths, strict=True)):
        for i in range(length):
            pos = start + i
            pool[full[b, pos // t], :, :, pos % t, :] = to_storage(feeds["new_kv"][b, i], case.dtype)
    whole = reference.paged_attention(
        feeds["query"], pool, feeds["context_lengths"], feeds["kvcache_start_index"], full,
        num_q_heads=case.num_q, num_kv_heads=case.num_kv, head_dim=case.head_dim,
        scale=float(case.head_dim) ** -0.5, kv_cache_dtype=case.dtype, attention_mask=feeds["attention_mask"])
    np.testing.assert_allclose(whole, rows, rtol=0, atol=1e-6)

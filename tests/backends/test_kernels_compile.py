"""Everything about the paged-KV CUDA kernels that can be checked without a GPU (NVRTC, specs, twins, emulation)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kvforge.contract.errors import KvforgeError
from kvforge.plugins import kernel_specs as ks
from kvforge.plugins import nvrtc as nv
from kvforge.plugins import reference

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "scripts" / "gpu_check.py"
KERNELS = ROOT / "kvforge" / "plugins" / "kernels"
PTX_ARCHS = ("sm_80", "sm_89", "sm_90")
E4M3 = ml_dtypes.float8_e4m3fn


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("kvforge_gpu_check", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nvrtc_cache")


@pytest.fixture(scope="session")
def modules(cache_dir: Path) -> dict[tuple[str, str], nv.CompiledModule]:
    available, why = nv.nvrtc_available()
    if not available:
        pytest.skip(why)
    jobs = [(arch, "ptx") for arch in PTX_ARCHS] + [("sm_90", "cubin")]
    with ThreadPoolExecutor(len(jobs)) as pool:  # NVRTC compiles in parallel threads
        built = list(pool.map(lambda job: nv.compile_kernels(job[0], emit=job[1], cache_dir=cache_dir), jobs))
    return dict(zip(jobs, built, strict=True))


# ----------------------------------------------------------------------------------------- NVRTC --

@pytest.mark.parametrize("arch", PTX_ARCHS)
def test_every_kernel_compiles_to_ptx(modules: dict, arch: str) -> None:
    module = modules[(arch, "ptx")]
    text = module.ptx
    assert re.search(rf"^\.target {arch}\b", text, re.M)
    for name in ks.kernel_names():
        assert re.search(rf"\.entry {name}\(", text), f"{name} missing from the {arch} PTX"
    assert set(module.entries) == set(ks.kernel_names())
    # FP16 stores use the IEEE round-to-nearest-even conversion; nothing was built with fast math.
    assert "cvt.rn.f16.f32" in text
    assert ".ftz" not in text and "ex2.approx.ftz" not in text


def _kind(kernel: str) -> str:
    if kernel.startswith("kvforge_copy_"):
        return kernel.removeprefix("kvforge_")
    return "kv_write" if "kv_write" in kernel else "attention"


def test_ptx_signatures_follow_kernel_parameters(modules: dict) -> None:
    """Pointers (.u64) and int32 scalars (.u32) in the order kernel_specs.kernel_parameters gives, which is
    TensorRT's AOT order for the plugin kernels: inputs, scalars, outputs."""
    text = modules[("sm_90", "ptx")].ptx
    scalars = {*ks.KV_WRITE_SCALAR_ARGS, *ks.ATTENTION_SCALAR_ARGS, *ks.COPY_SCALAR_ARGS}
    for name in ks.kernel_names():
        block = re.search(rf"\.entry {name}\((.*?)\)", text, re.S)[1]
        declared = re.findall(r"\.param \.(u64|u32)\b", block)
        wanted = ["u32" if p in scalars else "u64" for p in ks.kernel_parameters(_kind(name))]
        assert declared == wanted, name
    assert ks.kernel_parameters("attention")[-1] == "attention_output"


def test_kernel_arguments_order_pointers_and_scalars() -> None:
    spec = ks.attention_launch(2, 3, 8, 4, 64, 16, 5, "fp16")
    pointers = {name: 1000 + i for i, name in enumerate((*ks.ATTENTION_TENSOR_ARGS, *ks.ATTENTION_OUTPUT_ARGS))}
    args = ks.kernel_arguments("attention", spec, pointers)
    assert [t for t, _ in args] == ["ptr"] * 5 + ["i32"] * 6 + ["ptr"]
    assert [v for t, v in args if t == "i32"] == list(spec.scalar_args)
    assert args[-1] == ("ptr", pointers["attention_output"])
    with pytest.raises(KvforgeError):
        ks.kernel_parameters("softmax")


def test_cubin_for_sm90_holds_every_kernel(modules: dict) -> None:
    module = modules[("sm_90", "cubin")]
    assert module.image[:4] == b"\x7fELF"
    assert set(ks.kernel_names()) <= set(module.entries)


def test_compile_cache_hits_with_the_same_bytes(modules: dict, cache_dir: Path) -> None:
    first = modules[("sm_90", "ptx")]
    started = time.perf_counter()
    again = nv.compile_kernels("sm_90", emit="ptx", cache_dir=cache_dir)
    assert time.perf_counter() - started < 1.0
    assert again.from_cache and again.image == first.image and again.key == first.key
    assert first.key != modules[("sm_90", "cubin")].key


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(nv.CACHE_ENV, str(tmp_path))
    assert nv.default_cache_dir() == tmp_path
    monkeypatch.delenv(nv.CACHE_ENV)
    assert nv.default_cache_dir() == Path.home() / ".cache" / "kvforge" / "nvrtc"


def test_broken_source_gives_one_line_naming_file_and_line(modules: dict, tmp_path: Path) -> None:
    broken = tmp_path / "kernels"
    shutil.copytree(KERNELS, broken, ignore=shutil.ignore_patterns("emulation"))
    lines = (broken / "decode.cu").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "const int num_keys" in line)
    lines.insert(at + 1, "    int oops = undefined_symbol;")
    (broken / "decode.cu").write_text("\n".join(lines) + "\n")
    with pytest.raises(KvforgeError) as info:
        nv.compile_kernels("sm_90", kernel_dir=broken, cache_dir=tmp_path / "cache")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"kvforge/plugins/kernels/decode.cu:{at + 2}: ")
    assert "paged_decode" in message and "undefined_symbol" in message


def test_bad_arch_and_emit_are_clear() -> None:
    with pytest.raises(KvforgeError, match="sm_90"):
        nv.compile_kernels("hopper")
    with pytest.raises(KvforgeError, match="ptx, cubin"):
        nv.compile_kernels("sm_90", emit="fatbin")


def test_missing_nvrtc_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)  # makes the import fail
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    assert nv.nvrtc_available() == (False, "NVRTC not available: pip install 'kvforge[gpu]'")
    with pytest.raises(KvforgeError, match=re.escape("pip install 'kvforge[gpu]'")):
        nv.compile_kernels("sm_90")


# -------------------------------------------------------------------------------- kernel_specs --

def test_block_sizes_match_the_sources() -> None:
    attention = (KERNELS / "attention.cu").read_text()
    decode = (KERNELS / "decode.cu").read_text()
    assert f"kTileThreads = {ks.ATTENTION_THREADS};" in attention
    assert f"kTileRows = {ks.ATTENTION_TILE_ROWS};" in attention
    assert f"kDecodeThreads = {ks.DECODE_THREADS};" in decode
    assert f"__launch_bounds__({ks.KV_WRITE_THREADS})" in (KERNELS / "kv_write.cu").read_text()
    assert f"__launch_bounds__({ks.COPY_THREADS})" in (KERNELS / "copy.cu").read_text()


@pytest.mark.parametrize("dtype", ks.KV_CACHE_DTYPES)
@pytest.mark.parametrize("head_dim", ks.ATTENTION_HEAD_DIMS)
@pytest.mark.parametrize("tokens_per_page", [16, 64, 128])
def test_launch_shapes_cover_every_row_and_head(dtype: str, head_dim: int, tokens_per_page: int) -> None:
    for batch in (1, 3, 8):
        for seq_len in (1, 7, 64, 513):
            for num_q, num_kv in ((8, 8), (12, 4), (32, 8), (14, 2), (32, 4)):
                group = num_q // num_kv
                write = ks.kv_write_launch(batch, seq_len, num_kv, head_dim, tokens_per_page, 33, 4096, dtype)
                assert write.kernel in ks.kernel_names()
                assert write.grid[0] * write.block[0] >= seq_len * num_kv * head_dim // 2 and write.grid[1] == batch
                assert len(write.scalar_args) == len(ks.KV_WRITE_SCALAR_ARGS)
                launches = [write]
                for variant in ("prefill", "decode"):
                    spec = ks.attention_launch(batch, seq_len, num_q, num_kv, head_dim, tokens_per_page, 33, dtype,
                                               variant=variant)
                    assert spec.kernel in ks.kernel_names()
                    assert len(spec.scalar_args) == len(ks.ATTENTION_SCALAR_ARGS)
                    if variant == "prefill":
                        assert spec.grid[0] * ks.ATTENTION_TILE_ROWS >= seq_len * group
                        assert (spec.grid[0] - 1) * ks.ATTENTION_TILE_ROWS < seq_len * group  # no empty tiles
                        assert spec.grid[1:] == (num_kv, batch)
                    else:
                        assert spec.grid == (num_q, seq_len, batch)
                    launches.append(spec)
                for spec in launches:
                    assert 1 <= spec.block[0] * spec.block[1] * spec.block[2] <= 1024
                    assert spec.shared_bytes == 0 and all(g >= 1 for g in spec.grid)


def test_attention_launch_picks_decode_for_one_token_and_encodes_scale() -> None:
    decode = ks.attention_launch(2, 1, 32, 8, 128, 128, 32, "fp16")
    prefill = ks.attention_launch(2, 5, 32, 8, 128, 128, 32, "fp8", scale=0.125)
    assert decode.kernel == "kvforge_paged_decode_fp16_d128"
    assert prefill.kernel == "kvforge_paged_attention_fp8_d128"
    scale_bits = decode.scalar_args[ks.ATTENTION_SCALAR_ARGS.index("scale_bits")]
    assert np.array([scale_bits], np.int32).view(np.float32)[0] == np.float32(1 / np.sqrt(128))
    assert prefill.scalar_args[-1] == np.array([0.125], np.float32).view(np.int32)[0]


@pytest.mark.parametrize(("call", "field"), [
    (lambda: ks.kv_write_launch(1, 1, 8, 128, 96, 4, 384, "fp16"), "tokens_per_page"),
    (lambda: ks.attention_launch(1, 1, 8, 8, 96, 64, 4, "fp16"), "head_dim"),
    (lambda: ks.attention_launch(1, 1, 12, 8, 128, 64, 4, "fp16"), "num_q_heads"),
    (lambda: ks.attention_launch(1, 1, 8, 8, 128, 64, 4, "fp32"), "kv_cache_dtype"),
    (lambda: ks.attention_launch(70000, 1, 8, 8, 128, 64, 4, "fp16"), "batch"),
    (lambda: ks.copy_launch("page_to_slot", page=0, num_kv_heads=2, tokens_per_page=64, head_dim=64,
                            kv_cache_dtype="fp8", num_tokens=65), "num_tokens"),
])
def test_bad_launch_shapes_are_named(call, field: str) -> None:
    with pytest.raises(KvforgeError) as info:
        call()
    assert info.value.field == field


def test_grid_expressions_work_on_symbolic_sizes() -> None:
    class Sym:
        """A stand-in for a TensorRT shape expression: records the arithmetic."""

        def __init__(self, text: str) -> None:
            self.text = text

        def __add__(self, other: object) -> Sym:
            return Sym(f"({self.text} + {other})")

        def __mul__(self, other: object) -> Sym:
            return Sym(f"({self.text} * {other})")

        def __floordiv__(self, other: object) -> Sym:
            return Sym(f"({self.text} // {other})")

        def __repr__(self) -> str:
            return self.text

    b, s = Sym("B"), Sym("S")
    grid = ks.grid_expressions("prefill", batch=b, seq_len=s, num_q_heads=32, num_kv_heads=8, head_dim=128)
    assert repr(grid[0]) == "(((S * 4) + 31) // 32)" and grid[1:] == (8, b)
    assert ks.grid_expressions("decode", batch=b, seq_len=s, num_q_heads=32, num_kv_heads=8, head_dim=128) == (32, s, b)
    assert repr(ks.grid_expressions("kv_write", batch=b, seq_len=s, num_q_heads=32, num_kv_heads=8,
                                    head_dim=128)[0]) == "(((S * 512) + 255) // 256)"


# ---------------------------------------------------------------------------- conversion twins --

def test_e4m3_encode_matches_ml_dtypes_on_every_fp16_value() -> None:
    x = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    ours = ks.e4m3_encode(x)
    in_range = np.abs(x) <= 464  # above, ml_dtypes overflows to NaN and the kernel saturates
    with np.errstate(invalid="ignore"):
        theirs = x.astype(E4M3).view(np.uint8)
    assert np.array_equal(ours[in_range], theirs[in_range])
    assert ((ours[np.isnan(x)] & 0x7F) == 0x7F).all()
    big = np.isfinite(x) & (np.abs(x) > 464) | np.isinf(x)
    assert np.array_equal(ours[big], np.where(x[big] > 0, 0x7E, 0xFE).astype(np.uint8))


def test_e4m3_encode_matches_ml_dtypes_on_random_and_tie_values() -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, size=400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x, rng.standard_normal(100_000).astype(np.float32) * 50,
                        rng.standard_normal(100_000).astype(np.float32) * 1e-3])
    table = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    values = np.unique(table[np.isfinite(table)]).astype(np.float64)
    mids = ((values[1:] + values[:-1]) / 2).astype(np.float32)  # exact ties: round half to even
    ties = np.concatenate([mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    x = np.concatenate([x, ties, -ties])
    x = x[np.isfinite(x) & (np.abs(x) <= 464)]
    assert np.array_equal(ks.e4m3_encode(x), x.astype(E4M3).view(np.uint8))


def test_e4m3_decode_table_matches_ml_dtypes() -> None:
    ours = ks.e4m3_decode_table()
    theirs = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    assert np.array_equal(np.isnan(ours), np.isnan(theirs))
    finite = ~np.isnan(theirs)
    assert np.array_equal(ours[finite].view(np.uint32), theirs[finite].view(np.uint32))  # -0.0 too
    # every E4M3 value is exact in FP16, which the FP8 kernels rely on nowhere but the tests may
    assert np.array_equal(ours[finite].astype(np.float16).astype(np.float32), ours[finite])


# ------------------------------------------------------------------- gpu_check's numpy reference --

def _random_case(rng: np.random.Generator, dtype: str, *, hole: bool):
    batch, seq, hq, hkv, d, t = 3, 9, 6, 2, 64, 16
    starts = np.array([0, 21, 40], np.int32)
    lens = np.array([9, 4, 0], np.int32)
    pages_per_seq = 4
    table = np.arange(batch * pages_per_seq, dtype=np.int32)[rng.permutation(batch * pages_per_seq)]
    table = table.reshape(batch, pages_per_seq)
    if hole:
        table[1, 1] = -1  # a -1 page inside the write range: those tokens are skipped
    pool = rng.integers(0, 256, size=(batch * pages_per_seq, 2, hkv, t, d * (2 if dtype == "fp16" else 1)),
                        dtype=np.uint8).view(reference.pool_numpy_dtype(dtype))
    if dtype == "fp16":
        pool = np.where(np.isfinite(pool), pool, np.float16(0))  # cached K/V must be finite to attend over
    else:
        pool = np.where((pool & 0x7F) == 0x7F, np.uint8(0), pool)
    arrays = {
        "key": rng.standard_normal((batch, seq, hkv * d), dtype=np.float32) * 3,
        "value": rng.standard_normal((batch, seq, hkv * d), dtype=np.float32) * 3,
        "cos_sin": reference.rope_table(pages_per_seq * t, d, 10000.0),
        "context_lengths": lens, "kvcache_start_index": starts, "kv_page_table": table, "pool": pool,
    }
    query = rng.standard_normal((batch, seq, hq * d), dtype=np.float32)
    return arrays, query, {"num_kv_heads": hkv, "head_dim": d, "kv_cache_dtype": dtype}, hq


@pytest.mark.parametrize("dtype", ["fp16", "fp8"])
def test_gpu_check_reference_matches_plugins_reference(dtype: str) -> None:
    rng = np.random.default_rng(7)
    arrays, query, attrs, hq = _random_case(rng, dtype, hole=True)
    ours = gpu_check.ref_kv_write(*arrays.values(), **attrs)
    theirs = reference.paged_kv_write(*arrays.values(), **attrs)
    assert np.array_equal(ours.view(np.uint8), theirs.view(np.uint8))  # the same bytes

    arrays, query, attrs, hq = _random_case(rng, dtype, hole=False)
    pool = reference.paged_kv_write(*arrays.values(), **attrs)
    lengths, starts, table = arrays["context_lengths"], arrays["kvcache_start_index"], arrays["kv_page_table"]
    kwargs = {"num_q_heads": hq, "num_kv_heads": attrs["num_kv_heads"], "head_dim": attrs["head_dim"],
              "scale": 0.125, "kv_cache_dtype": dtype}
    np.testing.assert_allclose(gpu_check.ref_attention(query, pool, lengths, starts, table, **kwargs),
                               reference.paged_attention(query, pool, lengths, starts, table, **kwargs),
                               rtol=1e-6, atol=1e-6)


def test_gpu_check_tables_and_tolerances() -> None:
    assert np.array_equal(gpu_check.from_storage(np.arange(256, dtype=np.uint8), "fp8"), ks.e4m3_decode_table(),
                          equal_nan=True)
    ref = np.ones((2, 3, 4))
    good = gpu_check.compare_attention(ref.astype(np.float32) + 1e-4, ref, [3, 3])
    assert good["ok"]
    padded = gpu_check.compare_attention(np.where(np.arange(3)[None, :, None] < 2, 1.0, 0.0).astype(np.float32)
                                         + np.zeros((2, 3, 4), np.float32), ref, [2, 2])
    assert padded["ok"] and padded["padding_rows_zero"]
    assert not gpu_check.compare_attention(ref.astype(np.float32) + 1e-2, ref, [3, 3])["ok"]
    nan = ref.astype(np.float32)
    nan[1, 2, 3] = np.nan
    assert not gpu_check.compare_attention(nan, ref, [3, 3])["ok"]


def test_gpu_check_report_goes_under_out(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.report_path(None) == tmp_path / "gpu_check_report.json"
    assert gpu_check.report_path("r.json") == tmp_path / "r.json"
    assert gpu_check.report_path(str(tmp_path / "abs.json")) == tmp_path / "abs.json"
    monkeypatch.delenv("OUT")
    assert gpu_check.report_path(None) == Path("gpu_check_report.json")


# ----------------------------------------------------------------------- gpu_check as a program --

# The GPU machine has neither kvforge installed nor ml_dtypes: run the script with both imports blocked.
_BLOCKED = ("import runpy, sys; sys.modules['ml_dtypes'] = None; sys.modules['kvforge'] = None; "
            "sys.argv = ['gpu_check.py', *sys.argv[1:]]; runpy.run_path(sys.argv[0], run_name='__main__')")


def _run_gpu_check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCKED.replace("sys.argv[0]", repr(str(GPU_CHECK))), *args],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})}, timeout=120)


def test_gpu_check_help_runs_without_kvforge_or_ml_dtypes() -> None:
    done = _run_gpu_check("--help")
    assert done.returncode == 0, done.stderr
    assert "--out" in done.stdout and "--emulate" in done.stdout


def test_gpu_check_without_a_gpu_exits_2_with_one_line() -> None:
    done = _run_gpu_check(env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no GPU: ")


def test_gpu_check_dry_run_builds_cases_and_references() -> None:
    done = _run_gpu_check("--dry-run", "--quick", "--no-compile")
    assert done.returncode == 0, done.stderr
    quick = [c.name for c in gpu_check.CASES if c.quick]
    assert all(name in done.stdout for name in quick)


def test_case_list_spans_the_required_shapes() -> None:
    cases = gpu_check.CASES
    assert {c.dtype for c in cases} == {"fp16", "fp8"}
    assert {c.head_dim for c in cases} == {64, 128}
    assert {64, 128} <= {c.tokens_per_page for c in cases}
    assert {c.num_q_heads // c.num_kv_heads for c in cases} >= {1, 8}
    assert min(c.batch for c in cases) == 1 and max(c.batch for c in cases) == 8
    assert max(max(s + n for s, n in zip(c.starts, c.lens, strict=True)) for c in cases) == 4096
    assert any(c.seq_len == 1 for c in cases) and any(c.seq_len > 1 for c in cases)


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None or os.uname().machine != "x86_64",
                    reason="the CPU emulation of the kernels needs g++ on x86-64")
def test_kernels_pass_gpu_check_in_cpu_emulation(cache_dir: Path, tmp_path: Path) -> None:
    """The real kernel sources, run as C++ fibers: catches indexing, masking and barrier bugs without a GPU."""
    out = tmp_path / "report.json"
    done = _run_gpu_check("--emulate", "--cases", "dec_b3_inactive|pre_b3_s37|pre_b2_s40_t16", "--out", str(out),
                          env={nv.CACHE_ENV: str(cache_dir)})
    assert done.returncode == 0, done.stdout + done.stderr
    report = __import__("json").loads(out.read_text())
    kernels = {r["kernel"] for r in report["results"]}
    assert report["ok"] and len(report["results"]) == 9
    assert {"kvforge_paged_kv_write_fp8", "kvforge_paged_decode_fp16_d64",
            "kvforge_paged_attention_fp8_d128"} <= kernels

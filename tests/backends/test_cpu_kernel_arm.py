"""The kvforge.cpu kernels on ARM (issue 50, item 2): the library's sources cross-compiled for aarch64 with
tests/backends/cpu_op_runner.cc (the ONNX Runtime API the ops call, without ONNX Runtime) and run under qemu-user,
each compiled target in turn (NEON), against the float64 numpy reference, and within a target a matmul's,
SwiGLU's or the attention's decode row equals the same row of a many-row call bit for bit. Correctness only: qemu's
timings say nothing of an ARM CPU's speed, and SVE is not compiled (kvforge/plugins/cpu_kernel.py TARGET_FLAGS).

Highway's dynamic dispatch needs its runtime (hwy/targets.cc, in libhwy), not only its headers: the runner links
Debian's arm64 libhwy (libhwy-dev:arm64, multiarch) and qemu-aarch64 finds it and the arm64 C library where
multiarch puts them."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from kvforge.builder.lower_matmul import pack_blocks
from kvforge.plugins import cpu_kernel, reference
from kvforge.plugins.reference import pool_numpy_dtype, round_to_storage, to_storage

RUNNER = Path(__file__).with_name("cpu_op_runner.cc")
CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
ARM_LIBHWY = Path("/usr/lib/aarch64-linux-gnu/libhwy.so")
ARM_SYSROOT = Path("/usr/aarch64-linux-gnu")  # the cross toolchain's C library, where multiarch has none
# ONNX element types (onnx.TensorProto) the cases use
FLOAT, UINT8, INT32, FLOAT16, BOOL = 1, 2, 6, 10, 9
ELEMENT = {np.dtype(np.float32): FLOAT, np.dtype(np.uint8): UINT8, np.dtype(np.int32): INT32,
           np.dtype(np.float16): FLOAT16, np.dtype(np.bool_): BOOL}


@dataclass
class OpCase:
    """One op call: its name, attributes, inputs (None: an absent optional input) and expected outputs."""

    op: str
    attributes: dict[str, int | float]
    inputs: list[np.ndarray | None]
    expected: list[np.ndarray]
    atol: list[float] = field(default_factory=list)
    group: str = ""  # cases whose first row is the same computation: it must come out the same, bit for bit


def _str(text: str) -> bytes:
    return struct.pack("<I", len(text)) + text.encode()


def _dims(shape: tuple[int, ...]) -> bytes:
    return struct.pack("<I", len(shape)) + b"".join(struct.pack("<q", d) for d in shape)


def write_cases(path: Path, cases: list[OpCase]) -> None:
    """The case file cpu_op_runner.cc reads (its header comment gives the layout)."""
    out = [struct.pack("<I", len(cases))]
    for case in cases:
        out.append(_str(case.op) + struct.pack("<I", len(case.attributes)))
        for name, value in case.attributes.items():
            out.append(_str(name) + (struct.pack("<Bq", 0, value) if isinstance(value, int) else
                                     struct.pack("<Bf", 1, value)))
        out.append(struct.pack("<I", len(case.inputs)))
        for array in case.inputs:
            if array is None:
                out.append(struct.pack("<i", 0) + _dims(()) + struct.pack("<Q", 0))
                continue
            data = np.ascontiguousarray(array).tobytes()
            out.append(struct.pack("<i", ELEMENT[array.dtype]) + _dims(array.shape) + struct.pack("<Q", len(data)) +
                       data)
        out.append(struct.pack("<I", len(case.expected)))
        for expected, atol in zip(case.expected, case.atol, strict=True):
            out.append(_dims(expected.shape) + struct.pack("<f", atol) +
                       np.ascontiguousarray(expected, dtype="<f4").tobytes())
    path.write_bytes(b"".join(out))


def read_results(path: Path, cases: list[OpCase]) -> list[list[np.ndarray]]:
    data, offset, out = path.read_bytes(), 0, []
    for case in cases:
        outputs = []
        for expected in case.expected:
            size = expected.size * 4
            outputs.append(np.frombuffer(data[offset:offset + size], dtype="<f4").reshape(expected.shape))
            offset += size
        out.append(outputs)
    assert offset == len(data)
    return out


# ---------------------------------------------------------------------------------------------------- the cases --

def _matmul_cases(rng: np.random.Generator, bits: int) -> list[OpCase]:
    """A 21-column weight of 128 rows: 1, 6 and 16 rows (the per-row path every decode and verify call takes) and
    40 (the many-row path: dequantized once, then Gemm)."""
    k, n = 128, 21
    values = rng.integers(0, 16 if bits == 4 else 256, size=(n, k // 32, 32)).astype(np.uint8)
    scales = (rng.random((n, k // 32)) * 0.05 + 0.001).astype(np.float32)
    mins = (-rng.random((n, k // 32)) * (0.4 if bits == 4 else 6.4)).astype(np.float32)
    blocks = pack_blocks(values, scales, mins, bits=bits)
    a = rng.standard_normal((1, 40, k)).astype(np.float32)
    cases = []
    for rows in (1, 6, 16, 40):
        expected = reference.matmul_blocks(a[:, :rows], blocks).astype(np.float32)
        cases.append(OpCase("MatMulBlocks", {"K": k, "N": n, "bits": bits}, [a[:, :rows], blocks], [expected],
                            [1e-4 * float(np.abs(expected).max())],
                            f"matmul {bits}-bit" if rows <= 16 else ""))  # 40 rows: Gemm's own sums
    return cases


def _attention_cases(rng: np.random.Generator, dtype: str) -> list[OpCase]:
    """A sequence with 37 cached tokens (pages of 16, in a shuffled pool): a decode row, then the same row as the
    first of a 5-row call (a verify call). Both take the direct path (every item does on NEON), so row 0 of the 5
    equals the decode row bit for bit (it differed by ~1e-7 before issue 50's change), as on x86
    (tests/backends/test_cpu_kernel.py)."""
    num_q, num_kv, d, t, start = 8, 2, 64, 16, 37
    pages = -(-start // t)
    pool = to_storage(rng.standard_normal((pages + 3, 2, num_kv, t, d)).astype(np.float32), dtype)
    pool = pool.astype(pool_numpy_dtype(dtype))
    table = rng.permutation(pages + 3)[:pages].astype(np.int32).reshape(1, pages)
    query = rng.standard_normal((1, 5, num_q * d)).astype(np.float32)
    new_kv = round_to_storage(rng.standard_normal((1, 5, 2, num_kv, d)).astype(np.float32), dtype)
    attributes = {"num_q_heads": num_q, "num_kv_heads": num_kv, "head_dim": d, "tokens_per_page": t,
                  "scale": float(d) ** -0.5}
    cases = []
    for rows in (1, 5):
        feeds = [query[:, :rows], new_kv[:, :rows], pool, table, np.array([start], np.int32),
                 np.array([rows], np.int32)]
        expected = reference.paged_attention_rows(*feeds, num_q_heads=num_q, num_kv_heads=num_kv, head_dim=d,
                                                  scale=float(d) ** -0.5, kv_cache_dtype=dtype)
        cases.append(OpCase("PagedAttention", attributes, [*feeds, None], [expected], [1e-5], f"attention {dtype}"))
    return cases


def _swiglu_cases(rng: np.random.Generator) -> list[OpCase]:
    """SwiGLU (its sigmoid is the kernels' vector exp) over gates from -30 to 30, with a tail shorter than a
    vector (I = 67), one row and five."""
    x = (rng.standard_normal((1, 5, 2 * 67)) * 6).astype(np.float32)
    x[0, 0, :67] = np.linspace(-30, 30, 67, dtype=np.float32)
    cases = []
    for rows in (1, 5):
        expected = reference.swiglu(x[:, :rows]).astype(np.float32)
        cases.append(OpCase("SwiGLU", {}, [x[:, :rows]], [expected], [1e-5 * float(np.abs(expected).max())],
                            "swiglu"))
    return cases


def all_cases() -> list[OpCase]:
    rng = np.random.default_rng(50)
    return [*_matmul_cases(rng, 4), *_matmul_cases(rng, 8), *_attention_cases(rng, "fp16"),
            *_attention_cases(rng, "fp32"), *_swiglu_cases(rng)]


# ---------------------------------------------------------------------------------------------- build and run --

def _missing() -> str | None:
    if shutil.which(CROSS_CXX) is None:
        return f"no aarch64 cross compiler: apt-get install g++-aarch64-linux-gnu ({CROSS_CXX} not found)"
    if shutil.which(QEMU) is None:
        return f"no {QEMU}: apt-get install qemu-user"
    if not ARM_LIBHWY.is_file():
        return (f"no arm64 Highway runtime ({ARM_LIBHWY}): dpkg --add-architecture arm64 && apt-get update && "
                "apt-get install libhwy-dev:arm64")
    return None


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runner and the library's sources built for aarch64 (the library's own flags), or a skip saying what is
    missing."""
    missing = _missing()
    if missing:
        print(f"SKIP reason: {missing}")
        pytest.skip(missing)
    work = tmp_path_factory.mktemp("arm")
    highway = work / "include"
    highway.mkdir()
    (highway / "hwy").symlink_to(Path("/usr/include/hwy"))  # the same headers on every arch
    flags = [flag for flag in cpu_kernel.CXX_FLAGS if flag not in ("-shared", "-fPIC")]
    binary = work / "cpu_op_runner"
    done = subprocess.run([CROSS_CXX, *flags, f"-I{cpu_kernel.include_dir()}", f"-I{highway}",
                           *map(str, cpu_kernel.SOURCES), str(RUNNER), "-o", str(binary),
                           f"-L{ARM_LIBHWY.parent}", "-lhwy", "-lpthread"],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return binary


def _run(binary: Path, *args: str, target: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != cpu_kernel.TARGET_ENV}
    if target is not None:
        env[cpu_kernel.TARGET_ENV] = target
    env["QEMU_LD_PREFIX"] = str(ARM_SYSROOT)  # the arm64 C library for the dynamic loader
    env["LD_LIBRARY_PATH"] = str(ARM_LIBHWY.parent)  # read by the arm64 loader under qemu: libhwy, libstdc++
    return subprocess.run([QEMU, str(binary), *args], capture_output=True, text=True, env=env, timeout=600)


def test_every_arm_target_matches_the_reference_and_keeps_rows_exact(runner: Path, tmp_path: Path) -> None:
    listed = _run(runner, "--targets")
    assert listed.returncode == 0, listed.stderr
    compiled, runnable = (line.split() for line in listed.stdout.splitlines()[:2])
    print(f"aarch64 build under qemu: compiled {compiled}, runnable {runnable}")
    assert "neon" in compiled and "neon" in runnable
    assert not {"sve", "sve2"} & set(compiled)  # not compiled for now (cpu_kernel.TARGET_FLAGS)
    cases = all_cases()
    write_cases(tmp_path / "cases.bin", cases)
    for target in runnable:
        done = _run(runner, str(tmp_path / "cases.bin"), str(tmp_path / f"{target}.bin"), target=target)
        assert done.returncode == 0, f"{target}: {done.stdout}{done.stderr}"
        assert f"target {target}: {len(cases)} cases, 0 mismatched" in done.stdout
        got = read_results(tmp_path / f"{target}.bin", cases)
        groups: dict[str, list[np.ndarray]] = {}
        for case, outputs in zip(cases, got, strict=True):
            if case.group:
                groups.setdefault(case.group, []).append(outputs[0])
        for name, outputs in groups.items():
            alone = outputs[0][0, 0]  # the one-row call: a decode row
            for many in outputs[1:]:
                assert np.array_equal(many[0, 0], alone), f"{target} {name}: row 0 of {many.shape[1]} rows"


def test_a_wrong_answer_fails_the_runner(runner: Path, tmp_path: Path) -> None:
    """The runner's own check can fail: an expected output moved by more than its tolerance exits 1, naming it."""
    case = all_cases()[0]
    case.expected[0] = case.expected[0] + 10 * case.atol[0]
    write_cases(tmp_path / "cases.bin", [case])
    done = _run(runner, str(tmp_path / "cases.bin"), str(tmp_path / "out.bin"))
    assert done.returncode == 1 and "case 0 (MatMulBlocks) output 0" in done.stderr, done.stderr

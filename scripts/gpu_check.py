#!/usr/bin/env python3
"""One prepared GPU run: compile the paged-KV kernels for the local SM, check them against numpy, time them."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import platform
import re
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# The GPU machine has Python, numpy and cuda-bindings but neither kvforge installed nor ml_dtypes, so this
# script imports the checkout's kvforge/plugins/nvrtc.py and kvforge/plugins/kernel_specs.py by path and carries its own
# numpy reference (FP8 through kernel_specs' bit-exact E4M3 twins; tests/test_kernels_compile.py holds that
# reference against kvforge/plugins/reference.py and ml_dtypes on a CPU machine). --emulate runs the same checks on
# the CPU with the kernels compiled as C++ (kvforge/plugins/kernels/emulation), for development without a GPU.
#
# Pass criteria:
#  * kv_write: the pool bytes equal the reference's exactly, FP16 and FP8 alike (the rotation is evaluated
#    in the same float32 order as numpy, both conversions round to nearest even), and nothing outside the
#    new tokens' slots changes.
#  * attention: |gpu - ref| <= 2e-3 + 2e-3 * |ref| on every live row, exact zeros on rows past
#    context_lengths, no NaN. Both sides read the same stored K/V bytes, so storage precision cancels and
#    what is left is fp32 (online softmax, exp2) against fp64, ~1e-6: one bound serves FP16 and FP8; an
#    FP8-specific looser bound would only hide indexing bugs, whose errors are O(1).
#  * copies: the first num_tokens rows of every (K|V, head) block move, the rest of the destination does not.
# Exit codes: 0 all passed, 1 a check failed (or nothing could be compiled/loaded), 2 no GPU.

ROOT = Path(__file__).resolve().parents[1]
EXIT_FAILED = 1
EXIT_NO_GPU = 2
UNUSED_PAGE = -1
ATOL = RTOL = 2e-3
ROPE_THETA = 10000.0
H200_COPY_TBPS = 4.3  # device-to-device copy, bytes read + written, as measured on the H200s here


def import_repo_modules() -> tuple[types.ModuleType, types.ModuleType]:
    """(kernel_specs, nvrtc) of this checkout, with kvforge installed or not."""
    try:
        from kvforge.plugins import kernel_specs, nvrtc

        return kernel_specs, nvrtc
    except ImportError:
        pass
    # Map the package names onto the repo's folders without running setup or any __init__: nvrtc and
    # kernel_specs need only kvforge.contract.errors, which is plain Python.
    for name, folder in (("kvforge", "kvforge"), ("kvforge.plugins", "kvforge/plugins"),
                         ("kvforge.runtime", "kvforge/runtime")):
        package = types.ModuleType(name)
        package.__path__ = [str(ROOT / folder)]
        sys.modules[name] = package
    from kvforge.plugins import kernel_specs, nvrtc

    return kernel_specs, nvrtc


ks, nv = import_repo_modules()
from kvforge.contract.rope import rope_table  # noqa: E402 (plain numpy: the runtime's own table, after the mapping)

# ---------------------------------------------------------------- numpy reference (kvforge/plugins/reference.py) --

def pool_dtype(kv_cache_dtype: str) -> np.dtype:
    return np.dtype(np.float16) if kv_cache_dtype == "fp16" else np.dtype(np.uint8)


def to_storage(x: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    return x.astype(np.float16) if kv_cache_dtype == "fp16" else ks.e4m3_encode(x)


def from_storage(raw: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    return raw.astype(np.float32) if kv_cache_dtype == "fp16" else ks.e4m3_decode(raw)


def ref_kv_write(key: np.ndarray, value: np.ndarray, cos_sin: np.ndarray, context_lengths: np.ndarray,
                 kvcache_start_index: np.ndarray, kv_page_table: np.ndarray, pool: np.ndarray, *,
                 num_kv_heads: int, head_dim: int, kv_cache_dtype: str) -> np.ndarray:
    """reference.paged_kv_write, vectorised per row (same float32 operations, so the same bytes)."""
    pool = pool.copy()
    tokens_per_page, half = pool.shape[3], head_dim // 2
    for b in range(key.shape[0]):
        n = int(context_lengths[b])
        if n == 0:
            continue
        pos = int(kvcache_start_index[b]) + np.arange(n)
        pages = kv_page_table[b, pos // tokens_per_page]
        keep = pages != UNUSED_PAGE
        k = key[b, :n].reshape(n, num_kv_heads, head_dim)
        cos = cos_sin[pos, :half][:, None, :]
        sin = cos_sin[pos, half:][:, None, :]
        x1, x2 = k[..., :half], k[..., half:]
        k = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(np.float32)
        v = value[b, :n].reshape(n, num_kv_heads, head_dim)
        page, slot = pages[keep], (pos % tokens_per_page)[keep]
        pool[page, 0, :, slot, :] = to_storage(k[keep], kv_cache_dtype)
        pool[page, 1, :, slot, :] = to_storage(v[keep], kv_cache_dtype)
    return pool


def ref_attention(query: np.ndarray, pool: np.ndarray, context_lengths: np.ndarray,
                  kvcache_start_index: np.ndarray, kv_page_table: np.ndarray, *, num_q_heads: int,
                  num_kv_heads: int, head_dim: int, scale: float, kv_cache_dtype: str) -> np.ndarray:
    """reference.paged_attention in float64, one kv head at a time (bounded memory for long rows)."""
    batch, seq = query.shape[:2]
    group = num_q_heads // num_kv_heads
    tokens_per_page = pool.shape[3]
    out = np.zeros((batch, seq, num_q_heads * head_dim), dtype=np.float32)
    for b in range(batch):
        start, length = int(kvcache_start_index[b]), int(context_lengths[b])
        if length == 0:
            continue
        total = start + length
        pages = kv_page_table[b, : -(-total // tokens_per_page)]
        with np.errstate(invalid="ignore"):  # random bytes past `total` may be signalling NaNs
            kv = from_storage(pool[pages], kv_cache_dtype).astype(np.float64)  # [P, 2, H, T, D]
        kv = kv.transpose(1, 2, 0, 3, 4).reshape(2, num_kv_heads, -1, head_dim)[:, :, :total]
        q = query[b, :length].reshape(length, num_kv_heads, group, head_dim).astype(np.float64)
        visible = np.arange(total)[None, :] <= (start + np.arange(length))[:, None]  # [length, total]
        for h in range(num_kv_heads):
            scores = (q[:, h].transpose(1, 0, 2) @ kv[0, h].T) * scale  # [group, length, total], BLAS
            scores = np.where(visible[None], scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            attn = probs @ kv[1, h]  # [group, length, D]
            out[b, :length, h * group * head_dim:(h + 1) * group * head_dim] = (
                attn.transpose(1, 0, 2).reshape(length, group * head_dim))
    return out


# ------------------------------------------------------------------------------------------- cases --

@dataclass(frozen=True, slots=True)
class Case:
    name: str
    starts: tuple[int, ...]  # kvcache_start_index per row
    lens: tuple[int, ...]  # context_lengths per row (<= seq_len)
    seq_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    tokens_per_page: int
    dtype: str
    quick: bool = False

    @property
    def batch(self) -> int:
        return len(self.starts)


def _case(name: str, starts: Sequence[int], lens: Sequence[int], seq_len: int, hq: int, hkv: int, d: int, t: int,
          dtype: str, quick: bool = False) -> Case:
    return Case(name, tuple(starts), tuple(lens), seq_len, hq, hkv, d, t, dtype, quick)


MIXED8 = (1, 77, 640, 1023, 1500, 2047, 3333, 4095)
CASES: tuple[Case, ...] = (
    # decode (seq_len 1): 1-8 sequences, up to 4,096 cached tokens
    _case("dec_b1_l4096_d128_g4_fp16", [4095], [1], 1, 32, 8, 128, 128, "fp16"),
    _case("dec_b8_l4096_d128_g4_fp16", [4095] * 8, [1] * 8, 1, 32, 8, 128, 128, "fp16"),
    _case("dec_b8_l4096_d128_g4_fp8", [4095] * 8, [1] * 8, 1, 32, 8, 128, 128, "fp8"),
    _case("dec_b8_mixed_d64_g8_fp8", MIXED8, [1] * 8, 1, 32, 4, 64, 64, "fp8", quick=True),
    _case("dec_b4_mixed_d64_g1_fp16", [0, 63, 64, 2000], [1] * 4, 1, 8, 8, 64, 64, "fp16"),
    _case("dec_b3_inactive_d128_g3_fp8", [127, 300, 0], [1, 0, 1], 1, 12, 4, 128, 128, "fp8", quick=True),
    _case("dec_b2_t32_d128_g7_fp16", [1000, 31], [1, 1], 1, 14, 2, 128, 32, "fp16", quick=True),
    _case("dec_b8_mixed_d128_g2_fp16", MIXED8, [1] * 8, 1, 16, 8, 128, 128, "fp16"),
    # chunked prefill (seq_len > 1) over cached pages, with padded rows (len < seq_len) and idle rows
    _case("pre_b1_s512_d128_g4_fp16", [0], [512], 512, 32, 8, 128, 128, "fp16"),
    _case("pre_b2_s256_pad_d64_g8_fp8", [1000, 128], [256, 100], 256, 16, 2, 64, 64, "fp8", quick=True),
    _case("pre_b4_s64_d128_g1_fp16", [0, 511, 2048, 3000], [64, 64, 17, 0], 64, 8, 8, 128, 128, "fp16"),
    _case("pre_b3_s37_d128_g5_fp8", [5, 129, 777], [37, 30, 1], 37, 10, 2, 128, 64, "fp8", quick=True),
    _case("pre_b8_s128_d64_g3_fp16", [0, 128, 1000, 1500, 2500, 3000, 3500, 3968],
          [128, 128, 128, 5, 128, 64, 128, 128], 128, 24, 8, 64, 128, "fp16"),
    _case("pre_b1_s1024_l2048_d128_g4_fp16", [1024], [1024], 1024, 32, 8, 128, 128, "fp16"),
    _case("pre_b1_s1024_l2048_d128_g4_fp8", [1024], [1024], 1024, 32, 8, 128, 128, "fp8"),
    _case("pre_b2_s40_t16_d64_g2_fp16", [3, 100], [40, 33], 40, 4, 2, 64, 16, "fp16", quick=True),
)

# (dtype, num_kv_heads, tokens_per_page, head_dim, page, num_tokens)
COPY_CASES = (("fp16", 8, 128, 128, 3, 77), ("fp8", 2, 64, 64, 0, 64), ("fp8", 4, 128, 128, 5, 1))


@dataclass(slots=True)
class Inputs:
    key: np.ndarray
    value: np.ndarray
    query: np.ndarray
    cos_sin: np.ndarray
    context_lengths: np.ndarray
    start: np.ndarray
    page_table: np.ndarray
    pool_before: np.ndarray
    pool_after: np.ndarray
    capacity: int
    scale: float


def build_inputs(case: Case, rng: np.random.Generator) -> Inputs:
    """Random activations, a shuffled page table with -1 tails, a pool of random bytes (NaN patterns
    included, so an out-of-range read shows) whose first `start` tokens per row hold written history."""
    b, s, t, d, hkv = case.batch, case.seq_len, case.tokens_per_page, case.head_dim, case.num_kv_heads
    totals = [st + ln for st, ln in zip(case.starts, case.lens, strict=True)]
    pages_per_seq = -(-max(max(totals), 1) // t) + 1  # one spare column that stays -1
    capacity = pages_per_seq * t
    need = [-(-tot // t) for tot in totals]
    num_pages = sum(need) + 2  # two pages nobody references
    order = rng.permutation(num_pages).astype(np.int32)
    page_table = np.full((b, pages_per_seq), UNUSED_PAGE, dtype=np.int32)
    used = 0
    for row, n in enumerate(need):
        page_table[row, :n] = order[used:used + n]
        used += n
    elem = pool_dtype(case.dtype)
    pool = rng.integers(0, 256, size=num_pages * 2 * hkv * t * d * elem.itemsize, dtype=np.uint8)
    pool = pool.view(elem).reshape(num_pages, 2, hkv, t, d)
    cos_sin = rope_table(capacity, d, ROPE_THETA)
    start = np.asarray(case.starts, dtype=np.int32)
    context_lengths = np.asarray(case.lens, dtype=np.int32)
    common = {"num_kv_heads": hkv, "head_dim": d, "kv_cache_dtype": case.dtype}
    history = int(start.max())
    if history:
        past = rng.standard_normal((2, b, history, hkv * d), dtype=np.float32)
        pool = ref_kv_write(past[0], past[1], cos_sin, start, np.zeros_like(start), page_table, pool, **common)
    key = rng.standard_normal((b, s, hkv * d), dtype=np.float32)
    value = rng.standard_normal((b, s, hkv * d), dtype=np.float32)
    query = rng.standard_normal((b, s, case.num_q_heads * d), dtype=np.float32)
    pool_after = ref_kv_write(key, value, cos_sin, context_lengths, start, page_table, pool, **common)
    return Inputs(key, value, query, cos_sin, context_lengths, start, page_table, pool, pool_after, capacity,
                  1.0 / math.sqrt(d))


def kv_bytes(case: Case, *, new_only: bool) -> int:
    """Unique K+V bytes a kernel must move: the new tokens (write) or every visible token (attention)."""
    tokens = sum(ln if new_only else (st + ln if ln else 0) for st, ln in zip(case.starts, case.lens, strict=True))
    return tokens * 2 * case.num_kv_heads * case.head_dim * pool_dtype(case.dtype).itemsize


def compare_attention(got: np.ndarray, ref: np.ndarray, lens: Sequence[int]) -> dict[str, Any]:
    live = np.zeros(got.shape[:2], dtype=bool)
    for row, n in enumerate(lens):
        live[row, :n] = True
    err = np.abs(got.astype(np.float64) - ref)
    bound = ATOL + RTOL * np.abs(ref)
    finite = bool(np.isfinite(got).all())
    live_ok = bool((err[live] <= bound[live]).all()) if live.any() else True
    padding_zero = bool((got[~live] == 0).all())
    max_err = float(np.nanmax(np.where(live[..., None], err, 0.0))) if got.size else 0.0
    return {"ok": finite and live_ok and padding_zero, "max_abs_err": max_err,
            "max_err_over_tol": float(np.nanmax(np.where(live[..., None], err / bound, 0.0))),
            "finite": finite, "padding_rows_zero": padding_zero}


# ------------------------------------------------------------------------------------ CUDA driver --

def kernel_params(spec: Any, kind: str, pointers: dict[str, int]) -> list[ctypes.c_void_p | ctypes.c_int32]:
    """The argument values in kernel_specs' parameter order (inputs, int32 scalars, outputs); the caller
    passes their addresses as cuLaunchKernel's kernelParams."""
    return [ctypes.c_void_p(v) if ctype == "ptr" else ctypes.c_int32(v)
            for ctype, v in ks.kernel_arguments(kind, spec, pointers)]


class NoGpu(Exception):
    """No usable GPU: reported in one line with exit code 2."""


class Gpu:
    """The little of cuda.bindings.driver this check needs: memory, one module, launches, events."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise NoGpu(f"cuda-bindings is not installed ({exc})") from exc
        self.cu = driver
        try:
            self.check(driver.cuInit(0))
        except RuntimeError as exc:  # libcuda.so missing: no driver on this machine
            raise NoGpu(str(exc)) from exc
        except CudaError as exc:
            raise NoGpu(str(exc)) from exc
        if self.check(driver.cuDeviceGetCount()) < 1:
            raise NoGpu("the driver sees no device")
        self.device = self.check(driver.cuDeviceGet(0))
        self.context = self.check(driver.cuDevicePrimaryCtxRetain(self.device))
        self.check(driver.cuCtxSetCurrent(self.context))
        attr = driver.CUdevice_attribute
        major = self.check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device))
        minor = self.check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device))
        self.arch = f"sm_{major}{minor}"
        self.name = self.check(driver.cuDeviceGetName(256, self.device)).split(b"\0")[0].decode()
        self.sms = self.check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.device))
        self.driver_version = self.check(driver.cuDriverGetVersion())
        self.stream = self.check(driver.cuStreamCreate(0))
        self.module = None
        self._functions: dict[str, Any] = {}

    def check(self, result: Any) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            _, name = self.cu.cuGetErrorName(err)
            raise CudaError(int(err), name.decode() if isinstance(name, bytes) else str(name))
        return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)

    def alloc(self, nbytes: int) -> int:
        return int(self.check(self.cu.cuMemAlloc(max(nbytes, 16))))

    def free(self, ptr: int) -> None:
        self.check(self.cu.cuMemFree(ptr))

    def upload(self, array: np.ndarray, ptr: int | None = None) -> int:
        array = np.ascontiguousarray(array)
        ptr = self.alloc(array.nbytes) if ptr is None else ptr
        self.check(self.cu.cuMemcpyHtoD(ptr, array.ctypes.data, array.nbytes))
        return ptr

    def download(self, ptr: int, like: np.ndarray) -> np.ndarray:
        out = np.empty_like(like)
        self.check(self.cu.cuMemcpyDtoH(out.ctypes.data, ptr, out.nbytes))
        return out

    def fill(self, ptr: int, byte: int, nbytes: int) -> None:
        self.check(self.cu.cuMemsetD8(ptr, byte, nbytes))

    def load(self, image: bytes, emit: str) -> None:
        self.module = self.check(self.cu.cuModuleLoadData(image + b"\0" if emit == "ptx" else image))
        self._functions.clear()

    def function(self, name: str) -> Any:
        if name not in self._functions:
            self._functions[name] = self.check(self.cu.cuModuleGetFunction(self.module, name.encode()))
        return self._functions[name]

    def attributes(self, name: str) -> dict[str, int]:
        attr = self.cu.CUfunction_attribute
        fn = self.function(name)
        return {"registers": self.check(self.cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, fn)),
                "local_bytes": self.check(self.cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn)),
                "static_shared_bytes": self.check(
                    self.cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn))}

    def launch(self, spec: Any, kind: str, pointers: dict[str, int]) -> None:
        args = kernel_params(spec, kind, pointers)
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        self.check(self.cu.cuLaunchKernel(self.function(spec.kernel), *spec.grid, *spec.block, spec.shared_bytes,
                                          self.stream, ctypes.addressof(params), 0))

    def sync(self) -> None:
        self.check(self.cu.cuStreamSynchronize(self.stream))

    def time_ms(self, run: Callable[[], None], iters: int, warmup: int = 2) -> float:
        """Mean milliseconds per call, cuEvent-timed over `iters` back-to-back calls."""
        for _ in range(warmup):
            run()
        begin, end = (self.check(self.cu.cuEventCreate(0)) for _ in range(2))
        self.check(self.cu.cuEventRecord(begin, self.stream))
        for _ in range(iters):
            run()
        self.check(self.cu.cuEventRecord(end, self.stream))
        self.check(self.cu.cuEventSynchronize(end))
        ms = float(self.check(self.cu.cuEventElapsedTime(begin, end))) / iters
        for event in (begin, end):
            self.check(self.cu.cuEventDestroy(event))
        return ms

    def copy_rate_gbps(self, nbytes: int = 1 << 30, iters: int = 10) -> float:
        """cuMemcpyDtoD of a large buffer: GB/s counting bytes read and written (the H200's ~4.3 TB/s)."""
        src, dst = self.alloc(nbytes), self.alloc(nbytes)
        try:
            ms = self.time_ms(lambda: self.check(self.cu.cuMemcpyDtoDAsync(dst, src, nbytes, self.stream)), iters)
        finally:
            self.free(src)
            self.free(dst)
        return 2 * nbytes / (ms * 1e-3) / 1e9


class EmulatedGpu:
    """Gpu's interface over kvforge/plugins/kernels/emulation: the same kernel sources compiled as C++ and run on the
    CPU, one fiber per CUDA thread. Checks indexing, masking and synchronisation without a GPU; says nothing
    about speed (time_ms is 0) nor about NVRTC/PTX. Buffers carry guard bytes that are checked after every
    launch, so an out-of-bounds write fails the launch."""

    GUARD = 4096

    def __init__(self, library: Path) -> None:
        self.lib = ctypes.CDLL(str(library))
        self.lib.kvf_emu_launch.restype = ctypes.c_int
        self.lib.kvf_emu_launch.argtypes = [ctypes.c_char_p, *[ctypes.c_uint] * 6, ctypes.c_void_p,
                                            ctypes.c_char_p, ctypes.c_int]
        self.name, self.arch, self.sms, self.driver_version = "CPU emulation", "emulated", 0, 0
        self.buffers: dict[int, np.ndarray] = {}

    def alloc(self, nbytes: int) -> int:
        buffer = np.full(nbytes + 2 * self.GUARD + 16, 0xA5, dtype=np.uint8)
        ptr = (buffer.ctypes.data + self.GUARD + 15) // 16 * 16  # 16-byte aligned like cuMemAlloc
        self.buffers[ptr] = buffer
        return ptr

    def free(self, ptr: int) -> None:
        del self.buffers[ptr]

    def _view(self, ptr: int, nbytes: int) -> np.ndarray:
        buffer = self.buffers[ptr]
        offset = ptr - buffer.ctypes.data
        return buffer[offset:offset + nbytes]

    def upload(self, array: np.ndarray, ptr: int | None = None) -> int:
        array = np.ascontiguousarray(array)
        ptr = self.alloc(array.nbytes) if ptr is None else ptr
        self._view(ptr, array.nbytes)[:] = array.reshape(-1).view(np.uint8)
        return ptr

    def download(self, ptr: int, like: np.ndarray) -> np.ndarray:
        return self._view(ptr, like.nbytes).copy().view(like.dtype).reshape(like.shape)

    def fill(self, ptr: int, byte: int, nbytes: int) -> None:
        self._view(ptr, nbytes)[:] = byte

    def launch(self, spec: Any, kind: str, pointers: dict[str, int]) -> None:
        args = kernel_params(spec, kind, pointers)
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        error = ctypes.create_string_buffer(512)
        if self.lib.kvf_emu_launch(spec.kernel.encode(), *spec.grid, *spec.block, ctypes.addressof(params),
                                   error, len(error)):
            raise CudaError(-1, f"emulated {spec.kernel}: {error.value.decode()}")
        for ptr, buffer in self.buffers.items():
            offset = ptr - buffer.ctypes.data
            end = offset + buffer.size - 2 * self.GUARD - 16
            if (buffer[:offset] != 0xA5).any() or (buffer[end + (buffer.size - end) // 2:] != 0xA5).any():
                raise CudaError(-1, f"emulated {spec.kernel}: wrote outside a buffer")

    def sync(self) -> None:
        pass

    def time_ms(self, run: Callable[[], None], iters: int, warmup: int = 2) -> float:
        return 0.0  # emulated time means nothing


def build_emulator(cache_dir: Path | None = None) -> Path:
    """Compile kvforge/plugins/kernels/emulation/kernels_host.cpp with the kernels into a shared library (cached by
    the sha256 of every source)."""
    import hashlib
    import shutil
    import subprocess

    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise NoGpu("--emulate needs a C++17 compiler (g++ or $CXX)")
    kernels = ROOT / "kvforge" / "plugins" / "kernels"
    sources = sorted([*kernels.glob("*.cu"), *kernels.glob("*.cuh"), *(kernels / "emulation").glob("*")])
    flags = ["-std=c++17", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-Wno-unknown-pragmas", "-shared",
             "-fPIC", f"-I{kernels}"]
    digest = hashlib.sha256(" ".join([compiler, *flags]).encode())
    for source in sources:
        digest.update(source.name.encode() + source.read_bytes())
    folder = cache_dir or nv.default_cache_dir()
    library = folder / f"kvforge_emulation-{digest.hexdigest()[:32]}.so"
    if not library.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = library.with_name(f"{library.name}.{os.getpid()}.tmp")
        done = subprocess.run([compiler, *flags, "-o", str(tmp), str(kernels / "emulation" / "kernels_host.cpp")],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building the emulation failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, library)
    return library


class CudaError(Exception):
    def __init__(self, code: int, name: str) -> None:
        super().__init__(f"{name} ({code})")
        self.code = code


# ------------------------------------------------------------------------------------------ checks --

def check_case(gpu: Gpu | EmulatedGpu, case: Case, inputs: Inputs, iters: int,
               copy_gbps: float | None) -> list[dict[str, Any]]:
    """kv_write and both attention kernels on one case; the device buffers live only inside this call."""
    b, s, d = case.batch, case.seq_len, case.head_dim
    pages_per_seq = inputs.page_table.shape[1]
    ptrs: dict[str, int] = {}
    results = []
    try:
        for name, array in (("key", inputs.key), ("value", inputs.value), ("query", inputs.query),
                            ("rope_rotary_cos_sin", inputs.cos_sin), ("context_lengths", inputs.context_lengths),
                            ("kvcache_start_index", inputs.start), ("kv_page_table", inputs.page_table),
                            ("present_key_values", inputs.pool_before)):
            ptrs[name] = gpu.upload(array)
        out_like = np.zeros((b, s, case.num_q_heads * d), dtype=np.float32)
        ptrs["attention_output"] = gpu.alloc(out_like.nbytes)

        spec = ks.kv_write_launch(b, s, case.num_kv_heads, d, case.tokens_per_page, pages_per_seq, inputs.capacity,
                                  case.dtype)
        gpu.launch(spec, "kv_write", ptrs)
        gpu.sync()
        got = gpu.download(ptrs["present_key_values"], inputs.pool_after)
        diff = got.view(np.uint8) != inputs.pool_after.view(np.uint8)
        ms = gpu.time_ms(lambda: gpu.launch(spec, "kv_write", ptrs), iters)  # idempotent: rewrites the same bytes
        results.append(_timed({"case": case.name, "kernel": spec.kernel, "ok": not diff.any(),
                               "mismatched_bytes": int(diff.sum())}, kv_bytes(case, new_only=True), ms, copy_gbps))

        gpu.upload(inputs.pool_after, ptrs["present_key_values"])  # attention is checked on the reference pool
        ref = ref_attention(inputs.query, inputs.pool_after, inputs.context_lengths, inputs.start, inputs.page_table,
                            num_q_heads=case.num_q_heads, num_kv_heads=case.num_kv_heads, head_dim=d,
                            scale=inputs.scale, kv_cache_dtype=case.dtype)
        for variant in ("decode", "prefill"):
            spec = ks.attention_launch(b, s, case.num_q_heads, case.num_kv_heads, d, case.tokens_per_page,
                                       pages_per_seq, case.dtype, scale=inputs.scale, variant=variant)
            gpu.fill(ptrs["attention_output"], 0xFF, out_like.nbytes)  # NaN: every element must be written
            gpu.launch(spec, "attention", ptrs)
            gpu.sync()
            verdict = compare_attention(gpu.download(ptrs["attention_output"], out_like), ref, case.lens)
            ms = gpu.time_ms(lambda spec=spec: gpu.launch(spec, "attention", ptrs), iters)
            results.append(_timed({"case": case.name, "kernel": spec.kernel, **verdict},
                                  kv_bytes(case, new_only=False), ms, copy_gbps))
    finally:
        _free_all(gpu, ptrs.values())
    return results


def _free_all(gpu: Gpu | EmulatedGpu, pointers: Any) -> None:
    """Free what was allocated; after a kernel fault the context is dead and frees fail too, and the fault
    is the error worth reporting."""
    for ptr in list(pointers):
        with contextlib.suppress(CudaError):
            gpu.free(ptr)


def check_copies(gpu: Gpu | EmulatedGpu, rng: np.random.Generator, iters: int,
                 copy_gbps: float | None) -> list[dict[str, Any]]:
    results = []
    for dtype, hkv, t, d, page, n in COPY_CASES:
        elem = pool_dtype(dtype).itemsize
        pool = rng.integers(0, 256, size=(page + 2, 2, hkv, t, d * elem), dtype=np.uint8)
        slot = np.full((2, hkv, t, d * elem), 0xAB, dtype=np.uint8)
        name = f"copy_{dtype}_h{hkv}_t{t}_d{d}_n{n}"
        pool_ptr, slot_ptr = gpu.upload(pool), gpu.upload(slot)
        try:
            spec = ks.copy_launch("page_to_slot", page=page, num_kv_heads=hkv, tokens_per_page=t, head_dim=d,
                                  kv_cache_dtype=dtype, num_tokens=n)
            pointers = {"pool": pool_ptr, "slot": slot_ptr}
            gpu.launch(spec, "copy_page_to_slot", pointers)
            gpu.sync()
            got = gpu.download(slot_ptr, slot)
            want = slot.copy()
            want[:, :, :n] = pool[page, :, :, :n]
            moved = n * 2 * hkv * d * elem
            ms = gpu.time_ms(lambda spec=spec, p=pointers: gpu.launch(spec, "copy_page_to_slot", p), iters)
            results.append(_timed({"case": name, "kernel": spec.kernel, "ok": bool(np.array_equal(got, want))},
                                  moved, ms, copy_gbps))

            target = page + 1
            spec = ks.copy_launch("slot_to_page", page=target, num_kv_heads=hkv, tokens_per_page=t, head_dim=d,
                                  kv_cache_dtype=dtype, num_tokens=n)
            gpu.launch(spec, "copy_slot_to_page", pointers)
            gpu.sync()
            got = gpu.download(pool_ptr, pool)
            want = pool.copy()
            want[target, :, :, :n] = want[page, :, :, :n]
            ms = gpu.time_ms(lambda spec=spec, p=pointers: gpu.launch(spec, "copy_slot_to_page", p), iters)
            results.append(_timed({"case": name, "kernel": spec.kernel, "ok": bool(np.array_equal(got, want))},
                                  moved, ms, copy_gbps))
        finally:
            _free_all(gpu, (pool_ptr, slot_ptr))
    return results


def _timed(result: dict[str, Any], nbytes: int, ms: float, copy_gbps: float | None) -> dict[str, Any]:
    gbps = nbytes / (ms * 1e-3) / 1e9 if ms > 0 else 0.0
    return {**result, "time_us": round(ms * 1e3, 2), "kv_bytes": nbytes, "GBps": round(gbps, 1),
            "of_copy_rate": round(gbps / copy_gbps, 3) if copy_gbps else None}


def print_result(r: dict[str, Any]) -> None:
    err = f"err {r['max_abs_err']:.1e}" if "max_abs_err" in r else f"bytes off {r.get('mismatched_bytes', 0)}"
    share = f"{100 * r['of_copy_rate']:5.1f}% of copy" if r.get("of_copy_rate") is not None else ""
    print(f"  [{'ok' if r['ok'] else 'FAIL'}] {r['case']:34s} {r['kernel']:34s} {err:17s} "
          f"{r['time_us']:10.1f} us {r['GBps']:8.1f} GB/s {share}", flush=True)


# -------------------------------------------------------------------------------------------- main --

def compile_image(arch: str, ptx_file: Path | None) -> tuple[bytes, str, dict[str, Any]]:
    if ptx_file is not None:
        return ptx_file.read_bytes().rstrip(b"\0"), "ptx", {"source": str(ptx_file)}
    started = time.perf_counter()
    module = nv.compile_kernels(arch, emit="ptx")
    info = {"source": "nvrtc", "nvrtc_version": ".".join(map(str, module.nvrtc_version)),
            "from_cache": module.from_cache, "compile_s": round(time.perf_counter() - started, 2)}
    return module.image, "ptx", info


def report_path(out: str | None) -> Path:
    path = Path(out or "gpu_check_report.json")
    env = os.environ.get("OUT")
    return Path(env) / path if env and not path.is_absolute() else path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_check.py",
        description="Compile kvforge's paged-KV CUDA kernels for the local GPU, check them against the numpy "
                    "reference and time them. Exit 0 passed, 1 failed, 2 no GPU.")
    parser.add_argument("--out", help="JSON report path (default gpu_check_report.json; relative paths go "
                                      "under $OUT when OUT is set)")
    parser.add_argument("--quick", action="store_true", help="only the small cases")
    parser.add_argument("--cases", default="", help="regular expression selecting cases by name")
    parser.add_argument("--iters", type=int, default=20, help="timed launches per kernel (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ptx", type=Path, help="load this PTX (from `python kvforge/plugins/nvrtc.py --out`) "
                                                 "instead of compiling with the local NVRTC")
    parser.add_argument("--emulate", action="store_true",
                        help="no GPU: run the same checks on the kernels compiled as C++ for the CPU (needs g++; "
                             "slow, so pair it with --quick or --cases; no timings)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: build the cases, run the numpy reference, compile for --arch; then exit")
    parser.add_argument("--arch", default="sm_90", help="architecture for --dry-run (a GPU run uses its own)")
    parser.add_argument("--no-compile", action="store_true", help="with --dry-run: skip NVRTC")
    return parser.parse_args(argv)


def selected_cases(args: argparse.Namespace) -> list[Case]:
    pattern = re.compile(args.cases) if args.cases else None
    return [c for c in CASES if (c.quick or not args.quick) and (pattern is None or pattern.search(c.name))]


def dry_run(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(args.seed)
    for case in selected_cases(args):
        inputs = build_inputs(case, rng)
        ref = ref_attention(inputs.query, inputs.pool_after, inputs.context_lengths, inputs.start, inputs.page_table,
                            num_q_heads=case.num_q_heads, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                            scale=inputs.scale, kv_cache_dtype=case.dtype)
        assert np.isfinite(ref).all(), case.name
        for variant in ("decode", "prefill"):
            ks.attention_launch(case.batch, case.seq_len, case.num_q_heads, case.num_kv_heads, case.head_dim,
                                case.tokens_per_page, inputs.page_table.shape[1], case.dtype, variant=variant)
        print(f"  [ref] {case.name}: max |out| {float(np.abs(ref).max()):.3f}")
    if not args.no_compile:
        available, why = nv.nvrtc_available()
        print(f"NVRTC: {why}")
        if available:
            image, emit, info = compile_image(args.arch, args.ptx)
            print(f"compiled {len(image)} bytes of {emit} for {args.arch} {info}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    started = time.perf_counter()
    if args.emulate:
        try:
            gpu: Gpu | EmulatedGpu = EmulatedGpu(build_emulator())
        except NoGpu as exc:
            print(f"gpu_check: cannot emulate: {exc}", file=sys.stderr)
            return EXIT_NO_GPU
        report: dict[str, Any] = {"device": gpu.name, "emulated": True, "python": platform.python_version(),
                                  "numpy": np.__version__}
        return run_checks(args, gpu, report, None, started)
    try:
        gpu = Gpu()
    except NoGpu as exc:
        print(f"gpu_check: no GPU: {exc}", file=sys.stderr)
        return EXIT_NO_GPU
    available, why = nv.nvrtc_available()
    print(f"device: {gpu.name} ({gpu.arch}, {gpu.sms} SMs), driver {gpu.driver_version}")
    print(f"NVRTC: {why}")
    report = {"device": gpu.name, "arch": gpu.arch, "sms": gpu.sms, "driver": gpu.driver_version,
              "nvrtc": why, "python": platform.python_version(), "numpy": np.__version__}
    if not available and args.ptx is None:
        print(f"gpu_check: {why}; or prebuild with `python kvforge/plugins/nvrtc.py --arch {gpu.arch} --out k.ptx` "
              "and pass --ptx k.ptx", file=sys.stderr)
        return EXIT_FAILED
    try:
        return load_and_check(args, gpu, report, started)
    except (CudaError, nv.KvforgeError) as exc:  # nothing loaded or a kernel faulted: say so, keep the report
        print(f"gpu_check: {exc}", file=sys.stderr)
        report.update({"ok": False, "error": str(exc), "elapsed_s": round(time.perf_counter() - started, 1)})
        path = report_path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        return EXIT_FAILED


def load_and_check(args: argparse.Namespace, gpu: Gpu, report: dict[str, Any], started: float) -> int:
    image, emit, info = compile_image(gpu.arch, args.ptx)
    try:
        gpu.load(image, emit)
    except CudaError as exc:
        if exc.code != int(gpu.cu.CUresult.CUDA_ERROR_UNSUPPORTED_PTX_VERSION) or args.ptx is not None:
            raise
        # This NVRTC is newer than the driver: its SASS needs no driver JIT.
        print(f"PTX rejected by the driver ({exc}); loading a cubin instead")
        module = nv.compile_kernels(gpu.arch, emit="cubin")
        image, emit = module.image, "cubin"
        gpu.load(image, emit)
    ptx_version = re.search(rb"^\.version\s+(\S+)", image, re.M) if emit == "ptx" else None
    report["image"] = {"emit": emit, "bytes": len(image), **info,
                       "ptx_version": ptx_version[1].decode() if ptx_version else None}
    report["kernels"] = {name: gpu.attributes(name) for name in ks.kernel_names()}
    copy_gbps = gpu.copy_rate_gbps()
    report["copy_rate_GBps"] = round(copy_gbps, 1)
    print(f"image: {emit} {report['image']}")
    print(f"device copy rate (cuMemcpyDtoD, read+write): {copy_gbps:.0f} GB/s "
          f"(an H200 does ~{H200_COPY_TBPS * 1000:.0f})")
    return run_checks(args, gpu, report, copy_gbps, started)


def run_checks(args: argparse.Namespace, gpu: Gpu | EmulatedGpu, report: dict[str, Any], copy_gbps: float | None,
               started: float) -> int:
    rng = np.random.default_rng(args.seed)
    results: list[dict[str, Any]] = []
    for case in selected_cases(args):
        inputs = build_inputs(case, rng)
        print(f"{case.name}: B={case.batch} S={case.seq_len} starts={list(case.starts)} lens={list(case.lens)} "
              f"Hq={case.num_q_heads} Hkv={case.num_kv_heads} D={case.head_dim} T={case.tokens_per_page} "
              f"{case.dtype}", flush=True)
        try:
            case_results = check_case(gpu, case, inputs, args.iters, copy_gbps)
        except CudaError as exc:  # a faulting kernel poisons the context: report and stop
            results.append({"case": case.name, "kernel": "?", "ok": False, "error": str(exc)})
            print(f"  [FAIL] {case.name}: {exc}")
            break
        for r in case_results:
            print_result(r)
        results.extend(case_results)
    else:
        if not args.cases:
            print("snapshot copies:")
            for r in check_copies(gpu, rng, args.iters, copy_gbps):
                print_result(r)
                results.append(r)

    ok = bool(results) and all(r["ok"] for r in results)
    report.update({"ok": ok, "tolerance": {"atol": ATOL, "rtol": RTOL, "kv_write": "exact bytes"},
                   "results": results, "elapsed_s": round(time.perf_counter() - started, 1)})
    path = report_path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    failed = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)}/{len(results)} checks passed in {report['elapsed_s']} s; report: {path}")
    return 0 if ok else EXIT_FAILED


if __name__ == "__main__":
    raise SystemExit(main())

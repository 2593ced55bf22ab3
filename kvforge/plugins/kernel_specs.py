"""Launch geometry and argument order of the paged-KV CUDA kernels, shared by the TensorRT plugins and gpu_check."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvforge.contract.errors import KvforgeError


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    kernel: str  # extern "C" entry name
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int  # dynamic shared memory; every kernel here uses static shared memory only (<= 48 KiB)
    scalar_args: tuple[int, ...]  # int32 scalars passed after the *_TENSOR_ARGS pointers, in order


KV_CACHE_DTYPES = ("fp16", "fp8")
ELEMENT_BYTES = {"fp16": 2, "fp8": 1}
ATTENTION_HEAD_DIMS = (64, 128)  # the attention kernels are templated on these; kv_write/copy take any even D
ATTENTION_VARIANTS = ("auto", "prefill", "decode")

# Kernel parameters follow TensorRT's AOT plugin launcher: input pointers, then the int32 scalar_args, then
# output pointers. *_TENSOR_ARGS are the pointers before the scalars, *_OUTPUT_ARGS those after them;
# kernel_parameters() spells out the whole list. The kv-write kernels update the pool through its input
# pointer (present_key_values aliases past_key_values), so they declare no output; TensorRT's trailing
# aliased pointer is simply not read.
KV_WRITE_TENSOR_ARGS = ("key", "value", "rope_rotary_cos_sin", "context_lengths", "kvcache_start_index",
                        "kv_page_table", "present_key_values")  # pointer order of the kv-write kernels
KV_WRITE_OUTPUT_ARGS: tuple[str, ...] = ()
ATTENTION_TENSOR_ARGS = ("query", "present_key_values", "context_lengths", "kvcache_start_index",
                         "kv_page_table")  # pointer order of the attention kernels, before the scalars
ATTENTION_OUTPUT_ARGS = ("attention_output",)  # after the scalars
COPY_PAGE_TO_SLOT_TENSOR_ARGS = ("pool", "slot")  # source first, destination second (runtime launches)
COPY_SLOT_TO_PAGE_TENSOR_ARGS = ("slot", "pool")

# Names of the scalar_args, in order. seq_len comes from the query/key shape at run time; scale_bits is the
# float32 softmax scale's bit pattern as an int32 (AOT plugin extra arguments are integers only).
KV_WRITE_SCALAR_ARGS = ("seq_len", "num_kv_heads", "head_dim", "tokens_per_page", "pages_per_seq", "capacity")
ATTENTION_SCALAR_ARGS = ("seq_len", "num_q_heads", "num_kv_heads", "tokens_per_page", "pages_per_seq", "scale_bits")
COPY_SCALAR_ARGS = ("page", "num_kv_heads", "tokens_per_page", "head_dim", "elem_bytes", "num_tokens")

# Block sizes and tile shapes, mirrored from the .cu files (a test checks them against the sources).
KV_WRITE_THREADS = 256
ATTENTION_THREADS = 128
ATTENTION_TILE_ROWS = 32  # (token, GQA group member) query rows per attention block
DECODE_THREADS = 256
COPY_THREADS = 256
MAX_GRID_YZ = 65535


def kv_write_kernel(kv_cache_dtype: str) -> str:
    return f"kvforge_paged_kv_write_{_dtype(kv_cache_dtype)}"


def attention_kernel(kv_cache_dtype: str, head_dim: int, variant: str) -> str:
    """Entry of the tiled ("prefill") or per-query-head ("decode") attention kernel; both are correct for any
    seq_len, decode is the fast one at seq_len 1."""
    if variant not in ("prefill", "decode"):
        raise KvforgeError(f"expected prefill or decode, got {variant!r}", "variant")
    if head_dim not in ATTENTION_HEAD_DIMS:
        raise KvforgeError(f"attention kernels exist for head_dim {ATTENTION_HEAD_DIMS}, not {head_dim}", "head_dim")
    kind = "attention" if variant == "prefill" else "decode"
    return f"kvforge_paged_{kind}_{_dtype(kv_cache_dtype)}_d{head_dim}"


def kernel_parameters(kind: str) -> tuple[str, ...]:
    """Every parameter of a kernel family in declaration order: "kv_write", "attention" (prefill and decode),
    "copy_page_to_slot" or "copy_slot_to_page". Scalar names are those of the *_SCALAR_ARGS tuples."""
    layouts = {
        "kv_write": (*KV_WRITE_TENSOR_ARGS, *KV_WRITE_SCALAR_ARGS, *KV_WRITE_OUTPUT_ARGS),
        "attention": (*ATTENTION_TENSOR_ARGS, *ATTENTION_SCALAR_ARGS, *ATTENTION_OUTPUT_ARGS),
        "copy_page_to_slot": (*COPY_PAGE_TO_SLOT_TENSOR_ARGS, *COPY_SCALAR_ARGS),
        "copy_slot_to_page": (*COPY_SLOT_TO_PAGE_TENSOR_ARGS, *COPY_SCALAR_ARGS),
    }
    if kind not in layouts:
        raise KvforgeError(f"expected one of {', '.join(layouts)}, got {kind!r}", "kind")
    return layouts[kind]


def kernel_arguments(kind: str, launch: KernelLaunch, pointers: Mapping[str, int]) -> list[tuple[str, int]]:
    """(c type, value) per parameter for a cuLaunchKernel-style call: "ptr" for device pointers (taken from
    `pointers` by name), "i32" for launch.scalar_args."""
    scalars = iter(launch.scalar_args)
    scalar_names = {*KV_WRITE_SCALAR_ARGS, *ATTENTION_SCALAR_ARGS, *COPY_SCALAR_ARGS}
    return [("i32", next(scalars)) if name in scalar_names else ("ptr", pointers[name])
            for name in kernel_parameters(kind)]


def kernel_names() -> tuple[str, ...]:
    """Every extern "C" entry the kernels define."""
    names = [kv_write_kernel(dt) for dt in KV_CACHE_DTYPES]
    names += [attention_kernel(dt, d, v) for v in ("prefill", "decode") for dt in KV_CACHE_DTYPES
              for d in ATTENTION_HEAD_DIMS]
    return (*names, "kvforge_copy_page_to_slot", "kvforge_copy_slot_to_page")


def grid_expressions(kind: str, *, batch: Any, seq_len: Any, num_q_heads: int, num_kv_heads: int,
                     head_dim: int) -> tuple[Any, Any, Any]:
    """The grid of `kind` ("kv_write", "prefill" or "decode") as expressions of batch and seq_len.

    batch and seq_len may be ints or symbolic sizes (TensorRT AOT plugins pass shape expressions); the
    formulas use only +, * and floor division by a constant, ceil(x / c) being (x + c - 1) // c. Heads and
    head_dim are build-time constants:

      kv_write: (ceil(seq_len * num_kv_heads * head_dim / 2 / 256), batch, 1)   block 256
      prefill:  (ceil(seq_len * (num_q_heads / num_kv_heads) / 32), num_kv_heads, batch)   block 128
      decode:   (num_q_heads, seq_len, batch)   block 256

    The matching scalar_args are KV_WRITE_SCALAR_ARGS / ATTENTION_SCALAR_ARGS; only seq_len among them
    varies at run time."""
    if kind == "kv_write":
        per_token = num_kv_heads * (head_dim // 2)
        return (seq_len * per_token + (KV_WRITE_THREADS - 1)) // KV_WRITE_THREADS, batch, 1
    if kind == "prefill":
        group = num_q_heads // num_kv_heads
        return (seq_len * group + (ATTENTION_TILE_ROWS - 1)) // ATTENTION_TILE_ROWS, num_kv_heads, batch
    if kind == "decode":
        return num_q_heads, seq_len, batch
    raise KvforgeError(f"expected kv_write, prefill or decode, got {kind!r}", "kind")


def kv_write_launch(batch: int, seq_len: int, num_kv_heads: int, head_dim: int, tokens_per_page: int,
                    pages_per_seq: int, capacity: int, kv_cache_dtype: str) -> KernelLaunch:
    _positive(batch=batch, seq_len=seq_len, num_kv_heads=num_kv_heads, pages_per_seq=pages_per_seq,
              capacity=capacity)
    _page_geometry(head_dim, tokens_per_page)
    _grid_yz("batch", batch)
    grid = grid_expressions("kv_write", batch=batch, seq_len=seq_len, num_q_heads=num_kv_heads,
                            num_kv_heads=num_kv_heads, head_dim=head_dim)
    return KernelLaunch(kv_write_kernel(kv_cache_dtype), grid, (KV_WRITE_THREADS, 1, 1), 0,
                        (seq_len, num_kv_heads, head_dim, tokens_per_page, pages_per_seq, capacity))


def attention_launch(batch: int, seq_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                     tokens_per_page: int, pages_per_seq: int, kv_cache_dtype: str, *, scale: float | None = None,
                     variant: str = "auto") -> KernelLaunch:
    """`scale` defaults to 1/sqrt(head_dim) (the PagedAttention `scale` attribute); `variant` "auto" picks
    the decode kernel for seq_len 1 and the tiled one otherwise."""
    _positive(batch=batch, seq_len=seq_len, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
              pages_per_seq=pages_per_seq)
    _page_geometry(head_dim, tokens_per_page)
    if num_q_heads % num_kv_heads:
        raise KvforgeError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}",
                           "num_q_heads")
    if variant not in ATTENTION_VARIANTS:
        raise KvforgeError(f"expected one of {', '.join(ATTENTION_VARIANTS)}, got {variant!r}", "variant")
    if variant == "auto":
        variant = "decode" if seq_len == 1 else "prefill"
    _grid_yz("batch", batch)
    if variant == "decode":
        _grid_yz("seq_len", seq_len)
    grid = grid_expressions(variant, batch=batch, seq_len=seq_len, num_q_heads=num_q_heads,
                            num_kv_heads=num_kv_heads, head_dim=head_dim)
    threads = DECODE_THREADS if variant == "decode" else ATTENTION_THREADS
    scale = 1.0 / float(np.sqrt(head_dim)) if scale is None else float(scale)
    return KernelLaunch(attention_kernel(kv_cache_dtype, head_dim, variant), grid, (threads, 1, 1), 0,
                        (seq_len, num_q_heads, num_kv_heads, tokens_per_page, pages_per_seq, float_bits(scale)))


def copy_launch(direction: str, *, page: int, num_kv_heads: int, tokens_per_page: int, head_dim: int,
                kv_cache_dtype: str, num_tokens: int) -> KernelLaunch:
    """Snapshot copy of the first `num_tokens` tokens of one page of one layer: direction "page_to_slot"
    (pointers pool, slot) or "slot_to_page" (slot, pool)."""
    if direction not in ("page_to_slot", "slot_to_page"):
        raise KvforgeError(f"expected page_to_slot or slot_to_page, got {direction!r}", "direction")
    elem = ELEMENT_BYTES[_dtype(kv_cache_dtype)]
    _positive(num_kv_heads=num_kv_heads, tokens_per_page=tokens_per_page, head_dim=head_dim)
    if page < 0:
        raise KvforgeError(f"page must be >= 0, got {page}", "page")
    if not 0 <= num_tokens <= tokens_per_page:
        raise KvforgeError(f"num_tokens must be in 0..{tokens_per_page}, got {num_tokens}", "num_tokens")
    if head_dim * elem % 16:
        raise KvforgeError(f"rows of head_dim {head_dim} x {elem} bytes are not a multiple of 16 bytes", "head_dim")
    _grid_yz("num_kv_heads", 2 * num_kv_heads)
    vecs = tokens_per_page * head_dim * elem // 16
    grid = ((vecs + COPY_THREADS - 1) // COPY_THREADS, 2 * num_kv_heads, 1)
    return KernelLaunch(f"kvforge_copy_{direction}", grid, (COPY_THREADS, 1, 1), 0,
                        (page, num_kv_heads, tokens_per_page, head_dim, elem, num_tokens))


def float_bits(value: float) -> int:
    """The float32 bit pattern of `value` as a signed int32 (what the kernels' `scale_bits` expects)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _dtype(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise KvforgeError(f"the CUDA kernels store {' or '.join(KV_CACHE_DTYPES)}, not {kv_cache_dtype!r}",
                           "kv_cache_dtype")
    return kv_cache_dtype


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise KvforgeError(f"must be >= 1, got {value}", name)


def _page_geometry(head_dim: int, tokens_per_page: int) -> None:
    if head_dim < 2 or head_dim % 2:
        raise KvforgeError(f"head_dim must be even, got {head_dim}", "head_dim")
    if tokens_per_page < 1 or tokens_per_page & (tokens_per_page - 1):
        raise KvforgeError(f"tokens_per_page must be a power of two, got {tokens_per_page}", "tokens_per_page")


def _grid_yz(name: str, value: int) -> None:
    if value > MAX_GRID_YZ:
        raise KvforgeError(f"{value} exceeds the {MAX_GRID_YZ} blocks a grid's y/z dimension allows", name)


# --- numpy twins of common.cuh's E4M3 conversions (bit for bit), for hosts without ml_dtypes ---

def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 bytes exactly as f32_to_e4m3: round-to-nearest-even, NaN -> NaN, |x| >= 448 -> +-448.
    Equals ml_dtypes.float8_e4m3fn for |x| <= 464; ml_dtypes gives NaN above (it does not saturate)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    sign = (bits >> np.uint32(24)) & np.uint32(0x80)
    mag = bits & np.uint32(0x7FFFFFFF)
    small = np.where(mag < 0x3C800000, mag, np.uint32(0)).view(np.float32)
    subnormal = np.rint(small * np.float32(512.0)).astype(np.uint32)  # rint: round half to even, like cvt.rni
    rounded = mag + np.uint32(0x7FFFF) + ((mag >> np.uint32(20)) & np.uint32(1))
    normal = (rounded >> np.uint32(20)) - np.uint32(120 << 3)  # wraps for the masked-out lanes only
    out = np.where(mag > 0x7F800000, np.uint32(0x7F),
                   np.where(mag >= 0x43E00000, np.uint32(0x7E), np.where(mag < 0x3C800000, subnormal, normal)))
    return (out | sign).astype(np.uint8)


def e4m3_decode_table() -> np.ndarray:
    """float32 value of each of the 256 E4M3 bit patterns, built as e4m3_to_f32 does (0x7F/0xFF are NaN)."""
    byte = np.arange(256, dtype=np.uint32)
    em = byte & np.uint32(0x7F)
    mag = (em << np.uint32(20)).view(np.float32) * np.float32(2.0**120)
    mag[em == 0x7F] = np.nan
    return (mag.view(np.uint32) | ((byte & np.uint32(0x80)) << np.uint32(24))).view(np.float32)


def e4m3_decode(raw: np.ndarray) -> np.ndarray:
    return e4m3_decode_table()[np.asarray(raw, dtype=np.uint8)]

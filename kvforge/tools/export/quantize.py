"""Block-quantized linear weights for ONNX Runtime's MatMulNBits: from a GGUF file's own blocks, or quantized
by ONNX Runtime's weight-only quantizer.

MatMulNBits computes `A @ W` with W [K, N] stored per output column n as K / block_size blocks:
`packed` uint8 [N, blocks, block_size * bits / 8] (two 4-bit values per byte, element 2i in the low
nibble), `scales` float32 [N * blocks], optional `zero_points` (uint8, packed like the values; absent =
2^(bits-1)). A weight is W[k, n] = scale * (q - zero_point).

GGUF blocks that map exactly are copied, never rounded again: Q8_0 (d, 32 x int8) is 8-bit with zero
point 128; Q4_0 (d, 32 x 4-bit, low nibbles then high nibbles) is 4-bit with zero point 8. Q4_1 blocks hold
`d * q + m`: MatMulNBits takes float zero points only on a dequantizing CPU path measured 50x slower at
decode (2.7 ms vs 48 us for a 576x1536 layer), and quantizing the dequantized weights again (round(-m/d) as
an integer zero point) shifts every block by up to d/2, which cost SmolLM2 a quarter of its top-1 agreement.
So the blocks are kept with zero point z = round(-m/d) and the exact remainder r = m + d*z per block goes to
`offsets`: W = d * (q - z) + r, and x @ W = MatMulNBits(x) + blocksum(x) @ R, where blocksum sums x over
each block of K (a [K/32, N] float matmul, 1/8 of the 4-bit layer's bytes).

The symmetric int4 scheme (`--int4Scheme symmetric`) trades that exactness for a cheaper graph: every 4-bit weight
without an exact symmetric form (Q4_1 blocks, float checkpoints) is quantized again by ONNX Runtime's quantizer with
no zero points, and runs at accuracy level 4 (int8 activations), so no correction matmuls are left in the layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvforge.contract.engine_dir import ENGINE_MODEL_FILE
from kvforge.contract.errors import InvalidConfig, KvforgeError
from kvforge.contract.model_config import LM_HEADS, ModelConfig

if TYPE_CHECKING:
    import onnx

BITS = {"int8": 8, "int4": 4}
LM_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"
GGUF_BLOCK = 32  # Q4_0, Q4_1 and Q8_0 blocks hold 32 weights


@dataclass(frozen=True, slots=True)
class BlockQuantized:
    """A linear weight W [K = in, N = out] in MatMulNBits' layout."""

    bits: int
    block_size: int
    k: int
    n: int
    packed: np.ndarray  # uint8 [N, K / block_size, block_size * bits / 8]
    scales: np.ndarray  # float32 [N * K / block_size]
    zero_points: np.ndarray | None  # uint8 [N, ceil(blocks * bits / 8)] packed; None = symmetric
    offsets: np.ndarray | None = None  # float32 [K / block_size, N] added per block (Q4_1's exact remainder)
    accuracy_level: int | None = None  # MatMulNBits' accuracy_level; None = the family's default for `bits`

    def dequantize(self) -> np.ndarray:
        """W [K, N] float32, exactly as MatMulNBits reads it (the reference for tests and the embedding)."""
        blocks = self.k // self.block_size
        q = unpack(self.packed, self.bits).reshape(self.n, blocks, self.block_size).astype(np.float32)
        if self.zero_points is None:
            zero = np.full((self.n, blocks, 1), 2 ** (self.bits - 1), dtype=np.float32)
        else:
            zero = unpack(self.zero_points, self.bits)[:, :blocks].reshape(self.n, blocks, 1).astype(np.float32)
        w = (q - zero) * self.scales.reshape(self.n, blocks, 1)
        if self.offsets is not None:
            w = w + self.offsets.T.reshape(self.n, blocks, 1)
        return np.ascontiguousarray(w.reshape(self.n, self.k).T)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes → one uint8 value per element along the last axis (4-bit: low nibble first)."""
    if bits == 8:
        return packed
    low, high = packed & 0x0F, packed >> 4
    return np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


INT4_SCHEMES = ("asymmetric", "symmetric")
# What new int4 exports use (see the module docstring and docs/benchmarks.md "Symmetric int4").
DEFAULT_INT4_SCHEME = "asymmetric"
# Symmetric 4-bit blocks run with int8 activations: MLAS's fastest 4-bit kernel, and the form onnxruntime-genai's
# int4 models take.
SYMMETRIC_ACCURACY_LEVEL = 4


def quantize(weight_out_in: np.ndarray, bits: int, block_size: int, symmetric: bool = False) -> BlockQuantized:
    """Quantize a float Linear weight [out, in] with ONNX Runtime's own block quantizer, asymmetric (uint8 zero
    points) at both widths by default: its symmetric 8-bit mode clips each block's positive maximum by one step, a
    bias that flipped SmolLM2's first answer token. `symmetric` (4-bit only): no zero points (the implicit 8), at
    SYMMETRIC_ACCURACY_LEVEL."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    n, k = weight_out_in.shape
    check_block_size(block_size, k)
    if symmetric and bits != 4:
        raise InvalidConfig(f"symmetric blocks are 4-bit only, got {bits} bits", "--int4Scheme")
    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric, bits=bits)
    packed, scales, zero_points = DefaultWeightOnlyQuantizer(config).qbits_block_quant(
        np.ascontiguousarray(weight_out_in.T, dtype=np.float32))
    scales = np.ascontiguousarray(scales.reshape(-1), np.float32)
    if symmetric:  # the quantizer's zero points are all the implicit 2^(bits-1): MatMulNBits then takes none
        return BlockQuantized(bits, block_size, k, n, packed, scales, None, None, SYMMETRIC_ACCURACY_LEVEL)
    return BlockQuantized(bits, block_size, k, n, packed, scales, zero_points)


def check_block_size(block_size: int, k: int) -> None:
    if block_size < 16 or block_size & (block_size - 1):
        raise InvalidConfig(f"must be a power of two >= 16, got {block_size}", "quant_block_size")
    if k % block_size:
        raise InvalidConfig(f"{block_size} does not divide the input size {k} of a linear layer",
                            "quant_block_size")


def from_gguf_blocks(type_name: str, rows: np.ndarray, k: int) -> BlockQuantized | None:
    """The exact MatMulNBits form of a GGUF tensor's raw rows ([N, row bytes]); None when no exact form exists."""
    n = rows.shape[0]
    blocks = k // GGUF_BLOCK
    if type_name == "Q8_0":
        raw = rows.reshape(n, blocks, 34)
        scales = raw[..., :2].copy().view(np.float16).astype(np.float32).reshape(-1)
        q = raw[..., 2:].copy().view(np.int8)
        packed = (q.astype(np.int16) + 128).astype(np.uint8)
        return BlockQuantized(8, GGUF_BLOCK, k, n, np.ascontiguousarray(packed), scales, None)
    if type_name == "Q4_0":
        raw = rows.reshape(n, blocks, 18)
        scales = raw[..., :2].copy().view(np.float16).astype(np.float32).reshape(-1)
        nibbles = raw[..., 2:]
        values = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # GGUF: elements 0-15 low, 16-31 high
        packed = (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)  # MatMulNBits: pairs
        return BlockQuantized(4, GGUF_BLOCK, k, n, np.ascontiguousarray(packed), scales, None)
    if type_name == "Q4_1":
        raw = rows.reshape(n, blocks, 20)
        d = raw[..., :2].copy().view(np.float16).astype(np.float32)  # [N, blocks, 1]
        m = raw[..., 2:4].copy().view(np.float16).astype(np.float32)
        nibbles = raw[..., 4:]
        values = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
        packed = (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)
        safe = np.where(d == 0, 1.0, d)
        zero = np.where(d == 0, 0, np.clip(np.rint(-m / safe), 0, 15)).astype(np.uint8)[..., 0]  # [N, blocks]
        offsets = (m[..., 0] + d[..., 0] * zero.astype(np.float32)).T  # [blocks, N]
        zero_packed = _pack_nibbles(zero)
        return BlockQuantized(4, GGUF_BLOCK, k, n, np.ascontiguousarray(packed), d.reshape(-1), zero_packed,
                              np.ascontiguousarray(offsets, dtype=np.float32))
    return None


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """uint8 [N, blocks] of 4-bit values → MatMulNBits' packed zero points [N, ceil(blocks / 2)]."""
    if values.shape[1] % 2:
        values = np.concatenate([values, np.zeros((values.shape[0], 1), np.uint8)], axis=1)
    return np.ascontiguousarray(values[:, 0::2] | (values[:, 1::2] << 4), dtype=np.uint8)


def permute_rows(blocks: BlockQuantized, order: np.ndarray) -> BlockQuantized:
    """The same weight with its output columns (GGUF rows) reordered, e.g. to undo llama.cpp's Q/K permutation."""
    per_column = blocks.scales.reshape(blocks.n, -1)
    zero = None if blocks.zero_points is None else blocks.zero_points[order]
    offsets = None if blocks.offsets is None else np.ascontiguousarray(blocks.offsets[:, order])
    return BlockQuantized(blocks.bits, blocks.block_size, blocks.k, blocks.n, blocks.packed[order],
                          np.ascontiguousarray(per_column[order].reshape(-1)), zero, offsets, blocks.accuracy_level)


def concat_columns(parts: list[BlockQuantized | None]) -> BlockQuantized | None:
    """Weights of one input side by side (W = [W0 | W1 | ...], N summed); None unless every part is quantized
    alike (bits, block size, K, accuracy level). Missing zero points become the implicit 2^(bits-1) so parts can
    mix."""
    if any(p is None for p in parts):
        return None
    first = parts[0]
    if any((p.bits, p.block_size, p.k, p.accuracy_level) != (first.bits, first.block_size, first.k,
                                                              first.accuracy_level) for p in parts):
        return None
    zero_points = None
    if any(p.zero_points is not None for p in parts):
        blocks = first.k // first.block_size
        implicit = _pack_nibbles if first.bits == 4 else (lambda z: z)
        zero_points = np.concatenate([
            p.zero_points if p.zero_points is not None
            else implicit(np.full((p.n, blocks), 2 ** (first.bits - 1), dtype=np.uint8)) for p in parts])
    offsets = None
    if any(p.offsets is not None for p in parts):
        offsets = np.concatenate([p.offsets if p.offsets is not None
                                  else np.zeros((first.k // first.block_size, p.n), np.float32) for p in parts], axis=1)
    return BlockQuantized(first.bits, first.block_size, first.k, sum(p.n for p in parts),
                          np.concatenate([p.packed for p in parts]), np.concatenate([p.scales for p in parts]),
                          zero_points, offsets, first.accuracy_level)


def linear_weight_names(config: ModelConfig) -> list[str]:
    """Every Linear weight of the llama family, LM head included (tied models read it from the embedding)."""
    names = [f"model.layers.{i}.{module}.weight" for i in range(config.num_hidden_layers)
             for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    return [*names, LM_HEAD]


# The default head of a quantized export (measured on SmolLM2, README "The LM head"): 8-bit blocks at accuracy level
# 4 score the whole vocabulary in 0.63 ms a row (the float head: 2.4-3.7 ms, 113 MB read per step) and the 32 best
# are rescored exactly: top-1 equals the float head at all 2,119 measured positions, perplexity +0.03 %. 4-bit blocks
# are 0.2 ms faster but their approximate tail moves perplexity by +1.8 %.
DEFAULT_LM_HEAD, DEFAULT_LM_HEAD_CANDIDATES = "int8", 32


def resolve_lm_head(quantization: str, lm_head: str) -> str:
    """What `--lmHead auto` means: the float head for float32 exports, DEFAULT_LM_HEAD for quantized ones."""
    if lm_head == "auto":
        return "float" if quantization == "none" else DEFAULT_LM_HEAD
    if lm_head not in LM_HEADS:
        raise KvforgeError(f"must be auto or one of {', '.join(LM_HEADS)}, got {lm_head!r} (e.g. --lmHead int4)",
                           "--lmHead")
    if lm_head != "float" and quantization == "none":
        raise KvforgeError(f"a quantized head ({lm_head}) needs quantized layers (--quantization int4 or int8); "
                           "use --lmHead float with --quantization none", "--lmHead")
    return lm_head


def set_accuracy_level(engine_dir: Path, level: int) -> int:
    """Set every MatMulNBits node's accuracy_level in a built engine's model.onnx (graph only; the weights in
    the external data file are untouched); returns how many nodes changed. Benchmarks and tests compare
    int8 activations (level 4, the exported default) with float ones (level 0) this way."""
    import onnx

    path = engine_dir / ENGINE_MODEL_FILE
    model = onnx.load(path, load_external_data=False)
    patched = 0
    for node in _all_nodes(model.graph):
        if node.op_type == "MatMulNBits":
            for attribute in node.attribute:
                if attribute.name == "accuracy_level":
                    attribute.i = level
                    patched += 1
    from kvforge.contract.files import atomic_write_bytes
    from kvforge.contract.manifest import ENGINE_KIND, write_manifest

    atomic_write_bytes(path, model.SerializeToString())
    write_manifest(engine_dir, ENGINE_KIND)  # a deliberate edit: record it so the engine still loads
    return patched


def _all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node, those inside If branches (--prefillInt8Rows) included."""
    import onnx

    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attribute.g)

"""Rewrites the exported 4- and 8-bit block matmuls into kvforge's CPU kernel op, whose rows do not depend on the row
count.

The export's reference form of a GGUF Q4_1 weight is ONNX Runtime's MatMulNBits plus an exact-remainder correction
(kvforge/tools/export/quantize.py): `Add(MatMulNBits(x, q, scales, zero_points), MatMul(MatMul(x, block_sum),
offsets))`. On engines that attend with the CPU kernel (the library is loaded anyway), each such group, and each 4-bit
MatMulNBits without one (Q4_0, ONNX Runtime's own asymmetric blocks), becomes one `kvforge.cpu.MatMulBlocks` over the
same values and scales and their mins, weight = scale * q + min with min = remainder - scale * zero_point (zero point
2^(bits - 1) when absent, computed in float64 once here), packed as the kernel streams them (`pack_blocks`). Why
(measured in docs/benchmark-log.md): three nodes fewer per matmul, a cheaper decode call, and a verification call of
k + 1 rows that gives each row exactly the decode call's logits (kvforge/plugins/cpu/matmul_blocks.cc).

The 8-bit LM head (Q8_0, exported at accuracy level 4) is taken too, with float activations: ONNX Runtime prepacks
a level-4 weight into a second copy at load (SmolLM2 holds 16 MiB less without it) and rounds its one-row and
many-row calls differently; the kernel reads the blocks in place and gives a verification row its decode row's
logits. A 4-bit level-4 weight (`--int4Scheme symmetric`) keeps ONNX Runtime's int8 arithmetic, which is what its
export chose. Nodes inside If branches (`--prefillInt8Rows`) are left as they are.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kvforge.builder.graph_edit import GraphIndex, drop_unread_initializers, int_attribute, splice
from kvforge.plugins.ops import CPU_DOMAIN

MATMUL_BLOCKS = "MatMulBlocks"
BLOCK = 32  # the kernel's block: GGUF's Q4_0 / Q4_1


def lower_block_matmuls(model: onnx.ModelProto, prefill_bf16: bool = False, bits: tuple[int, ...] = (4, 8)) -> int:
    """Every eligible MatMulNBits of `bits` (with its correction, if any) -> MatMulBlocks, in place; returns how
    many. `prefill_bf16`: the 4-bit nodes' calls of more than 16 rows run in bfloat16 where the CPU has
    AVX512_BF16."""
    graph = model.graph
    index = GraphIndex.of(graph)
    initializers = index.initializers
    replaced: dict[int, onnx.NodeProto] = {}
    removed: set[int] = set()
    new_initializers: list[onnx.TensorProto] = []
    wanted = bits
    for node in graph.node:
        if not _eligible(node, initializers) or int_attribute(node, "bits") not in wanted:
            continue
        bits = int_attribute(node, "bits")
        correction = _correction(node, index) if bits == 4 else None
        k, n = int_attribute(node, "K"), int_attribute(node, "N")
        scales = numpy_helper.to_array(initializers[node.input[2]]).astype(np.float64).reshape(n, k // BLOCK)
        zero_points = _zero_points(initializers, node, n, k // BLOCK, bits)
        remainder = np.zeros_like(scales)
        output = node.output[0]
        if correction is not None:
            add, offsets_name, dropped = correction
            remainder = numpy_helper.to_array(initializers[offsets_name]).astype(np.float64).T
            output = add.output[0]
            removed.update(id(d) for d in dropped)
            removed.add(id(add))
        blocks_name = f"{node.input[1]}.blocks"
        if bits == 4:
            packed = numpy_helper.to_array(initializers[node.input[1]]).reshape(n, k // BLOCK, BLOCK // 2)
            values = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n, k // BLOCK, BLOCK)
        else:
            values = numpy_helper.to_array(initializers[node.input[1]]).reshape(n, k // BLOCK, BLOCK)
        new_initializers.append(numpy_helper.from_array(
            pack_blocks(values, scales.astype(np.float32), (remainder - scales * zero_points).astype(np.float32),
                        bits), blocks_name))
        fused = helper.make_node(MATMUL_BLOCKS, [node.input[0], blocks_name], [output],
                                 name=f"blocks/{node.name or output}", domain=CPU_DOMAIN, K=k, N=n, bits=bits)
        if prefill_bf16 and bits == 4:
            fused.attribute.append(helper.make_attribute("bf16", 1))
        # At the correction's Add (or the MatMulNBits itself): every input exists there and every reader comes later.
        replaced[id(correction[0] if correction else node)] = fused
        if correction is not None:
            removed.add(id(node))
    if not replaced:
        return 0
    splice(graph, replaced, removed)
    graph.initializer.extend(new_initializers)
    drop_unread_initializers(graph)  # zero points, offsets and block-sum matrices
    if all(op.domain != CPU_DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(CPU_DOMAIN, 1))
    return len(replaced)


def run_on_mlas(model: onnx.ModelProto) -> int:
    """The 4-bit block matmuls the kernel would take, left to MLAS in its form whose rows do not depend on the row
    count: accuracy level 4 (int8 activations per block; MLAS's float32 path rounds a one-row call and a many-row call
    differently, so a verification row would not be its decode row). Returns how many; the 8-bit head is
    MatMulBlocks' (lower_block_matmuls(bits=(8,))), whose rows are exact at any row count."""
    initializers = GraphIndex.of(model.graph).initializers
    moved = 0
    for node in model.graph.node:
        if _eligible(node, initializers) and int_attribute(node, "bits") == 4:
            kept = [a for a in node.attribute if a.name != "accuracy_level"]  # none, or 0 (_eligible)
            del node.attribute[:]
            node.attribute.extend([*kept, helper.make_attribute("accuracy_level", 4)])
            moved += 1
    return moved


def has_q4_1_corrections(model: onnx.ModelProto) -> bool | None:
    """Whether the graph's 4-bit block matmuls carry the export's Q4_1 correction (True), are plain MatMulNBits
    (False), or there are none the kernel would take (None): which of MLAS's measured forms an engine would run."""
    index = GraphIndex.of(model.graph)
    forms = {_correction(node, index) is not None for node in model.graph.node
             if _eligible(node, index.initializers) and int_attribute(node, "bits") == 4}
    return None if not forms else True in forms


def pack_blocks(values: np.ndarray, scales: np.ndarray, mins: np.ndarray, bits: int = 4) -> np.ndarray:
    """MatMulBlocks' weight from the values [N, K/32, 32] (uint8, 0..15 for 4 bits) and float32 scales and mins
    [N, K/32]. 4 bits: uint8 [N, K/32, 24], per block 16 bytes (byte j: element j in the low nibble, element j + 16
    in the high one); 8 bits: [N, K/32, 40], the 32 values as bytes. Then the scale and the min as float32
    (little-endian, as the kernel reads them)."""
    n, blocks, _ = values.shape
    stored = (values[..., :16] | (values[..., 16:] << 4)) if bits == 4 else values
    stored = stored.astype(np.uint8)
    floats = np.stack([scales, mins], axis=-1).astype("<f4").reshape(n, blocks, 2).view(np.uint8)
    return np.ascontiguousarray(np.concatenate([stored, floats], axis=-1))


def _eligible(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> bool:
    if node.op_type != "MatMulNBits" or len(node.input) < 3 or len(node.input) > 4:
        return False
    bits = int_attribute(node, "bits")
    if int_attribute(node, "block_size") != BLOCK or bits not in (4, 8):
        return False
    if bits == 4 and int_attribute(node, "accuracy_level", 0) != 0:
        return False
    k = int_attribute(node, "K")
    return k % BLOCK == 0 and all(name in initializers for name in node.input[1:])


def _zero_points(initializers: dict[str, onnx.TensorProto], node: onnx.NodeProto, n: int, blocks: int,
                 bits: int) -> np.ndarray:
    """[N, blocks] float64 zero points: MatMulNBits' uint8 ones (4 bits: packed, even block in the low nibble),
    else its default 2^(bits - 1)."""
    if len(node.input) < 4 or not node.input[3]:
        return np.full((n, blocks), float(2 ** (bits - 1)))
    packed = numpy_helper.to_array(initializers[node.input[3]]).reshape(n, -1)
    if bits == 8:
        return packed[:, :blocks].astype(np.float64)
    values = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    return values.astype(np.float64)


def _correction(node: onnx.NodeProto, index: GraphIndex) -> tuple[onnx.NodeProto, str, list[onnx.NodeProto]] | None:
    """For y = MatMulNBits(x) read only by Add(y, MatMul(MatMul(x, block_sum), offsets)): (the Add, the offsets
    initializer, the two MatMuls when nothing else reads them, else only the offsets one); None otherwise."""
    producers, consumers, initializers = index.producers, index.consumers, index.initializers
    graph_outputs = index.outputs
    y, x = node.output[0], node.input[0]
    readers = consumers.get(y, [])
    if y in graph_outputs or len(readers) != 1 or readers[0].op_type != "Add":
        return None
    add = readers[0]
    other = add.input[1] if add.input[0] == y else add.input[0]
    offsets_matmul = producers.get(other)
    if offsets_matmul is None or offsets_matmul.op_type != "MatMul" or offsets_matmul.input[1] not in initializers:
        return None
    sums = producers.get(offsets_matmul.input[0])
    if sums is None or sums.op_type != "MatMul" or sums.input[0] != x or sums.input[1] not in initializers:
        return None
    k, n = int_attribute(node, "K"), int_attribute(node, "N")
    offsets = initializers[offsets_matmul.input[1]]
    if tuple(offsets.dims) != (k // BLOCK, n) or len(consumers.get(other, [])) != 1 or other in graph_outputs:
        return None
    dropped = [offsets_matmul]
    if len(consumers.get(sums.output[0], [])) == 1 and sums.output[0] not in graph_outputs:
        dropped.append(sums)
    return add, offsets_matmul.input[1], dropped

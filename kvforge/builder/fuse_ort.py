"""Rewrites a lowered graph into ONNX Runtime's fused contrib ops where ONNX Runtime's own optimizer leaves them apart.

The exported graph stays the readable reference form (Add, then the Pow/ReduceMean/Sqrt/Div/Mul RMSNorm); only the
engine's copy is rewritten. ONNX Runtime fuses each RMSNorm into SimplifiedLayerNormalization itself, but not the
residual Add before it, because that sum also feeds the next residual: SkipSimplifiedLayerNormalization returns the
sum as its fourth output, so one node does both.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kvforge.builder.graph_edit import GraphIndex, int_attribute, splice

ORT_DOMAIN = "com.microsoft"
SKIP_RMS_NORM = "SkipSimplifiedLayerNormalization"


def fuse_for_onnxruntime(model: onnx.ModelProto) -> int:
    """Residual Add + RMSNorm -> SkipSimplifiedLayerNormalization, in place; returns how many were fused."""
    graph = model.graph
    index = GraphIndex.of(graph)
    replaced: dict[int, onnx.NodeProto] = {}  # id(residual Add) -> the fused node taking its place
    removed: set[int] = set()
    for node in graph.node:
        match = _rms_norm_after_add(node, index)
        if match is None:
            continue
        residual, norm_nodes, eps = match
        fused = helper.make_node(SKIP_RMS_NORM, [residual.input[0], residual.input[1], node.input[1]],
                                 [node.output[0], "", "", residual.output[0]], name=f"fused/{node.name}",
                                 domain=ORT_DOMAIN, epsilon=eps)
        # At the Add's place: its operands and the weight exist there, and every reader of the sum or the norm
        # comes later, so the order stays topological.
        replaced[id(residual)] = fused
        removed.update(id(n) for n in (*norm_nodes, node))
    if not replaced:
        return 0
    splice(graph, replaced, removed)
    if all(op.domain != ORT_DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(ORT_DOMAIN, 1))
    return len(replaced)


def _rms_norm_after_add(scale: onnx.NodeProto,
                        index: GraphIndex) -> tuple[onnx.NodeProto, list[onnx.NodeProto], float] | None:
    """For `scale` = Mul(Div(x, Sqrt(Add(ReduceMean(Pow(x, 2), [-1]), eps))), w) with x = Add(a, b) of two
    activations and w a 1-D initializer: (the residual Add, the norm's other nodes, eps); else None."""
    producers, consumers, initializers, graph_outputs = index.producers, index.consumers, index.initializers, \
        index.outputs
    if scale.op_type != "Mul" or scale.domain or len(scale.input) != 2:
        return None
    weight = initializers.get(scale.input[1])
    div = producers.get(scale.input[0])
    if weight is None or len(weight.dims) != 1 or div is None or div.op_type != "Div":
        return None
    x = div.input[0]
    sqrt = producers.get(div.input[1])
    add_eps = producers.get(sqrt.input[0]) if sqrt is not None and sqrt.op_type == "Sqrt" else None
    mean = producers.get(add_eps.input[0]) if add_eps is not None and add_eps.op_type == "Add" else None
    if mean is None or mean.op_type != "ReduceMean" or add_eps.input[1] not in initializers:
        return None
    power = producers.get(mean.input[0])
    if power is None or power.op_type != "Pow" or power.input[0] != x:
        return None
    if not _is_value(initializers, power.input[1], 2.0):
        return None
    if len(mean.input) < 2 or not _is_value(initializers, mean.input[1], -1) or int_attribute(mean, "keepdims", 1) != 1:
        return None
    residual = producers.get(x)
    if residual is None or residual.op_type != "Add" or residual.domain:
        return None
    if any(name in initializers for name in residual.input):
        return None  # a bias, not a residual: leave it
    norm_nodes = [power, mean, add_eps, sqrt, div]
    inside = {id(n) for n in [*norm_nodes, scale]}
    for node in norm_nodes:  # the norm's intermediates feed nothing else
        if node.output[0] in graph_outputs or any(id(c) not in inside for c in consumers[node.output[0]]):
            return None
    eps = float(numpy_helper.to_array(initializers[add_eps.input[1]]).reshape(-1)[0])
    return residual, norm_nodes, eps


def _is_value(initializers: dict[str, onnx.TensorProto], name: str, value: float) -> bool:
    tensor = initializers.get(name)
    if tensor is None:
        return False
    array = numpy_helper.to_array(tensor)
    return array.size == 1 and bool(np.isclose(float(array.reshape(-1)[0]), value))

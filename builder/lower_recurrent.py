"""Lowers the recurrent custom ops (plugins/recurrent.py) to standard ONNX ops so ONNX Runtime runs them.

The conv is one grouped Conv over [carried state | new inputs]; the new conv state is gathered at each
row's own length. The selective scan is an ONNX Scan over the sequence axis carrying the [B,H,P,N] state:
everything that does not depend on the state (softplus, decay, dt * x, group-to-head broadcast) is computed
for all positions before the loop, and padded positions get decay 1 and input 0, so the carried state
stops at each row's last real token without a branch in the loop body. The gated delta rule is lowered the
same way (padding gets decay 1 and beta 0, which leaves the state as it was).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from kvforge.graph.onnx_graph import FLOAT, INT64, GraphWriter, value_info
from kvforge.plugins import ops, recurrent


def _attr(node: onnx.NodeProto, name: str) -> int:
    return next(int(a.i) for a in node.attribute if a.name == name)


def lower_recurrent_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """Replace every kvforge CausalConv1dWithState / SelectiveScan / GatedDeltaRule node in place (other nodes
    untouched)."""
    g = GraphWriter(prefix="recurrent/")
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        start = len(g.nodes)
        if node.domain == ops.DOMAIN and node.op_type == recurrent.CAUSAL_CONV.name:
            lower_causal_conv(g, node)
        elif node.domain == ops.DOMAIN and node.op_type == recurrent.SELECTIVE_SCAN.name:
            lower_selective_scan(g, node)
        elif node.domain == ops.DOMAIN and node.op_type == recurrent.GATED_DELTA_RULE.name:
            lower_gated_delta_rule(g, node)
        else:
            nodes.append(node)
            continue
        nodes.extend(g.nodes[start:])
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(g.initializers)
    return model


def _valid(g: GraphWriter, like: str, context_lengths: str) -> str:
    """[B,S] bool: position t of row b is a real token (t < context_lengths[b])."""
    positions = g.op("Range", [g.const(0), g.op("Squeeze", [g.dim(like, 1), g.const([0])]), g.const(1)])
    lengths = g.unsqueeze(g.cast(context_lengths, INT64), [1])
    return g.op("Less", [g.unsqueeze(positions, [0]), lengths])


def lower_causal_conv(g: GraphWriter, node: onnx.NodeProto) -> None:
    x, weight, bias, context_lengths, conv_state = node.input
    y_out, state_out = node.output
    kernel = _attr(node, "kernel_size")
    window = g.op("Concat", [conv_state, g.transpose(x, [0, 2, 1])], axis=2)  # [B, C, K-1+S]
    # Depthwise conv as K shifted slices (K is 4 in Mamba2): no Conv `group` attribute, which would need the
    # channel count at lowering time.
    seq = g.dim(x, 1)
    conv = g.unsqueeze(bias, [1])
    for k in range(kernel):
        shifted = g.op("Slice", [window, g.const([k]), g.add(seq, g.const([k])), g.const([2])])
        tap = g.unsqueeze(g.op("Gather", [weight, g.const(k)], axis=1), [1])  # [C, 1]
        conv = g.add(conv, g.mul(shifted, tap))
    activated = g.mul(conv, g.op("Sigmoid", [conv]))
    valid = g.cast(g.unsqueeze(_valid(g, x, context_lengths), [2]), FLOAT)  # [B, S, 1]
    g.op("Mul", [g.transpose(activated, [0, 2, 1]), valid], outputs=[y_out])
    # The state after a row's last real token: window columns [len, len + K - 1).
    offsets = g.add(g.unsqueeze(g.cast(context_lengths, INT64), [1]), g.const([list(range(kernel - 1))]))
    index = g.op("Expand", [g.unsqueeze(offsets, [1]), g.op("Shape", [conv_state])])  # [B, C, K-1]
    g.op("GatherElements", [window, index], outputs=[state_out], axis=2)


def lower_selective_scan(g: GraphWriter, node: onnx.NodeProto) -> None:
    x, dt, b, c, a_log, d, dt_bias, context_lengths, state = node.input
    y_out, state_out = node.output
    heads, head_dim = _attr(node, "num_heads"), _attr(node, "head_dim")
    groups, size = _attr(node, "n_groups"), _attr(node, "state_size")
    valid = _valid(g, x, context_lengths)  # [B, S]
    step = g.op("Softplus", [g.add(dt, dt_bias)])  # [B, S, H]
    decay = g.op("Exp", [g.mul(step, g.op("Neg", [g.op("Exp", [a_log])]))])
    decay = g.op("Where", [g.unsqueeze(valid, [2]), decay, g.const(1.0, np.float32)])  # padding keeps the state
    xh = g.reshape(x, [0, 0, heads, head_dim])
    mask = g.cast(valid, FLOAT)
    drive = g.mul(g.mul(xh, g.unsqueeze(step, [3])), g.unsqueeze(mask, [2, 3]))  # dt * x, 0 on padding

    def per_head(t: str) -> str:  # [B, S, G*N] -> [B, S, H, N]: head h reads group h // (H / G)
        grouped = g.reshape(t, [0, 0, groups, 1, size])
        spread = g.op("Expand", [grouped, g.const([1, 1, 1, heads // groups, 1])])
        return g.reshape(spread, [0, 0, heads, size])

    body = GraphWriter(prefix="recurrent/scan/")
    h, decay_t, drive_t, b_t, c_t = (body.fresh(n) for n in ("h", "decay", "drive", "b", "c"))
    h_next = body.add(body.mul(h, body.unsqueeze(decay_t, [2, 3])),
                      body.mul(body.unsqueeze(drive_t, [3]), body.unsqueeze(b_t, [2])))
    y_t = body.op("ReduceSum", [body.mul(h_next, body.unsqueeze(c_t, [2])), body.const([3])], keepdims=0)
    h_out = body.op("Identity", [h_next])
    scan_body = helper.make_graph(
        body.nodes, "selective_scan_step",
        [value_info(h, FLOAT, ["B", heads, head_dim, size]), value_info(decay_t, FLOAT, ["B", heads]),
         value_info(drive_t, FLOAT, ["B", heads, head_dim]), value_info(b_t, FLOAT, ["B", heads, size]),
         value_info(c_t, FLOAT, ["B", heads, size])],
        [value_info(h_out, FLOAT, ["B", heads, head_dim, size]), value_info(y_t, FLOAT, ["B", heads, head_dim])],
        initializer=body.initializers)
    final, ys = g.op("Scan", [state, decay, drive, per_head(b), per_head(c)], n_out=2, body=scan_body,
                     num_scan_inputs=4, scan_input_axes=[1, 1, 1, 1], scan_output_axes=[1])
    g.op("Identity", [final], outputs=[state_out])
    skip = g.mul(xh, g.unsqueeze(d, [1]))
    y = g.mul(g.add(ys, skip), g.unsqueeze(mask, [2, 3]))
    g.op("Reshape", [y, g.const([0, 0, heads * head_dim])], outputs=[y_out])


def lower_gated_delta_rule(g: GraphWriter, node: onnx.NodeProto) -> None:
    q, k, v, log_decay, beta, context_lengths, state = node.input
    y_out, state_out = node.output
    k_heads, v_heads = _attr(node, "num_k_heads"), _attr(node, "num_v_heads")
    k_dim, v_dim = _attr(node, "k_head_dim"), _attr(node, "v_head_dim")
    valid = g.unsqueeze(_valid(g, q, context_lengths), [2])  # [B, S, 1]
    decay = g.op("Where", [valid, g.op("Exp", [log_decay]), g.const(1.0, np.float32)])  # padding keeps the state
    gain = g.op("Where", [valid, beta, g.const(0.0, np.float32)])  # ... and writes nothing into it

    def per_value_head(t: str) -> str:  # [B, S, Hk*Dk] -> [B, S, Hv, Dk]: value head h reads key head h // (Hv/Hk)
        grouped = g.reshape(t, [0, 0, k_heads, 1, k_dim])
        spread = g.op("Expand", [grouped, g.const([1, 1, 1, v_heads // k_heads, 1])])
        return g.reshape(spread, [0, 0, v_heads, k_dim])

    body = GraphWriter(prefix="recurrent/delta/")
    s, decay_t, q_t, k_t, v_t, beta_t = (body.fresh(n) for n in ("s", "decay", "q", "k", "v", "beta"))
    decayed = body.mul(s, body.unsqueeze(decay_t, [2, 3]))  # [B, H, Dv, Dk]
    recalled = body.op("Squeeze", [body.matmul(decayed, body.unsqueeze(k_t, [3])), body.const([3])])  # S k: [B,H,Dv]
    delta = body.mul(body.op("Sub", [v_t, recalled]), body.unsqueeze(beta_t, [2]))
    s_next = body.add(decayed, body.mul(body.unsqueeze(delta, [3]), body.unsqueeze(k_t, [2])))
    y_t = body.op("Squeeze", [body.matmul(s_next, body.unsqueeze(q_t, [3])), body.const([3])])
    s_out = body.op("Identity", [s_next])
    step = helper.make_graph(
        body.nodes, "gated_delta_step",
        [value_info(s, FLOAT, ["B", v_heads, v_dim, k_dim]), value_info(decay_t, FLOAT, ["B", v_heads]),
         value_info(q_t, FLOAT, ["B", v_heads, k_dim]), value_info(k_t, FLOAT, ["B", v_heads, k_dim]),
         value_info(v_t, FLOAT, ["B", v_heads, v_dim]), value_info(beta_t, FLOAT, ["B", v_heads])],
        [value_info(s_out, FLOAT, ["B", v_heads, v_dim, k_dim]), value_info(y_t, FLOAT, ["B", v_heads, v_dim])],
        initializer=body.initializers)
    final, ys = g.op("Scan", [state, decay, per_value_head(q), per_value_head(k),
                              g.reshape(v, [0, 0, v_heads, v_dim]), gain],
                     n_out=2, body=step, num_scan_inputs=5, scan_input_axes=[1] * 5, scan_output_axes=[1])
    g.op("Identity", [final], outputs=[state_out])
    masked = g.mul(ys, g.unsqueeze(g.cast(valid, FLOAT), [3]))  # [B, S, Hv, Dv], 0 on padding
    g.op("Reshape", [masked, g.const([0, 0, v_heads * v_dim])], outputs=[y_out])

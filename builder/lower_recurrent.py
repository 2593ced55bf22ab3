"""Lowers the recurrent custom ops (plugins/recurrent.py) to standard ONNX ops so ONNX Runtime runs them.

The conv is one grouped Conv over [carried state | new inputs]; the new conv state is gathered at each
row's own length. The selective scan has two exact forms, picked per call by an ONNX `If` on its length:

- up to QUADRATIC_MAX_TOKENS new tokens (every decode step and the engine's 512-token prefill chunks), the
  state-space dual form: with a[t] the running sum of log-decays, y = (L ∘ C·Bᵀ)·(dt·x) + exp(a)·(C·h0) and
  h = exp(a[S])·h0 + (w·dt·x)ᵀ·B, L[t,s] = exp(a[t] − a[s]) for s ≤ t, w[s] = exp(a[S] − a[s]): a few
  batched matmuls instead of one tiny loop step per token (what made Mamba2 prefill slow);
- longer calls, an ONNX Scan over the sequence axis carrying the [B,H,P,N] state (memory linear in the
  length, where the dual form's [H, S, S] matrices grow with its square).

Everything that does not depend on the state (softplus, decay, dt * x, group-to-head broadcast) is computed
for all positions first, and padded positions get decay 1 and input 0, so the carried state stops at each
row's last real token without a branch.
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
    """Replace every kvforge CausalConv1dWithState / SelectiveScan node in place (other nodes untouched)."""
    g = GraphWriter(prefix="recurrent/")
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        start = len(g.nodes)
        if node.domain == ops.DOMAIN and node.op_type == recurrent.CAUSAL_CONV.name:
            lower_causal_conv(g, node)
        elif node.domain == ops.DOMAIN and node.op_type == recurrent.SELECTIVE_SCAN.name:
            lower_selective_scan(g, node)
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


QUADRATIC_MAX_TOKENS = 1024  # the dual form's [B, H, S, S] temporaries: 24 heads x 1024^2 x 4 B = 100 MB


def lower_selective_scan(g: GraphWriter, node: onnx.NodeProto) -> None:
    x, dt, b, c, a_log, d, dt_bias, context_lengths, state = node.input
    y_out, state_out = node.output
    heads, head_dim = _attr(node, "num_heads"), _attr(node, "head_dim")
    groups, size = _attr(node, "n_groups"), _attr(node, "state_size")
    valid = _valid(g, x, context_lengths)  # [B, S]
    step = g.op("Softplus", [g.add(dt, dt_bias)])  # [B, S, H]
    log_decay = g.mul(step, g.op("Neg", [g.op("Exp", [a_log])]))
    log_decay = g.op("Where", [g.unsqueeze(valid, [2]), log_decay, g.const(0.0, np.float32)])  # padding keeps h
    xh = g.reshape(x, [0, 0, heads, head_dim])
    mask = g.cast(valid, FLOAT)
    drive = g.mul(g.mul(xh, g.unsqueeze(step, [3])), g.unsqueeze(mask, [2, 3]))  # dt * x, 0 on padding

    def per_head(t: str) -> str:  # [B, S, G*N] -> [B, S, H, N]: head h reads group h // (H / G)
        grouped = g.reshape(t, [0, 0, groups, 1, size])
        spread = g.op("Expand", [grouped, g.const([1, 1, 1, heads // groups, 1])])
        return g.reshape(spread, [0, 0, heads, size])

    b_heads, c_heads = per_head(b), per_head(c)
    groups_bc = (g.reshape(b, [0, 0, groups, size]), g.reshape(c, [0, 0, groups, size]), groups)
    outputs = [value_info(f"{y_out}/ys", FLOAT, ["B", "S", heads, head_dim]),
               value_info(f"{y_out}/state", FLOAT, ["B", heads, head_dim, size])]
    branches = []
    for form in (_dual_form, _scan_form):
        branch = GraphWriter(prefix=f"{y_out}/{form.__name__}/")
        ys, final = form(branch, state, log_decay, drive, b_heads, c_heads, groups_bc, heads, head_dim, size)
        branch.op("Identity", [ys], outputs=[f"{y_out}/{form.__name__}/ys"])
        branch.op("Identity", [final], outputs=[f"{y_out}/{form.__name__}/state"])
        branches.append(helper.make_graph(branch.nodes, form.__name__, [], [
            value_info(f"{y_out}/{form.__name__}/ys", FLOAT, ["B", "S", heads, head_dim]),
            value_info(f"{y_out}/{form.__name__}/state", FLOAT, ["B", heads, head_dim, size])],
            initializer=branch.initializers))
    short = g.op("LessOrEqual", [g.op("Squeeze", [g.dim(x, 1), g.const([0])]), g.const(QUADRATIC_MAX_TOKENS)])
    ys, final = g.op("If", [short], outputs=[o.name for o in outputs], then_branch=branches[0],
                     else_branch=branches[1])
    g.op("Identity", [final], outputs=[state_out])
    skip = g.mul(xh, g.unsqueeze(d, [1]))
    y = g.mul(g.add(ys, skip), g.unsqueeze(mask, [2, 3]))
    g.op("Reshape", [y, g.const([0, 0, heads * head_dim])], outputs=[y_out])


def _dual_form(g: GraphWriter, state: str, log_decay: str, drive: str, b: str, c: str,
               groups_bc: tuple[str, str, int], heads: int, head_dim: int, size: int) -> tuple[str, str]:
    """The whole call as masked matmuls per head (the state-space dual form); returns ys [B,S,H,P] and h."""
    cumulative = g.transpose(g.op("CumSum", [log_decay, g.const(1)]), [0, 2, 1])  # a [B, H, S]
    gaps = g.op("Sub", [g.unsqueeze(cumulative, [3]), g.unsqueeze(cumulative, [2])])  # a[t] - a[s] [B, H, S, S]
    seq = g.dim(log_decay, 1)
    ones = g.op("ConstantOfShape", [g.op("Concat", [seq, seq], axis=0)], value=helper.make_tensor(
        "one", FLOAT, [1], [1.0]))
    causal = g.cast(g.op("Trilu", [ones], upper=0), onnx.TensorProto.BOOL)  # s <= t
    # Masked before the exponential: a[t] - a[s] > 0 above the diagonal would overflow.
    weights = g.op("Exp", [g.op("Where", [causal, gaps, g.const(-np.inf, np.float32)])])
    b_h, c_h = g.transpose(b, [0, 2, 1, 3]), g.transpose(c, [0, 2, 1, 3])  # [B, H, S, N]
    drive_h = g.transpose(drive, [0, 2, 1, 3])  # [B, H, S, P]
    # C·Bᵀ once per group (heads of a group share B and C), broadcast over the group's heads.
    b_g, c_g, groups = groups_bc
    per_group = g.matmul(g.transpose(c_g, [0, 2, 1, 3]), g.transpose(b_g, [0, 2, 3, 1]))  # [B, G, S, S]
    per_head_weights = g.op("Reshape", [weights, g.op("Concat", [g.const([0, groups, heads // groups]),
                                                                  g.dim(weights, 2), g.dim(weights, 3)], axis=0)])
    grouped_scores = g.mul(per_head_weights, g.unsqueeze(per_group, [2]))  # [B, G, H/G, S, S]
    scores = g.op("Reshape", [grouped_scores, g.op("Concat", [g.dim(weights, 0), g.const([heads]), g.dim(weights, 2),
                                                              g.dim(weights, 3)], axis=0)])  # [B, H, S, S]
    from_state = g.mul(g.matmul(c_h, g.transpose(state, [0, 1, 3, 2])),  # C·h0 [B, H, S, P]
                       g.unsqueeze(g.op("Exp", [cumulative]), [3]))
    ys = g.transpose(g.add(g.matmul(scores, drive_h), from_state), [0, 2, 1, 3])  # [B, S, H, P]
    last = g.op("Gather", [cumulative, g.op("Sub", [g.op("Squeeze", [seq, g.const([0])]), g.const(1)])], axis=2)
    tail = g.op("Exp", [g.op("Sub", [g.unsqueeze(last, [2]), cumulative])])  # w[s] = exp(a[S] - a[s]) [B, H, S]
    gathered = g.matmul(g.transpose(g.mul(drive_h, g.unsqueeze(tail, [3])), [0, 1, 3, 2]), b_h)  # [B, H, P, N]
    final = g.add(g.mul(state, g.unsqueeze(g.op("Exp", [last]), [2, 3])), gathered)
    return ys, final


def _scan_form(g: GraphWriter, state: str, log_decay: str, drive: str, b: str, c: str,
               groups_bc: tuple[str, str, int], heads: int, head_dim: int, size: int) -> tuple[str, str]:
    """One ONNX Scan step per token carrying h; returns ys [B,S,H,P] and the final h."""
    decay = g.op("Exp", [log_decay])
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
    final, ys = g.op("Scan", [state, decay, drive, b, c], n_out=2, body=scan_body,
                     num_scan_inputs=4, scan_input_axes=[1, 1, 1, 1], scan_output_axes=[1])
    return ys, final

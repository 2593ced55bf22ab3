"""Lowers the recurrent custom ops (kvforge/plugins/recurrent.py) to standard ONNX ops so ONNX Runtime runs them.

The conv is one grouped Conv over [carried state | new inputs]; the new conv state is gathered at each
row's own length. The selective scan is an ONNX Scan over the sequence axis carrying the [B,H,P,N] state:
everything that does not depend on the state (softplus, decay, dt * x, group-to-head broadcast) is computed
for all positions before the loop, and padded positions get decay 1 and input 0, so the carried state
stops at each row's last real token without a branch in the loop body. The gated delta rule is lowered the
same way (padding gets decay 1 and beta 0, which leaves the state as it was).

Both recurrences also have a chunked form for prefill (an If on the call's length picks it): the sequence is cut
into chunks whose intra-chunk part is batched matrix products for all chunks at once, and a Scan over chunks, not
tokens, carries the state (experiments/kernels/recurrent_prefill.py measures the two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from kvforge.builder.graph_edit import int_attribute
from kvforge.graph.onnx_graph import FLOAT, INT64, GraphWriter, value_info
from kvforge.plugins import ops, recurrent

# Tokens per chunk of the chunked prefill forms (0 = per-token Scans only); the delta rule's is a power of two (its
# triangular inverse doubles blocks).
DELTA_CHUNK = 64
SCAN_CHUNK = 64


def lower_recurrent_ops(model: onnx.ModelProto, delta_chunk: int = DELTA_CHUNK,
                        scan_chunk: int = SCAN_CHUNK) -> onnx.ModelProto:
    """Replace every kvforge CausalConv1dWithState / SelectiveScan / GatedDeltaRule node in place (other nodes
    untouched)."""
    g = GraphWriter(prefix="recurrent/")
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        start = len(g.nodes)
        if node.domain == ops.DOMAIN and node.op_type == recurrent.CAUSAL_CONV.name:
            lower_causal_conv(g, node)
        elif node.domain == ops.DOMAIN and node.op_type == recurrent.SELECTIVE_SCAN.name:
            lower_selective_scan(g, node, scan_chunk)
        elif node.domain == ops.DOMAIN and node.op_type == recurrent.GATED_DELTA_RULE.name:
            lower_gated_delta_rule(g, node, delta_chunk)
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
    kernel = int_attribute(node, "kernel_size")
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


def lower_selective_scan(g: GraphWriter, node: onnx.NodeProto, chunk_size: int = 0) -> None:
    """Calls of at least chunk_size / 4 tokens run the chunked form (`_chunked_selective_scan`), shorter ones (and
    every call when chunk_size is 0) the per-token Scan."""
    x, dt, b, c, a_log, d, dt_bias, context_lengths, state = node.input
    y_out, state_out = node.output
    heads, head_dim = int_attribute(node, "num_heads"), int_attribute(node, "head_dim")
    groups, size = int_attribute(node, "n_groups"), int_attribute(node, "state_size")
    valid = _valid(g, x, context_lengths)  # [B, S]
    step = g.op("Softplus", [g.add(dt, dt_bias)])  # [B, S, H]
    log_decay = g.mul(step, g.op("Neg", [g.op("Exp", [a_log])]))
    log_decay = g.op("Where", [g.unsqueeze(valid, [2]), log_decay, g.const(0.0, np.float32)])  # padding: kept
    xh = g.reshape(x, [0, 0, heads, head_dim])
    mask = g.cast(valid, FLOAT)
    drive = g.mul(g.mul(xh, g.unsqueeze(step, [3])), g.unsqueeze(mask, [2, 3]))  # dt * x, 0 on padding

    b, c = _spread_groups(g, b, groups, heads, size), _spread_groups(g, c, groups, heads, size)
    ys, final = _either_form(
        g, x, node.name or "selective_scan", chunk_size,
        lambda w: _per_token_selective_scan(w, state, log_decay, drive, b, c, heads, head_dim, size),
        lambda w: _chunked_selective_scan(w, state, log_decay, drive, b, c, heads, head_dim, size, chunk_size),
        ([None, None, heads, head_dim], [None, heads, head_dim, size]))
    g.op("Identity", [final], outputs=[state_out])
    skip = g.mul(xh, g.unsqueeze(d, [1]))
    y = g.mul(g.add(ys, skip), g.unsqueeze(mask, [2, 3]))
    g.op("Reshape", [y, g.const([0, 0, heads * head_dim])], outputs=[y_out])


def _per_token_selective_scan(g: GraphWriter, state: str, log_decay: str, drive: str, b: str, c: str, heads: int,
                              head_dim: int, size: int) -> tuple[str, str]:
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
    final, ys = g.op("Scan", [state, g.op("Exp", [log_decay]), drive, b, c], n_out=2, body=scan_body,
                     num_scan_inputs=4, scan_input_axes=[1, 1, 1, 1], scan_output_axes=[1])
    return ys, final


def _chunked_selective_scan(g: GraphWriter, state: str, log_decay: str, drive: str, b: str, c: str, heads: int,
                            head_dim: int, size: int, chunk: int) -> tuple[str, str]:
    """Mamba2's SSD over chunks: with G_t the cumulative log decay in a chunk and h the state entering it,
    y_t = e^{G_t} h c_t + sum_{s<=t} e^{G_t - G_s} (c_t . b_s) dt_s x_s and the state leaving it is
    e^{G_last} h + sum_s e^{G_last - G_s} dt_s x_s ⊗ b_s. The intra-chunk sums are computed for all chunks at once;
    a Scan over chunks adds the carried state's part."""
    seq = g.dim(drive, 1)
    to_chunks = _chunker(g, seq, chunk, heads)
    x, b, c = to_chunks(drive, [head_dim]), to_chunks(b, [size]), to_chunks(c, [size])
    cumulative = g.op("CumSum", [to_chunks(log_decay, []), g.const(-1)])  # [B, H, N, C]
    ratio = _decay_ratio(g, cumulative, chunk)
    intra = g.matmul(g.mul(g.matmul(c, g.transpose(b, [0, 1, 2, 4, 3])), ratio), x)  # [B, H, N, C, P]
    c_grown = g.mul(c, g.unsqueeze(g.op("Exp", [cumulative]), [4]))
    last, to_end = _decay_to_end(g, cumulative, chunk)  # [B, H, N], [B, H, N, C]
    x_to_end = g.mul(x, g.unsqueeze(to_end, [4]))
    body = GraphWriter(prefix="recurrent/scan_chunk/")
    h, intra_c, cg_c, xend_c, b_c, last_c = (body.fresh(n) for n in ("h", "intra", "c", "xend", "b", "g"))
    y_c = body.add(intra_c, body.matmul(cg_c, body.transpose(h, [0, 1, 3, 2])))  # [B, H, C, P]
    h_next = body.add(body.mul(h, body.unsqueeze(body.op("Exp", [last_c]), [2, 3])),
                      body.matmul(body.transpose(xend_c, [0, 1, 3, 2]), b_c))
    h_out = body.op("Identity", [h_next])
    step = helper.make_graph(
        body.nodes, "selective_scan_chunk",
        [value_info(h, FLOAT, ["B", heads, head_dim, size]), value_info(intra_c, FLOAT, ["B", heads, chunk, head_dim]),
         value_info(cg_c, FLOAT, ["B", heads, chunk, size]), value_info(xend_c, FLOAT, ["B", heads, chunk, head_dim]),
         value_info(b_c, FLOAT, ["B", heads, chunk, size]), value_info(last_c, FLOAT, ["B", heads])],
        [value_info(h_out, FLOAT, ["B", heads, head_dim, size]), value_info(y_c, FLOAT, ["B", heads, chunk, head_dim])],
        initializer=body.initializers)
    final, ys = g.op("Scan", [state, intra, c_grown, x_to_end, b, last], n_out=2, body=step, num_scan_inputs=5,
                     scan_input_axes=[2] * 5, scan_output_axes=[2])
    return _from_chunks(g, ys, seq, heads, head_dim), final


def _chunker(g: GraphWriter, seq: str, size: int, heads: int) -> Callable[[str, list[int]], str]:
    """A function [B, S, H, *dims] -> [B, H, N, size, *dims]: S zero-padded to whole chunks (zero drive, zero log
    decay: padding changes nothing)."""
    pad = g.op("Mod", [g.op("Sub", [g.const([size]), g.op("Mod", [seq, g.const([size])])]), g.const([size])])

    def to_chunks(t: str, dims: list[int]) -> str:
        rank = 3 + len(dims)  # Pad's pads: every axis' start, then every axis' end; only S's end grows
        pads = g.op("Concat", [g.const([0] * (rank + 1)), pad, g.const([0] * (rank - 2))], axis=0)
        split = g.reshape(g.op("Pad", [t, pads]), [0, -1, size, heads, *dims])
        return g.transpose(split, [0, 3, 1, 2, *range(4, 4 + len(dims))])

    return to_chunks


def _from_chunks(g: GraphWriter, ys: str, seq: str, heads: int, dim: int) -> str:
    """[B, H, N, C, D] -> [B, S, H, D]: chunks back in sequence order, cut to the call's S tokens."""
    tokens = g.reshape(g.transpose(ys, [0, 2, 3, 1, 4]), [0, -1, heads, dim])
    return g.op("Slice", [tokens, g.const([0]), seq, g.const([1])])


def _decay_ratio(g: GraphWriter, cumulative: str, size: int) -> str:
    """M [.., C, C]: e^{G_t - G_s} for s <= t (at most 1: no overflow), else 0."""
    gaps = g.op("Sub", [g.unsqueeze(cumulative, [4]), g.unsqueeze(cumulative, [3])])  # [.., t, s]: G_t - G_s
    causal = g.const(np.tril(np.ones((size, size), dtype=bool)), np.bool_)
    return g.op("Exp", [g.op("Where", [causal, gaps, g.const(-np.inf, np.float32)])])


Form = Callable[[GraphWriter], tuple[str, str]]  # writes one lowering into a writer: (ys, final state)


def _either_form(g: GraphWriter, like: str, name: str, chunk_size: int, per_token: Form, chunked: Form,
                 shapes: tuple[list, list]) -> tuple[str, str]:
    """The per-token form inline when chunk_size is 0; else an If on the call's length: calls of a quarter chunk or
    more (16 tokens at 64) take the chunked branch, the break-even measured by experiments/kernels/recurrent_prefill.py
    (a chunk costs about as much as 16 per-token steps). Each branch writes under a prefix of this node's own."""
    base = g.fresh(name)
    token = GraphWriter(prefix=f"{base}/token/")
    token_outputs = per_token(token)
    if not chunk_size:
        g.nodes.extend(token.nodes)
        g.initializers.extend(token.initializers)
        return token_outputs
    chunk = GraphWriter(prefix=f"{base}/chunk/")
    chunk_outputs = chunked(chunk)
    many = g.op("GreaterOrEqual", [g.op("Squeeze", [g.dim(like, 1), g.const([0])]), g.const(max(1, chunk_size // 4))])
    ys, final = g.op("If", [many], n_out=2, then_branch=_branch(chunk, chunk_outputs, shapes, "chunked"),
                     else_branch=_branch(token, token_outputs, shapes, "per_token"))
    return ys, final


def _spread_groups(g: GraphWriter, t: str, groups: int, heads: int, dim: int) -> str:
    """[B, S, G*D] -> [B, S, H, D]: head h reads group h // (H / G)."""
    grouped = g.reshape(t, [0, 0, groups, 1, dim])
    spread = g.op("Expand", [grouped, g.const([1, 1, 1, heads // groups, 1])])
    return g.reshape(spread, [0, 0, heads, dim])


def _decay_to_end(g: GraphWriter, cumulative: str, size: int) -> tuple[str, str]:
    """A chunk's total log decay G_last [.., N] and e^{G_last - G_s} [.., N, C]: what each position's write still
    decays by when the chunk ends."""
    last = g.op("Gather", [cumulative, g.const(size - 1)], axis=3)
    return last, g.op("Exp", [g.op("Sub", [g.unsqueeze(last, [3]), cumulative])])


def lower_gated_delta_rule(g: GraphWriter, node: onnx.NodeProto, chunk_size: int = DELTA_CHUNK) -> None:
    """A call of at least chunk_size / 4 tokens (prefill) runs the chunked form (`_chunked_delta_rule`: a Scan over
    chunks of `chunk_size` tokens); shorter calls (decode), or any call with chunk_size 0, run the per-token Scan."""
    q, k, v, log_decay, beta, context_lengths, state = node.input
    y_out, state_out = node.output
    shape = DeltaShape(int_attribute(node, "num_k_heads"), int_attribute(node, "num_v_heads"),
                       int_attribute(node, "k_head_dim"), int_attribute(node, "v_head_dim"))
    valid = g.unsqueeze(_valid(g, q, context_lengths), [2])  # [B, S, 1]
    # Padding gets log decay 0 (the state is kept) and beta 0 (nothing is written into it).
    log_decay = g.op("Where", [valid, log_decay, g.const(0.0, np.float32)])
    gain = g.op("Where", [valid, beta, g.const(0.0, np.float32)])

    # Value head h reads key head h // (Hv / Hk), as a selective scan's head reads its group.
    inputs = DeltaInputs(_spread_groups(g, q, shape.k_heads, shape.v_heads, shape.k_dim),
                         _spread_groups(g, k, shape.k_heads, shape.v_heads, shape.k_dim),
                         g.reshape(v, [0, 0, shape.v_heads, shape.v_dim]), log_decay, gain, state)
    ys, final = _either_form(
        g, q, node.name or "gated_delta_rule", chunk_size, lambda w: _per_token_delta_rule(w, shape, inputs),
        lambda w: _chunked_delta_rule(w, shape, inputs, chunk_size),
        ([None, None, shape.v_heads, shape.v_dim], [None, shape.v_heads, shape.v_dim, shape.k_dim]))
    g.op("Identity", [final], outputs=[state_out])
    masked = g.mul(ys, g.unsqueeze(g.cast(valid, FLOAT), [3]))  # [B, S, Hv, Dv], 0 on padding
    g.op("Reshape", [masked, g.const([0, 0, shape.v_heads * shape.v_dim])], outputs=[y_out])


@dataclass(frozen=True, slots=True)
class DeltaShape:
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int


@dataclass(frozen=True, slots=True)
class DeltaInputs:
    """Per value head, padding already neutral: q, k [B,S,Hv,Dk], v [B,S,Hv,Dv], log decay and beta [B,S,Hv]; the
    carried state [B,Hv,Dv,Dk]."""

    q: str
    k: str
    v: str
    log_decay: str
    beta: str
    state: str


def _branch(g: GraphWriter, outputs: tuple[str, str], shapes: tuple[list, list], name: str) -> onnx.GraphProto:
    """An If branch: the writer's nodes over outer-scope values, returning ys [B,S,H,D] and the final state."""
    ys, final = (g.op("Identity", [o]) for o in outputs)
    return helper.make_graph(g.nodes, f"recurrence_{name}", [],
                             [value_info(ys, FLOAT, shapes[0]), value_info(final, FLOAT, shapes[1])],
                             initializer=g.initializers)


def _per_token_delta_rule(g: GraphWriter, shape: DeltaShape, x: DeltaInputs) -> tuple[str, str]:
    """A Scan over tokens: S = S * exp(g); S += beta (v - S k) ⊗ k; y = S q."""
    v_heads, v_dim, k_dim = shape.v_heads, shape.v_dim, shape.k_dim
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
    final, ys = g.op("Scan", [x.state, g.op("Exp", [x.log_decay]), x.q, x.k, x.v, x.beta], n_out=2, body=step,
                     num_scan_inputs=5, scan_input_axes=[1] * 5, scan_output_axes=[1])
    return ys, final


def _chunked_delta_rule(g: GraphWriter, shape: DeltaShape, x: DeltaInputs, size: int) -> tuple[str, str]:
    """The gated delta rule over chunks of `size` tokens (the WY form of FLA's chunked kernels).

    Within a chunk, with G_t the cumulative log decay and H = S^T [Dk, Dv] the state entering it, the written
    values u_t = beta_t (v_t - e^{G_t} H^T k_t - sum_{r<t} e^{G_t - G_r} (k_t . k_r) u_r) solve a unit lower
    triangular system, so U = T diag(beta) V - W H with T its inverse and W = T diag(beta e^G) K. Everything but
    the "- W H" is computed for all chunks at once; a Scan over chunks then does, per chunk, U = U0 - W H,
    Y = diag(e^G) Q H + (M ∘ Q K^T) U and H' = e^{G_last} H + (K ∘ e^{G_last - G})^T U (M_ts = e^{G_t - G_s},
    s <= t). T comes from exact block doubling (a unit lower triangular inverse from its half-size blocks:
    [[A, 0], [-C, D]]^-1 = [[A^-1, 0], [D^-1 C A^-1, D^-1]]), which has no Neumann-series cancellation.
    """
    v_heads, v_dim, k_dim = shape.v_heads, shape.v_dim, shape.k_dim
    seq = g.dim(x.q, 1)
    to_chunks = _chunker(g, seq, size, v_heads)
    q, k, v = to_chunks(x.q, [k_dim]), to_chunks(x.k, [k_dim]), to_chunks(x.v, [v_dim])
    beta, log_decay = to_chunks(x.beta, []), to_chunks(x.log_decay, [])  # [B, Hv, N, C]
    cumulative = g.op("CumSum", [log_decay, g.const(-1)])  # G
    ratio = _decay_ratio(g, cumulative, size)  # M
    strict = g.mul(ratio, g.const(np.tril(np.ones((size, size)), -1), np.float32))
    k_t = g.transpose(k, [0, 1, 2, 4, 3])
    lower = g.mul(g.mul(g.matmul(k, k_t), strict), g.op("Neg", [g.unsqueeze(beta, [4])]))  # L; T = (I - L)^-1
    inverse = _unit_lower_inverse(g, lower, beta, size)
    growth = g.op("Exp", [cumulative])  # e^G
    w = g.matmul(inverse, g.mul(k, g.unsqueeze(g.mul(beta, growth), [4])))
    u0 = g.matmul(inverse, g.mul(v, g.unsqueeze(beta, [4])))
    q_grown = g.mul(q, g.unsqueeze(growth, [4]))
    scores = g.mul(g.matmul(q, k_t), ratio)
    last, to_end = _decay_to_end(g, cumulative, size)  # [B, Hv, N], [B, Hv, N, C]
    k_to_end = g.mul(k, g.unsqueeze(to_end, [4]))
    body = GraphWriter(prefix="recurrent/delta_chunk/")
    h, w_c, u0_c, qg_c, scores_c, kend_c, last_c = (body.fresh(n) for n in ("h", "w", "u0", "q", "p", "kend", "g"))
    u = body.op("Sub", [u0_c, body.matmul(w_c, h)])  # [B, Hv, C, Dv]
    y_c = body.add(body.matmul(qg_c, h), body.matmul(scores_c, u))
    h_next = body.add(body.mul(h, body.unsqueeze(body.op("Exp", [last_c]), [2, 3])),
                      body.matmul(body.transpose(kend_c, [0, 1, 3, 2]), u))
    h_out = body.op("Identity", [h_next])
    step = helper.make_graph(
        body.nodes, "gated_delta_chunk",
        [value_info(h, FLOAT, ["B", v_heads, k_dim, v_dim]), value_info(w_c, FLOAT, ["B", v_heads, size, k_dim]),
         value_info(u0_c, FLOAT, ["B", v_heads, size, v_dim]), value_info(qg_c, FLOAT, ["B", v_heads, size, k_dim]),
         value_info(scores_c, FLOAT, ["B", v_heads, size, size]),
         value_info(kend_c, FLOAT, ["B", v_heads, size, k_dim]), value_info(last_c, FLOAT, ["B", v_heads])],
        [value_info(h_out, FLOAT, ["B", v_heads, k_dim, v_dim]), value_info(y_c, FLOAT, ["B", v_heads, size, v_dim])],
        initializer=body.initializers)
    final, ys = g.op("Scan", [g.transpose(x.state, [0, 1, 3, 2]), w, u0, q_grown, scores, k_to_end, last], n_out=2,
                     body=step, num_scan_inputs=6, scan_input_axes=[2] * 6, scan_output_axes=[2])
    return _from_chunks(g, ys, seq, v_heads, v_dim), g.transpose(final, [0, 1, 3, 2])


def _unit_lower_inverse(g: GraphWriter, lower: str, like: str, size: int) -> str:
    """(I - L)^-1 for strictly lower triangular L [B, Hv, N, C, C], C a power of two: the diagonal blocks of the
    inverse double in size log2(C) times, starting from 1x1 blocks of 1."""
    blocks = g.unsqueeze(g.add(g.mul(like, g.const(0.0, np.float32)), g.const(1.0, np.float32)), [4, 5])  # [.., C,1,1]
    width = 1
    while width < size:
        count = size // (2 * width)
        tiles = g.reshape(lower, [0, 0, 0, count, 2 * width, count, 2 * width])
        diagonal = g.op("ReduceSum", [g.mul(tiles, g.const(np.eye(count).reshape(count, 1, count, 1), np.float32)),
                                      g.const([-2])], keepdims=0)  # [.., count, 2w, 2w]: L's diagonal blocks
        corner = g.op("Slice", [diagonal, g.const([width, 0]), g.const([2 * width, width]), g.const([-2, -1])])
        pairs = g.reshape(blocks, [0, 0, 0, count, 2, width, width])
        first, second = (g.op("Squeeze", [half, g.const([4])])
                         for half in g.op("Split", [pairs], n_out=2, axis=4, num_outputs=2))
        joined = g.matmul(g.matmul(second, corner), first)  # D^-1 C A^-1
        top = g.op("Concat", [first, g.mul(first, g.const(0.0, np.float32))], axis=-1)
        bottom = g.op("Concat", [joined, second], axis=-1)
        blocks = g.op("Concat", [top, bottom], axis=-2)
        width *= 2
    return g.reshape(blocks, [0, 0, 0, size, size])

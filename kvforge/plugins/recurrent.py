"""Schemas and numpy reference semantics of the recurrent ops: the causal conv with a carried conv state, the
selective state-space scan (Mamba2) and the gated delta rule (Qwen3.5's gated delta-net), each with a carried
recurrent state.

Both ops take ragged rows like the paged-KV ops: row b has `context_lengths[b]` new tokens, later
positions are padding (outputs 0, states untouched), and the returned states are the ones after the
row's last real token, so a prefill can continue in chunks (or after a restored snapshot) exactly.
"""

from __future__ import annotations

import numpy as np

from kvforge.plugins.ops import OpSchema

CAUSAL_CONV = OpSchema(
    name="CausalConv1dWithState",
    inputs=("x", "weight", "bias", "context_lengths", "conv_state"),
    outputs=("y", "new_conv_state"),
    attributes=("kernel_size",),
    doc="Depthwise causal conv of x [B,S,C] (weight [C,K], bias [C]) continuing from conv_state [B,C,K-1] "
        "(the row's previous K-1 inputs, oldest first), then SiLU. new_conv_state: the last K-1 inputs up to "
        "the row's last real token.",
)

SELECTIVE_SCAN = OpSchema(
    name="SelectiveScan",
    inputs=("x", "dt", "b", "c", "a_log", "d", "dt_bias", "context_lengths", "recurrent_state"),
    outputs=("y", "new_recurrent_state"),
    attributes=("num_heads", "head_dim", "n_groups", "state_size"),
    doc="Mamba2 SSD recurrence per row: dt' = softplus(dt + dt_bias) [B,S,H]; h = h * exp(dt' * -exp(a_log)) "
        "+ dt' * x ⊗ b (b, c [B,S,G*N] shared by H/G heads each); y = h·c + d * x. x, y [B,S,H*P]; "
        "recurrent_state [B,H,P,N], fp32.",
)

GATED_DELTA_RULE = OpSchema(
    name="GatedDeltaRule",
    inputs=("q", "k", "v", "g", "beta", "context_lengths", "recurrent_state"),
    outputs=("y", "new_recurrent_state"),
    attributes=("num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim"),
    doc="Gated delta rule per row (value head h reads key head h // (Hv/Hk)): S = S * exp(g); "
        "S += beta * (v - S k) ⊗ k; y = S q. q, k [B,S,Hk*Dk] (normalised and scaled by the caller), v, y "
        "[B,S,Hv*Dv], g (log decay) and beta [B,S,Hv]; recurrent_state S [B,Hv,Dv,Dk], fp32.",
)

SCHEMAS = {s.name: s for s in (CAUSAL_CONV, SELECTIVE_SCAN, GATED_DELTA_RULE)}


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def causal_conv(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, context_lengths: np.ndarray,
                conv_state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    batch, seq, channels = x.shape
    kernel = weight.shape[1]
    y = np.zeros((batch, seq, channels), dtype=np.float32)
    new_state = conv_state.astype(np.float32).copy()
    for b in range(batch):
        length = int(context_lengths[b])
        window = np.concatenate([conv_state[b].T.astype(np.float64), x[b, :length].astype(np.float64)])  # [K-1+L, C]
        for t in range(length):
            y[b, t] = silu((window[t:t + kernel] * weight.T).sum(axis=0) + bias)
        new_state[b] = window[length:length + kernel - 1].T
    return y, new_state


def selective_scan(x: np.ndarray, dt: np.ndarray, b: np.ndarray, c: np.ndarray, a_log: np.ndarray, d: np.ndarray,
                   dt_bias: np.ndarray, context_lengths: np.ndarray, recurrent_state: np.ndarray, *,
                   num_heads: int, head_dim: int, n_groups: int, state_size: int) -> tuple[np.ndarray, np.ndarray]:
    batch, seq = x.shape[:2]
    heads_per_group = num_heads // n_groups
    a = -np.exp(a_log.astype(np.float64))
    y = np.zeros((batch, seq, num_heads * head_dim), dtype=np.float32)
    new_state = recurrent_state.astype(np.float32).copy()
    for row in range(batch):
        h = recurrent_state[row].astype(np.float64)  # [H, P, N]
        for t in range(int(context_lengths[row])):
            step = softplus(dt[row, t].astype(np.float64) + dt_bias)  # [H]
            xt = x[row, t].reshape(num_heads, head_dim).astype(np.float64)
            bt = np.repeat(b[row, t].reshape(n_groups, state_size), heads_per_group, axis=0)  # [H, N]
            ct = np.repeat(c[row, t].reshape(n_groups, state_size), heads_per_group, axis=0)
            h = h * np.exp(step * a)[:, None, None] + (step[:, None] * xt)[:, :, None] * bt[:, None, :]
            y[row, t] = ((h * ct[:, None, :]).sum(-1) + d[:, None] * xt).reshape(-1)
        new_state[row] = h
    return y, new_state


def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                     context_lengths: np.ndarray, recurrent_state: np.ndarray, *, num_k_heads: int, num_v_heads: int,
                     k_head_dim: int, v_head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    batch, seq = q.shape[:2]
    per_key = num_v_heads // num_k_heads
    y = np.zeros((batch, seq, num_v_heads * v_head_dim), dtype=np.float32)
    new_state = recurrent_state.astype(np.float32).copy()
    for row in range(batch):
        state = recurrent_state[row].astype(np.float64)  # [Hv, Dv, Dk]
        for t in range(int(context_lengths[row])):
            qt = np.repeat(q[row, t].reshape(num_k_heads, k_head_dim), per_key, axis=0).astype(np.float64)
            kt = np.repeat(k[row, t].reshape(num_k_heads, k_head_dim), per_key, axis=0).astype(np.float64)
            vt = v[row, t].reshape(num_v_heads, v_head_dim).astype(np.float64)
            state = state * np.exp(g[row, t].astype(np.float64))[:, None, None]
            delta = (vt - np.einsum("hvk,hk->hv", state, kt)) * beta[row, t].astype(np.float64)[:, None]
            state = state + delta[:, :, None] * kt[:, None, :]
            y[row, t] = np.einsum("hvk,hk->hv", state, qt).reshape(-1)
        new_state[row] = state
    return y, new_state

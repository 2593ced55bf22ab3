"""The recurrent ops (Mamba2 conv and selective scan): numpy reference against transformers, and the ONNX
Runtime lowering against the reference on ragged rows and chunked continuation from a carried state."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from kvforge.builder.lower_recurrent import lower_recurrent_ops
from kvforge.graph.onnx_graph import FLOAT, INT32, OPSET, value_info
from kvforge.plugins import ops, recurrent

H, P, G, N, K = 4, 3, 2, 5, 4  # heads, head_dim, groups, state size, conv kernel
C = H * P + 2 * G * N  # conv channels: x, B and C
rng = np.random.default_rng(0)
WEIGHTS = {
    "weight": rng.standard_normal((C, K)).astype(np.float32) * 0.5,
    "bias": rng.standard_normal(C).astype(np.float32) * 0.1,
    "a_log": rng.standard_normal(H).astype(np.float32) * 0.5,
    "d": rng.standard_normal(H).astype(np.float32),
    "dt_bias": rng.standard_normal(H).astype(np.float32),
}
SCAN_ATTRS = {"num_heads": H, "head_dim": P, "n_groups": G, "state_size": N}


def inputs(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    return {"xbc": r.standard_normal((batch, seq, C)).astype(np.float32),
            "dt": r.standard_normal((batch, seq, H)).astype(np.float32),
            "conv_state": r.standard_normal((batch, C, K - 1)).astype(np.float32),
            "recurrent_state": r.standard_normal((batch, H, P, N)).astype(np.float32)}


def reference(data: dict[str, np.ndarray], lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    conv, conv_state = recurrent.causal_conv(data["xbc"], WEIGHTS["weight"], WEIGHTS["bias"], lengths,
                                             data["conv_state"])
    x, b, c = np.split(conv, [H * P, H * P + G * N], axis=-1)
    y, state = recurrent.selective_scan(x, data["dt"], b, c, WEIGHTS["a_log"], WEIGHTS["d"], WEIGHTS["dt_bias"],
                                        lengths, data["recurrent_state"], **SCAN_ATTRS)
    return y, conv_state, state


@pytest.fixture(scope="module", params=[0, 4, 16], ids=["per_token", "chunks_of_4", "chunks_of_16"])
def session(request: pytest.FixtureRequest) -> ort.InferenceSession:
    """conv -> split -> scan with the kvforge nodes, lowered for ONNX Runtime: the per-token Scan (chunk 0) and the
    chunked form, taken by calls of chunk / 4 tokens or more (several padded chunks of 4; one chunk of 16)."""
    nodes = [
        helper.make_node(recurrent.CAUSAL_CONV.name, ["xbc", "weight", "bias", "context_lengths", "conv_state"],
                         ["conv", "new_conv_state"], domain=ops.DOMAIN, kernel_size=K),
        helper.make_node("Split", ["conv", "splits"], ["x", "b", "c"], axis=-1),
        helper.make_node(recurrent.SELECTIVE_SCAN.name, ["x", "dt", "b", "c", "a_log", "d", "dt_bias",
                                                         "context_lengths", "recurrent_state"],
                         ["y", "new_recurrent_state"], domain=ops.DOMAIN, **SCAN_ATTRS),
    ]
    initializers = [onnx.numpy_helper.from_array(v, k) for k, v in WEIGHTS.items()]
    initializers.append(onnx.numpy_helper.from_array(np.array([H * P, G * N, G * N], dtype=np.int64), "splits"))
    graph = helper.make_graph(nodes, "recurrent", [
        value_info("xbc", FLOAT, ["B", "S", C]), value_info("dt", FLOAT, ["B", "S", H]),
        value_info("context_lengths", INT32, ["B"]), value_info("conv_state", FLOAT, ["B", C, K - 1]),
        value_info("recurrent_state", FLOAT, ["B", H, P, N])],
        [value_info("y", FLOAT, ["B", "S", H * P]), value_info("new_conv_state", FLOAT, ["B", C, K - 1]),
         value_info("new_recurrent_state", FLOAT, ["B", H, P, N])], initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(ops.DOMAIN, ops.OPSET_VERSION)])
    lowered = lower_recurrent_ops(model, scan_chunk=request.param)
    assert not any(n.domain == ops.DOMAIN for n in lowered.graph.node)
    assert any(n.op_type == "If" for n in lowered.graph.node) == bool(request.param)
    onnx.checker.check_model(lowered)
    return ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])


def run(session: ort.InferenceSession, data: dict[str, np.ndarray], lengths: np.ndarray) -> list[np.ndarray]:
    return session.run(["y", "new_conv_state", "new_recurrent_state"],
                       {**data, "context_lengths": lengths.astype(np.int32)})


def test_lowering_matches_the_reference_on_ragged_rows(session: ort.InferenceSession) -> None:
    data = inputs(3, 9, seed=1)
    lengths = np.array([9, 4, 1])
    for got, want in zip(run(session, data, lengths), reference(data, lengths), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    y = run(session, data, lengths)[0]
    assert not y[1, 4:].any() and not y[2, 1:].any()  # padding outputs 0


def test_both_scan_forms_match_the_reference(session: ort.InferenceSession) -> None:
    """Short calls run the per-token Scan, calls of SCAN_CHUNK / 4 tokens or more the chunked SSD form: both exact
    on ragged rows, including lengths that are not a multiple of the chunk and rows ending inside a chunk."""
    from kvforge.builder.lower_recurrent import SCAN_CHUNK

    for seq in (SCAN_CHUNK // 4 - 1, SCAN_CHUNK + 1, 3 * SCAN_CHUNK + 5, 1100):
        data = inputs(3, seq, seed=seq)
        data["dt"] -= 2.0  # long rows: keep the decay mild so the state carries information to the end
        lengths = np.array([seq, max(1, seq - 70), 1])
        for got, want in zip(run(session, data, lengths), reference(data, lengths), strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_continues_from_the_carried_states(session: ort.InferenceSession) -> None:
    data = inputs(1, 11, seed=2)
    whole = run(session, data, np.array([11]))
    first = run(session, {**data, "xbc": data["xbc"][:, :5], "dt": data["dt"][:, :5]}, np.array([5]))
    second = run(session, {"xbc": data["xbc"][:, 5:], "dt": data["dt"][:, 5:], "conv_state": first[1],
                           "recurrent_state": first[2]}, np.array([6]))
    np.testing.assert_allclose(np.concatenate([first[0], second[0]], axis=1), whole[0], atol=1e-5, rtol=1e-5)
    for got, want in zip(second[1:], whole[1:], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    last = run(session, {"xbc": data["xbc"][:, 10:], "dt": data["dt"][:, 10:], **dict(zip(
        ("conv_state", "recurrent_state"), run(session, {**data, "xbc": data["xbc"][:, :10], "dt": data["dt"][:, :10]},
                                               np.array([10]))[1:], strict=True))}, np.array([1]))
    np.testing.assert_allclose(last[0][:, 0], whole[0][:, 10], atol=1e-5, rtol=1e-5)  # decode after a prefill
    np.testing.assert_allclose(last[2], whole[2], atol=1e-5, rtol=1e-5)


def test_reference_matches_transformers_mamba2() -> None:
    torch = pytest.importorskip("torch")
    mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    data = inputs(2, 13, seed=3)
    lengths = np.array([13, 13])
    y, conv_state, state = reference(data, lengths)
    # transformers' conv (zero initial state) and its single-token update with a [B, C, K] state.
    zero = {**data, "conv_state": np.zeros_like(data["conv_state"])}
    conv_ref = mamba2.causal_conv1d_fn(torch.tensor(data["xbc"]).transpose(1, 2), torch.tensor(WEIGHTS["weight"]),
                                       torch.tensor(WEIGHTS["bias"]), activation="silu").transpose(1, 2)
    conv_ours, _ = recurrent.causal_conv(zero["xbc"], WEIGHTS["weight"], WEIGHTS["bias"], lengths, zero["conv_state"])
    np.testing.assert_allclose(conv_ours, conv_ref.numpy(), atol=1e-5)
    hf_state = torch.tensor(np.concatenate([np.zeros((2, C, 1), np.float32), data["conv_state"]], axis=2))
    token = torch.tensor(data["xbc"][:, :1]).transpose(1, 2)
    one_ref = mamba2.causal_conv1d_update(token, hf_state, torch.tensor(WEIGHTS["weight"]),
                                          torch.tensor(WEIGHTS["bias"]), activation="silu")
    one_ours, _ = recurrent.causal_conv(data["xbc"][:, :1], WEIGHTS["weight"], WEIGHTS["bias"], np.array([1, 1]),
                                        data["conv_state"])
    np.testing.assert_allclose(one_ours, one_ref.transpose(1, 2).numpy(), atol=1e-5)
    # The chunked SSD scan from an initial state.
    conv, _ = recurrent.causal_conv(data["xbc"], WEIGHTS["weight"], WEIGHTS["bias"], lengths, data["conv_state"])
    x, b, c = np.split(conv, [H * P, H * P + G * N], axis=-1)
    out, final = mamba2.mamba2_chunk_scan(
        torch.tensor(x).view(2, 13, H, P), torch.tensor(data["dt"]), -torch.exp(torch.tensor(WEIGHTS["a_log"])),
        torch.tensor(b).view(2, 13, G, N), torch.tensor(c).view(2, 13, G, N), chunk_size=4,
        D=torch.tensor(WEIGHTS["d"]), z=None, return_final_states=True, dt_bias=torch.tensor(WEIGHTS["dt_bias"]),
        dt_softplus=True, initial_states=torch.tensor(data["recurrent_state"]), dt_limit=(0.0, float("inf")))
    np.testing.assert_allclose(y, out.reshape(2, 13, -1).numpy(), atol=1e-4)
    np.testing.assert_allclose(state, final.numpy(), atol=1e-4)
    assert conv_state.shape == (2, C, K - 1)


# --- the gated delta rule (Qwen3.5's gated delta-net): 2 key heads serving 4 value heads --------------------------

HK, HV, DK, DV = 2, 4, 3, 5
DELTA_ATTRS = {"num_k_heads": HK, "num_v_heads": HV, "k_head_dim": DK, "v_head_dim": DV}


def delta_inputs(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    q, k = (r.standard_normal((batch, seq, HK, DK)) for _ in range(2))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # as the graph feeds it: l2-normalised keys
    return {"q": q.reshape(batch, seq, -1).astype(np.float32), "k": k.reshape(batch, seq, -1).astype(np.float32),
            "v": r.standard_normal((batch, seq, HV * DV)).astype(np.float32),
            "g": -np.abs(r.standard_normal((batch, seq, HV))).astype(np.float32),
            "beta": r.uniform(0.0, 1.0, (batch, seq, HV)).astype(np.float32),
            "recurrent_state": r.standard_normal((batch, HV, DV, DK)).astype(np.float32)}


@pytest.fixture(scope="module", params=[0, 4, 16], ids=["per_token", "chunks_of_4", "chunks_of_16"])
def delta_session(request: pytest.FixtureRequest) -> ort.InferenceSession:
    """The per-token Scan (chunk 0) and the chunked form, taken by calls of chunk / 4 tokens or more: chunks of 4
    split the 3-10 token calls into several chunks and pad the last (and take 1-token calls too); chunks of 16 hold
    a whole call in one, padded, and leave 1-3 token calls to the per-token branch."""
    node = helper.make_node(recurrent.GATED_DELTA_RULE.name, ["q", "k", "v", "g", "beta", "context_lengths",
                                                              "recurrent_state"],
                            ["y", "new_recurrent_state"], domain=ops.DOMAIN, **DELTA_ATTRS)
    graph = helper.make_graph([node], "delta", [
        value_info("q", FLOAT, ["B", "S", HK * DK]), value_info("k", FLOAT, ["B", "S", HK * DK]),
        value_info("v", FLOAT, ["B", "S", HV * DV]), value_info("g", FLOAT, ["B", "S", HV]),
        value_info("beta", FLOAT, ["B", "S", HV]), value_info("context_lengths", INT32, ["B"]),
        value_info("recurrent_state", FLOAT, ["B", HV, DV, DK])],
        [value_info("y", FLOAT, ["B", "S", HV * DV]), value_info("new_recurrent_state", FLOAT, ["B", HV, DV, DK])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(ops.DOMAIN, ops.OPSET_VERSION)])
    lowered = lower_recurrent_ops(model, delta_chunk=request.param)
    assert not any(n.domain == ops.DOMAIN for n in lowered.graph.node)
    assert any(n.op_type == "If" for n in lowered.graph.node) == bool(request.param)
    onnx.checker.check_model(lowered)
    return ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])


def run_delta(session: ort.InferenceSession, data: dict[str, np.ndarray], lengths: np.ndarray) -> list[np.ndarray]:
    return session.run(["y", "new_recurrent_state"], {**data, "context_lengths": lengths.astype(np.int32)})


def test_gated_delta_lowering_matches_the_reference_on_ragged_rows(delta_session: ort.InferenceSession) -> None:
    data = delta_inputs(3, 8, seed=4)
    lengths = np.array([8, 3, 1])
    want = recurrent.gated_delta_rule(**data, context_lengths=lengths, **DELTA_ATTRS)
    got = run_delta(delta_session, data, lengths)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    assert not got[0][1, 3:].any() and not got[0][2, 1:].any()  # padding outputs 0
    assert not np.allclose(got[1][1], data["recurrent_state"][1])  # the short row's state moved ...
    shorter = recurrent.gated_delta_rule(**data, context_lengths=np.array([8, 2, 1]), **DELTA_ATTRS)[1]
    assert not np.allclose(got[1][1], shorter[1])  # ... and stopped after its 3rd token, not before


def test_gated_delta_chunks_continue_from_the_carried_state(delta_session: ort.InferenceSession) -> None:
    data = delta_inputs(1, 10, seed=5)
    whole = run_delta(delta_session, data, np.array([10]))
    sequence = ("q", "k", "v", "g", "beta")
    first = run_delta(delta_session, {**data, **{n: data[n][:, :4] for n in sequence}}, np.array([4]))
    second = run_delta(delta_session, {**{n: data[n][:, 4:] for n in sequence}, "recurrent_state": first[1]},
                       np.array([6]))
    np.testing.assert_allclose(np.concatenate([first[0], second[0]], axis=1), whole[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(second[1], whole[1], atol=1e-5, rtol=1e-5)
    one = run_delta(delta_session, {**{n: data[n][:, 9:] for n in sequence}, "recurrent_state": run_delta(
        delta_session, {**data, **{n: data[n][:, :9] for n in sequence}}, np.array([9]))[1]}, np.array([1]))
    np.testing.assert_allclose(one[0][:, 0], whole[0][:, 9], atol=1e-5, rtol=1e-5)  # decode after a prefill
    np.testing.assert_allclose(one[1], whole[1], atol=1e-5, rtol=1e-5)


def test_gated_delta_reference_matches_transformers() -> None:
    torch = pytest.importorskip("torch")
    qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    data = delta_inputs(2, 7, seed=6)
    y, state = recurrent.gated_delta_rule(**data, context_lengths=np.array([7, 7]), **DELTA_ATTRS)

    def heads(name: str, dim: int) -> torch.Tensor:
        return torch.tensor(data[name]).view(2, 7, -1, dim)

    # transformers scales q by Dk^-0.5 itself (our graph does it before the op) and keeps S as [Hv, Dk, Dv].
    out, final = qwen3_5.torch_recurrent_gated_delta_rule(
        heads("q", DK) * DK ** 0.5, heads("k", DK), heads("v", DV), g=torch.tensor(data["g"]),
        beta=torch.tensor(data["beta"]), initial_state=torch.tensor(data["recurrent_state"]).transpose(2, 3),
        output_final_state=True, use_qk_l2norm_in_kernel=False)
    np.testing.assert_allclose(y, out.reshape(2, 7, -1).numpy(), atol=1e-5)
    np.testing.assert_allclose(state, final.transpose(2, 3).numpy(), atol=1e-5)

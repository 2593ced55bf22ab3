"""The positions an engine call computes outputs for, shared by every family's graph: `logits_indices` [N] are flat
indices b * S + t into the call's [B, S] token grid, so a row can ask for one position (decode, prefill) or several
(a speculative verify row), and the norm and LM head run on N rows instead of B * S."""

from __future__ import annotations

import onnx

from kvforge.contract.engine_dir import HIDDEN_STATES, HIDDEN_STATES_INDICES, LOGITS_INDICES
from kvforge.graph.onnx_graph import FLOAT, INT64, GraphWriter, value_info

NUM_POSITIONS = "num_logits"  # the symbolic N of logits_indices and logits
NUM_HIDDEN_POSITIONS = "num_hidden"  # the symbolic M of hidden_states_indices and hidden_states


def logits_indices_input() -> onnx.ValueInfoProto:
    return value_info(LOGITS_INDICES, INT64, [NUM_POSITIONS])


def logits_output(vocab_size: int) -> onnx.ValueInfoProto:
    return value_info("logits", FLOAT, [NUM_POSITIONS, vocab_size])


def hidden_indices_input() -> onnx.ValueInfoProto:
    return value_info(HIDDEN_STATES_INDICES, INT64, [NUM_HIDDEN_POSITIONS])


def gather_positions(g: GraphWriter, hidden: str, hidden_size: int, indices: str = LOGITS_INDICES) -> str:
    """[B, S, H] -> [N, H]: the rows `indices` (logits_indices by default) names."""
    return g.op("Gather", [g.reshape(hidden, [-1, hidden_size]), indices], axis=0)


def hidden_states_output(g: GraphWriter, layer_outputs: list[str], layers: list[int] | tuple[int, ...],
                         hidden_size: int, indices: str = HIDDEN_STATES_INDICES) -> onnx.ValueInfoProto | None:
    """`hidden_states` [M, len(layers) * H]: the outputs of the named decoder layers (the residual stream after
    each, before the final norm) at the positions `indices` names (the graph's hidden_states_indices input; a draft
    passes logits_indices), concatenated in the order named; None when none are named."""
    if not layers:
        return None
    gathered = [gather_positions(g, layer_outputs[layer], hidden_size, indices) for layer in layers]
    joined = gathered[0] if len(gathered) == 1 else g.op("Concat", gathered, axis=-1)
    g.op("Identity", [joined], outputs=[HIDDEN_STATES])
    rows = NUM_POSITIONS if indices == LOGITS_INDICES else NUM_HIDDEN_POSITIONS
    return value_info(HIDDEN_STATES, FLOAT, [rows, len(layers) * hidden_size])


def attach_hidden_states(g: GraphWriter, layer_outputs: list[str], layers: list[int] | tuple[int, ...],
                         hidden_size: int, inputs: list[onnx.ValueInfoProto],
                         outputs: list[onnx.ValueInfoProto]) -> None:
    """A base graph's `hidden_states` output (second, after logits) and its `hidden_states_indices` input, when
    `layers` names any: what every family's graph does the same way."""
    hidden_states = hidden_states_output(g, layer_outputs, layers, hidden_size)
    if hidden_states is not None:
        outputs.insert(1, hidden_states)
        inputs.append(hidden_indices_input())

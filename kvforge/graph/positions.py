"""The positions an engine call computes outputs for, shared by every family's graph: `logits_indices` [N] are flat
indices b * S + t into the call's [B, S] token grid, so a row can ask for one position (decode, prefill) or several
(a speculative verify row), and the norm and LM head run on N rows instead of B * S."""

from __future__ import annotations

import onnx

from kvforge.contract.engine_dir import HIDDEN_STATES, LOGITS_INDICES
from kvforge.graph.onnx_graph import FLOAT, INT64, GraphWriter, value_info

NUM_POSITIONS = "num_logits"  # the symbolic N of logits_indices, logits and hidden_states


def logits_indices_input() -> onnx.ValueInfoProto:
    return value_info(LOGITS_INDICES, INT64, [NUM_POSITIONS])


def logits_output(vocab_size: int) -> onnx.ValueInfoProto:
    return value_info("logits", FLOAT, [NUM_POSITIONS, vocab_size])


def gather_positions(g: GraphWriter, hidden: str, hidden_size: int) -> str:
    """[B, S, H] -> [N, H]: the rows logits_indices names."""
    return g.op("Gather", [g.reshape(hidden, [-1, hidden_size]), LOGITS_INDICES], axis=0)


def hidden_states_output(g: GraphWriter, layer_outputs: list[str], layers: list[int] | tuple[int, ...],
                         hidden_size: int) -> onnx.ValueInfoProto | None:
    """`hidden_states` [N, len(layers) * H]: the outputs of the named decoder layers (the residual stream after
    each, before the final norm) at logits_indices, concatenated in the order named; None when none are named."""
    if not layers:
        return None
    gathered = [gather_positions(g, layer_outputs[layer], hidden_size) for layer in layers]
    joined = gathered[0] if len(gathered) == 1 else g.op("Concat", gathered, axis=-1)
    g.op("Identity", [joined], outputs=[HIDDEN_STATES])
    return value_info(HIDDEN_STATES, FLOAT, [NUM_POSITIONS, len(layers) * hidden_size])

"""LoRA at build time: keep the low-rank inputs for --maxLoraRank > 0, strip them for a lean base engine."""

from __future__ import annotations

import onnx
from onnx import helper

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.lora import ACTIVATION_INPUT

MAX_LORA_RANK = 1024


def has_lora_inputs(model: onnx.ModelProto) -> bool:
    return any(vi.name.startswith("lora_") for vi in model.graph.input)


def check_max_lora_rank(max_lora_rank: int, model: onnx.ModelProto) -> None:
    if not 0 <= max_lora_rank <= MAX_LORA_RANK:
        raise InvalidConfig(f"must be in [0, {MAX_LORA_RANK}], got {max_lora_rank}", "max_lora_rank")
    if max_lora_rank and not has_lora_inputs(model):
        raise InvalidConfig("the ONNX dir has no lora_A/lora_B inputs; re-export with --loraTargets (e.g. all)",
                            "max_lora_rank")


def strip_lora(model: onnx.ModelProto) -> onnx.ModelProto:
    """Remove every `lora_*` branch: each `y + mask * (x @ A) @ B` becomes `y`, and the activation input goes too."""
    graph = model.graph
    kept = []
    for node in graph.node:
        if node.name.startswith("lora_add_"):
            kept.append(helper.make_node("Identity", [node.input[0]], list(node.output), name=node.name))
        elif not node.name.startswith("lora_"):
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    inputs = [vi for vi in graph.input if not vi.name.startswith("lora_") and vi.name != ACTIVATION_INPUT]
    del graph.input[:]
    graph.input.extend(inputs)
    return model

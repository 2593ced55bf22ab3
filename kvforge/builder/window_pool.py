"""llm_build --slidingWindowPool: the sliding layers read and write their own page group through a second table."""

from __future__ import annotations

import onnx

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.model_config import ModelConfig
from kvforge.contract.window_pool import WINDOW_PAGE_TABLE, window_pool_layers
from kvforge.plugins import ops

PAGE_TABLE = "kv_page_table"


def check_window_build(config: ModelConfig, backend: str, speculative: dict[str, bool | int]) -> None:
    """What a sliding-window group cannot be built for yet, refused in one line naming the flag."""
    if not window_pool_layers(config):
        raise InvalidConfig(f"this {config.model} model has no sliding-window layers to give a page group",
                            "sliding_window_pool")
    if backend != "onnxruntime":
        raise InvalidConfig("the sliding-window page group runs on onnxruntime only; build it with --backend "
                            "onnxruntime", "sliding_window_pool")
    if config.is_hybrid or speculative["spec_base"] or speculative["spec_draft"]:
        raise InvalidConfig("the sliding-window page group is for plain engines (no recurrent layers, no "
                            "speculative roles) yet", "sliding_window_pool")


def bind_window_table(model: onnx.ModelProto, config: ModelConfig) -> None:
    """Before lowering: the sliding layers' writes (into a sliding pool) and attentions (with a sliding_window
    attribute) take WINDOW_PAGE_TABLE instead of kv_page_table, a new graph input of the same shape."""
    pools = {f"past_key_values_{i}" for i in window_pool_layers(config)}
    graph = model.graph
    for node in graph.node:
        if node.domain != ops.DOMAIN:
            continue
        sliding = (node.op_type == ops.PAGED_KV_WRITE.name and node.input[-1] in pools) or (
            node.op_type == ops.PAGED_ATTENTION.name
            and any(a.name == "sliding_window" and a.i for a in node.attribute))
        if sliding:
            for index, name in enumerate(node.input):
                if name == PAGE_TABLE:
                    node.input[index] = WINDOW_PAGE_TABLE
    table = next((vi for vi in graph.input if vi.name == PAGE_TABLE), None)
    if table is None:
        raise InvalidConfig("the graph has no kv_page_table input; re-export it with llm_export", "model.onnx")
    window = onnx.ValueInfoProto()
    window.CopyFrom(table)
    window.name = WINDOW_PAGE_TABLE
    graph.input.append(window)


def size_window_pools(model: onnx.ModelProto, config: ModelConfig, window_pages: int) -> None:
    """After lowering: the sliding pools' inputs hold `window_pages` pages (the lowering gave every pool the
    global count)."""
    pools = {f"past_key_values_{i}" for i in window_pool_layers(config)}
    for vi in model.graph.input:
        if vi.name in pools:
            dim = vi.type.tensor_type.shape.dim[0]
            dim.ClearField("dim_param")
            dim.dim_value = window_pages

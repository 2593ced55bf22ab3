"""What every pattern rewrite of the builder shares: an index of a graph's producers and readers, the splice that
swaps nodes in place, and attribute reads."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import onnx


@dataclass(frozen=True, slots=True)
class GraphIndex:
    """Who makes and who reads each tensor of a graph: what a pattern rewrite asks before it replaces nodes."""

    initializers: dict[str, onnx.TensorProto]
    producers: dict[str, onnx.NodeProto]
    consumers: dict[str, list[onnx.NodeProto]]
    outputs: set[str]

    @classmethod
    def of(cls, graph: onnx.GraphProto) -> GraphIndex:
        consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in graph.node:
            for name in node.input:
                consumers[name].append(node)
        return cls({t.name: t for t in graph.initializer}, {out: n for n in graph.node for out in n.output},
                   consumers, {o.name for o in graph.output})


def int_attribute(node: onnx.NodeProto, name: str, default: int | None = None) -> int:
    """A node's int attribute; `default` where the attribute is optional (absent and no default: KeyError)."""
    for attribute in node.attribute:
        if attribute.name == name:
            return attribute.i
    if default is None:
        raise KeyError(f"{node.op_type} {node.name!r} has no attribute {name!r}")
    return default


def names_read(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name a node reads, in `graph` and in the subgraphs of its nodes (If and Loop branches read the
    outer graph's initializers)."""
    read: set[str] = set()
    for node in graph.node:
        read.update(node.input)
        for attribute in node.attribute:
            for sub in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                read |= names_read(sub)
    return read


def drop_unread_initializers(graph: onnx.GraphProto) -> None:
    """Initializers neither a node (subgraphs included) nor a graph output reads: what a rewrite left behind."""
    read = names_read(graph) | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in read]
    if len(kept) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)


def splice(graph: onnx.GraphProto, replaced: dict[int, onnx.NodeProto], removed: set[int]) -> None:
    """Each node whose id is in `replaced` gives way to its replacement (at its place, so the order stays
    topological); the others in `removed` go."""
    kept = [replaced.get(id(n), n) for n in graph.node if id(n) in replaced or id(n) not in removed]
    del graph.node[:]
    graph.node.extend(kept)

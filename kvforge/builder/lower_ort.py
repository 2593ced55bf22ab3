"""Lowers the paged-KV custom ops so ONNX Runtime (CPU) runs the graph: kvforge's CPU kernel, or standard ops.

ONNX Runtime cannot update an input in place, so the lowered graph only *reads* the pool and returns the new
K/V rows as `new_key_values_{i}` [B, S, 2, Hkv, D]; the runtime scatters those into its numpy pool afterwards.
The new rows are rounded through the storage dtype before attention reads them, so a token's output does not
depend on whether its keys came from this call or from the pool. Attention itself is, by preference,
`kvforge.cpu.PagedAttention` (kvforge/plugins/cpu_kernel.py: reads each row's pages in place through the page table,
nothing gathered or copied, so a decode step does not grow with copies of the context); where that library
cannot be built, ONNX Runtime's fused GroupQueryAttention over pages gathered in the graph (the op-by-op form
stays for the dense baseline and `fused_attention=False`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx
from onnx import helper

from kvforge.builder.graph_edit import int_attribute
from kvforge.contract.engine_dir import TIED_HEAD_INPUT, TREE_MASK_INPUT, TREE_POSITIONS_INPUT, new_rows_name
from kvforge.contract.errors import InvalidConfig
from kvforge.graph.onnx_graph import BOOL, FLOAT, FLOAT8E4M3FN, FLOAT16, INT32, INT64, GraphWriter, value_info
from kvforge.plugins import ops

NEW_ROWS_ELEM_TYPES = {"fp16": FLOAT16, "fp8": FLOAT, "fp32": FLOAT}


@dataclass(slots=True)
class Shared:
    """Tensors every layer needs once: masks depend only on lengths and the page-table width."""

    g: GraphWriter
    group: int
    masks: dict[str, str] = field(default_factory=dict)
    fp8_table: str | None = None


def lower_for_onnxruntime(model: onnx.ModelProto, *, kv_cache_dtype: str, tokens_per_page: int,
                          num_pages: int, dense: bool = False, fused_attention: bool = True,
                          cpu_kernel: bool = False, tree_inputs: bool = False,
                          kernel_rope: bool = False) -> onnx.ModelProto:
    """Replace PagedKVWrite/PagedAttention pairs. `cpu_kernel=True` attends with kvforge.cpu.PagedAttention (the
    session must register kvforge/plugins/cpu_kernel.py's library). `dense=True` writes the unpaged baseline instead:
    per-layer `past_key_{i}`/`past_value_{i}` [B,Hkv,L,D] in, `present_key_{i}`/`present_value_{i}` out.
    `tree_inputs=True` (with cpu_kernel) adds tree attention: RoPE positions from TREE_POSITIONS_INPUT and the
    kernel's mask from TREE_MASK_INPUT (see kvforge/contract/engine_dir.py). `kernel_rope=True` (with cpu_kernel)
    lowers each write/attention pair to kvforge.cpu.PagedAttentionRope where the query's RoPE can be traced back:
    the kernel rotates Q and K and writes the pool in place, so the graph has no new_key_values_* outputs
    (kernel_writes_kv says which form a lowered graph is)."""
    if cpu_kernel and (dense or not fused_attention):
        raise ValueError("cpu_kernel lowers the paged graph; dense and op-by-op forms use standard ops only")
    if tree_inputs and not cpu_kernel:
        raise ValueError("tree attention needs the kvforge CPU kernel (its attention_mask input)")
    graph = model.graph
    writes = {n.output[0]: n for n in graph.node if n.domain == ops.DOMAIN and n.op_type == ops.PAGED_KV_WRITE.name}
    if not any(n.domain == ops.DOMAIN and n.op_type == ops.PAGED_ATTENTION.name for n in graph.node):
        raise InvalidConfig("graph has no kvforge.PagedAttention nodes; was it exported by llm_export?", "model.onnx")
    first_attention = next(n for n in graph.node if n.op_type == ops.PAGED_ATTENTION.name)
    num_q = int_attribute(first_attention, "num_q_heads")
    num_kv = int_attribute(first_attention, "num_kv_heads")
    shared = Shared(GraphWriter(prefix="lowered/"), group=num_q // num_kv)
    # Each layer's un-rotated query, where the whole graph's attention can take RoPE and the write inside.
    unrotated = _unrotated_queries(graph, writes) if cpu_kernel and kernel_rope else {}
    if tree_inputs and any(int_attribute(n, "sliding_window", 0)
                           for n in graph.node if n.op_type == ops.PAGED_ATTENTION.name):
        raise InvalidConfig("tree attention (speculative verification) is not supported on a model with "
                            "sliding-window layers yet", "spec_decode")
    pending_writes: dict[str, tuple[str, str, str]] = {}  # pool output -> (key, value, pool input)
    new_nodes: list[onnx.NodeProto] = []
    new_rows: dict[str, tuple[str, str, str]] = {}  # pool output -> (pool input, new rows float, new rows out)
    shared_pools: set[str] = set()  # pools read only: another engine's, as many pages as it has
    inputs = {vi.name: vi for vi in graph.input}
    extra_inputs, outputs = [], [o for o in graph.output if o.name not in writes]
    for node in graph.node:
        g = shared.g
        start = len(g.nodes)
        if node.domain == ops.DOMAIN and node.op_type == ops.PAGED_KV_WRITE.name and unrotated:
            key, value, _, _, _, _, pool_in = node.input
            pending_writes[node.output[0]] = (key, value, pool_in)  # written by the attention node's kernel
            continue
        if node.domain == ops.DOMAIN and node.op_type == ops.PAGED_ATTENTION.name and node.input[1] in pending_writes:
            key, value, pool_in = pending_writes[node.input[1]]
            _kernel_rope_attention(g, unrotated[node.name], key, value, pool_in, node, num_kv, tokens_per_page,
                                   tree_inputs)
            new_nodes.extend(g.nodes[start:])
            continue
        if node.domain == ops.DOMAIN and node.op_type == ops.PAGED_KV_WRITE.name:
            key, value, _, _, _, _, pool_in = node.input
            head_dim = int_attribute(node, "head_dim")
            rows = _lower_write(g, key, value, num_kv, head_dim, kv_cache_dtype, int_attribute(node, "rotary_dim", 0))
            rows_out = rows_float = rows
            if not dense:
                rows_out = g.op("Identity", [_to_storage_output(g, rows, kv_cache_dtype)],
                                outputs=[new_rows_name(pool_in)])
                rows_float = _round_through_storage(g, rows, kv_cache_dtype)
                outputs.append(value_info(rows_out, NEW_ROWS_ELEM_TYPES[kv_cache_dtype],
                                          ["batch", "seq", 2, num_kv, head_dim]))
            new_rows[node.output[0]] = (pool_in, rows_float, rows_out)
        elif node.domain == ops.DOMAIN and node.op_type == ops.PAGED_ATTENTION.name:
            query, pool_out, _, start_index, page_table = node.input
            head_dim = int_attribute(node, "head_dim")
            if pool_out not in new_rows:  # a KV-shared layer (Gemma4 MTP): reads a pool it does not write
                if not cpu_kernel:
                    raise InvalidConfig("a layer reading another engine's KV pool needs the kvforge CPU kernel; "
                                        "build it with --cpuAttention kernel", "cpu_attention")
                _read_only_attention(g, query, pool_out, page_table, start_index, node, num_kv, head_dim,
                                     tokens_per_page)
                shared_pools.add(pool_out)
                new_nodes.extend(g.nodes[start:])
                continue
            pool_in, rows, _ = new_rows[pool_out]
            if dense:
                layer = pool_in.rsplit("_", 1)[1]
                cached, present = _dense_cache(g, rows, layer)
                for name in present:
                    outputs.append(value_info(name, FLOAT, ["batch", num_kv, "total", head_dim]))
                for name in (f"past_key_{layer}", f"past_value_{layer}"):
                    extra_inputs.append(value_info(name, FLOAT, ["batch", num_kv, "past", head_dim]))
            elif cpu_kernel:
                _kernel_attention(g, query, rows, pool_in, page_table, start_index, node, num_kv, head_dim,
                                  tokens_per_page, TREE_MASK_INPUT if tree_inputs else "")
            elif fused_attention:
                group_query_attention(g, shared, query, pool_in, page_table, rows, start_index, kv_cache_dtype,
                                       num_kv, head_dim, _attr_f(node, "scale"), node.output[0],
                                       int_attribute(node, "sliding_window", 0))
            else:
                cached = _gather_pages(g, pool_in, page_table, rows, kv_cache_dtype, shared, num_kv, head_dim)
            if dense or not fused_attention:
                _attend(g, shared, query, cached, start_index, num_kv, head_dim, _attr_f(node, "scale"),
                        node.output[0], int_attribute(node, "sliding_window", 0))
        else:
            new_nodes.append(node)
            continue
        new_nodes.extend(g.nodes[start:])
    if dense:
        kept = [vi for name, vi in inputs.items() if not name.startswith("past_key_values_")
                and name != "kv_page_table"]
    else:
        kept = [vi for vi in inputs.values()]
        for vi in kept:
            if vi.name.startswith("past_key_values_"):
                _fix_pool_shape(vi, 0 if vi.name in shared_pools else num_pages, tokens_per_page)
    if unrotated:  # the queries' in-graph RoPE (and, with no other reader, the table's Gather) are now dead
        new_nodes = _live_nodes(new_nodes, {o.name for o in outputs})
    if tree_inputs:
        if not unrotated or _rope_gathers(new_nodes):  # some RoPE is still in the graph: it takes the positions too
            new_nodes = _positions_from_input(new_nodes, shared.g)
        extra_inputs += [value_info(TREE_POSITIONS_INPUT, INT32, ["batch", "seq"]),
                         value_info(TREE_MASK_INPUT, BOOL, ["batch", "mask_rows", "mask_cols"])]
    del graph.node[:]
    graph.node.extend(new_nodes)
    graph.initializer.extend(shared.g.initializers)
    del graph.input[:]
    graph.input.extend(kept + extra_inputs)
    del graph.output[:]
    graph.output.extend(outputs)
    opsets = [op for op in model.opset_import if op.domain != ops.DOMAIN]
    if cpu_kernel:
        opsets.append(helper.make_opsetid(ops.CPU_DOMAIN, 1))
    elif fused_attention and not dense and all(op.domain != "com.microsoft" for op in opsets):
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    lowered = helper.make_model(graph, opset_imports=opsets,
                                producer_name="kvforge-builder")
    return lowered


def kernel_writes_kv(model: onnx.ModelProto) -> bool:
    """Whether a lowered graph attends with kvforge.cpu.PagedAttentionRope (the kernel writes the pools in place:
    engine_dir's BuilderConfig.kernel_kv_write)."""
    return any(n.domain == ops.CPU_DOMAIN and n.op_type == ops.CPU_PAGED_ATTENTION_ROPE.name for n in model.graph.node)


def _unrotated_queries(graph: onnx.GraphProto, writes: dict[str, onnx.NodeProto]) -> dict[str, str]:
    """Attention node name -> its query before graph.rope.apply_rope, for every layer that writes its own pool; empty
    when any such layer's query does not come out of that pattern (the graph then keeps the separate form)."""
    producers = {out: n for n in graph.node for out in n.output}
    found: dict[str, str] = {}
    for node in graph.node:
        if node.domain != ops.DOMAIN or node.op_type != ops.PAGED_ATTENTION.name or node.input[1] not in writes:
            continue
        source = _rope_source(producers, node.input[0])
        if source is None:
            return {}
        found[node.name] = source
    return found


def _rope_source(producers: dict[str, onnx.NodeProto], rotated: str) -> str | None:
    """x for rotated = apply_rope(x, ..., "rope_cos", "rope_sin"): Reshape <- Concat [<- Concat] <- Sub <- Mul(x1,
    rope_cos), x1 from a Split [<- the partial-rotary Split] <- Reshape(x); None for anything else."""
    def producer(name: str | None, op_type: str) -> onnx.NodeProto | None:
        node = producers.get(name) if name is not None else None
        return node if node is not None and node.op_type == op_type else None

    def first_input(node: onnx.NodeProto | None) -> str | None:
        return node.input[0] if node is not None and node.input else None

    joined = producer(first_input(producer(rotated, "Reshape")), "Concat")
    inner = producer(first_input(joined), "Concat")  # partial rotary: [rotated halves, passed dims]
    mul = producer(first_input(producer(first_input(joined if inner is None else inner), "Sub")), "Mul")
    if mul is None or list(mul.input)[1:] != ["rope_cos"]:
        return None
    halves = producer(mul.input[0], "Split")
    partial = producer(first_input(halves), "Split")
    heads = halves if partial is None else partial
    return first_input(producer(first_input(heads), "Reshape"))


def _kernel_rope_attention(g: GraphWriter, query: str, key: str, value: str, pool: str, node: onnx.NodeProto,
                           num_kv: int, tokens_per_page: int, tree_inputs: bool) -> None:
    """kvforge.cpu.PagedAttentionRope: un-rotated query and key, the table and (tree) positions; the kernel writes
    the rounded rows into `pool` in place and attends over the cached positions and them."""
    _, _, _, start_index, page_table = node.input
    inputs = [query, key, value, pool, page_table, start_index, "context_lengths", "rope_rotary_cos_sin"]
    if tree_inputs:
        inputs += [TREE_POSITIONS_INPUT, TREE_MASK_INPUT]
    g.op(ops.CPU_PAGED_ATTENTION_ROPE.name, inputs, outputs=[node.output[0]], domain=ops.CPU_DOMAIN,
         num_q_heads=int_attribute(node, "num_q_heads"), num_kv_heads=num_kv, head_dim=int_attribute(node, "head_dim"),
         tokens_per_page=tokens_per_page, scale=_attr_f(node, "scale"), **_window_attribute(node))


def _window_attribute(node: onnx.NodeProto) -> dict[str, int]:
    """The kernel's sliding_window attribute where the export's PagedAttention has one (Gemma's local layers)."""
    window = int_attribute(node, "sliding_window", 0)
    return {"sliding_window": window} if window else {}


def _rope_gathers(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    return [n for n in nodes if n.op_type == "Gather" and n.input[0] == "rope_rotary_cos_sin"]


def _live_nodes(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """The nodes some graph output depends on (names read inside subgraphs, an If's branches, count as read)."""
    needed, kept = set(outputs), []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(_reads(node))
    return kept[::-1]


def _reads(node: onnx.NodeProto) -> set[str]:
    names = set(node.input)
    for attribute in node.attribute:
        for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
            for inner in sub.node:
                names |= _reads(inner)
    return names


def share_tied_head(model: onnx.ModelProto, head_initializer: str = "lm_head.weight") -> bool:
    """A tied model's float LM head reads the runtime's embedding table: MatMul(x, W^T initializer) becomes
    Gemm(x, TIED_HEAD_INPUT, transB=1) and the initializer goes (113 MB for SmolLM2; a non-initializer B
    measured as fast as MLAS's prepacked one at one row). A quantized head's exact rescoring (Gather of its
    candidates' rows from the float [V, H] head, families/llama.py rescore_candidates) reads the same table in place.
    False when the graph has no float head."""
    graph = model.graph
    weight = next((t for t in graph.initializer if t.name == head_initializer), None)
    users = [n for n in graph.node if head_initializer in n.input]
    if weight is None or not users:
        return False
    if all(n.op_type == "Gather" and n.input[0] == head_initializer for n in users):
        vocab, hidden = weight.dims
        for node in users:
            node.input[0] = TIED_HEAD_INPUT
    elif len(users) == 1 and users[0].op_type == "MatMul" and users[0].input[1] == head_initializer:
        hidden, vocab = weight.dims
        node = users[0]
        gemm = helper.make_node("Gemm", [node.input[0], TIED_HEAD_INPUT], list(node.output), name=node.name,
                                transB=1)
        graph.node.insert(list(graph.node).index(node), gemm)
        graph.node.remove(node)
    else:
        return False
    graph.initializer.remove(weight)
    graph.input.append(value_info(TIED_HEAD_INPUT, FLOAT, [vocab, hidden]))
    return True


def _attr_f(node: onnx.NodeProto, name: str) -> float:
    return next(a.f for a in node.attribute if a.name == name)


def _lower_write(g: GraphWriter, key: str, value: str, num_kv: int, head_dim: int, kv_cache_dtype: str,
                 rotary_dim: int = 0) -> str:
    """Rotated keys and values stacked as [B, S, 2, Hkv, D] float32."""
    from kvforge.graph.rope import apply_rope  # the same RoPE the queries got

    rotated = apply_rope(g, key, num_kv, head_dim, "rope_cos", "rope_sin", rotary_dim)
    k = g.reshape(rotated, [0, 0, 1, num_kv, head_dim])
    v = g.reshape(value, [0, 0, 1, num_kv, head_dim])
    return g.op("Concat", [k, v], axis=2)


def _to_storage_output(g: GraphWriter, rows: str, kv_cache_dtype: str) -> str:
    if kv_cache_dtype == "fp16":
        return g.cast(rows, FLOAT16)
    return _round_through_storage(g, rows, kv_cache_dtype)  # fp8 leaves as exact float32 values


def _round_through_storage(g: GraphWriter, rows: str, kv_cache_dtype: str) -> str:
    if kv_cache_dtype == "fp32":
        return rows
    storage = FLOAT16 if kv_cache_dtype == "fp16" else FLOAT8E4M3FN
    return g.cast(g.cast(rows, storage), FLOAT)


def _fp8_table(g: GraphWriter, shared: Shared) -> str:
    """float32 value of each E4M3 bit pattern: dequantising a uint8 pool is one Gather."""
    if shared.fp8_table is None:
        table = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        table = np.nan_to_num(table, nan=0.0)  # NaN patterns are never written; keep the table finite
        shared.fp8_table = g.weight("lowered/fp8_e4m3_to_float", table)
    return shared.fp8_table


def _cached_pages(g: GraphWriter, pool: str, page_table: str, kv_cache_dtype: str, shared: Shared, num_kv: int,
                  head_dim: int) -> str:
    """[B, 2, Hkv, P*T, D]: each row's pages in order, fp16 still fp16 (fp8 decoded to float32 by table)."""
    safe_pages = g.op("Max", [page_table, g.const(0, np.int32)])  # -1 entries are masked out later
    pages = g.op("Gather", [pool, safe_pages], axis=0)  # [B, P, 2, Hkv, T, D]
    if kv_cache_dtype == "fp8":
        pages = g.op("Gather", [_fp8_table(g, shared), g.cast(pages, INT32)], axis=0)
    return g.reshape(g.transpose(pages, [0, 2, 3, 1, 4, 5]), [0, 2, num_kv, -1, head_dim])


def _gather_pages(g: GraphWriter, pool: str, page_table: str, rows: str, kv_cache_dtype: str,
                  shared: Shared, num_kv: int, head_dim: int) -> str:
    """[B, 2, Hkv, P*T + S, D] float32: the row's cached pages followed by its new rows."""
    cached = _cached_pages(g, pool, page_table, kv_cache_dtype, shared, num_kv, head_dim)
    new = g.transpose(rows, [0, 2, 3, 1, 4])  # [B, 2, Hkv, S, D]
    if kv_cache_dtype == "fp16":
        new = g.cast(new, FLOAT16)  # exact: the rows were already rounded to fp16
        return g.cast(g.op("Concat", [cached, new], axis=3), FLOAT)
    return g.op("Concat", [cached, new], axis=3)


def group_query_attention(g: GraphWriter, shared: Shared, query: str, pool: str, page_table: str, rows: str,
                           start_index: str, kv_cache_dtype: str, num_kv: int, head_dim: int, scale: float,
                           output: str, sliding_window: int = 0) -> None:
    """Attention as ONNX Runtime's fused GroupQueryAttention: the row's gathered pages are the BNSH past (its
    first kvcache_start_index[b] slots valid), the new rows are right-padded chunks (`query_seqlens`), so
    masking, GQA head sharing, scaling and softmax run in one kernel instead of a dozen nodes per layer.
    Queries and keys arrive rotated (the export applies RoPE), so do_rotary stays 0. A sliding window is its
    local_window_size (the same count: tests/parity/test_gemma3_parity.py pins it against transformers)."""
    cached = _cached_pages(g, pool, page_table, kv_cache_dtype, shared, num_kv, head_dim)
    if kv_cache_dtype == "fp16":
        cached = g.cast(cached, FLOAT)
    past_k, past_v = g.op("Split", [cached], n_out=2, axis=1, num_outputs=2)
    past_k, past_v = g.op("Squeeze", [past_k, g.const([1])]), g.op("Squeeze", [past_v, g.const([1])])
    new_k, new_v = g.op("Split", [rows], n_out=2, axis=2, num_outputs=2)  # [B, S, 1, Hkv, D] each
    new_k = g.reshape(new_k, [0, 0, num_kv * head_dim])
    new_v = g.reshape(new_v, [0, 0, num_kv * head_dim])
    if "gqa_lengths" not in shared.masks:
        lengths = g.cast("context_lengths", INT32)
        shared.masks["gqa_lengths"] = lengths
        shared.masks["gqa_seqlens_k"] = g.op("Sub", [g.add(g.cast(start_index, INT32), lengths),
                                                    g.const(1, np.int32)])
        past_len = g.dim(past_k, 2)
        seq = g.dim(query, 1)
        shared.masks["gqa_total"] = g.op("Squeeze", [g.cast(g.add(past_len, seq), INT32), g.const([0])])
    g.op("GroupQueryAttention",
         [query, new_k, new_v, past_k, past_v, shared.masks["gqa_seqlens_k"], shared.masks["gqa_total"],
          "", "", "", "", "", "", "", "", "", shared.masks["gqa_lengths"]],
         n_out=3, outputs=[output, g.fresh("gqa_present_key"), g.fresh("gqa_present_value")],
         domain="com.microsoft", num_heads=num_kv * shared.group, kv_num_heads=num_kv, scale=scale,
         **({"local_window_size": sliding_window} if sliding_window else {}))


def _kernel_attention(g: GraphWriter, query: str, rows: str, pool: str, page_table: str, start_index: str,
                      node: onnx.NodeProto, num_kv: int, head_dim: int, tokens_per_page: int, mask: str = "") -> None:
    """kvforge.cpu.PagedAttention: the cached positions straight from the pool through the page table, this
    call's rows (already rounded through the storage dtype) beside them; causal among the new tokens, or as `mask`
    (a tree) says. The page size is the build's (export leaves the attribute 0)."""
    inputs = [query, rows, pool, page_table, start_index, "context_lengths"] + ([mask] if mask else [])
    g.op(ops.CPU_PAGED_ATTENTION.name, inputs,
         outputs=[node.output[0]], domain=ops.CPU_DOMAIN, num_q_heads=int_attribute(node, "num_q_heads"),
         num_kv_heads=num_kv, head_dim=head_dim, tokens_per_page=tokens_per_page, scale=_attr_f(node, "scale"),
         **_window_attribute(node))


def _read_only_attention(g: GraphWriter, query: str, pool: str, page_table: str, start_index: str,
                         node: onnx.NodeProto, num_kv: int, head_dim: int, tokens_per_page: int) -> None:
    """The kernel over the cached positions [0, start) of `pool` only: this call's queries bring no keys (zero rows
    that an all-false mask hides), so nothing is written and the pool may be another engine's."""
    batch, seq = g.dim(query, 0), g.dim(query, 1)
    rows = g.op("ConstantOfShape", [g.op("Concat", [batch, seq, g.const([2, num_kv, head_dim])], axis=0)],
                value=helper.make_tensor("zero", onnx.TensorProto.FLOAT, [1], [0.0]))
    hidden = g.op("ConstantOfShape", [g.op("Concat", [batch, seq, seq], axis=0)],
                  value=helper.make_tensor("unseen", onnx.TensorProto.BOOL, [1], [False]))
    _kernel_attention(g, query, rows, pool, page_table, start_index, node, num_kv, head_dim, tokens_per_page, hidden)


def _positions_from_input(nodes: list[onnx.NodeProto], g: GraphWriter) -> list[onnx.NodeProto]:
    """Tree attention: the one Gather of the RoPE table (export's rope_inputs: queries and, in this lowering, keys
    rotate by it) takes TREE_POSITIONS_INPUT, clamped like the export's start + i, instead of start + i."""
    gathers = _rope_gathers(nodes)
    if len(gathers) != 1:
        raise InvalidConfig(f"tree attention needs one Gather of rope_rotary_cos_sin, the graph has {len(gathers)}",
                            "model.onnx")
    start = len(g.nodes)
    capacity = g.dim("rope_rotary_cos_sin", 0)
    positions = g.op("Min", [g.cast(TREE_POSITIONS_INPUT, INT64), g.op("Sub", [capacity, g.const([1])])],
                     name="tree_rope_positions")
    gathers[0].input[1] = positions
    at = nodes.index(gathers[0])
    return nodes[:at] + g.nodes[start:] + nodes[at:]


def _dense_cache(g: GraphWriter, rows: str, layer: str) -> tuple[str, tuple[str, str]]:
    new = g.transpose(rows, [2, 0, 3, 1, 4])  # [2, B, Hkv, S, D]
    new_k, new_v = g.op("Split", [new], n_out=2, axis=0, num_outputs=2)
    present_k = g.op("Concat", [f"past_key_{layer}", g.op("Squeeze", [new_k, g.const([0])])], axis=2,
                     outputs=[f"present_key_{layer}"])
    present_v = g.op("Concat", [f"past_value_{layer}", g.op("Squeeze", [new_v, g.const([0])])], axis=2,
                     outputs=[f"present_value_{layer}"])
    both = g.op("Concat", [g.unsqueeze(present_k, [1]), g.unsqueeze(present_v, [1])], axis=1)
    return both, (present_k, present_v)


def _masks(g: GraphWriter, shared: Shared, query: str, keys: str, start_index: str) -> str:
    """Bool [B, 1, S*G, C+S]: cached slot c visible iff c < start[b]; new key j visible iff j <= query s.

    Query rows are ordered (s, g) so a row's token is row // G. Built once and reused by every layer.
    """
    if "mask" in shared.masks:
        return shared.masks["mask"]
    seq = g.op("Squeeze", [g.dim(query, 1), g.const([0])])
    total = g.op("Squeeze", [g.dim(keys, 3), g.const([0])])
    cached_len = g.op("Sub", [total, seq])
    batch = g.dim(query, 0)
    rows = g.op("Mul", [seq, g.const(shared.group)])
    row_token = g.op("Div", [g.op("Range", [g.const(0), rows, g.const(1)]), g.const(shared.group)])
    new_keys = g.op("Range", [g.const(0), seq, g.const(1)])
    visible_new = g.op("LessOrEqual", [g.unsqueeze(new_keys, [0]), g.unsqueeze(row_token, [1])])  # [SG, S]
    slots = g.op("Range", [g.const(0), cached_len, g.const(1)])
    start = g.unsqueeze(g.cast(start_index, INT64), [1])
    visible_cached = g.op("Less", [g.unsqueeze(slots, [0]), start])  # [B, C]
    rows_1d = g.unsqueeze(rows, [0])
    shape_c = g.op("Concat", [batch, g.const([1]), rows_1d, g.unsqueeze(cached_len, [0])], axis=0)
    shape_n = g.op("Concat", [batch, g.const([1]), rows_1d, g.unsqueeze(seq, [0])], axis=0)
    mask = g.op("Concat", [g.op("Expand", [g.unsqueeze(visible_cached, [1, 2]), shape_c]),
                           g.op("Expand", [g.unsqueeze(visible_new, [0, 1]), shape_n])], axis=-1)
    shared.masks["mask"] = mask
    return mask


def _window_mask(g: GraphWriter, shared: Shared, query: str, keys: str, start_index: str, window: int) -> str:
    """The causal mask narrowed to a sliding window: query token s (position start + s) sees key slot c (position c:
    cached slots, then the new tokens at start + j) iff c > start + s - window. Built once per window size."""
    if f"window_{window}" not in shared.masks:
        seq, total = (g.op("Squeeze", [g.dim(x, axis), g.const([0])]) for x, axis in ((query, 1), (keys, 3)))
        rows = g.op("Mul", [seq, g.const(shared.group)])
        row_token = g.op("Div", [g.op("Range", [g.const(0), rows, g.const(1)]), g.const(shared.group)])  # [SG]
        start = g.unsqueeze(g.cast(start_index, INT64), [1, 2])  # [B, 1, 1]
        slots, cached_len = g.op("Range", [g.const(0), total, g.const(1)]), g.op("Sub", [total, seq])
        # Slot c >= cached_len is new token c - cached_len, at position start + c - cached_len.
        positions = g.op("Where", [g.unsqueeze(g.op("GreaterOrEqual", [slots, cached_len]), [0, 1]),
                                   g.add(start, g.unsqueeze(g.op("Sub", [slots, cached_len]), [0, 1])),
                                   g.unsqueeze(slots, [0, 1])])  # [B, 1, C + S]
        first = g.op("Sub", [g.add(start, g.unsqueeze(row_token, [0, 2])), g.const(window - 1)])  # [B, SG, 1]
        inside = g.op("GreaterOrEqual", [positions, first])  # [B, SG, C + S]
        causal = _masks(g, shared, query, keys, start_index)
        shared.masks[f"window_{window}"] = g.op("And", [causal, g.unsqueeze(inside, [1])])
    return shared.masks[f"window_{window}"]


def _attend(g: GraphWriter, shared: Shared, query: str, keys_values: str, start_index: str, num_kv: int,
            head_dim: int, scale: float, output: str, sliding_window: int = 0) -> None:
    group = shared.group
    q = g.transpose(g.reshape(query, [0, 0, num_kv, group, head_dim]), [0, 2, 1, 3, 4])  # [B,Hkv,S,G,D]
    q = g.reshape(q, [0, num_kv, -1, head_dim])  # rows ordered (s, g)
    k, v = g.op("Split", [keys_values], n_out=2, axis=1, num_outputs=2)
    k = g.op("Squeeze", [k, g.const([1])])
    v = g.op("Squeeze", [v, g.const([1])])
    scores = g.mul(g.matmul(q, g.transpose(k, [0, 1, 3, 2])), g.const(scale, np.float32))
    mask = _window_mask(g, shared, query, keys_values, start_index, sliding_window) if sliding_window else \
        _masks(g, shared, query, keys_values, start_index)
    scores = g.op("Where", [mask, scores, g.const(np.finfo(np.float32).min, np.float32)])
    attn = g.matmul(g.op("Softmax", [scores], axis=-1), v)  # [B, Hkv, S*G, D]
    attn = g.transpose(g.reshape(attn, [0, num_kv, -1, group, head_dim]), [0, 2, 1, 3, 4])
    g.op("Reshape", [attn, g.const([0, 0, num_kv * group * head_dim])], outputs=[output])


def _fix_pool_shape(vi: onnx.ValueInfoProto, num_pages: int, tokens_per_page: int) -> None:
    """Fix the page size and, unless `num_pages` is 0 (a shared pool), the page count."""
    dims = vi.type.tensor_type.shape.dim
    if num_pages:
        dims[0].ClearField("dim_param")
        dims[0].dim_value = num_pages
    dims[3].ClearField("dim_param")
    dims[3].dim_value = tokens_per_page


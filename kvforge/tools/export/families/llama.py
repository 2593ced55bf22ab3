"""The llama family (Llama, SmolLM, Qwen2, Qwen3), registered once: its decoder as an ONNX graph with paged-KV custom
ops, and its HF config mapping, weight names, synthetic models and random weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

from kvforge.contract.errors import KvforgeError
from kvforge.contract.lora import ACTIVATION_INPUT, lora_a_name, lora_b_name, target_dims
from kvforge.contract.model_config import ModelConfig
from kvforge.graph.onnx_graph import FLOAT, FLOAT16, INT32, INT64, OPSET, UINT8, GraphWriter, value_info
from kvforge.graph.positions import (
    attach_hidden_states,
    gather_positions,
    logits_indices_input,
    logits_output,
)
from kvforge.graph.rope import apply_rope
from kvforge.plugins import ops
from kvforge.tools.export.families.registry import Family, register
from kvforge.tools.export.quantize import LM_HEAD, BlockQuantized, concat_columns
from kvforge.tools.export.sources.hf_common import FIELD

if TYPE_CHECKING:
    from kvforge.tools.export.sources.base import LoadedModel


POOL_ELEM_TYPES = {"fp16": FLOAT16, "fp8": UINT8, "fp32": FLOAT}
ORT_DOMAIN = "com.microsoft"
# MatMulNBits' accuracy_level per weight width, chosen by measurement on an AVX-512 VNNI CPU (2 threads,
# a 576x1536 layer): 4-bit blocks run as fast with float activations (level 0: 43 us at 1 row, 3.1 ms at 512)
# as with int8 ones (level 4: 46 us, 5.0 ms), and level 0 is exact; 8-bit blocks have no float-activation
# kernel (level 0 dequantizes the whole weight per call: 2.0 ms at 1 row), so they take level 4 (17 us).
ACCURACY_LEVELS = {4: 0, 8: 4}
# A quantized LM head only ranks the vocabulary (its candidates are rescored against the float head), so it takes
# the fastest level at both widths: int8 activations (SmolLM2's head, one row: 4-bit 0.40 ms vs 1.13 ms at level 0;
# 8-bit has no fast level-0 kernel at all).
HEAD_ACCURACY_LEVEL = 4


def pool_input_name(layer: int) -> str:
    return f"past_key_values_{layer}"


def pool_output_name(layer: int) -> str:
    return f"present_key_values_{layer}"


def build_llama_graph(config: ModelConfig, weights: dict[str, np.ndarray],
                      progress: Callable[[int], None] | None = None,
                      quantized: dict[str, BlockQuantized] | None = None) -> onnx.ModelProto:
    """Embeddings come in as `inputs_embeds` (the runtime looks them up); logits go out at the positions
    `logits_indices` names (graph/positions.py), with `hidden_states` of config.hidden_state_layers when it names
    any. Linears named in `quantized` become MatMulNBits (ONNX Runtime's block-quantized matmul)."""
    g = GraphWriter()
    prefill = None
    if quantized and config.prefill_int8_rows:
        rows = g.op("ReduceProd", [g.op("Shape", ["inputs_embeds"], end=2)], keepdims=0)
        prefill = g.op("GreaterOrEqual", [rows, g.const(config.prefill_int8_rows)], name="is_prefill")
    linears = _Linears(weights, quantized or {}, prefill, g)
    num_q, num_kv, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    hidden = "inputs_embeds"
    rope_cos, rope_sin = rope_inputs(g, hidden)
    graph_inputs = [
        value_info("inputs_embeds", FLOAT, ["batch", "seq", config.hidden_size]),
        value_info("context_lengths", INT32, ["batch"]),
        value_info("kvcache_start_index", INT32, ["batch"]),
        value_info("kv_page_table", INT32, ["batch", "pages_per_seq"]),
        value_info("rope_rotary_cos_sin", FLOAT, ["capacity", head_dim]),
        logits_indices_input(),
    ]
    graph_outputs = []
    layer_outputs = []
    activation = LoraActivation(graph_inputs)
    for layer in range(config.num_hidden_layers):
        w = _layer_weights(g, weights, layer)
        linear = linears.for_layer(layer)  # o_proj and down_proj; q/k/v and gate/up go through linears.fused
        x = g.rms_norm(hidden, w["input_layernorm"], config.rms_norm_eps)
        lora = LoraInputs(config, layer, graph_inputs, activation)
        q, k, v = linears.fused(g, x, layer, ("q_proj", "k_proj", "v_proj"), weights)
        q, k, v = (lora.apply(g, target, x, y) for target, y in zip("qkv", (q, k, v), strict=True))
        if config.qk_norm:  # Qwen3 normalises each head before RoPE
            q = _head_norm(g, q, num_q, head_dim, w["q_norm"], config.rms_norm_eps)
            k = _head_norm(g, k, num_kv, head_dim, w["k_norm"], config.rms_norm_eps)
        q = apply_rope(g, q, num_q, head_dim, rope_cos, rope_sin)
        pool_in, pool_out = pool_input_name(layer), pool_output_name(layer)
        graph_inputs.append(value_info(pool_in, POOL_ELEM_TYPES[config.kv_cache_dtype],
                                       ["num_pages", 2, num_kv, "tokens_per_page", head_dim]))
        graph_outputs.append(value_info(pool_out, POOL_ELEM_TYPES[config.kv_cache_dtype],
                                        ["num_pages", 2, num_kv, "tokens_per_page", head_dim]))
        g.op(ops.PAGED_KV_WRITE.name, [k, v, "rope_rotary_cos_sin", "context_lengths", "kvcache_start_index",
                                       "kv_page_table", pool_in],
             outputs=[pool_out], domain=ops.DOMAIN, name=f"paged_kv_write_{layer}",
             num_kv_heads=num_kv, head_dim=head_dim, tokens_per_page=0)
        attn = g.op(ops.PAGED_ATTENTION.name, [q, pool_out, "context_lengths", "kvcache_start_index",
                                               "kv_page_table"],
                    domain=ops.DOMAIN, name=f"paged_attention_{layer}", num_q_heads=num_q,
                    num_kv_heads=num_kv, head_dim=head_dim, tokens_per_page=0,
                    scale=float(head_dim ** -0.5))
        hidden = g.add(hidden, lora.apply(g, "o", attn, linear(g, attn, "o_proj")))
        x = g.rms_norm(hidden, w["post_attention_layernorm"], config.rms_norm_eps)
        gate, up = linears.fused(g, x, layer, ("gate_proj", "up_proj"), weights)
        gate, up = lora.apply(g, "gate", x, gate), lora.apply(g, "up", x, up)
        mlp = g.mul(g.mul(gate, g.op("Sigmoid", [gate])), up)
        hidden = g.add(hidden, lora.apply(g, "down", mlp, linear(g, mlp, "down_proj")))
        layer_outputs.append(hidden)
        if progress:
            progress(layer)
    logits = _position_logits(g, hidden, config, weights, linears)
    g.op("Identity", [logits], outputs=["logits"])
    graph_outputs.insert(0, logits_output(config.vocab_size))
    attach_hidden_states(g, layer_outputs, config.hidden_state_layers, config.hidden_size, graph_inputs, graph_outputs)
    graph = helper.make_graph(g.nodes, "kvforge_llm", graph_inputs, graph_outputs, g.initializers)
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(ops.DOMAIN, ops.OPSET_VERSION)]
    if quantized:
        opsets.append(helper.make_opsetid(ORT_DOMAIN, 1))
    return helper.make_model(graph, opset_imports=opsets, producer_name="kvforge")


def rope_inputs(g: GraphWriter, embeds: str) -> tuple[str, str]:
    """Positions start+i and their cos/sin [B,S,1,D/2], computed once and shared by every layer.

    The tensors are named `rope_cos` / `rope_sin` so backend lowerings can reuse them for the keys.
    """
    seq = g.dim(embeds, 1)
    steps = g.op("Range", [g.const(0), g.op("Squeeze", [seq, g.const([0])]), g.const(1)])
    start = g.unsqueeze(g.cast("kvcache_start_index", INT64), [1])
    positions = g.add(start, g.unsqueeze(steps, [0]))  # [B, S]
    # Padded rows may run past the table; clamp so Gather stays in range (their results are discarded).
    capacity = g.dim("rope_rotary_cos_sin", 0)
    last = g.op("Sub", [capacity, g.const([1])])
    positions = g.op("Min", [positions, last], name="rope_positions")
    table = g.op("Gather", ["rope_rotary_cos_sin", positions], axis=0)  # [B, S, D]
    cos, sin = g.split_halves(table)
    return _named(g, g.unsqueeze(cos, [2]), "rope_cos"), _named(g, g.unsqueeze(sin, [2]), "rope_sin")


def _named(g: GraphWriter, value: str, name: str) -> str:
    return g.op("Identity", [value], outputs=[name])


def _head_norm(g: GraphWriter, x: str, num_heads: int, head_dim: int, weight: str, eps: float) -> str:
    heads = g.reshape(x, [0, 0, num_heads, head_dim])
    return g.reshape(g.rms_norm(heads, weight, eps), [0, 0, num_heads * head_dim])


class LoraActivation:
    """Activated LoRA: the mask [B, S, 1] of positions at or after each row's `adapter_activation_start`, built once
    per graph on first use. PEFT's aLoRA applies the delta from the invocation's start on, so K/V before it are the
    base model's; a row with start 0 (every ordinary adapter, and base rows) is multiplied by exact ones."""

    def __init__(self, graph_inputs: list) -> None:
        self.graph_inputs = graph_inputs
        self.mask: str | None = None

    def get(self, g: GraphWriter) -> str:
        if self.mask is None:
            self.graph_inputs.append(value_info(ACTIVATION_INPUT, INT32, ["batch"]))
            seq = g.op("Squeeze", [g.dim("inputs_embeds", 1), g.const([0])], name="lora_activation_seq")
            steps = g.op("Range", [g.const(0), seq, g.const(1)], name="lora_activation_steps")
            # Every node is named lora_*: strip_lora drops them all with the input for a --maxLoraRank 0 engine.
            start = g.op("Cast", ["kvcache_start_index"], name="lora_activation_start", to=INT64)
            positions = g.op("Add", [g.op("Unsqueeze", [start, g.const([1])], name="lora_activation_rows"),
                                     g.op("Unsqueeze", [steps, g.const([0])], name="lora_activation_cols")],
                             name="lora_activation_positions")  # [B, S]
            first = g.op("Unsqueeze", [g.op("Cast", [ACTIVATION_INPUT], name="lora_activation_cast_first", to=INT64),
                                       g.const([1])], name="lora_activation_first")
            active = g.op("GreaterOrEqual", [positions, first], name="lora_activation_active")
            self.mask = g.op("Unsqueeze", [g.op("Cast", [active], name="lora_activation_cast", to=FLOAT),
                                           g.const([2])], name="lora_activation_mask")
        return self.mask


class LoraInputs:
    """Adds `y + mask * ((x @ lora_A) @ lora_B)` for the exported targets with per-row adapters: lora_A is
    [B, in, r] and lora_B [B, r, out], so one call serves rows on different adapters (base rows hold
    zeros); rank is a dynamic dim and 0 means no adapter in the whole call. `mask` is the activated-LoRA mask
    (LoraActivation): ones for ordinary adapters.

    The adapter's scaling (alpha / r) is folded into lora_B when it is converted, so the graph has no
    scale input. Nodes are named `lora_*` so llm_build can strip them for a --maxLoraRank 0 engine.
    """

    def __init__(self, config: ModelConfig, layer: int, graph_inputs: list, activation: LoraActivation) -> None:
        self.config, self.layer, self.graph_inputs, self.activation = config, layer, graph_inputs, activation

    def apply(self, g: GraphWriter, target: str, x: str, y: str) -> str:
        if target not in self.config.lora_targets:
            return y
        in_dim, out_dim = target_dims(self.config, target, self.layer)
        a, b = lora_a_name(self.layer, target), lora_b_name(self.layer, target)
        self.graph_inputs += [value_info(a, FLOAT, ["batch", in_dim, "lora_rank"]),
                              value_info(b, FLOAT, ["batch", "lora_rank", out_dim])]
        low_rank = g.op("MatMul", [g.op("MatMul", [x, a], name=f"lora_{a}"), b], name=f"lora_{b}")
        masked = g.op("Mul", [low_rank, self.activation.get(g)], name=f"lora_masked_{self.layer}_{target}")
        return g.op("Add", [y, masked], name=f"lora_add_{self.layer}_{target}")


class _Linears:
    """Linear layers as MatMul over float32 [in, out] initializers, or MatMulNBits over quantized blocks."""

    def __init__(self, weights: dict[str, np.ndarray], quantized: dict[str, BlockQuantized],
                 prefill: str | None = None, top: GraphWriter | None = None) -> None:
        """`prefill`: a bool scalar in the graph, true for calls of prefill size; quantized layers then run an If
        between int8 weights (DynamicQuantizeMatMul, true) and their MatMulNBits blocks (false). `top`: the
        graph's own writer, for initializers every branch shares."""
        self.weights, self.quantized = weights, quantized
        self.prefill, self.top = prefill, top
        self._block_sums: dict[tuple[str, int], str] = {}  # per input: o_proj's correction reuses nothing else
        self._block_sum_weights: set[str] = set()

    def for_layer(self, layer: int) -> Callable[..., str]:
        def linear(g: GraphWriter, x: str, proj: str) -> str:  # o_proj and down_proj: no biases in the family
            return self.apply(g, x, f"model.layers.{layer}.{_PROJ_MODULES[proj]}.weight")
        return linear

    def fused(self, g: GraphWriter, x: str, layer: int, projs: tuple[str, ...],
              weights: dict[str, np.ndarray]) -> list[str]:
        """Projections of one input (q/k/v, gate/up) as ONE matmul over their weights side by side, then Split:
        a third of the MatMulNBits calls per token (each has a fixed cost at one row) and one block-sum
        correction. Biases (Qwen2's q/k/v) are concatenated alike; mixed widths fall back to one per projection."""
        names = [f"model.layers.{layer}.{_PROJ_MODULES[p]}.weight" for p in projs]
        biases = [weights.get(n.removesuffix(".weight") + ".bias") for n in names]
        blocks = [self.quantized.get(n) for n in names]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            return [self._with_bias(g, self.apply(g, x, n), n, b) for n, b in zip(names, biases, strict=True)]
        fused_name = f"model.layers.{layer}.{'_'.join(p.removesuffix('_proj') for p in projs)}.fused.weight"
        if all(b is None for b in blocks):
            weight = np.concatenate([self.weights[n].astype(np.float32).T for n in names], axis=1)
            widths = [self.weights[n].shape[0] for n in names]
            y = g.matmul(x, g.weight(fused_name, weight))
        else:
            joined = concat_columns(blocks)
            if joined is None:
                return [self._with_bias(g, self.apply(g, x, n), n, b) for n, b in zip(names, biases, strict=True)]
            widths = [b.n for b in blocks]
            y = self.apply_blocks(g, x, fused_name, joined)
        if biases[0] is not None:
            y = g.add(y, g.weight(fused_name.removesuffix(".weight") + ".bias",
                                  np.concatenate(biases).astype(np.float32)))
        return g.op("Split", [y, g.const(widths)], n_out=len(names), axis=-1)

    def _with_bias(self, g: GraphWriter, y: str, name: str, bias: np.ndarray | None) -> str:
        if bias is None:
            return y
        return g.add(y, g.weight(name.removesuffix(".weight") + ".bias", bias.astype(np.float32)))

    def apply(self, g: GraphWriter, x: str, name: str, float_weight: np.ndarray | None = None) -> str:
        blocks = self.quantized.get(name)
        if blocks is None:
            weight = self.weights[name] if float_weight is None else float_weight
            return g.matmul(x, g.weight(name, weight.astype(np.float32).T))
        return self.apply_blocks(g, x, name, blocks)

    def apply_blocks(self, g: GraphWriter, x: str, name: str, blocks: BlockQuantized,
                     accuracy_level: int | None = None) -> str:
        if self.prefill is None or accuracy_level is not None:  # the head passes its own level: never an If
            return self._nbits(g, x, name, blocks, accuracy_level)
        decode, prefill = GraphWriter(prefix=f"{name}/decode/"), GraphWriter(prefix=f"{name}/prefill/")
        decoded = self._nbits(decode, x, name, blocks, None, cache=False)
        weight, scales = int8_columns(blocks)
        prefilled = prefill.op("DynamicQuantizeMatMul", [x, prefill.weight(f"{name}.int8", weight),
                                                         prefill.weight(f"{name}.int8_scales", scales)],
                               domain=ORT_DOMAIN, name="prefill_matmul")
        return g.op("If", [self.prefill], then_branch=_branch(prefill, prefilled, f"{name}/prefill"),
                    else_branch=_branch(decode, decoded, f"{name}/decode"), name="prefill_or_decode")

    def _nbits(self, g: GraphWriter, x: str, name: str, blocks: BlockQuantized, accuracy_level: int | None,
               cache: bool = True) -> str:
        if accuracy_level is None:  # symmetric int4 blocks carry their own level (quantize.py)
            accuracy_level = blocks.accuracy_level
        level = ACCURACY_LEVELS[blocks.bits] if accuracy_level is None else accuracy_level
        inputs = [x, g.weight(f"{name}.qweight", blocks.packed), g.weight(f"{name}.scales", blocks.scales)]
        if blocks.zero_points is not None:
            inputs.append(g.weight(f"{name}.zero_points", blocks.zero_points))
        y = g.op("MatMulNBits", inputs, domain=ORT_DOMAIN, K=blocks.k, N=blocks.n, bits=blocks.bits,
                 block_size=blocks.block_size, accuracy_level=level)
        if blocks.offsets is None:
            return y
        return g.add(y, g.matmul(self.block_sums(g, x, blocks, cache), g.weight(f"{name}.offsets", blocks.offsets)))

    def block_sums(self, g: GraphWriter, x: str, blocks: BlockQuantized, cache: bool = True) -> str:
        """x [..., K] summed over each quantization block of K → [..., K / block_size] (see quantize.py): one
        MatMul with a 0/1 matrix, any rank, instead of Shape/Concat/Reshape/ReduceSum. Inside an If branch
        (`cache=False`) the sum stays local; the 0/1 matrix is the top graph's, shared by every branch."""
        key = (x, blocks.block_size)
        if key not in self._block_sums or not cache:
            ones = np.kron(np.eye(blocks.k // blocks.block_size, dtype=np.float32),
                           np.ones((blocks.block_size, 1), dtype=np.float32))  # [K, K / block_size]
            name = f"block_sum_{blocks.k}_{blocks.block_size}"
            if name not in self._block_sum_weights:
                self._block_sum_weights.add(name)
                (self.top or g).weight(name, ones)
            if not cache:
                return g.matmul(x, name)
            self._block_sums[key] = g.matmul(x, name)
        return self._block_sums[key]


def int8_columns(blocks: BlockQuantized) -> tuple[np.ndarray, np.ndarray]:
    """The dequantized weight (offsets included) as int8 [K, N] with one symmetric scale per output column, the form
    DynamicQuantizeMatMul takes (ONNX Runtime runs it on MLAS's u8s8 GEMM, AMX where the CPU has it)."""
    w = blocks.dequantize()
    scales = np.abs(w).max(axis=0) / 127.0
    scales = np.where(scales == 0, 1.0, scales).astype(np.float32)
    return np.clip(np.rint(w / scales), -127, 127).astype(np.int8), scales


def _branch(g: GraphWriter, output: str, name: str) -> onnx.GraphProto:
    """An If branch: its nodes and initializers, outer-scope inputs read by name, one float output."""
    return helper.make_graph(g.nodes, name.replace("/", "_"), [],
                             [helper.make_tensor_value_info(output, FLOAT, None)], g.initializers)


_PROJ_MODULES = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                 "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                 "down_proj": "mlp.down_proj"}


def _layer_weights(g: GraphWriter, weights: dict[str, np.ndarray], layer: int) -> dict[str, str]:
    """Initializers of one layer other than its Linear weights and biases (norms)."""
    prefix = f"model.layers.{layer}."
    names = {
        "input_layernorm": "input_layernorm.weight",
        "post_attention_layernorm": "post_attention_layernorm.weight",
        "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    }
    out = {}
    for key, suffix in names.items():
        full = prefix + suffix
        if full not in weights:
            continue
        out[key] = g.weight(full, weights[full].astype(np.float32))
    return out


def _position_logits(g: GraphWriter, hidden: str, config: ModelConfig, weights: dict[str, np.ndarray],
                     linears: _Linears) -> str:
    """Norm and LM head on the positions logits_indices names only ([N, H] -> [N, V])."""
    last = gather_positions(g, hidden, config.hidden_size)  # [N, H]
    normed = g.rms_norm(last, g.weight("model.norm.weight", weights["model.norm.weight"].astype(np.float32)),
                        config.rms_norm_eps)
    head = weights.get(LM_HEAD)
    if head is None:  # tied embeddings
        head = weights["model.embed_tokens.weight"]
    blocks = linears.quantized.get(LM_HEAD)
    if blocks is None:
        return linears.apply(g, normed, LM_HEAD, head)
    approximate = linears.apply_blocks(g, normed, LM_HEAD, blocks, HEAD_ACCURACY_LEVEL)
    candidates = min(config.lm_head_candidates, config.vocab_size)
    if not candidates:
        return approximate
    return rescore_candidates(g, approximate, normed, g.weight(LM_HEAD, head.astype(np.float32)), candidates)


def rescore_candidates(g: GraphWriter, approximate: str, normed: str, head: str, candidates: int) -> str:
    """The `candidates` best of the approximate logits [N, V] replaced by their exact values normed @ head[t]
    (head [V, H], float): TopK, Gather of those rows, a [N, k, H] x [N, H, 1] MatMul, ScatterElements. Greedy
    and top-1 then equal the float head's whenever its argmax is among the candidates; other tokens keep their
    approximate logits. For a tied model the builder binds `head` to the runtime's embedding table."""
    _, ids = g.op("TopK", [approximate, g.const([candidates])], n_out=2, axis=-1, name="lm_head_topk")
    rows = g.op("Gather", [head, ids], axis=0, name="lm_head_rows")  # [N, k, H]: k rows read, not V
    exact = g.op("MatMul", [rows, g.unsqueeze(normed, [2])], name="lm_head_rescore")  # [N, k, 1]
    exact = g.op("Squeeze", [exact, g.const([2])])
    return g.op("ScatterElements", [approximate, ids, exact], axis=1, name="lm_head_exact")


# ---------------------------------------------------------------------------------------------------- the family

_LAYER_TENSORS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _rope_theta(hf: dict[str, Any]) -> float:
    # transformers 5 nests RoPE settings in rope_parameters; older configs use rope_theta + rope_scaling.
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise KvforgeError(f"unsupported rope_scaling type {rope_type!r}; only plain RoPE is supported", FIELD)
    return float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))


def _check_supported(hf: dict[str, Any], model_type: str) -> None:
    # The weight layout carries q/k/v biases only: llama/qwen3 attention_bias also adds an o_proj bias.
    if model_type != "qwen2" and hf.get("attention_bias"):
        raise KvforgeError(f"attention_bias=true on {model_type} (adds an o_proj bias) is not supported", FIELD)
    if hf.get("mlp_bias"):
        raise KvforgeError("mlp_bias=true is not supported", FIELD)
    sliding = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    if hf.get("use_sliding_window") or sliding:
        raise KvforgeError("sliding-window attention layers are not supported", FIELD)


def config_from_hf(hf: dict[str, Any], **common: Any) -> ModelConfig:
    """ModelConfig of an HF llama/qwen2/qwen3 config.json (`common`: tokens, name, kv dtype)."""
    model_type = hf["model_type"]
    _check_supported(hf, model_type)
    heads = int(hf["num_attention_heads"])
    return ModelConfig(
        model=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        max_position_embeddings=int(hf["max_position_embeddings"]),
        rope_theta=_rope_theta(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2",  # Qwen2's q/k/v projections always carry a bias
        qk_norm=model_type == "qwen3",
        **common,
    )


def expected_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    per_layer = [f"{t}.weight" for t in _LAYER_TENSORS]
    if config.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if config.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return names + [f"model.layers.{i}.{n}" for i in range(config.num_hidden_layers) for n in per_layer]


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Scaled so activations stay O(1) through the layers and logits are far from ties."""
    rng = np.random.default_rng(seed)
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.standard_normal((config.vocab_size, hidden)).astype(np.float32)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": norm(hidden),
            p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": linear(q_out, hidden),
            p + "self_attn.k_proj.weight": linear(kv_out, hidden),
            p + "self_attn.v_proj.weight": linear(kv_out, hidden),
            p + "self_attn.o_proj.weight": linear(hidden, q_out),
            p + "mlp.gate_proj.weight": linear(inter, hidden),
            p + "mlp.up_proj.weight": linear(inter, hidden),
            p + "mlp.down_proj.weight": linear(hidden, inter),
        })
        if config.attention_bias:
            for proj, dim in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                weights[p + f"self_attn.{proj}_proj.bias"] = (0.1 * rng.standard_normal(dim)).astype(np.float32)
        if config.qk_norm:
            weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
            weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
    weights["model.norm.weight"] = norm(hidden)
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = linear(config.vocab_size, hidden)
    return weights


def build_graph(loaded: LoadedModel, progress: Callable[[int], None]) -> onnx.ModelProto:
    return build_llama_graph(loaded.config, loaded.weights, progress=progress, quantized=loaded.quantized)


FAMILY = register(Family(
    model_types=("llama", "qwen2", "qwen3"),
    config_from_hf=config_from_hf,
    expected_names=expected_names,
    build_graph=build_graph,
    random_weights=random_weights,
    architectures={"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"},
    synthetic={
        "tiny-llama": {"model": "llama"},
        "tiny-qwen2": {"model": "qwen2", "attention_bias": True, "tie_word_embeddings": True},
        "tiny-qwen3": {"model": "qwen3", "qk_norm": True, "head_dim": 32},
        "tiny-llama-mha": {"model": "llama", "num_key_value_heads": 4},
    },
    gguf_architectures=("llama", "qwen2", "qwen3"),  # Ollama's most served families with this graph
))

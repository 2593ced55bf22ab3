"""Block drafts (DFlash, DSpark, JetSpec): their public Hugging Face format to an ONNX dir drafting a block per call.

The checkpoint (z-lab's `DFlashDraftModel`, SpecForge's `DSparkDraftModel`) is a stack of qwen3 decoder layers. Its
`fc` projects the concatenated outputs of the base layers `dflash_config.target_layer_ids` (kvforge's
hidden_state_layers convention: the layer's output) to H, and `hidden_norm` normalises them: the *context feature*
of each position. In every layer, the keys and values of a context position are that layer's k/v projections of the
context feature (k_norm and RoPE on the keys as usual); the positions being drafted (the block: the pending token,
then mask tokens) run the layers normally, with queries only there. The block attends to all the context and to
the whole block (non-causal; JetSpec's, below, causally). `norm`, then the base's LM head, give the logits of block
positions 1.. (the guesses for the tokens after the pending one). The base's embedding table embeds the block.

As an engine graph (the kvforge contract plus BASE_HIDDEN_INPUT and CONTEXT_TOKEN_MASK_INPUT): one call's row is
new context positions followed by block positions, contiguous. Per token, the K/V source is
`mask * feature + (1 - mask) * input_layernorm(h)`, so one pool per layer holds the context's K/V (kept) and the
block's (scratch, overwritten by the next call's context). The tree-attention mask input gives the block its
non-causal view, so these drafts need the kvforge CPU kernel. `hidden_states` is the normed last layer (DSpark's
acceptance predictor reads it).

DSpark adds two small heads applied by the runtime (`dspark_heads.safetensors`): a previous-token (Markov) logit bias
`markov_w2 @ markov_w1[previous token]`, which makes the block's tokens semi-autoregressive, and an acceptance
predictor `sigmoid(w . [h_k; markov_w1[x_{k-1}]] + b)` whose scores schedule the proposal length.

JetSpec (hao-ai-lab/JetSpec) ships DFlash's class, tensors and keys, trained with a causal in-block mask: block row i
sees the context and block rows j <= i. Its config says so with `dflash_config.causal_head: true` (or `causal`), or
carries a top-level `jetspec_config` (the runtime config TensorRT Edge-LLM writes and accepts). The graph is DFlash's:
the block's mask is the mask input, so the runtime passes the causal one (spec_decode_type says which).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper
from safetensors.numpy import save_file

from kvforge.contract.engine_dir import (
    BASE_HIDDEN_INPUT,
    CONTEXT_TOKEN_MASK_INPUT,
    DSPARK_HEADS_FILE,
)
from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import read_json, write_json
from kvforge.contract.formats import EXPORT_FORMAT
from kvforge.contract.model_config import MAX_BLOCK_SIZE, SPEC_DFLASH, SPEC_DSPARK, SPEC_JETSPEC, ModelConfig
from kvforge.contract.speculation import SPEC_SUPPORT, base_kind
from kvforge.graph.onnx_graph import OPSET, GraphWriter, value_info
from kvforge.graph.positions import gather_positions, hidden_states_output, logits_output
from kvforge.graph.rope import apply_rope
from kvforge.plugins import ops
from kvforge.tools.export.drafts.common import (
    base_embedding,
    base_head,
    check_base_layers,
    draft_graph_inputs,
    open_draft_export,
    weight_ops,
    write_draft_dir,
)
from kvforge.tools.export.families.llama import POOL_ELEM_TYPES, pool_input_name, pool_output_name, rope_inputs
from kvforge.tools.export.sources.hf_common import read_safetensors_header, read_tensor, safetensors_files

ARCHITECTURES = {"DFlashDraftModel": SPEC_DFLASH, "DSparkDraftModel": SPEC_DSPARK}
FIELD = "--draftDir"
_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
          "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
          "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_TOP = ("fc.weight", "hidden_norm.weight", "norm.weight")
MARKOV = ("markov_w1.weight", "markov_w2.weight")
# The acceptance predictor's Linear(H + rank -> 1): SpecForge's module name, and the names ports use.
ACCEPT_PREFIXES = ("accept_rate_predictor.proj", "confidence_head.proj", "confidence_proj")
# Keys a checkpoint may set that change the math this graph implements; refused unless at their neutral value.
_NEUTRAL = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None,
            "attention_bias": False, "is_causal": False}


def block_draft_kind(path: Path) -> str | None:
    """SPEC_DFLASH, SPEC_DSPARK or SPEC_JETSPEC when `path` holds such a checkpoint, else None."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        return _kind(json.loads(config.read_text()))
    except (OSError, ValueError, AttributeError):
        return None


def _kind(hf: dict[str, Any]) -> str | None:
    """The method a block draft's config.json is for: a DFlash-class checkpoint with a causal head is JetSpec's."""
    kind = next((ARCHITECTURES[a] for a in hf.get("architectures") or [] if a in ARCHITECTURES), None)
    if kind == SPEC_DFLASH and _causal_head(hf):
        return SPEC_JETSPEC
    return kind


def _causal_head(hf: dict[str, Any]) -> bool:
    """JetSpec's marks: its own `jetspec_config` (Edge-LLM's runtime config), or DFlash's keys with `causal_head` (the
    public checkpoints) or `causal` (vLLM's spelling) true."""
    if isinstance(hf.get("jetspec_config"), dict):
        return True
    return any(_draft_value(hf, key, False) is True for key in ("causal_head", "causal"))


def _draft_value(hf: dict[str, Any], name: str, default: Any = None) -> Any:
    """z-lab keeps its keys in `dflash_config`, SpecForge at the top, Edge-LLM in `jetspec_config`; any may hold one
    (the first that does, in that order: jetspec_config, dflash_config, dspark_config, the top level)."""
    for section in ("jetspec_config", "dflash_config", "dspark_config"):
        nested = hf.get(section)
        if isinstance(nested, dict) and name in nested:
            return nested[name]
    return hf.get(name, default)


def draft_config(hf: dict[str, Any], base: ModelConfig) -> ModelConfig:
    """The draft's model config from its HF config.json, checked against the base's."""
    kind = _kind(hf)
    if kind is None:
        raise KvforgeError(f"not a block draft: architectures {hf.get('architectures')} (expected one of "
                           f"{', '.join(ARCHITECTURES)})", FIELD)
    for key, neutral in _NEUTRAL.items():
        value = _draft_value(hf, key, neutral)
        if value not in (neutral, None) and not (neutral is None and not value):
            raise KvforgeError(f"the draft sets {key} = {value!r}; this exporter implements {neutral!r} only", FIELD)
    if kind == SPEC_DSPARK and _causal_head(hf):
        raise KvforgeError("a DSparkDraftModel sets causal_head (or a jetspec_config); JetSpec drafts are "
                           "DFlashDraftModel checkpoints and DSpark's block is non-causal here", FIELD)
    if _draft_value(hf, "causal_head", True) is False and isinstance(hf.get("jetspec_config"), dict):
        raise KvforgeError("jetspec_config.causal_head is false; a JetSpec draft's block is causal", FIELD)
    vocab = int(hf.get("vocab_size", base.vocab_size))
    if vocab != base.vocab_size:
        raise KvforgeError(f"the draft's vocab_size {vocab} is not the base's {base.vocab_size}", FIELD)
    layers = _draft_value(hf, "target_layer_ids")
    if not isinstance(layers, list) or not layers or not all(
            type(i) is int and 0 <= i < base.num_hidden_layers for i in layers):
        raise KvforgeError(f"dflash_config.target_layer_ids must list base layers in [0, {base.num_hidden_layers}), "
                           f"got {layers}", FIELD)
    block = int(_draft_value(hf, "block_size", 16))
    if not 2 <= block <= MAX_BLOCK_SIZE:
        raise KvforgeError(f"block_size must be in [2, {MAX_BLOCK_SIZE}], got {block}", FIELD)
    mask = _draft_value(hf, "mask_token_id")
    if type(mask) is not int or not 0 <= mask < vocab:
        raise KvforgeError(f"mask_token_id must be a token id in [0, {vocab}), got {mask!r}", FIELD)
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    target_hidden = _draft_value(hf, "target_hidden_size")
    if target_hidden is not None and target_hidden != base.hidden_size:
        raise KvforgeError(f"dflash_config.target_hidden_size {target_hidden} is not the base's hidden_size "
                           f"{base.hidden_size} (the hidden-size adapter is not supported)", FIELD)
    if hidden != base.hidden_size:
        raise KvforgeError(f"the draft's hidden_size {hidden} is not the base's {base.hidden_size} (it embeds with "
                           "the base's table and scores with the base's head)", FIELD)
    num_layers = int(hf.get("num_hidden_layers", 5))
    config = ModelConfig(
        model="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        max_position_embeddings=int(hf.get("max_position_embeddings") or base.max_position_embeddings),
        rope_theta=float(hf.get("rope_theta") or base.rope_theta), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qk_norm=True, kv_cache_dtype=base.kv_cache_dtype, eos_token_ids=list(base.eos_token_ids),
        name=f"{kind}-draft", hidden_state_layers=[num_layers - 1], spec_decode_type=kind,
        base_model_hidden_size=len(layers) * base.hidden_size, eagle_hidden_state_layers=list(layers),
        dflash_block_size=block, mask_token_id=mask, lm_head="float", format=EXPORT_FORMAT)
    config.validate()
    return config


def load_weights(path: Path, config: ModelConfig) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(graph weights by canonical name `layers.{i}.*` / `fc.weight` / ..., DSpark heads {} for DFlash)."""
    tensors: dict[str, tuple[Path, dict[str, Any], int]] = {}
    for file in safetensors_files(path):
        header, start = read_safetensors_header(file)
        for name, entry in header.items():
            tensors[name.removeprefix("model.")] = (file, entry, start)
    expected = [*_TOP, *(f"layers.{i}.{n}" for i in range(config.num_hidden_layers) for n in _LAYER)]
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise KvforgeError(f"draft checkpoint in {path} lacks tensor {missing[0]} ({len(missing)} missing)", FIELD)
    heads: list[str] = []
    if config.spec_decode_type == SPEC_DSPARK:
        accept = next((p for p in ACCEPT_PREFIXES if f"{p}.weight" in tensors), None)
        if accept is None or any(m not in tensors for m in MARKOV):
            raise KvforgeError(f"DSpark checkpoint in {path} lacks its heads (markov_w1, markov_w2 and one of "
                               f"{', '.join(p + '.weight' for p in ACCEPT_PREFIXES)})", FIELD)
        heads = [*MARKOV, f"{accept}.weight", *([f"{accept}.bias"] if f"{accept}.bias" in tensors else [])]
    ignored = {"embed_tokens.weight", "lm_head.weight"}  # a copy of the base's, if saved: the base's are used
    unexpected = sorted(n for n in tensors if n not in {*expected, *heads, *ignored})
    if unexpected:
        raise KvforgeError(f"draft checkpoint in {path} has tensor {unexpected[0]} this loader does not handle",
                           FIELD)

    def read(name: str) -> np.ndarray:
        file, entry, start = tensors[name]
        return read_tensor(file, name, entry, start).astype(np.float32)

    weights = {n: read(n) for n in expected}
    H, heads_q, kv, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    shapes = {"fc.weight": (H, config.base_model_hidden_size)}
    for i in range(config.num_hidden_layers):
        shapes |= {f"layers.{i}.self_attn.q_proj.weight": (heads_q * D, H),
                   f"layers.{i}.self_attn.k_proj.weight": (kv * D, H),
                   f"layers.{i}.self_attn.v_proj.weight": (kv * D, H),
                   f"layers.{i}.self_attn.o_proj.weight": (H, heads_q * D)}
    for name, shape in shapes.items():
        if weights[name].shape != shape:
            raise KvforgeError(f"tensor {name} is {list(weights[name].shape)}, the config implies {list(shape)}",
                               FIELD)
    return weights, _dspark_heads(read, heads, config) if heads else {}


def _dspark_heads(read: Any, names: list[str], config: ModelConfig) -> dict[str, np.ndarray]:
    w1, w2 = read(names[0]), read(names[1])
    rank = w1.shape[1] if w1.ndim == 2 else 0
    V, H = config.vocab_size, config.hidden_size
    accept = read(names[2]).reshape(-1)
    if w1.shape != (V, rank) or w2.shape != (V, rank) or accept.shape != (H + rank,):
        raise KvforgeError(f"DSpark heads must be markov_w1 [{V}, r], markov_w2 [{V}, r] and an acceptance "
                           f"predictor of {H} + r inputs; got {list(w1.shape)}, {list(w2.shape)}, {list(accept.shape)}",
                           FIELD)
    bias = read(names[3]).reshape(1) if len(names) > 3 else np.zeros(1, dtype=np.float32)
    return {"markov_w1": w1, "markov_w2": w2, "accept_weight": accept, "accept_bias": bias}


def build_block_draft_graph(config: ModelConfig, weights: dict[str, np.ndarray], head: np.ndarray) -> onnx.ModelProto:
    """The draft as an engine graph (see the module docstring): logits [N, V] and the normed last layer [N, H] at
    logits_indices."""
    g = GraphWriter()
    H, heads, kv, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps = config.rms_norm_eps
    rope_cos, rope_sin = rope_inputs(g, "inputs_embeds")

    w, linear = weight_ops(g, weights)

    def head_norm(x: str, n: int, weight: str) -> str:
        return g.reshape(g.rms_norm(g.reshape(x, [0, 0, n, D]), w(weight), eps), [0, 0, n * D])

    pool = POOL_ELEM_TYPES[config.kv_cache_dtype]
    pool_shape = ["num_pages", 2, kv, "tokens_per_page", D]
    inputs = draft_graph_inputs(config, CONTEXT_TOKEN_MASK_INPUT, 1)
    outputs = []
    feature = g.rms_norm(linear(BASE_HIDDEN_INPUT, "fc.weight"), w("hidden_norm.weight"), eps)
    context = CONTEXT_TOKEN_MASK_INPUT
    block = g.op("Sub", [g.const(np.float32(1.0), np.float32), context])
    feature = g.mul(feature, context)
    h = "inputs_embeds"
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        normed = g.rms_norm(h, w(p + "input_layernorm.weight"), eps)
        source = g.add(feature, g.mul(normed, block))  # context rows: the feature; block rows: the layer's input
        q = head_norm(linear(normed, p + "self_attn.q_proj.weight"), heads, p + "self_attn.q_norm.weight")
        k = head_norm(linear(source, p + "self_attn.k_proj.weight"), kv, p + "self_attn.k_norm.weight")
        v = linear(source, p + "self_attn.v_proj.weight")
        q = apply_rope(g, q, heads, D, rope_cos, rope_sin)
        pool_in, pool_out = pool_input_name(i), pool_output_name(i)
        inputs.append(value_info(pool_in, pool, pool_shape))
        outputs.append(value_info(pool_out, pool, pool_shape))
        g.op(ops.PAGED_KV_WRITE.name, [k, v, "rope_rotary_cos_sin", "context_lengths", "kvcache_start_index",
                                       "kv_page_table", pool_in],
             outputs=[pool_out], domain=ops.DOMAIN, name=f"paged_kv_write_{i}", num_kv_heads=kv, head_dim=D,
             tokens_per_page=0)
        attn = g.op(ops.PAGED_ATTENTION.name, [q, pool_out, "context_lengths", "kvcache_start_index",
                                               "kv_page_table"],
                    domain=ops.DOMAIN, name=f"paged_attention_{i}", num_q_heads=heads, num_kv_heads=kv, head_dim=D,
                    tokens_per_page=0, scale=float(D ** -0.5))
        h = g.add(h, linear(attn, p + "self_attn.o_proj.weight"))
        post = g.rms_norm(h, w(p + "post_attention_layernorm.weight"), eps)
        gate, up = linear(post, p + "mlp.gate_proj.weight"), linear(post, p + "mlp.up_proj.weight")
        h = g.add(h, linear(g.mul(g.mul(gate, g.op("Sigmoid", [gate])), up), p + "mlp.down_proj.weight"))
    last = g.rms_norm(gather_positions(g, h, H), w("norm.weight"), eps)
    g.op("Identity", [g.matmul(last, g.weight("base_lm_head", np.ascontiguousarray(head.T)))], outputs=["logits"])
    normed_all = g.rms_norm(h, "norm.weight", eps)
    hidden = hidden_states_output(g, [normed_all], [0], H, indices="logits_indices")
    assert hidden is not None
    graph = helper.make_graph(g.nodes, f"kvforge_{config.spec_decode_type}_draft", inputs,
                              [logits_output(config.vocab_size), hidden, *outputs], g.initializers)
    return helper.make_model(graph, producer_name="kvforge", opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(ops.DOMAIN, ops.OPSET_VERSION)])


def export_block_draft(draft_dir: Path, base_onnx_dir: Path, output_dir: Path) -> ModelConfig:
    """Write the draft's ONNX dir: model.onnx (with a float copy of the base's head), config.json, the base's
    embedding table, and DSpark's heads. The base must return the hidden states the draft reads."""
    draft_dir, base_onnx_dir = Path(draft_dir), Path(base_onnx_dir)
    hf, base = open_draft_export(draft_dir, base_onnx_dir, output_dir, FIELD)
    kind = block_draft_kind(draft_dir) or SPEC_DFLASH
    if base_kind(base.is_recurrent, base.is_hybrid) not in SPEC_SUPPORT[kind].bases:  # the support table
        raise KvforgeError(f"a block draft needs an attention-only base; {base.model} has recurrent layers (the "
                           "support matrix rejects hybrid DFlash/JetSpec/DSpark)", "--baseOnnxDir")
    config = draft_config(hf, base)
    check_base_layers(base, config)
    weights, dspark = load_weights(draft_dir, config)
    write_draft_dir(output_dir, build_block_draft_graph(config, weights, base_head(base_onnx_dir, base)), config,
                    base_embedding(base_onnx_dir),
                    {DSPARK_HEADS_FILE: dspark} if dspark else {})
    return config


def write_random_block_draft(base_onnx_dir: Path, output_dir: Path, *, kind: str = SPEC_DFLASH, seed: int = 0,
                             layers: list[int] | None = None, num_layers: int = 2, block_size: int = 0,
                             mask_token_id: int | None = None, markov_rank: int = 16) -> Path:
    """A random-weight DFlash, DSpark or JetSpec checkpoint in the Hugging Face format for a base's ONNX dir (tests,
    demos): the base's attention geometry, `num_layers` layers, reading `layers` (default: the base's
    hidden_state_layers)."""
    kinds = (*ARCHITECTURES.values(), SPEC_JETSPEC)
    if kind not in kinds:
        raise KvforgeError(f"must be one of {', '.join(kinds)}, got {kind!r}", "--kind")
    base = ModelConfig.from_dict(read_json(Path(base_onnx_dir) / "config.json", "--baseOnnxDir"))
    rng = np.random.default_rng(seed)
    H, heads, kv, D = base.hidden_size, base.num_attention_heads, base.num_key_value_heads, base.head_dim
    layers = layers or base.hidden_state_layers
    if not layers:
        raise KvforgeError("the base returns no hidden states; export it with --hiddenStateLayers", "--baseOnnxDir")
    block_size = block_size or (7 if kind == SPEC_DSPARK else 16)
    mask = base.vocab_size - 1 if mask_token_id is None else mask_token_id

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(n: int = H) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"fc.weight": linear(H, len(layers) * H), "hidden_norm.weight": norm(), "norm.weight": norm()}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors |= {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                    p + "self_attn.q_proj.weight": linear(heads * D, H),
                    p + "self_attn.k_proj.weight": linear(kv * D, H),
                    p + "self_attn.v_proj.weight": linear(kv * D, H),
                    p + "self_attn.o_proj.weight": linear(H, heads * D),
                    p + "self_attn.q_norm.weight": norm(D), p + "self_attn.k_norm.weight": norm(D),
                    p + "mlp.gate_proj.weight": linear(base.intermediate_size, H),
                    p + "mlp.up_proj.weight": linear(base.intermediate_size, H),
                    p + "mlp.down_proj.weight": linear(H, base.intermediate_size)}
    # JetSpec's public checkpoints are DFlash's class with dflash_config.causal_head set.
    architecture = next(a for a, k in ARCHITECTURES.items() if k == (SPEC_DFLASH if kind == SPEC_JETSPEC else kind))
    extra: dict[str, Any] = {}
    if kind == SPEC_DSPARK:
        tensors |= {"markov_w1.weight": (0.1 * rng.standard_normal((base.vocab_size, markov_rank))).astype(np.float32),
                    "markov_w2.weight": linear(base.vocab_size, markov_rank),
                    f"{ACCEPT_PREFIXES[0]}.weight": linear(1, H + markov_rank),
                    f"{ACCEPT_PREFIXES[0]}.bias": np.array([1.0], dtype=np.float32)}
        extra = {"projector_type": SPEC_DSPARK, "markov_rank": markov_rank}  # DSpark checkpoints name it so too
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output_dir / "model.safetensors"))
    write_json(output_dir / "config.json", {
        "architectures": [architecture], "model_type": "qwen3", "num_hidden_layers": num_layers, "hidden_size": H,
        "intermediate_size": base.intermediate_size, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": D, "rms_norm_eps": base.rms_norm_eps, "rope_theta": base.rope_theta,
        "max_position_embeddings": base.max_position_embeddings, "vocab_size": base.vocab_size,
        "block_size": block_size, "num_target_layers": base.num_hidden_layers, "tie_word_embeddings": False,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(layers),
                          **({"causal_head": True} if kind == SPEC_JETSPEC else {})}, **extra})
    return output_dir

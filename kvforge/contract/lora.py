"""The LoRA part of the engine contract: which linears take low-rank inputs, their names and shapes."""

from __future__ import annotations

from typing import Protocol


class LoraModel(Protocol):
    """What this contract reads of a model config (ModelConfig has it all). Not ModelConfig itself: ModelConfig
    checks its lora_targets with is_target_list below, so importing it here would be a cycle."""

    model: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    lora_targets: list[str]
    kv_source_layers: list[int]

    def layer_head_dim(self, layer: int) -> int: ...


# Short target names (the --loraTargets flag) and the Hugging Face / PEFT module each one adapts.
LORA_MODULES = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}
LORA_TARGETS = tuple(LORA_MODULES)


def is_target_list(value: object) -> bool:
    """Whether `value` is a list of known target names, as config.json's lora_targets must be."""
    return isinstance(value, list) and all(isinstance(v, str) and v in LORA_TARGETS for v in value)


def lora_a_name(layer: int, target: str) -> str:
    return f"lora_A_{layer}_{target}"


def lora_b_name(layer: int, target: str) -> str:
    return f"lora_B_{layer}_{target}"


def target_dims(config: LoraModel, target: str, layer: int | None = None) -> tuple[int, int]:
    """(in_features, out_features) of the adapted linear (of `layer`: Gemma 4's global layers have wider heads)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = config.head_dim if layer is None else config.layer_head_dim(layer)
    q_out = config.num_attention_heads * head_dim
    kv_out = config.num_key_value_heads * head_dim
    return {"q": (hidden, q_out), "k": (hidden, kv_out), "v": (hidden, kv_out), "o": (q_out, hidden),
            "gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}[target]


def lora_inputs(config: LoraModel) -> list[tuple[str, str, int, str]]:
    """(A name, B name, layer, target) for every adapted linear of the exported graph. A layer reading another
    layer's K/V (Gemma 4's kv_source_layers) has no k/v projections, so PEFT adapts none there and neither does
    the graph."""
    sources = config.kv_source_layers
    return [(lora_a_name(layer, t), lora_b_name(layer, t), layer, t)
            for layer in range(config.num_hidden_layers) for t in config.lora_targets
            if not (t in ("k", "v") and sources and sources[layer] != layer)]


def parse_targets(text: str) -> list[str]:
    """`q,k,v` → ["q", "k", "v"]; `all` → every target; `none` or "" → no LoRA inputs."""
    text = text.strip()
    if text in ("", "none"):
        return []
    if text == "all":
        return list(LORA_TARGETS)
    targets = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in targets if t not in LORA_MODULES]
    if unknown:
        from kvforge.contract.errors import InvalidConfig
        raise InvalidConfig(f"unknown target(s) {', '.join(unknown)}; choose from {', '.join(LORA_TARGETS)}, "
                            "'all' or 'none'", "lora_targets")
    return [t for t in LORA_TARGETS if t in targets]  # canonical order, no duplicates


ADAPTER_FORMAT = "kvforge-lora-v1"


def model_fingerprint(config: LoraModel) -> str:
    """Architecture identity an adapter is converted for; an adapter for another model is refused."""
    import hashlib
    import json

    shape = {k: getattr(config, k) for k in ("model", "vocab_size", "hidden_size", "intermediate_size",
                                             "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                             "head_dim")}
    return hashlib.blake2b(json.dumps(shape, sort_keys=True).encode(), digest_size=8).hexdigest()


# The graph input [B] int32 naming each row's first adapted position (activated LoRA); 0 = every position, as an
# ordinary adapter. Not `lora_*`: those are the per-row A/B matrices, and kvforge/builder/lora.py strips this one with
# them.
ACTIVATION_INPUT = "adapter_activation_start"
# A row whose activated adapter found no invocation: no position takes the delta (PEFT then runs the base model).
NEVER_ACTIVATED = 2 ** 31 - 1

# PEFT's activated-LoRA field: the token ids whose last occurrence in a prompt switches the adapter on.
INVOCATION_FIELD = "alora_invocation_tokens"


def check_invocation_tokens(value: object, vocab_size: int, adapter: str, where: str) -> tuple[int, ...]:
    """A non-empty list of token ids inside the vocabulary, or one line naming the adapter and the field."""
    from kvforge.contract.errors import KvforgeError

    def refuse(why: str) -> KvforgeError:
        return KvforgeError(f"adapter {adapter}: {INVOCATION_FIELD} {why}", where)

    if not isinstance(value, list | tuple) or not value:
        raise refuse(f"must be a non-empty list of token ids, got {str(value)[:60]!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise refuse(f"must hold integers only, got {str(list(value))[:60]!r}")
    outside = [v for v in value if not 0 <= v < vocab_size]
    if outside:
        raise refuse(f"has id {outside[0]} outside the vocabulary [0, {vocab_size})")
    return tuple(value)

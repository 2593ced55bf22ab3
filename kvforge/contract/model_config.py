"""The model description every stage agrees on: written by llm_export, extended by llm_build."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from kvforge.contract.config_fields import check_field
from kvforge.contract.errors import InvalidConfig, KvforgeError
from kvforge.contract.formats import EXPORT_FORMAT
from kvforge.contract.speculation import (  # noqa: F401 - re-exported: the export and build steps import them here
    BLOCK_DRAFTS,
    SPEC_DECODE_TYPES,
    SPEC_DFLASH,
    SPEC_DSPARK,
    SPEC_EAGLE3,
    SPEC_GEMMA4_MTP,
    SPEC_JETSPEC,
    SPEC_MTP,
    SPEC_NONE,
    SPEC_SUPPORT,
    DraftKV,
)

KV_CACHE_DTYPES = ("fp16", "fp8", "fp32")
QUANTIZATIONS = ("none", "int8", "int4")  # linear weights: float32, or MatMulNBits blocks
# The LM head: a float matmul, or MatMulNBits blocks whose approximate logits pick lm_head_candidates tokens that
# are then scored exactly against the float head ("" = an export from before the field, head as its graph says).
LM_HEADS = ("float", "int8", "int4")
# Draft-only families: gemma4_assistant, a Gemma4 MTP assistant (its layers read the base's K/V, see
# kv_shared_layers); qwen3_5_mtp, Qwen3.5's MTP layer (one gated-attention decoder layer with its own pool).
MODEL_FAMILIES = ("llama", "qwen2", "qwen3", "mamba2", "qwen3_5", "gemma4_assistant", "qwen3_5_mtp", "gemma3",
                  "gemma4")
RECURRENT_FAMILIES = ("mamba2",)  # every layer a Mamba2 mixer: no KV cache, carried conv + recurrent states
# Attention layers with a paged KV pool interleaved with recurrent layers (Qwen3.5: gated delta-net + gated attention).
HYBRID_FAMILIES = ("qwen3_5",)
# TensorRT Edge-LLM's normalized names: "mamba" means any recurrent mixer with a carried conv + recurrent state
# (a Mamba2 SSM or a gated delta-net); the family says which one. HF's "linear_attention" maps to "mamba".
LAYER_TYPES = ("attention", "mamba")
MAX_BLOCK_SIZE = 64  # the longest block a block draft proposes in one call (z-lab's drafts use 16, DSpark's 7)
# The draft kinds (config.json's spec_decode_type) come from the speculation table. Block drafters (BLOCK_DRAFTS):
# one call over [pending token, mask x (block - 1)] proposes a whole block from K/V that are projections of the base's
# hidden states, non-causal inside the block (DFlash, DSpark: DSpark adds a previous-token head and an acceptance
# predictor) or causal (JetSpec).


@dataclass(slots=True)
class ModelConfig:
    model: str  # family: one of MODEL_FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    kv_cache_dtype: str = "fp16"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    name: str = ""
    lora_targets: list[str] = field(default_factory=list)  # linears with lora_A/lora_B inputs (q, k, ..., down)
    quantization: str = "none"  # requested weight format; GGUF blocks that map exactly keep their own bits
    quant_block_size: int = 0  # MatMulNBits block size of re-quantized weights (0 = not quantized)
    # 4-bit blocks: asymmetric or symmetric (kvforge/tools/export/quantize.py); "" = older exports
    int4_scheme: str = ""
    lm_head: str = ""  # one of LM_HEADS; "" = not recorded (older exports)
    lm_head_candidates: int = 0  # top-k of a quantized head rescored against the float head (0 = none)
    prefill_int8_rows: int = 0  # calls of at least this many rows run quantized layers as int8 GEMMs (0 = never)
    # Recurrent layers; names as TensorRT Edge-LLM's config.json. layer_types empty = all attention.
    # Mamba2: state [H, P, N] = [num_heads, head_dim, state_size], n_groups B/C groups.
    # Gated delta-net (qwen3_5): the same fields describe state [Hv, Dv, Dk]: num_heads = value heads, head_dim =
    # value head dim, state_size = key head dim, n_groups = key heads (each serves Hv / Hk value heads, as a Mamba2
    # group does), so conv_dim and the snapshot bytes follow one formula for both mixers.
    layer_types: list[str] = field(default_factory=list)
    recurrent_state_num_heads: int = 0
    recurrent_state_head_dim: int = 0
    recurrent_state_size: int = 0
    n_groups: int = 0
    conv_kernel: int = 0
    # Fraction of each attention head's dims RoPE rotates (the first rotary_dim; Qwen3.5: 0.25). 1.0 = all.
    partial_rotary_factor: float = 1.0
    # Decoder layers (0-based) whose outputs the graph returns as `hidden_states` [N, len * hidden_size] at the
    # logits positions, in this order: what a drafter (EAGLE3: three base layers, MTP: the last) reads. Empty = no
    # such output.
    hidden_state_layers: list[int] = field(default_factory=list)
    # Speculative drafts (TensorRT Edge-LLM's names). An EAGLE3 draft is a one-layer llama whose graph also takes the
    # base's hidden states of `eagle_hidden_state_layers` (base_model_hidden_size = their concatenated width) and
    # returns logits over a reduced vocabulary of draft_vocab_size tokens (d2t.safetensors maps them to base ids).
    spec_decode_type: str = "none"  # one of SPEC_DECODE_TYPES
    draft_vocab_size: int = 0  # 0 = vocab_size (the logits' width)
    base_model_hidden_size: int = 0
    eagle_hidden_state_layers: list[int] = field(default_factory=list)
    # Block drafts (DFlash, DSpark): the block they were trained on and the mask token filling it; base layers read
    # are in eagle_hidden_state_layers (the one field every hidden-state drafter names its base layers in).
    dflash_block_size: int = 0
    mask_token_id: int = 0
    # Gemma4 MTP assistants: per layer, the base layer whose KV pool it reads (its layers have query projections
    # only and own no pool), and its centroid-sparse logits (0 centroids = a dense head over the vocabulary).
    kv_shared_layers: list[int] = field(default_factory=list)
    num_centroids: int = 0
    centroid_top_k: int = 0
    # Gemma: the layers attending over only the last `sliding_window` positions, their RoPE base (0 = rope_theta),
    # the other layers' linear RoPE scaling (0 = none), the query scale's denominator (0 = head_dim) and tanh softcap
    # of the logits (0 = none). Gemma 4's global layers turn only their first rope_proportion of the rotate-half
    # frequencies (proportional RoPE; 0 = all of them) and may have heads of their own size, global_head_dim (0 =
    # head_dim; their pools are that wide: layer_head_dim).
    sliding_window: int = 0
    sliding_window_layers: list[int] = field(default_factory=list)
    rope_local_theta: float = 0.0
    rope_linear_factor: float = 0.0
    rope_proportion: float = 0.0
    # Gemma 4's KV sharing: per layer, the layer whose pool it attends over (itself: its own pool; an earlier layer:
    # no pool, no K/V projections). Empty = every layer its own.
    kv_source_layers: list[int] = field(default_factory=list)
    query_pre_attn_scalar: float = 0.0
    final_logit_softcapping: float = 0.0
    # Gemma 4's per-layer embeddings: each layer's input width (0 = none); the runtime feeds each token's row of the
    # per-layer table (engine_dir.PER_LAYER_EMBEDDING_FILE) beside its embedding row (media: the pad token's row).
    hidden_size_per_layer_input: int = 0
    global_head_dim: int = 0
    format: str = EXPORT_FORMAT

    @property
    def logits_width(self) -> int:
        """Columns of the graph's `logits`: the draft vocabulary of an EAGLE3 draft, else the vocabulary."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def is_eagle3_draft(self) -> bool:
        return self.spec_decode_type == SPEC_EAGLE3

    @property
    def kv_reads_next_token(self) -> bool:
        """A draft whose K/V at position p depends on token p + 1 (EAGLE3, MTP): a reuse hit replays its boundary."""
        row = SPEC_SUPPORT.get(self.spec_decode_type)
        return self.is_draft and row is not None and row.replays_final_page

    @property
    def is_block_draft(self) -> bool:
        return self.spec_decode_type in BLOCK_DRAFTS

    @property
    def reads_base_kv(self) -> bool:
        """A Gemma4 MTP assistant: attention over the base's pools (kv_shared_layers), no pool of its own."""
        row = SPEC_SUPPORT.get(self.spec_decode_type)
        return self.is_draft and row is not None and row.draft_kv is DraftKV.BASE

    @property
    def is_draft(self) -> bool:
        """Any draft engine's model (its graph reads the base's hidden states)."""
        return self.spec_decode_type != SPEC_NONE

    @property
    def is_recurrent(self) -> bool:
        """Pure recurrent: no attention layer, no KV pool (a hybrid is not)."""
        return self.model in RECURRENT_FAMILIES

    @property
    def is_hybrid(self) -> bool:
        return self.model in HYBRID_FAMILIES

    @property
    def attention_layer_ids(self) -> list[int]:
        """Absolute indices of the layers with a KV pool (`past_key_values_{i}`): all of them unless layer_types
        says otherwise, less the layers attending over an earlier layer's pool (kv_source_layers)."""
        if self.reads_base_kv:
            return []
        if not self.layer_types:
            return [i for i in range(self.num_hidden_layers) if not self.kv_source_layers or
                    self.kv_source_layers[i] == i]
        return [i for i, t in enumerate(self.layer_types) if t == "attention"]

    @property
    def embedding_width(self) -> int:
        """Width of `inputs_embeds` and the embedding table: an assistant embeds with its base's table."""
        return self.base_model_hidden_size if self.reads_base_kv else self.hidden_size

    @property
    def pool_layer_ids(self) -> list[int]:
        """The layers whose pools the graph takes as `past_key_values_{i}`: its own attention layers, or for a
        KV-shared assistant the base layers it reads."""
        return sorted(set(self.kv_shared_layers)) if self.reads_base_kv else self.attention_layer_ids

    @property
    def recurrent_layer_ids(self) -> list[int]:
        """Absolute indices of the layers with `conv_state_{i}` / `recurrent_state_{i}`."""
        return [i for i, t in enumerate(self.layer_types) if t == "mamba"]

    @property
    def num_attention_layers(self) -> int:
        return len(self.attention_layer_ids)

    def layer_head_dim(self, layer: int) -> int:
        """Head size of decoder layer `layer`'s queries, keys and values, the last axis of its pool."""
        sliding = layer in self.sliding_window_layers
        return self.global_head_dim if self.global_head_dim and not sliding else self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates (even); `rope_rotary_cos_sin` is [capacity, rotary_dim]."""
        return int(self.head_dim * self.partial_rotary_factor) // 2 * 2

    @property
    def uniform_rope(self) -> bool:
        """Whether every layer's keys turn by the runtime's RoPE table alone: what moving stored keys to another
        position with that table (document reuse) needs. Gemma's other bases, scalings and proportions do not."""
        return not ((self.rope_local_theta and self.rope_local_theta != self.rope_theta and self.sliding_window_layers)
                    or self.rope_linear_factor or self.rope_proportion)

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: the SSM input plus its B and C projections."""
        return self.recurrent_state_num_heads * self.recurrent_state_head_dim + \
            2 * self.n_groups * self.recurrent_state_size

    def validate(self) -> None:
        """The schema (types and ranges) plus the rules between fields; exporters call it on what they built."""
        for name, spec in CONFIG_SCHEMA.items():
            check_field(spec, getattr(self, name), f"config.{name}", "the model config")
        if self.model not in MODEL_FAMILIES:
            raise InvalidConfig(f"unsupported model family {self.model!r}; expected one of {MODEL_FAMILIES}",
                                "config.model")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidConfig(f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
                                "config.kv_cache_dtype")
        if self.quantization not in QUANTIZATIONS:
            raise KvforgeError(f"must be one of {QUANTIZATIONS}, got {self.quantization!r}", "config.quantization")
        if self.lm_head and self.lm_head not in LM_HEADS:
            raise InvalidConfig(f"must be one of {LM_HEADS}, got {self.lm_head!r}", "config.lm_head")
        self._validate_hidden_state_layers()
        self._validate_draft()
        if any(not 0 <= i < self.num_hidden_layers for i in self.sliding_window_layers) or \
                bool(self.sliding_window_layers) != bool(self.sliding_window):
            raise InvalidConfig(f"must name layers in [0, {self.num_hidden_layers}) exactly when sliding_window "
                                f"({self.sliding_window}) is set", "config.sliding_window_layers")
        sources = self.kv_source_layers
        if sources and (len(sources) != self.num_hidden_layers or self.layer_types or
                        any(not (s == i or (s < i and sources[s] == s and (s in self.sliding_window_layers) ==
                                            (i in self.sliding_window_layers))) for i, s in enumerate(sources))):
            raise InvalidConfig("must name, per layer, itself or an earlier layer of its kind that has its own pool",
                                "config.kv_source_layers")
        if self.global_head_dim and (self.global_head_dim % 2 or self.global_head_dim < self.rotary_dim or
                                     self.model != "gemma4" or not self.sliding_window_layers):
            raise InvalidConfig(f"must be 0 or an even head size of at least the RoPE table's {self.rotary_dim} dims, "
                                "on a gemma4 model with sliding layers", "config.global_head_dim")
        for name in ("rope_local_theta", "rope_linear_factor", "rope_proportion", "query_pre_attn_scalar",
                     "final_logit_softcapping"):
            if getattr(self, name) < 0:
                raise InvalidConfig("must be >= 0 (0: unset)", f"config.{name}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise InvalidConfig(f"unknown layer type {unknown[0]!r} (known: {', '.join(LAYER_TYPES)})",
                                "config.layer_types")
        if self.is_recurrent:
            self._validate_recurrent()
            self._validate_token_ids()
            return
        if self.is_hybrid:
            self._validate_hybrid()
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise InvalidConfig("must be positive", f"config.{name}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidConfig("num_attention_heads must be a multiple of num_key_value_heads",
                                "config.num_key_value_heads")
        if self.head_dim % 2:
            raise InvalidConfig("must be even for rotate-half RoPE", "config.head_dim")
        if self.rotary_dim <= 0:
            raise InvalidConfig(f"rotates {self.rotary_dim} dims of head_dim {self.head_dim}; must be > 0",
                                "config.partial_rotary_factor")
        if not self.is_hybrid and any(t != "attention" for t in self.layer_types):
            raise InvalidConfig(f"family {self.model} has attention layers only", "config.layer_types")
        self._validate_token_ids()

    def _validate_hidden_state_layers(self) -> None:
        layers = self.hidden_state_layers
        bad = [i for i in layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise InvalidConfig(f"must hold layer ids in [0, num_hidden_layers {self.num_hidden_layers}), got "
                                f"{bad[0]}", "config.hidden_state_layers")
        if len(set(layers)) != len(layers):
            raise InvalidConfig(f"must name each layer once, got {layers}", "config.hidden_state_layers")

    def _validate_draft(self) -> None:
        if self.spec_decode_type not in SPEC_DECODE_TYPES:
            raise InvalidConfig(f"must be one of {SPEC_DECODE_TYPES}, got {self.spec_decode_type!r}",
                                "config.spec_decode_type")
        if not self.is_draft:
            if self.draft_vocab_size or self.base_model_hidden_size or self.eagle_hidden_state_layers or \
                    self.dflash_block_size or self.kv_shared_layers or self.num_centroids:
                raise InvalidConfig("draft fields are set but spec_decode_type is 'none'", "config.spec_decode_type")
            return
        self._validate_base_layers()
        if self.is_block_draft:
            self._validate_block_draft()
            return
        if self.reads_base_kv:
            self._validate_assistant()
            return
        if self.spec_decode_type == SPEC_MTP:
            if self.model != "qwen3_5_mtp" or self.num_hidden_layers != 1 or self.layer_types:
                raise InvalidConfig("an MTP draft is one qwen3_5_mtp layer", "config.num_hidden_layers")
            if self.draft_vocab_size not in (0, self.vocab_size) or self.hidden_state_layers != [0]:
                raise InvalidConfig("an MTP draft scores the base's vocabulary and returns its normed output as "
                                    "hidden_states [0]", "config.hidden_state_layers")
            return
        if self.model != "llama" or self.num_hidden_layers != 1 or self.layer_types:
            raise InvalidConfig("an EAGLE3 draft is one llama decoder layer", "config.num_hidden_layers")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise InvalidConfig(f"must be in [1, vocab_size {self.vocab_size}], got {self.draft_vocab_size}",
                                "config.draft_vocab_size")
        if self.hidden_state_layers != [0]:
            raise InvalidConfig("an EAGLE3 draft returns its layer's output as hidden_states: must be [0]",
                                "config.hidden_state_layers")

    def _validate_base_layers(self) -> None:
        if not self.eagle_hidden_state_layers or len(set(self.eagle_hidden_state_layers)) != \
                len(self.eagle_hidden_state_layers) or min(self.eagle_hidden_state_layers) < 0:
            raise InvalidConfig(f"must name distinct base layers, got {self.eagle_hidden_state_layers}",
                                "config.eagle_hidden_state_layers")
        if self.base_model_hidden_size <= 0 or self.base_model_hidden_size % len(self.eagle_hidden_state_layers):
            raise InvalidConfig(f"must be a positive multiple of the {len(self.eagle_hidden_state_layers)} base "
                                f"layers read, got {self.base_model_hidden_size}", "config.base_model_hidden_size")

    def _validate_block_draft(self) -> None:
        if self.model != "qwen3" or self.layer_types:
            raise InvalidConfig(f"a {self.spec_decode_type} draft is a stack of qwen3 decoder layers, got "
                                f"{self.model}", "config.model")
        if not 2 <= self.dflash_block_size <= MAX_BLOCK_SIZE:
            raise InvalidConfig(f"must be in [2, {MAX_BLOCK_SIZE}], got {self.dflash_block_size}",
                                "config.dflash_block_size")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise InvalidConfig(f"must be a token id in [0, vocab_size {self.vocab_size}), got {self.mask_token_id}",
                                "config.mask_token_id")
        if self.draft_vocab_size not in (0, self.vocab_size):
            raise InvalidConfig("a block draft scores the base's whole vocabulary with the base's head",
                                "config.draft_vocab_size")
        if self.hidden_state_layers != [self.num_hidden_layers - 1]:
            raise InvalidConfig("a block draft returns its normed last layer as hidden_states: must be "
                                f"[{self.num_hidden_layers - 1}]", "config.hidden_state_layers")

    def _validate_assistant(self) -> None:
        if self.model != "gemma4_assistant" or self.layer_types:
            raise InvalidConfig(f"a {SPEC_GEMMA4_MTP} draft is a gemma4_assistant, got {self.model}", "config.model")
        if len(self.kv_shared_layers) != self.num_hidden_layers or min(self.kv_shared_layers, default=0) < 0:
            raise InvalidConfig(f"must name one base layer per assistant layer ({self.num_hidden_layers}), got "
                                f"{self.kv_shared_layers}", "config.kv_shared_layers")
        if self.num_centroids and (self.vocab_size % self.num_centroids or
                                   not 0 < self.centroid_top_k <= self.num_centroids):
            raise InvalidConfig(f"{self.num_centroids} centroids must divide vocab_size {self.vocab_size} and "
                                f"centroid_top_k ({self.centroid_top_k}) be in [1, num_centroids]",
                                "config.num_centroids")
        if self.draft_vocab_size not in (0, self.vocab_size):
            raise InvalidConfig("an assistant scores the base's whole vocabulary", "config.draft_vocab_size")
        if self.hidden_state_layers != [self.num_hidden_layers - 1]:
            raise InvalidConfig("an assistant returns its projected last layer as hidden_states: must be "
                                f"[{self.num_hidden_layers - 1}]", "config.hidden_state_layers")

    def _validate_hybrid(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise InvalidConfig(f"must have one entry per layer ({self.num_hidden_layers}), got "
                                f"{len(self.layer_types)}", "config.layer_types")
        if not self.attention_layer_ids or not self.recurrent_layer_ids:
            raise InvalidConfig(f"a {self.model} model mixes 'attention' and 'mamba' layers", "config.layer_types")
        for name in ("recurrent_state_num_heads", "recurrent_state_head_dim", "recurrent_state_size", "n_groups",
                     "conv_kernel"):
            if getattr(self, name) <= 0:
                raise InvalidConfig("must be positive", f"config.{name}")
        if self.recurrent_state_num_heads % self.n_groups:
            raise InvalidConfig("recurrent_state_num_heads (value heads) must be a multiple of n_groups (key heads)",
                                "config.n_groups")

    def _validate_token_ids(self) -> None:
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise InvalidConfig(f"must be a token id in [0, vocab_size {self.vocab_size}), got {value}",
                                    f"config.{name}")
        bad = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidConfig(f"must hold token ids in [0, vocab_size {self.vocab_size}), got {bad[0]}",
                                "config.eos_token_ids")

    def _validate_recurrent(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "recurrent_state_num_heads",
                     "recurrent_state_head_dim", "recurrent_state_size", "n_groups", "conv_kernel"):
            if getattr(self, name) <= 0:
                raise InvalidConfig("must be positive", f"config.{name}")
        if self.recurrent_state_num_heads % self.n_groups:
            raise InvalidConfig("recurrent_state_num_heads must be a multiple of n_groups", "config.n_groups")
        if self.layer_types != ["mamba"] * self.num_hidden_layers:
            raise InvalidConfig(f"a {self.model} model has one 'mamba' entry per layer", "config.layer_types")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """A config.json object checked against CONFIG_SCHEMA: every error names the field (`config.NAME`)."""
        if not isinstance(data, dict):
            raise InvalidConfig(f"must hold a JSON object, got {type(data).__name__}", where)
        if data.get("format") != EXPORT_FORMAT:
            raise InvalidConfig(
                f"not a kvforge export (format is {data.get('format')!r}, expected {EXPORT_FORMAT!r}); "
                "re-export it with llm_export", where)
        values = {}
        for f in fields(cls):
            if f.name not in data:
                if f.default is MISSING and f.default_factory is MISSING:
                    raise InvalidConfig(f"is required in {where}", f"config.{f.name}")
                continue
            values[f.name] = check_field(CONFIG_SCHEMA[f.name], data[f.name], f"config.{f.name}", where)
        config = cls(**values)
        config.validate()
        return config


# The schema of config.json's model fields: (kind, low, high) per field; kinds are checked strictly
# (a bool is not an int, 2.0 is not an int, "4" is not a number), ranges bound what a hostile file can make
# the runtime allocate (the embedding's real shape is checked against vocab_size x hidden_size on load).
_DIM = ("int", 1, 2**20)
CONFIG_SCHEMA: dict[str, tuple[str, float | None, float | None]] = {
    "model": ("str", None, None), "vocab_size": ("int", 1, 2**24), "hidden_size": _DIM,
    # Attention sizes may be 0 in the schema (a pure recurrent model has none); validate() requires them > 0 on
    # attention families.
    "intermediate_size": ("int", 0, 2**20), "num_hidden_layers": ("int", 1, 1024),
    "num_attention_heads": ("int", 0, 1024), "num_key_value_heads": ("int", 0, 1024), "head_dim": ("int", 0, 4096),
    "max_position_embeddings": ("int", 1, 2**28), "rope_theta": ("float", 0.0, 1e12),
    "rms_norm_eps": ("float", 0.0, 1.0), "tie_word_embeddings": ("bool", None, None),
    "attention_bias": ("bool", None, None), "qk_norm": ("bool", None, None), "kv_cache_dtype": ("str", None, None),
    "bos_token_id": ("token?", None, None), "eos_token_ids": ("tokens", None, None),
    "pad_token_id": ("token?", None, None), "name": ("str", None, None), "lora_targets": ("strs", None, None),
    "quantization": ("str", None, None), "quant_block_size": ("int", 0, 2**16), "format": ("str", None, None),
    "int4_scheme": ("str", None, None),
    "lm_head": ("str", None, None), "lm_head_candidates": ("int", 0, 2**20),
    "prefill_int8_rows": ("int", 0, 2**30),
    # Recurrent (Mamba2) fields; 0 on attention-only models. validate() checks them per family.
    "layer_types": ("layers", None, None), "recurrent_state_num_heads": ("int", 0, 2**16),
    "recurrent_state_head_dim": ("int", 0, 2**16), "recurrent_state_size": ("int", 0, 2**16),
    "n_groups": ("int", 0, 1024), "conv_kernel": ("int", 0, 1024),
    "partial_rotary_factor": ("float", 0.0, 1.0), "hidden_state_layers": ("ints", 0, 1024),
    "spec_decode_type": ("str", None, None), "draft_vocab_size": ("int", 0, 2**24),
    "base_model_hidden_size": ("int", 0, 2**22), "eagle_hidden_state_layers": ("ints", 0, 1024),
    "dflash_block_size": ("int", 0, 1024), "mask_token_id": ("int", 0, 2**24),
    "kv_shared_layers": ("ints", 0, 1024), "num_centroids": ("int", 0, 2**20), "centroid_top_k": ("int", 0, 2**20),
    "sliding_window": ("int", 0, 2**28), "sliding_window_layers": ("ints", 0, 1024),
    # Gemma's optional floats: 0 = unset, so the range's open end is below it (validate() refuses negatives).
    "rope_local_theta": ("float", -1.0, 1e12), "rope_linear_factor": ("float", -1.0, 1e6),
    "rope_proportion": ("float", -1.0, 1.0), "kv_source_layers": ("ints", 0, 1024),
    "query_pre_attn_scalar": ("float", -1.0, 1e9),
    "final_logit_softcapping": ("float", -1.0, 1e9), "hidden_size_per_layer_input": ("int", 0, 2**16),
    "global_head_dim": ("int", 0, 4096),
}


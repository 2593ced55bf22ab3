"""The engine side of corrected adapters: the correction math, factors from a base call's hidden states, and corrected
page copies (the LoRA loader, runtime/adapters.py, only loads and marks adapters; the cache type,
context_cache/types/adapter_corrections.py, decides which pages are corrected)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvforge.contract.engine_dir import EngineDir
from kvforge.contract.errors import KvforgeError
from kvforge.contract.lora import lora_a_name, lora_b_name
from kvforge.plugins.reference import apply_rope, from_storage, to_storage
from kvforge.runtime.adapters import CORRECTION_FIELD, LoraAdapter
from kvforge.runtime.context_cache.types.adapter_corrections import FactorCapture, check_deployment
from kvforge.runtime.execution.kv_store import KVStore
from kvforge.runtime.step import ScheduledRow
from kvforge.runtime.types import Deployment

ADAPTER_CORRECTIONS_PART = "adapter_corrections"  # the cache type's name (profile_schema.ADAPTER_CORRECTIONS)

# --- the correction math (issue 39 item 2) ----------------------------------------------------------------------
# A corrected adapter's request starts from the base model's pages plus, per layer, dK = rot((x A_k) B_k) and
# dV = (x A_v) B_v, with x the base model's input to that layer's attention (its input_layernorm output) and the
# scaling already folded into B by the conversion. The base prefill stores only P = x A per corrected adapter
# (2r floats per token and layer); x itself comes from the engine's hidden_states output (the residual stream after
# layers 0..L-2) and, for layer 0, the embedding row. docs/lora.md has the measurement: it changes answers.

NORM_WEIGHT = "model.layers.{layer}.input_layernorm.weight"  # the llama family's initializer name


@dataclass(frozen=True, slots=True, eq=False)
class FoldedCorrection:
    """One corrected adapter, ready for the two products: A with each layer's norm weight folded in
    (x A = (h / rms(h)) (diag(w) A)), and B for k and v (zeros where the adapter leaves a target out)."""

    digest: bytes
    rank: int
    a: np.ndarray  # [L, 2, H, r]: k then v
    b: np.ndarray  # [L, 2, r, Hkv * D]
    adapts_kv: bool  # False: no k/v target, so the corrected pages are the base pages as they are


def check_correction_engine(engine: EngineDir, deployment: Deployment) -> None:
    """Refuse, in one line naming `lora_corrections`, an engine the correction cannot serve (the deployment first,
    as the cache type checks it)."""
    model = engine.model
    check_deployment(deployment)
    if model.model != "llama":
        raise KvforgeError(f"corrected adapters are implemented for the llama family only, not {model.model}",
                           CORRECTION_FIELD)
    needed = list(range(model.num_hidden_layers - 1))
    if list(model.hidden_state_layers) != needed:
        raise KvforgeError(f"the engine must return hidden states of layers {','.join(map(str, needed))}; re-export "
                           f"with llm_export --hiddenStateLayers {','.join(map(str, needed))} (it returns "
                           f"{model.hidden_state_layers or 'none'})", CORRECTION_FIELD)


def load_attention_norms(engine: EngineDir) -> tuple[np.ndarray, float]:
    """Each layer's input_layernorm weight [L, H] and the norm's eps, read once from the engine's ONNX initializers
    (only those tensors: the graph is read without its external weights)."""
    import onnx
    from onnx import numpy_helper

    from kvforge.contract.engine_dir import ENGINE_MODEL_FILE

    graph = onnx.load(str(engine.file(ENGINE_MODEL_FILE)), load_external_data=False).graph
    wanted = {NORM_WEIGHT.format(layer=layer): layer for layer in range(engine.model.num_hidden_layers)}
    weights: list[np.ndarray | None] = [None] * len(wanted)
    for tensor in graph.initializer:
        if tensor.name in wanted:
            weights[wanted[tensor.name]] = numpy_helper.to_array(tensor, base_dir=str(engine.path)).astype(np.float32)
    missing = [name for name, layer in wanted.items() if weights[layer] is None]
    if missing:
        raise KvforgeError(f"the engine's graph has no initializer {missing[0]}; rebuild it with llm_build",
                           CORRECTION_FIELD)
    return np.stack(weights), float(engine.model.rms_norm_eps)  # type: ignore[arg-type]


def fold_correction(adapter: LoraAdapter, norm_weights: np.ndarray) -> FoldedCorrection:
    """`adapter`'s k/v matrices per layer with the norm weights folded into A. Targets the adapter leaves out are
    zeros already (load_adapter); an engine exported without k/v LoRA inputs has nothing to correct with."""
    names = [(lora_a_name(layer, t), lora_b_name(layer, t)) for layer in range(len(norm_weights)) for t in "kv"]
    absent = [a for a, b in names if a not in adapter.tensors or b not in adapter.tensors]
    if absent:
        raise KvforgeError(f"adapter {adapter.name!r} cannot be corrected: the engine has no LoRA input {absent[0]} "
                           "(re-export with --loraTargets including k,v)", CORRECTION_FIELD)
    layers = len(norm_weights)
    a = np.stack([adapter.tensors[name] for name, _ in names])  # [2L, H, r]
    b = np.stack([adapter.tensors[name] for _, name in names])  # [2L, r, Hkv * D]
    a, b = a.reshape(layers, 2, *a.shape[1:]), b.reshape(layers, 2, *b.shape[1:])
    folded_a = (norm_weights[:, None, :, None] * a).astype(np.float32)
    return FoldedCorrection(adapter.digest, adapter.rank, folded_a, b.astype(np.float32), bool(np.any(b)))


def normed_inputs(embeds: np.ndarray, hidden: np.ndarray, eps: float) -> np.ndarray:
    """h / rms(h) for each layer's attention input [n, L, H]: layer 0 reads the embedding rows, layer l the
    residual stream after layer l - 1 (the engine's hidden_states [n, (L - 1) * H])."""
    n, width = embeds.shape
    residual = np.concatenate([embeds.astype(np.float32)[:, None],
                               hidden.astype(np.float32).reshape(n, -1, width)], axis=1)
    return residual / np.sqrt(np.mean(residual * residual, axis=-1, keepdims=True) + eps)


def correction_factors(folded: FoldedCorrection, normed: np.ndarray) -> np.ndarray:
    """P = x A for k and v of every layer: [n, L, 2, r] float32 (what a base prefill stores per token)."""
    return np.einsum("nlh,lkhr->nlkr", normed, folded.a, optimize=True).astype(np.float32)


def correction_deltas(folded: FoldedCorrection, factors: np.ndarray) -> np.ndarray:
    """(P B) for k and v of every layer from stored factors [n, L, 2, r]: [L, 2, n, Hkv * D], before RoPE."""
    return np.einsum("nlkr,lkro->lkno", factors, folded.b, optimize=True).astype(np.float32)


class AdapterCorrector:
    """Holds the corrected adapters folded with the engine's norm weights, the pool and the rope table.

    `observe` runs after each engine call: every base row whose lease collects factors gets P = x A of its new
    positions for every corrected adapter. `correct` is what the cache type calls at a corrected admission."""

    __slots__ = ("kv", "cos_sin", "kv_cache_dtype", "num_kv_heads", "head_dim", "norm_weights", "eps", "names",
                 "_folded")

    def __init__(self, kv: KVStore, cos_sin: np.ndarray, kv_cache_dtype: str, num_kv_heads: int, head_dim: int,
                 norm_weights: np.ndarray, eps: float, names: tuple[str, ...]) -> None:
        self.kv = kv
        self.cos_sin = cos_sin
        self.kv_cache_dtype = kv_cache_dtype
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.norm_weights = norm_weights  # [L, H]
        self.eps = eps
        self.names = names  # what the option names (checked against the adapters when they are loaded)
        self._folded: dict[bytes, FoldedCorrection] = {}

    @property
    def digests(self) -> tuple[bytes, ...]:
        return tuple(self._folded)

    @property
    def num_adapters(self) -> int:
        return len(self.names)

    def register(self, adapters: list[LoraAdapter]) -> None:
        """The corrected adapters of the loaded set (replacing any before)."""
        self._folded = {adapter.digest: fold_correction(adapter, self.norm_weights) for adapter in adapters}

    def observe(self, rows: list[ScheduledRow], new_ids: list[list[int]], hidden: list[np.ndarray | None] | None,
                embedding: np.ndarray) -> None:
        """Factors of every collecting row's new positions (hidden states at each of them: the executor asks)."""
        if not self._folded or hidden is None:
            return
        for row, ids, states in zip(rows, new_ids, hidden, strict=True):
            lease = row.seq.lease
            capture = None if lease is None else lease.parts.get(ADAPTER_CORRECTIONS_PART)
            if not isinstance(capture, FactorCapture) or states is None or row.draft_token_ids:
                continue
            normed = normed_inputs(np.asarray(embedding[ids]), states[:len(ids)], self.eps)
            capture.add(row.seq.num_computed_tokens, {digest: correction_factors(folded, normed)
                                                      for digest, folded in self._folded.items()})

    def correct(self, digest: bytes, src_pages: list[int], dst_pages: list[int], factors: list[np.ndarray]) -> None:
        """dst page i = base page i + (rot(P_k B_k), P_v B_v) at positions i*T .. (i+1)*T - 1, in the pool's dtype.
        An adapter without k/v targets gets the base pages as they are."""
        if not src_pages:
            return
        folded = self._folded[digest]
        T = self.kv.tokens_per_page
        src, dst = np.asarray(src_pages, np.int64), np.asarray(dst_pages, np.int64)
        pages = [layer[src].copy() for layer in self.kv.layers]  # [n, 2, Hkv, T, D] each: every source read first
        if folded.adapts_kv:
            deltas = correction_deltas(folded, np.concatenate(factors))  # [L, 2, n*T, Hkv*D]
            positions = np.arange(len(src_pages) * T)
            n, heads, dim = len(src_pages), self.num_kv_heads, self.head_dim
            for layer, stored in enumerate(pages):
                dk = apply_rope(deltas[layer, 0].reshape(-1, heads, dim), self.cos_sin, positions)
                dv = deltas[layer, 1].reshape(-1, heads, dim)
                delta = np.stack([dk, dv]).reshape(2, n, T, heads, dim).transpose(1, 0, 3, 2, 4)  # [n, 2, Hkv, T, D]
                pages[layer] = to_storage(from_storage(stored, self.kv_cache_dtype) + delta, self.kv_cache_dtype)
        for layer, stored in zip(self.kv.layers, pages, strict=True):
            layer[dst] = stored

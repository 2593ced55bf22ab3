"""LoRA adapters at run time: load, check against the engine, identify by digest; corrected adapters' products."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from safetensors import safe_open

from kvforge.contract.engine_dir import EngineDir
from kvforge.contract.errors import KvforgeError
from kvforge.contract.lora import (
    ADAPTER_FORMAT,
    INVOCATION_FIELD,
    NEVER_ACTIVATED,
    check_invocation_tokens,
    lora_a_name,
    lora_b_name,
    lora_inputs,
    model_fingerprint,
    target_dims,
)
from kvforge.contract.tensor_header import read_tensor_header
from kvforge.contract.validation import one_line
from kvforge.runtime.context_cache.types.adapter_corrections import check_deployment
from kvforge.runtime.types import Deployment


@dataclass(frozen=True, slots=True, eq=False)
class LoraAdapter:
    name: str
    path: Path
    rank: int
    tensors: dict[str, np.ndarray] = field(repr=False)  # engine input name -> array (missing targets: zeros)
    digest: bytes  # BLAKE2b of the converted weights (scaling folded in): the cache identity, never the name
    # Activated LoRA (PEFT's alora_invocation_tokens): the delta applies from the last occurrence of these ids on.
    invocation_tokens: tuple[int, ...] | None = None
    # Corrected (opt-in, `lora_corrections`): its requests start from base pages plus a low-rank K/V correction.
    corrected: bool = False


def adapter_digest(tensors: dict[str, np.ndarray]) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name], dtype="<f4")
        digest.update(name.encode() + b"\0" + str(array.shape).encode() + b"\0")
        digest.update(array.tobytes())
    return digest.digest()


def load_adapter(name: str, path: Path, engine: EngineDir, where: str, shown: str | None = None) -> LoraAdapter:
    """Load a converted adapter; its header (names, dtypes, shapes, offsets) is checked against the engine
    before any tensor is read. Messages show `shown` (the path as the request file wrote it), never the
    expanded path, so a request file cannot read environment variables back through errors."""
    shown = one_line(str(path) if shown is None else shown)
    model, limit = engine.model, engine.build.max_lora_rank
    if limit == 0 or not model.lora_targets:
        raise KvforgeError("the engine was built without LoRA inputs; rebuild with llm_build --maxLoraRank R", where)
    if not path.is_file():
        raise KvforgeError(f"adapter file {shown} does not exist", where)
    header, metadata = read_tensor_header(path, where, shown)
    if metadata.get("format") != ADAPTER_FORMAT:
        raise KvforgeError(f"{shown} is not a converted adapter; convert it with: llm_export lora --adapterDir DIR "
                           "--onnxDir ONNXDIR --output FILE.safetensors", where)
    if metadata.get("model_fingerprint") != model_fingerprint(model):
        raise KvforgeError(f"adapter {shown} was converted for another model", where)
    rank_text = metadata.get("rank", "0")
    rank = int(rank_text) if rank_text.isdigit() and len(rank_text) < 6 else 0
    if rank <= 0:
        raise KvforgeError(f"adapter rank {one_line(rank_text)[:20]!r} is not a positive integer", where)
    if rank > limit:
        raise KvforgeError(f"adapter rank {rank} exceeds the engine's --maxLoraRank {limit}", where)
    expected: dict[str, tuple[int, int]] = {}
    for a_name, b_name, layer, target in lora_inputs(model):
        in_dim, out_dim = target_dims(model, target, layer)
        expected[a_name], expected[b_name] = (in_dim, rank), (rank, out_dim)
    extra = sorted(set(header) - set(expected))
    if extra:
        raise KvforgeError(f"adapter has tensors the engine does not take ({one_line(', '.join(extra[:3]))[:120]}"
                           "...); was the engine exported with fewer --loraTargets?", where)
    for a_name, b_name, _layer, _target in lora_inputs(model):
        if (a_name in header) != (b_name in header):
            raise KvforgeError(f"adapter has only one of {a_name}/{b_name}", where)
        for tensor in (a_name, b_name):
            info = header.get(tensor)
            if info is not None and (info.dtype not in ("F32", "F16") or info.shape != expected[tensor]):
                raise KvforgeError(f"adapter tensor {tensor} is {info.dtype} {list(info.shape)}, the engine expects "
                                   f"F32 {list(expected[tensor])}", where)
    try:
        with safe_open(str(path), framework="numpy") as handle:
            raw = {key: handle.get_tensor(key) for key in header}
    except Exception as exc:
        raise KvforgeError(f"cannot read adapter {shown}: {one_line(str(exc))[:200]}", where) from None
    tensors: dict[str, np.ndarray] = {}
    for tensor, shape in expected.items():  # targets the adapter leaves out are exact zeros
        tensors[tensor] = raw[tensor].astype(np.float32) if tensor in raw else np.zeros(shape, np.float32)
    invocation = _invocation(metadata, model.vocab_size, shown, where)
    if invocation is not None and model.recurrent_layer_ids:
        # A recurrent state carries the base model's history past the invocation only if it was checkpointed
        # exactly there; kvforge does not capture such checkpoints, so the engine refuses rather than run inexactly.
        raise KvforgeError(f"adapter {shown} is an activated LoRA (alora_invocation_tokens), which recurrent and "
                           "hybrid engines do not run", where)
    return LoraAdapter(name, path, rank, tensors, adapter_digest(tensors), invocation)


# Appended to an activated adapter's name in responses and the profile's per_adapter block when its invocation was
# absent from the prompt, so the request ran on the base model.
NOT_INVOKED = " (not invoked)"


def activation_start(adapter: LoraAdapter | None, prompt_ids: list[int]) -> int:
    """The first position an adapter's delta applies to: 0 for the base model and ordinary adapters; for an
    activated LoRA, PEFT's rule (peft.tuners.lora.variants.calculate_alora_offsets): the start of the invocation
    sequence's last occurrence in the prompt, so the invocation tokens themselves are adapted, and every generated
    token after them. Without an occurrence PEFT runs the base model throughout: NEVER_ACTIVATED."""
    if adapter is None or adapter.invocation_tokens is None:
        return 0
    invocation = list(adapter.invocation_tokens)
    width = len(invocation)
    first = invocation[0]
    for start in range(len(prompt_ids) - width, -1, -1):
        if prompt_ids[start] == first and prompt_ids[start:start + width] == invocation:
            return start
    return NEVER_ACTIVATED


def base_pages_reused(adapter: LoraAdapter | None, start: int, reused_tokens: int, tokens_per_page: int) -> int:
    """Whole pages an adapter request reused that carry no adapter identity (base pages): those ending at or before
    its activation start (kvforge/runtime/context_cache/keys.py drops the digest there). 0 for base requests and
    ordinary adapters, whose every page carries the digest; all reused pages for an activated adapter never invoked."""
    if adapter is None or tokens_per_page <= 0:
        return 0
    return min(reused_tokens, start) // tokens_per_page


def corrected_pages_reused(adapter: LoraAdapter | None, reused_tokens: int, tokens_per_page: int) -> int:
    """Whole pages a corrected adapter's request started from (base pages copied and corrected): its whole reused
    pages, since a corrected request reuses nothing else. 0 for every other request."""
    if adapter is None or not adapter.corrected or tokens_per_page <= 0:
        return 0
    return reused_tokens // tokens_per_page


def _invocation(metadata: dict[str, str], vocab_size: int, shown: str, where: str) -> tuple[int, ...] | None:
    """The converted file's invocation ids, checked again: a file edited after conversion is refused here."""
    text = metadata.get(INVOCATION_FIELD)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = one_line(text)[:60]
    return check_invocation_tokens(value, vocab_size, shown, where)


# $VARS in adapter paths: only these names expand (an operator opts a variable in by its name); anything else
# is refused by name, and no message ever shows an expanded value, so a request file cannot probe the environment.
EXPANDABLE_VARIABLE = re.compile(r"KVFORGE_[A-Za-z0-9_]*|LORA_WEIGHTS_DIR")
_VARIABLE = re.compile(r"\$(?:\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def resolve_adapter_path(raw_path: str, base_dir: Path | None, where: str) -> Path:
    """`available_lora_weights` path → file path: allowed $VARS expanded, relative to the request file's dir."""
    def expand(match: re.Match[str]) -> str:
        name = match[1] if match[1] is not None else match[2]
        if not EXPANDABLE_VARIABLE.fullmatch(name):
            raise KvforgeError(f"uses ${{{one_line(name)[:40]}}}; only KVFORGE_* variables and LORA_WEIGHTS_DIR "
                               "are expanded in adapter paths", where)
        value = os.environ.get(name)
        if value is None:
            raise KvforgeError(f"uses ${name}, which is not set", where)
        return value

    path = Path(_VARIABLE.sub(expand, raw_path))
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return path


def stack_adapters(adapters: list[LoraAdapter | None], shapes: dict[str, tuple[int, int]]) -> dict[str, np.ndarray]:
    """Per-row LoRA inputs for one engine call: [B, in, r] and [B, r, out] with r the largest rank among
    the rows; a row on a smaller rank is zero-padded and a base-model row is all zeros (both exact)."""
    rank = max((a.rank for a in adapters if a is not None), default=0)
    stacked = {}
    for name, (rows, cols) in shapes.items():
        is_a = name.startswith("lora_A")
        out = np.zeros((len(adapters), rows, rank) if is_a else (len(adapters), rank, cols), dtype=np.float32)
        for i, adapter in enumerate(adapters):
            if adapter is None:
                continue
            tensor = adapter.tensors[name]
            if is_a:
                out[i, :, :adapter.rank] = tensor
            else:
                out[i, :adapter.rank, :] = tensor
        stacked[name] = out
    return stacked


def lora_input_shapes(engine: EngineDir) -> dict[str, tuple[int, int]]:
    """Engine input name -> (rows, cols) of one adapter's matrix, rank left out: A is (in, r), B is (r, out)."""
    shapes = {}
    for a_name, b_name, layer, target in lora_inputs(engine.model):
        in_dim, out_dim = target_dims(engine.model, target, layer)
        shapes[a_name], shapes[b_name] = (in_dim, 0), (0, out_dim)
    return shapes


class LoraRegistry:
    """The adapters of one request file, loaded once each; names resolve per request."""

    __slots__ = ("engine", "adapters")

    def __init__(self, engine: EngineDir) -> None:
        self.engine = engine
        self.adapters: dict[str, LoraAdapter] = {}

    def load(self, available: dict[str, str], base_dir: Path | None = None) -> None:
        """Load `available_lora_weights`; paths may use allowed $VARS (EXPANDABLE_VARIABLE) and are relative to
        the request file."""
        self.adapters = {}
        for name, raw_path in available.items():
            where = f"available_lora_weights[{json.dumps(name)}]"
            path = resolve_adapter_path(raw_path, base_dir, where)
            self.adapters[name] = load_adapter(name, path, self.engine, where, shown=raw_path)

    def get(self, name: str | None) -> LoraAdapter | None:
        if not name:
            return None
        if name not in self.adapters:  # request parsing checks names; this catches API callers that skip load()
            raise KvforgeError(f"adapter {name!r} is not loaded (load available_lora_weights first)", "lora_name")
        return self.adapters[name]


# --- corrected adapters (issue 39 item 2: opt-in, off by default) -------------------------------------------------
# A corrected adapter's request starts from the base model's pages plus, per layer, dK = rot((x A_k) B_k) and
# dV = (x A_v) B_v, with x the base model's input to that layer's attention (its input_layernorm output) and the
# scaling already folded into B by the conversion. The base prefill stores only P = x A per corrected adapter
# (2r floats per token and layer); x itself comes from the engine's hidden_states output (the residual stream after
# layers 0..L-2) and, for layer 0, the embedding row. docs/lora.md has the measurement: it changes answers.

CORRECTION_FIELD = "lora_corrections"
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


def mark_corrected(registry: LoraRegistry, names: tuple[str, ...] | list[str]) -> list[LoraAdapter]:
    """Turn the option on for `names` among the loaded adapters (refused in one line naming `lora_corrections`:
    a name not loaded, an activated adapter). Returns the corrected adapters."""
    marked = []
    for name in names:
        adapter = registry.adapters.get(name)
        if adapter is None:
            raise KvforgeError(f"names adapter {one_line(name)[:60]!r}, which is not loaded (loaded: "
                               f"{', '.join(sorted(registry.adapters)) or 'none'})", CORRECTION_FIELD)
        if adapter.invocation_tokens is not None:
            raise KvforgeError(f"adapter {name!r} is an activated LoRA (alora_invocation_tokens): it shares the base "
                               "pages exactly already and takes no correction", CORRECTION_FIELD)
        if not adapter.corrected:
            adapter = replace(adapter, corrected=True)
            registry.adapters[name] = adapter
        marked.append(adapter)
    return marked

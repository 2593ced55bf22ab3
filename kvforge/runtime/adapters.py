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
    lora_inputs,
    model_fingerprint,
    target_dims,
)
from kvforge.contract.tensor_header import read_tensor_header
from kvforge.contract.validation import one_line


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


# --- corrected adapters (issue 39 item 2: opt-in, off by default): the math is execution/corrections.py's ---------

CORRECTION_FIELD = "lora_corrections"


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

"""LoRA adapters at run time: load converted files, check them against the engine, identify them by digest."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import safe_open

from kvforge.contract.engine_dir import EngineDir
from kvforge.contract.errors import KvforgeError
from kvforge.contract.lora import ADAPTER_FORMAT, lora_inputs, model_fingerprint, target_dims


@dataclass(frozen=True, slots=True, eq=False)
class LoraAdapter:
    name: str
    path: Path
    rank: int
    tensors: dict[str, np.ndarray] = field(repr=False)  # engine input name -> array (missing targets: zeros)
    digest: bytes  # BLAKE2b of the converted weights (scaling folded in): the cache identity, never the name


def adapter_digest(tensors: dict[str, np.ndarray]) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name], dtype="<f4")
        digest.update(name.encode() + b"\0" + str(array.shape).encode() + b"\0")
        digest.update(array.tobytes())
    return digest.digest()


def load_adapter(name: str, path: Path, engine: EngineDir, where: str) -> LoraAdapter:
    model, limit = engine.model, engine.build.max_lora_rank
    if limit == 0 or not model.lora_targets:
        raise KvforgeError("the engine was built without LoRA inputs; rebuild with llm_build --maxLoraRank R", where)
    if not path.is_file():
        raise KvforgeError(f"adapter file {path} does not exist", where)
    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = handle.metadata() or {}
            raw = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 - safe_open has no iter
    except Exception as exc:
        raise KvforgeError(f"cannot read adapter {path}: {str(exc).splitlines()[0]}", where) from None
    if metadata.get("format") != ADAPTER_FORMAT:
        raise KvforgeError(f"{path} is not a converted adapter; convert it with: llm_export lora --adapterDir DIR "
                           "--onnxDir ONNXDIR --output FILE.safetensors", where)
    if metadata.get("model_fingerprint") != model_fingerprint(model):
        raise KvforgeError(f"adapter {path} was converted for another model", where)
    rank = int(metadata.get("rank", "0"))
    if not 0 < rank <= limit:
        raise KvforgeError(f"adapter rank {rank} exceeds the engine's --maxLoraRank {limit}", where)
    tensors: dict[str, np.ndarray] = {}
    for a_name, b_name, _layer, target in lora_inputs(model):
        in_dim, out_dim = target_dims(model, target)
        a = raw.pop(a_name, None)
        b = raw.pop(b_name, None)
        if a is None and b is None:
            a, b = np.zeros((in_dim, rank), np.float32), np.zeros((rank, out_dim), np.float32)
        if a is None or b is None or a.shape != (in_dim, rank) or b.shape != (rank, out_dim):
            raise KvforgeError(f"adapter tensors {a_name}/{b_name} do not match the engine (expected "
                               f"[{in_dim}, {rank}] and [{rank}, {out_dim}])", where)
        tensors[a_name], tensors[b_name] = a.astype(np.float32), b.astype(np.float32)
    if raw:
        raise KvforgeError(f"adapter has tensors the engine does not take ({', '.join(sorted(raw)[:3])}...); "
                           "was the engine exported with fewer --loraTargets?", where)
    return LoraAdapter(name, path, rank, tensors, adapter_digest(tensors))


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
    for a_name, b_name, _layer, target in lora_inputs(engine.model):
        in_dim, out_dim = target_dims(engine.model, target)
        shapes[a_name], shapes[b_name] = (in_dim, 0), (0, out_dim)
    return shapes


class LoraRegistry:
    """The adapters of one request file, loaded once each; names resolve per request."""

    __slots__ = ("engine", "adapters")

    def __init__(self, engine: EngineDir) -> None:
        self.engine = engine
        self.adapters: dict[str, LoraAdapter] = {}

    def load(self, available: dict[str, str], base_dir: Path | None = None) -> None:
        """Load `available_lora_weights`; paths may use $VARS and are relative to the request file."""
        self.adapters = {}
        for name, raw_path in available.items():
            path = Path(os.path.expandvars(raw_path))
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            self.adapters[name] = load_adapter(name, path, self.engine, f'available_lora_weights["{name}"]')

    def get(self, name: str | None) -> LoraAdapter | None:
        if not name:
            return None
        if name not in self.adapters:  # request parsing checks names; this catches API callers that skip load()
            raise KvforgeError(f"adapter {name!r} is not loaded (load available_lora_weights first)", "lora_name")
        return self.adapters[name]

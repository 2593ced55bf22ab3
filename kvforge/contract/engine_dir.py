"""The engine-dir contract the runtime runs: which files, which config keys, validated on load."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.geometry import PageGeometry, partial_kv_bytes_per_slot, recurrent_bytes_per_slot
from kvforge.contract.model_config import ModelConfig, read_json

ENGINE_MODEL_FILE = "model.onnx"
ENGINE_WEIGHTS_FILE = "model.onnx.data"
TRT_ENGINE_FILE = "llm.engine"  # backend "tensorrt": the serialized TensorRT engine (AOT plugin kernels inside)
BACKEND_FILES = {"onnxruntime": (ENGINE_MODEL_FILE, ENGINE_WEIGHTS_FILE), "tensorrt": (TRT_ENGINE_FILE,)}
EMBEDDING_FILE = "embedding.safetensors"
EMBEDDING_TENSOR = "embedding"
# ONNX Runtime engines of tied models take the LM head as this input [vocab, hidden] float32 and the runtime binds
# the (memory-mapped) embedding table to it: one copy of the largest weight instead of two.
TIED_HEAD_INPUT = "lm_head_weight"
COPIED_FILES = (EMBEDDING_FILE, "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True, slots=True)
class BuilderConfig(PageGeometry):
    """config.json's `builder_config`: the engine's page geometry plus what it was built for."""

    backend: str  # a key of BACKEND_FILES
    max_lora_rank: int = 0  # 0: no LoRA inputs (engine dirs from before LoRA lack the key)
    # Snapshot geometry (informational: the runtime recomputes it from the model config). Every kvforge layer is
    # an attention layer today; recurrent slots are 0 until a recurrent family lands.
    layer_types: tuple[str, ...] = ()
    partial_kv_snapshot_bytes_per_slot: int = 0  # one K+V page per attention layer
    recurrent_snapshot_bytes_per_slot: int = 0

    @classmethod
    def from_geometry(cls, geometry: PageGeometry, backend: str, max_lora_rank: int,
                      model: ModelConfig | None = None) -> BuilderConfig:
        resolved = {f.name: getattr(geometry, f.name) for f in fields(PageGeometry)}
        snapshots: dict[str, Any] = {}
        if model is not None and model.is_recurrent:
            snapshots = {"layer_types": tuple(model.layer_types), "recurrent_snapshot_bytes_per_slot":
                         recurrent_bytes_per_slot(model.num_hidden_layers, model.recurrent_state_num_heads,
                                                  model.recurrent_state_head_dim, model.recurrent_state_size,
                                                  model.conv_dim, model.conv_kernel)}
        elif model is not None:
            snapshots = {"layer_types": ("attention",) * model.num_hidden_layers,
                         "partial_kv_snapshot_bytes_per_slot": partial_kv_bytes_per_slot(
                             model.num_hidden_layers, model.num_key_value_heads, model.head_dim,
                             geometry.tokens_per_page, model.kv_cache_dtype)}
        return cls(**resolved, backend=backend, max_lora_rank=max_lora_rank, **snapshots)

    def to_dict(self) -> dict[str, Any]:
        # minimum_active_pages: written since the first engine dirs (batch × pages per sequence); nothing reads it.
        return {**asdict(self), "minimum_active_pages": self.full_batch_pages}


BUILDER_KEYS = tuple(f.name for f in fields(BuilderConfig) if f.default is MISSING)  # required in builder_config


@dataclass(frozen=True, slots=True)
class EngineDir:
    path: Path
    model: ModelConfig
    build: BuilderConfig

    def file(self, name: str) -> Path:
        return self.path / name


def load_engine_dir(path: Path) -> EngineDir:
    """The engine dir at `path`, checked; errors name the field `engine_dir`."""
    if not path.is_dir():
        raise InvalidConfig(f"{path} is not a directory", "engine_dir")
    data = read_json(path / "config.json", "engine_dir")
    model = ModelConfig.from_dict(data, f"{path}/config.json")
    if model.is_recurrent or any(t != "attention" for t in model.layer_types):
        raise InvalidConfig(f"engine has layer types {sorted(set(model.layer_types))}; this runtime runs attention "
                            "layers only", "engine_dir")
    raw = data.get("builder_config")
    if not isinstance(raw, dict):
        raise InvalidConfig(f"{path}/config.json has no builder_config; is this an ONNX dir? build it with llm_build",
                            "engine_dir")
    missing = [k for k in BUILDER_KEYS if k not in raw]
    if missing:
        raise InvalidConfig(f"builder_config lacks {', '.join(missing)}; rebuild the engine", "engine_dir")
    build = BuilderConfig(**{k: raw[k] for k in BUILDER_KEYS}, max_lora_rank=int(raw.get("max_lora_rank", 0)),
                          layer_types=tuple(raw.get("layer_types", ())),
                          partial_kv_snapshot_bytes_per_slot=int(raw.get("partial_kv_snapshot_bytes_per_slot", 0)),
                          recurrent_snapshot_bytes_per_slot=int(raw.get("recurrent_snapshot_bytes_per_slot", 0)))
    if build.backend not in BACKEND_FILES:
        raise InvalidConfig(f"engine backend {build.backend!r} cannot run here", "engine_dir")
    for name in (*BACKEND_FILES[build.backend], *COPIED_FILES):
        if not (path / name).is_file():
            raise InvalidConfig(f"engine dir {path} is missing {name}; rebuild it with llm_build", "engine_dir")
    return EngineDir(path, model, build)

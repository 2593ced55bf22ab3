"""The engine-dir contract the runtime runs: which files, which config keys, validated on load."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.geometry import PageGeometry
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

    @classmethod
    def from_geometry(cls, geometry: PageGeometry, backend: str, max_lora_rank: int) -> BuilderConfig:
        resolved = {f.name: getattr(geometry, f.name) for f in fields(PageGeometry)}
        return cls(**resolved, backend=backend, max_lora_rank=max_lora_rank)

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
    raw = data.get("builder_config")
    if not isinstance(raw, dict):
        raise InvalidConfig(f"{path}/config.json has no builder_config; is this an ONNX dir? build it with llm_build",
                            "engine_dir")
    missing = [k for k in BUILDER_KEYS if k not in raw]
    if missing:
        raise InvalidConfig(f"builder_config lacks {', '.join(missing)}; rebuild the engine", "engine_dir")
    build = BuilderConfig(**{k: raw[k] for k in BUILDER_KEYS}, max_lora_rank=int(raw.get("max_lora_rank", 0)))
    if build.backend not in BACKEND_FILES:
        raise InvalidConfig(f"engine backend {build.backend!r} cannot run here", "engine_dir")
    for name in (*BACKEND_FILES[build.backend], *COPIED_FILES):
        if not (path / name).is_file():
            raise InvalidConfig(f"engine dir {path} is missing {name}; rebuild it with llm_build", "engine_dir")
    return EngineDir(path, model, build)

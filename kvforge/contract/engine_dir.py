"""The engine-dir contract the runtime runs: which files, which config keys, validated on load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvforge.contract.errors import KvforgeError
from kvforge.contract.model_config import ModelConfig, read_json

ENGINE_MODEL_FILE = "model.onnx"
ENGINE_WEIGHTS_FILE = "model.onnx.data"
TRT_ENGINE_FILE = "llm.engine"  # backend "tensorrt": the serialized TensorRT engine (AOT plugin kernels inside)
BACKEND_FILES = {"onnxruntime": (ENGINE_MODEL_FILE, ENGINE_WEIGHTS_FILE), "tensorrt": (TRT_ENGINE_FILE,)}
EMBEDDING_FILE = "embedding.safetensors"
EMBEDDING_TENSOR = "embedding"
COPIED_FILES = (EMBEDDING_FILE, "tokenizer.json", "tokenizer_config.json")
BUILDER_KEYS = ("max_input_len", "max_kv_cache_capacity", "max_batch_size", "tokens_per_page",
                "max_kv_pool_pages", "max_pages_per_seq", "backend")


@dataclass(frozen=True, slots=True)
class BuilderConfig:
    max_input_len: int
    max_kv_cache_capacity: int
    max_batch_size: int
    tokens_per_page: int
    max_kv_pool_pages: int
    max_pages_per_seq: int
    backend: str
    max_lora_rank: int = 0


@dataclass(frozen=True, slots=True)
class EngineDir:
    path: Path
    model: ModelConfig
    build: BuilderConfig

    def file(self, name: str) -> Path:
        return self.path / name


def load_engine_dir(path: Path) -> EngineDir:
    if not path.is_dir():
        raise KvforgeError(f"{path} is not a directory", "--engineDir")
    data = read_json(path / "config.json", "--engineDir")
    model = ModelConfig.from_dict(data, f"{path}/config.json")
    raw = data.get("builder_config")
    if not isinstance(raw, dict):
        raise KvforgeError(f"{path}/config.json has no builder_config; is this an ONNX dir? build it with llm_build",
                           "--engineDir")
    missing = [k for k in BUILDER_KEYS if k not in raw]
    if missing:
        raise KvforgeError(f"builder_config lacks {', '.join(missing)}; rebuild the engine", "--engineDir")
    build = BuilderConfig(**{k: raw[k] for k in BUILDER_KEYS}, max_lora_rank=int(raw.get("max_lora_rank", 0)))
    if build.backend not in BACKEND_FILES:
        raise KvforgeError(f"engine backend {build.backend!r} cannot run here", "--engineDir")
    for name in (*BACKEND_FILES[build.backend], *COPIED_FILES):
        if not (path / name).is_file():
            raise KvforgeError(f"engine dir {path} is missing {name}; rebuild it with llm_build", "--engineDir")
    return EngineDir(path, model, build)

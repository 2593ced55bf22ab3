"""Readers of a Hugging Face checkpoint dir shared by every HF family's loader (text, vision, audio): its config's
model type, safetensors headers and tensors (bfloat16 included), and its tokenizer files."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import loads_json, read_json
from kvforge.contract.model_config import ModelConfig
from kvforge.contract.tensor_header import MAX_HEADER_BYTES

FIELD = "SOURCE"
# HF stores this when no limit was set; an int(1e30) is no use to a runtime.
_NO_MAX_LENGTH = 10**9
_FLOAT_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}


def hf_dir_is(path: Path, model_types: tuple[str, ...], architecture: str) -> bool:
    """Whether `path` holds a Hugging Face checkpoint of a family: its config.json's model_type or architecture."""
    config = path / "config.json"
    if not config.is_file():
        return False
    hf = read_json(config, FIELD)
    return hf.get("model_type") in model_types or architecture in (hf.get("architectures") or [])


def optional_json(path: Path) -> dict[str, Any]:
    return read_json(path, FIELD) if path.is_file() else {}


# ----------------------------------------------------------------------------------------------- weights

def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, FIELD).get("weight_map") or {}
        files = [path / f for f in sorted(set(weight_map.values()))]
        absent = [f for f in files if not f.is_file()]
        if absent:
            raise KvforgeError(f"{index} lists missing shard {absent[0]}", FIELD)
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise KvforgeError(f"no *.safetensors files in {path}", FIELD)
    return files


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the byte offset where tensor data starts."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:  # a forged length would make read() allocate it
                raise ValueError(f"header length {size} is not plausible")
            header = loads_json(f.read(size), FIELD, f"the header of {path}")
    except (OSError, struct.error, ValueError) as exc:
        raise KvforgeError(f"cannot read safetensors header of {path}: {exc}", FIELD) from None
    if not isinstance(header, dict):
        raise KvforgeError(f"cannot read safetensors header of {path}: not a JSON object", FIELD)
    header.pop("__metadata__", None)
    return header, 8 + size


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 is the top half of a float32, so widening the raw uint16 bits by 16 is exact."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def read_tensor(path: Path, name: str, entry: dict[str, Any], data_start: int) -> np.ndarray:
    # Read straight from the header's offsets rather than through safe_open(framework="numpy"): that
    # backend cannot return bfloat16, and one reader for every dtype keeps the paths identical.
    dtype, shape = entry["dtype"], tuple(entry["shape"])
    begin, end = entry["data_offsets"]
    raw_type = np.uint16 if dtype == "BF16" else _FLOAT_DTYPES.get(dtype)
    if raw_type is None:
        raise KvforgeError(f"tensor {name} in {path} has unsupported dtype {dtype}", FIELD)
    count = (end - begin) // np.dtype(raw_type).itemsize
    little = np.dtype(raw_type).newbyteorder("<")
    raw = np.fromfile(path, dtype=little, count=count, offset=data_start + begin)
    if raw.size != int(np.prod(shape)):
        raise KvforgeError(f"tensor {name} in {path} is truncated", FIELD)
    values = bf16_bits_to_f32(raw) if dtype == "BF16" else raw.astype(np.float32, copy=False)
    return values.reshape(shape)


def read_all(path: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for file in safetensors_files(path):
        header, data_start = read_safetensors_header(file)
        for name, entry in header.items():
            tensors[name] = read_tensor(file, name, entry, data_start)
    return tensors


def check_names(path: Path, tensors: dict[str, np.ndarray], expected: list[str], part: str) -> None:
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise KvforgeError(f"checkpoint in {path} lacks {part} tensor {missing[0]} ({len(missing)} missing)", FIELD)
    unexpected = sorted(set(tensors) - set(expected) - {"lm_head.weight"})
    if unexpected:
        raise KvforgeError(f"checkpoint in {path} has {part} tensor {unexpected[0]} this loader does not handle",
                           FIELD)


# --------------------------------------------------------------------------------------------- tokenizer

def tokenizer_json(path: Path) -> str:
    file = path / "tokenizer.json"
    if not file.is_file():
        raise KvforgeError(f"tokenizer.json missing in {path} (only fast-tokenizer checkpoints are "
                           "supported)", FIELD)
    return file.read_text(encoding="utf-8")


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(path: Path, tok_config: dict[str, Any]) -> str | None:
    template = tok_config.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None and (path / "chat_template.json").is_file():
        template = read_json(path / "chat_template.json", FIELD).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def tokenizer_config(path: Path, config: ModelConfig) -> dict[str, Any]:
    tok = optional_json(path / "tokenizer_config.json")
    max_length = tok.get("model_max_length")
    if not isinstance(max_length, (int, float)) or max_length >= _NO_MAX_LENGTH:
        max_length = config.max_position_embeddings
    return {
        "chat_template": _chat_template(path, tok),
        "bos_token": _token_text(tok.get("bos_token")),
        "eos_token": _token_text(tok.get("eos_token")),
        "add_bos_token": bool(tok.get("add_bos_token", False)),
        "model_max_length": int(max_length),
    }

"""Reads a profile JSON for llm_profile: size-capped, strictly parsed and made safe to print, whoever wrote it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvforge.contract import profile_schema as schema
from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import loads_json, read_limited
from kvforge.contract.validation import json_kind, printable

MAX_PROFILE_BYTES = 64 * 2**20
MAX_DEPTH = 32  # a profile nests 4 deep; anything deeper is dropped, not walked
MAX_STRING = 200


def load_profile(path: Path) -> dict[str, Any]:
    """Read and sanity-check a profile JSON; every failure is a KvforgeError naming the file."""
    path = Path(path)
    name = str(path)
    if not path.exists():
        raise KvforgeError("no such file", name)
    if path.is_dir():
        raise KvforgeError("is a directory, expected a profile JSON file", name)
    try:
        text = read_limited(path, MAX_PROFILE_BYTES, name).decode("utf-8")
    except UnicodeDecodeError:
        raise KvforgeError("not UTF-8 text, expected a profile JSON file", name) from None
    except OSError as exc:
        raise KvforgeError(f"cannot read: {exc.strerror or exc}", name) from None
    data = sanitize(loads_json(text, name))  # duplicate keys, nesting and huge literals: one line each
    if not isinstance(data, dict):
        raise KvforgeError(f"not a profile: the top level is a JSON {json_kind(data)}, expected an object", name)
    if not schema.TOP_LEVEL_KEYS & data.keys():
        raise KvforgeError("not a profile: none of the sections prefill, generation, stages, context_cache, "
                           "peak_*_memory found (write one with llm_inference --profileOutputFile)", name)
    return data


def sanitize(value: Any, depth: int = 0) -> Any:
    """A profile as the tables may print it: strings and keys made terminal-safe (escape sequences shown, not
    obeyed) and shortened, numbers beyond float range or non-finite dropped (None), nesting capped."""
    if depth > MAX_DEPTH:
        return None
    if isinstance(value, dict):
        return {_clean_text(str(k)): sanitize(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [sanitize(v, depth + 1) for v in value]
    if isinstance(value, str):
        return _clean_text(value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**63 else None  # formatting or mixing it with floats would overflow
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return None


def _clean_text(text: str) -> str:
    text = printable(text)
    return text if len(text) <= MAX_STRING else text[:MAX_STRING - 3] + "..."

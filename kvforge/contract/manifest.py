"""Completion manifests: an ONNX or engine dir is valid only when every file matches the digest written last.

`manifest.json` lists each file's size and digest; llm_export and llm_build write it as the last step
inside their staging dir, and llm_build / the runtime verify it on load. A directory from an
interrupted or failed run never has a matching manifest, so it is refused with one line.

Digest cost: files up to FULL_DIGEST_BYTES get a full SHA-256 (tokenizer, config, graph, a small
model's weights: ~2 ms per MiB). Larger files (weights, embeddings of real models) get their size plus
a BLAKE2b over SAMPLED_BLOCKS blocks of 64 KiB at evenly spaced offsets: about 1 MiB read whatever the
size (~1 ms for SmolLM2's 540 MB), so loading stays fast. That catches truncation, interruption and
replacement by another file, not a flipped byte in an unsampled region; set KVFORGE_FULL_DIGESTS=1 when
writing and verifying to hash every byte (release checks, untrusted copies).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.files import TEMP_MARK, read_json, write_json
from kvforge.contract.formats import MANIFEST_FILE, MANIFEST_FORMAT
from kvforge.contract.validation import one_line

ONNX_KIND = "onnx"  # what llm_export writes
ENGINE_KIND = "engine"  # what llm_build writes
FULL_DIGEST_BYTES = 64 * 2**20
SAMPLED_BLOCKS = 16
BLOCK_BYTES = 64 * 2**10


def file_digest(path: Path, size: int) -> str:
    """`sha256:HEX` of the whole file, or `sampled-blake2b:HEX` of evenly spaced blocks for a large one."""
    with open(path, "rb") as handle:
        if size <= FULL_DIGEST_BYTES or os.environ.get("KVFORGE_FULL_DIGESTS"):
            return "sha256:" + hashlib.file_digest(handle, "sha256").hexdigest()
        digest = hashlib.blake2b(str(size).encode(), digest_size=16)
        for i in range(SAMPLED_BLOCKS):
            handle.seek((size - BLOCK_BYTES) * i // (SAMPLED_BLOCKS - 1))
            digest.update(handle.read(BLOCK_BYTES))
        return "sampled-blake2b:" + digest.hexdigest()


def write_manifest(directory: Path, kind: str) -> None:
    """Record every regular file of `directory` (flat: ONNX and engine dirs have no subdirectories)."""
    files: dict[str, Any] = {}
    for path in sorted(directory.iterdir()):
        if path.name == MANIFEST_FILE or TEMP_MARK in path.name or not path.is_file():
            continue
        size = path.stat().st_size
        files[path.name] = {"size": size, "digest": file_digest(path, size)}
    write_json(directory / MANIFEST_FILE, {"format": MANIFEST_FORMAT, "kind": kind, "files": files})


def verify_manifest(directory: Path, kind: str, field: str, remedy: str, required: Iterable[str] = ()) -> None:
    """Check `directory` against its manifest, which must list at least one file and each of `required` (every
    file the reader opens); files it does not list are never read. Errors name `field`."""
    shown = one_line(str(directory))
    if not (directory / MANIFEST_FILE).is_file():
        raise InvalidConfig(f"{shown} has no {MANIFEST_FILE}: it was not completed (an interrupted run, or written "
                            f"by an older kvforge); {remedy}", field)
    data = read_json(directory / MANIFEST_FILE, field)
    files = data.get("files")
    if data.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
        raise InvalidConfig(f"{shown}/{MANIFEST_FILE} is not a kvforge manifest; {remedy}", field)
    if data.get("kind") != kind:
        found = one_line(str(data.get("kind")))
        raise InvalidConfig(f"{shown} holds a manifest of kind {found!r}, expected {kind!r}; {remedy}", field)
    if not files:
        raise InvalidConfig(f"{shown}/{MANIFEST_FILE} lists no files, so it vouches for none; {remedy}", field)
    for name, entry in files.items():
        if not isinstance(entry, dict) or "/" in name or name in ("", ".", ".."):
            raise InvalidConfig(f"{shown}/{MANIFEST_FILE} has a malformed entry; {remedy}", field)
    # A file read but not listed was added or edited after the dir was written (a chat template, a graph): it
    # would change answers that nothing vouches for.
    unlisted = sorted(set(required) - set(files))
    if unlisted:
        raise InvalidConfig(f"{shown}: {one_line(unlisted[0])} is not in its {MANIFEST_FILE} (added or edited since "
                            f"it was written); {remedy}", field)
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            raise InvalidConfig(f"{shown} is incomplete: {one_line(name)} is missing; {remedy}", field)
        size = path.stat().st_size
        if size != entry.get("size") or file_digest(path, size) != entry.get("digest"):
            raise InvalidConfig(f"{shown}: {one_line(name)} does not match {MANIFEST_FILE} (changed or truncated "
                                f"since it was written); {remedy}", field)

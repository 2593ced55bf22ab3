"""Engines llm_test builds from an ONNX dir and a config string, cached under a digest of everything they depend on."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from kvforge.builder.build import BuildOptions, build_engine, read_onnx_dir, resolve_backend, resolve_cpu_attention
from kvforge.contract.formats import MANIFEST_FILE
from kvforge.contract.version import __version__

KEY_FILE = "llm_test_key.json"  # what the digest covers, written beside the engine for people to read


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvforge" / "llm_test"


def lowering_sources() -> list[Path]:
    """The files whose content decides what a build writes: the builder, the op schemas and the CPU kernel's
    sources (the ops an engine's graph names must be the ones the library registers)."""
    import kvforge.builder
    from kvforge.plugins import cpu_kernel, ops

    builder = sorted(Path(kvforge.builder.__file__).parent.glob("*.py"))
    return [*builder, Path(ops.__file__), *cpu_kernel.KERNEL_FILES]


def lowering_digest() -> str:
    digest = hashlib.blake2b(digest_size=8)
    for path in lowering_sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def engine_key(onnx_dir: Path, options: BuildOptions) -> dict[str, object]:
    """What a cached engine depends on: the ONNX dir (config.json, every file's size and mtime), the resolved
    build options, the kvforge version and a digest of the lowering's sources (within one development version an
    op's inputs can change: an engine built before would no longer load)."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in onnx_dir.iterdir() if p.is_file())
    return {"kvforge": __version__, "lowering": lowering_digest(), "onnx_dir": str(onnx_dir.resolve()),
            "onnx_config": json.loads((onnx_dir / "config.json").read_text(encoding="utf-8")),
            "files": files, "build": asdict(options)}


def cached_engine(onnx_dir: Path, options: BuildOptions, cache_dir: Path,
                  step: Callable[[str], None] = lambda _m: None) -> tuple[Path, bool]:
    """(engine dir, built now): an engine for `options` from `cache_dir`, built there first when missing."""
    config = read_onnx_dir(onnx_dir)  # one-line errors for a missing or foreign ONNX dir before anything is written
    # Resolved so the key tells a kernel engine from a fallback one (KVFORGE_CPU_KERNEL=off builds the other).
    options = replace(options, backend=resolve_backend(options.backend),
                      cpu_attention=resolve_cpu_attention(options.cpu_attention,
                                                          head_dim=max(config.head_dim, config.global_head_dim)))
    key = engine_key(onnx_dir, options)
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=8).hexdigest()
    engine_dir = cache_dir / f"{onnx_dir.resolve().name}-{digest}"
    # The key file is written last and the dir appears whole (os.replace); a cached engine from before
    # completion manifests has no manifest.json and is rebuilt (the runtime would refuse it).
    if (engine_dir / KEY_FILE).is_file() and (engine_dir / MANIFEST_FILE).is_file():
        return engine_dir, False
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{engine_dir.name}-", dir=cache_dir))
    try:
        build_engine(onnx_dir, staging, options, step)
        (staging / KEY_FILE).write_text(json.dumps(key, indent=2) + "\n", encoding="utf-8")
        shutil.rmtree(engine_dir, ignore_errors=True)  # a dir left without its key file by an older interruption
        try:
            os.replace(staging, engine_dir)  # atomic: a concurrent run sees the whole engine or none
        except OSError:
            if not (engine_dir / KEY_FILE).is_file():  # not a concurrent run that got there first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return engine_dir, True

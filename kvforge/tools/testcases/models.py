"""A MODEL (GGUF file, HF checkpoint dir, bundled name, ONNX dir or engine dir) to an engine dir: exported and built
once into a cache keyed by the source, the flags and the kernel version, as llm_bench builds its ONNX dirs (the
same `cached_engine`), so `llm_serve MODEL`, `llm_inference MODEL` and `kvforge.LLM(MODEL)` start from a model file."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvforge.builder.build import BuildOptions
from kvforge.cli_common import console, progress_bar
from kvforge.contract.errors import KvforgeError
from kvforge.contract.formats import MANIFEST_FILE
from kvforge.contract.geometry import DEFAULT_TOKENS_PER_PAGE, kv_bytes_per_page
from kvforge.contract.model_config import ModelConfig
from kvforge.contract.version import __version__
from kvforge.tools.testcases.engines import cached_engine, default_cache_dir

FIELD = "MODEL"
KEY_FILE = "model_key.json"  # what an exported ONNX dir's digest covers, beside it for people to read
# llm_build's default, 16-token pages: reuse at vLLM's block granularity (to the token within a cached tail page);
# decode measured against 128-token pages on SmolLM2 (docs/benchmarks.md, "Page size").
TOKENS_PER_PAGE = DEFAULT_TOKENS_PER_PAGE
MAX_BATCH_SIZE = 4  # requests at once, as make demo's engine
CPU_CONTEXT_CAP = 8192  # tokens per sequence: beyond this, prefill on a CPU takes minutes
KV_MEMORY_SHARE = 8  # the KV pool takes at most 1/8 of the machine's memory
KV_BYTES = {"fp32": 4, "fp16": 2, "fp8": 1}


def model_cache_dir() -> Path:
    return default_cache_dir().parent / "models"


def engine_kind(path: Path) -> str | None:
    """"engine" for an engine dir, "onnx" for an ONNX dir llm_export wrote, None for anything else."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not (path / MANIFEST_FILE).is_file():
        return None
    return "engine" if "builder_config" in config else "onnx"


def export_digest() -> str:
    """The exporter's sources: within one development version a change there can change the ONNX it writes."""
    import kvforge.tools.export as export

    digest = hashlib.blake2b(digest_size=8)
    for path in sorted(Path(export.__file__).parent.rglob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def source_identity(model: str) -> dict[str, Any]:
    """What an export depends on in the source: the file (or every file of a dir) by resolved path, size and mtime;
    a bundled name by the GGUF it names."""
    from kvforge.tools.export.cli import SMOLLM2_NAME

    path = Path(model)
    if model == SMOLLM2_NAME:
        from kvforge.tools.export.sources.gguf import find_smollm2_gguf

        path = find_smollm2_gguf()
    elif not path.exists():
        raise KvforgeError(f"{model} is neither a file, a directory nor {SMOLLM2_NAME!r}", FIELD)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {"name": model if model == SMOLLM2_NAME else None, "path": str(path.resolve()),
            "files": [(str(p.relative_to(path)) if p != path else p.name, p.stat().st_size, p.stat().st_mtime_ns)
                      for p in files]}


@contextmanager
def stage(what: str, total: int | None = None) -> Iterator[Callable[[str], None]]:
    """A progress bar on a terminal; elsewhere (a service's log) a line when the stage starts and ends."""
    started = time.perf_counter()
    if not console.is_terminal:
        console.print(f"{what}…")
    with progress_bar(what, total, lines=False) as step:
        yield step
    if not console.is_terminal:
        console.print(f"{what}: done in {time.perf_counter() - started:.1f} s")


def exported(model: str, cache_dir: Path) -> tuple[Path, bool]:
    """(ONNX dir, exported now) of a GGUF file, HF dir or bundled name, from `cache_dir` (exported there first)."""
    from kvforge.tools.export.cli import default_quantization, load_source

    quantization = default_quantization(model, None)
    key = {"kvforge": __version__, "export": export_digest(), "source": source_identity(model),
           "quantization": quantization, "kv_cache_dtype": "fp16"}
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=8).hexdigest()
    onnx_dir = cache_dir / "onnx" / f"{Path(model).name.removesuffix('.gguf')}-{digest}"
    if (onnx_dir / KEY_FILE).is_file() and (onnx_dir / MANIFEST_FILE).is_file():
        return onnx_dir, False
    from kvforge.tools.export.quantize_model import quantize_linears
    from kvforge.tools.export.writer import write_onnx_dir

    onnx_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{onnx_dir.name}-", dir=onnx_dir.parent))
    try:
        with stage(f"exporting {model}: loading weights") as step:
            loaded = load_source(model, None, "fp16", 0, step)
        with stage(f"exporting {model}: weights {quantization}") as step:
            quantize_linears(loaded, quantization, 32, step)
        with stage(f"exporting {model}: writing the graph", loaded.config.num_hidden_layers + 1) as step:
            write_onnx_dir(loaded, staging / "onnx", step)
        (staging / "onnx" / KEY_FILE).write_text(json.dumps(key, indent=2) + "\n", encoding="utf-8")
        shutil.rmtree(onnx_dir, ignore_errors=True)
        try:
            os.replace(staging / "onnx", onnx_dir)  # a concurrent run sees the whole dir or none
        except OSError:
            if not (onnx_dir / KEY_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return onnx_dir, True


def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def choose_limits(config: ModelConfig, memory: int | None = None) -> tuple[BuildOptions, str]:
    """Build limits from the model and the machine, as llama-server picks its context: the model's positions, capped
    for a CPU and so that a full batch's KV cache takes at most 1/8 of the memory; prompts take 3/4 of a sequence,
    the answer the rest. Returns the options and a line that says how they were chosen."""
    memory = memory or machine_memory()
    T = TOKENS_PER_PAGE
    layers = max(config.num_hidden_layers, 1)
    per_token = 0
    if config.num_key_value_heads and config.head_dim:
        per_token = kv_bytes_per_page(config.num_key_value_heads, max(config.head_dim, config.global_head_dim), 1,
                                      config.kv_cache_dtype) * layers
    by_memory = memory // KV_MEMORY_SHARE // MAX_BATCH_SIZE // per_token if per_token else CPU_CONTEXT_CAP
    capacity = min(config.max_position_embeddings, CPU_CONTEXT_CAP, by_memory) // T * T
    if capacity < 2 * T:
        raise KvforgeError(f"this machine's {memory / 2**30:.1f} GiB hold too little KV cache for "
                           f"{config.name or 'the model'}; build an engine with llm_build and give its dir", FIELD)
    max_input = max(T, capacity * 3 // 4 // T * T)
    options = BuildOptions(max_input_len=max_input, max_kv_cache_capacity=capacity, max_batch_size=MAX_BATCH_SIZE,
                           tokens_per_page=T)
    binding = min((config.max_position_embeddings, "the model's positions"), (CPU_CONTEXT_CAP, "the CPU cap"),
                  (by_memory, f"1/{KV_MEMORY_SHARE} of {memory / 2**30:.0f} GiB for the KV cache"))[1]
    kv_mib = MAX_BATCH_SIZE * capacity * per_token / 2**20
    why = (f"limits: prompts up to {max_input:,} tokens, {capacity:,} per request with its answer, "
           f"{MAX_BATCH_SIZE} requests at once, pages of {T} tokens (set by {binding}; the model has "
           f"{config.max_position_embeddings:,} positions; KV cache {kv_mib:,.0f} MiB); other limits: llm_export, "
           "llm_build, then give the engine dir")
    return options, why


def is_model_source(model: str) -> bool:
    """A GGUF file, an HF checkpoint dir (config.json and safetensors) or the bundled name: something to export."""
    from kvforge.tools.export.cli import SMOLLM2_NAME

    path = Path(model)
    return model == SMOLLM2_NAME or path.is_file() or (
        (path / "config.json").is_file() and any(path.glob("*.safetensors")))


def model_engine(model: str | Path, cache_dir: Path | None = None, strict: bool = False) -> Path:
    """The engine dir to run for MODEL: an engine dir as it is; an ONNX dir built; a GGUF file, HF dir or bundled
    name exported, then built, each cached and found again on the next run. Prints what it did. Anything else is
    returned as it is for the runtime's engine-dir checks to name, or with `strict` (a CLI's MODEL) refused here."""
    from kvforge.builder.build import read_onnx_dir

    cache_dir = cache_dir or model_cache_dir()
    text = str(model)
    kind = engine_kind(Path(text))
    if kind == "engine":
        return Path(text)
    if kind is None and not is_model_source(text):
        if strict:
            raise KvforgeError(f"{text} is neither a GGUF file, an HF checkpoint dir (config.json and safetensors), "
                               "smollm2-135m-instruct, an ONNX dir nor an engine dir", FIELD)
        return Path(text)
    if kind == "onnx":
        onnx_dir, made = Path(text), False
    else:
        onnx_dir, made = exported(text, cache_dir)
        console.print(f"{text}: {'exported' if made else 'found exported'} {onnx_dir}")
    options, why = choose_limits(read_onnx_dir(onnx_dir))
    with stage(f"building {onnx_dir.name}") as step:
        engine_dir, built = cached_engine(onnx_dir, options, cache_dir / "engines", step)
    console.print(f"{text}: {'built' if built else 'found built'} {engine_dir}")
    console.print(f"{text}: {why}")
    return engine_dir


def engine_dir_of(model: str | None, engine_dir: Path | None) -> Path:
    """The engine dir a front end runs: --engineDir, or MODEL resolved (exported and built when it must be)."""
    if model is not None and engine_dir is not None:
        raise KvforgeError("give MODEL or --engineDir, not both", FIELD)
    if model is None and engine_dir is None:
        raise KvforgeError("missing: a GGUF file, an HF checkpoint dir, smollm2-135m-instruct, an ONNX dir or an "
                           "engine dir (or --engineDir)", FIELD)
    return engine_dir if engine_dir is not None else model_engine(str(model), strict=True)

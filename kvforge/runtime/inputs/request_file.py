"""The llm_inference request-file format: parses a JSON file into the runtime's request types, one-line errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from kvforge.contract.files import loads_json
from kvforge.contract.validation import (
    MISSING,
    check_choice,
    check_int,
    check_string,
    describe,
    fail,
    get_bool,
    join_path,
    json_kind,
    one_line,
    optional,
)
from kvforge.runtime.inputs.checks import (
    check_logit_bias,
    check_response_format,
    check_seed,
    check_stop,
    check_temperature,
    check_top_p,
    parse_messages,
)
from kvforge.runtime.types import (
    MAX_NUM_LOGPROBS,
    CommitPolicy,
    LookupPolicy,
    Request,
    SamplingParams,
)

T = TypeVar("T")

# Limits mirror TensorRT Edge-LLM's requestFileParser so a file accepted there is accepted here.
MAX_BATCH_SIZE = 16
LOOKUP_POLICIES = tuple(p.value for p in LookupPolicy)
COMMIT_POLICIES = tuple(p.value for p in CommitPolicy)

# Per-request keys we interpret; anything else lands in Request.extra (test fixtures carry `reference`...).
REQUEST_KEYS = frozenset({
    "messages", "temperature", "top_p", "top_k", "max_generate_length", "num_logprobs", "logit_bias",
    "stop", "seed", "apply_chat_template", "add_generation_prompt", "lora_name",
    "save_system_prompt_kv_cache", "cache_salt", "disable_spec_decode", "parse_special_tokens", "response_format",
})

@dataclass(slots=True)
class RequestFile:
    requests: list[Request]
    batch_size: int = 1
    context_cache_lookup_policy: LookupPolicy = LookupPolicy.USE_CACHE
    context_cache_commit_policy: CommitPolicy = CommitPolicy.INCLUDING_GENERATED_TOKENS
    available_lora_weights: dict[str, str] = field(default_factory=dict)
    enable_thinking: bool = False
    source: str = ""

    def batches(self) -> list[list[Request]]:
        """Requests chunked into batches of batch_size, in file order (the last one may be short)."""
        size = self.batch_size
        return [self.requests[i:i + size] for i in range(0, len(self.requests), size)]

    def apply_overrides(self, batch_size: int | None = None, max_generate_length: int | None = None,
                        num_logprobs: int | None = None) -> RequestFile:
        """Apply --batchSize/--maxGenerateLength/--numLogprobs in place (None or -1 keeps the file's)."""
        if _overridden(batch_size):
            self.batch_size = check_int(batch_size, "batch_size_override", 1, MAX_BATCH_SIZE)
        if _overridden(max_generate_length):
            length = check_int(max_generate_length, "max_generate_length_override", 1)
            self._replace_sampling(max_generate_length=length)
        if _overridden(num_logprobs):
            count = check_int(num_logprobs, "num_logprobs_override", 0, MAX_NUM_LOGPROBS)
            self._replace_sampling(num_logprobs=count)
        return self

    def parse_special_tokens_everywhere(self) -> None:
        """--parseSpecialTokens: every request's content may hold special tokens (the pre-hardening behaviour)."""
        for request in self.requests:
            request.parse_special_tokens = True

    def _replace_sampling(self, **changes: Any) -> None:
        for request in self.requests:
            request.sampling = replace(request.sampling, **changes)


DEFAULT_MAX_INPUT_FILE_BYTES = 64 * 2**20  # --maxInputFileBytes: ~100k chat requests; the file is read whole
MAX_INPUT_FILE_BYTES = 2**40


def load_request_file(path: Path | str, max_bytes: int = DEFAULT_MAX_INPUT_FILE_BYTES) -> RequestFile:
    """Read and validate a request file; every failure is a one-line KvforgeError on "inputFile"."""
    path = Path(path)
    shown = one_line(str(path))
    check_int(max_bytes, "max_input_file_bytes", 1, MAX_INPUT_FILE_BYTES)
    try:
        size = path.stat().st_size
        if path.is_file() and size > max_bytes:
            fail("inputFile", f"{shown} is {size:,} bytes, more than --maxInputFileBytes {max_bytes:,}; split the "
                              "file or raise the limit")
        with open(path, "rb") as handle:
            raw = handle.read(max_bytes + 1)  # a FIFO or /dev/zero has no size: never read past the cap
        if len(raw) > max_bytes:
            fail("inputFile", f"{shown} is more than --maxInputFileBytes {max_bytes:,} bytes")
        text = raw.decode("utf-8-sig")  # -sig: tolerate a BOM from Windows editors
    except FileNotFoundError:
        fail("inputFile", f"request file not found: {shown}")
    except IsADirectoryError:
        fail("inputFile", f"{shown} is a directory, expected a JSON file")
    except UnicodeDecodeError as exc:
        fail("inputFile", f"{shown} is not valid UTF-8 (bad byte at offset {exc.start})")
    except OSError as exc:
        fail("inputFile", f"cannot read {shown}: {one_line(exc.strerror or str(exc))}")
    data = loads_json(text, "inputFile", shown)  # duplicate keys refused, naming the key
    return parse_request_file(data, source=str(path))


def parse_request_file(data: dict[str, Any], *, source: str = "") -> RequestFile:
    """Validate an already-decoded request file; unknown top-level keys are ignored."""
    if not isinstance(data, dict):
        fail("inputFile", f"top level must be a JSON object, got {json_kind(data)}")
    # Top-level fields first, so an error there is reported before one inside a request.
    batch_size = check_int(data.get("batch_size", 1), "batch_size", 1, MAX_BATCH_SIZE)
    defaults = _parse_sampling(data, "", SamplingParams())
    chat = get_bool(data, "apply_chat_template", "", True)
    generation_prompt = get_bool(data, "add_generation_prompt", "", True)
    enable_thinking = get_bool(data, "enable_thinking", "", False)
    special = get_bool(data, "parse_special_tokens", "", False)
    lookup_policy = LookupPolicy(check_choice(data.get("context_cache_lookup_policy", LOOKUP_POLICIES[0]),
                                              "context_cache_lookup_policy", LOOKUP_POLICIES))
    commit_policy = CommitPolicy(check_choice(data.get("context_cache_commit_policy", COMMIT_POLICIES[0]),
                                              "context_cache_commit_policy", COMMIT_POLICIES))
    # The file's policies apply to every request; the API sets them per request on SamplingParams.
    defaults = replace(defaults, reuse_context=lookup_policy is LookupPolicy.USE_CACHE,
                       cache_generated_tokens=commit_policy is CommitPolicy.INCLUDING_GENERATED_TOKENS)
    loras = _parse_loras(data.get("available_lora_weights", {}), "available_lora_weights")
    raw_requests = data.get("requests", MISSING)
    if raw_requests is MISSING:
        fail("requests", "is required (a non-empty array of request objects)")
    if not isinstance(raw_requests, list) or not raw_requests:
        fail("requests", f"must be a non-empty array, got {describe(raw_requests)}")
    requests = [_parse_request(raw, i, defaults, chat, generation_prompt, loras, special)
                for i, raw in enumerate(raw_requests)]
    return RequestFile(requests=requests, batch_size=batch_size, context_cache_lookup_policy=lookup_policy,
                       context_cache_commit_policy=commit_policy, available_lora_weights=loras,
                       enable_thinking=enable_thinking, source=source)


def _parse_request(raw: Any, index: int, defaults: SamplingParams, chat: bool, generation_prompt: bool,
                   loras: dict[str, str], special: bool = False) -> Request:
    prefix = f"requests[{index}]"
    if not isinstance(raw, dict):
        fail(prefix, f"must be an object, got {json_kind(raw)}")
    sampling = replace(_parse_sampling(raw, prefix, defaults),
                       speculative=not get_bool(raw, "disable_spec_decode", prefix, False))
    return Request(
        index=index,
        messages=parse_messages(raw.get("messages", MISSING), f"{prefix}.messages"),
        sampling=sampling,
        apply_chat_template=get_bool(raw, "apply_chat_template", prefix, chat),
        add_generation_prompt=get_bool(raw, "add_generation_prompt", prefix, generation_prompt),
        lora_name=_parse_lora_name(raw.get("lora_name", ""), f"{prefix}.lora_name", loras),
        save_system_prompt_kv_cache=get_bool(raw, "save_system_prompt_kv_cache", prefix, False),
        cache_salt=optional(raw, "cache_salt", prefix, check_string),
        parse_special_tokens=get_bool(raw, "parse_special_tokens", prefix, special),
        extra={k: v for k, v in raw.items() if k not in REQUEST_KEYS},
    )


def _parse_sampling(obj: dict[str, Any], prefix: str, defaults: SamplingParams) -> SamplingParams:
    """Sampling fields of `obj`, each falling back to `defaults` (the top level for a request)."""
    def pick(name: str, check: Callable[[Any, str], T]) -> T:
        value = obj.get(name, MISSING)
        if value is MISSING:
            default = getattr(defaults, name)
            return dict(default) if isinstance(default, dict) else default  # no shared mutable dicts
        return check(value, join_path(prefix, name))

    return SamplingParams(
        temperature=pick("temperature", check_temperature),
        top_p=pick("top_p", check_top_p),
        top_k=pick("top_k", lambda v, f: check_int(v, f, 0)),
        max_generate_length=pick("max_generate_length", lambda v, f: check_int(v, f, 1)),
        num_logprobs=pick("num_logprobs", lambda v, f: check_int(v, f, 0, MAX_NUM_LOGPROBS)),
        logit_bias=pick("logit_bias", check_logit_bias),
        stop=pick("stop", check_stop),
        seed=pick("seed", check_seed),
        response_format=pick("response_format", check_response_format),
        reuse_context=defaults.reuse_context,  # policies are file-wide: never set per request in the file
        cache_generated_tokens=defaults.cache_generated_tokens,
    )


def _parse_loras(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        fail(where, f"must be an object mapping adapter name to path, got {json_kind(value)}")
    loras: dict[str, str] = {}
    for name, path in value.items():
        entry = f"{where}[{json.dumps(name)}]"
        if not name:
            fail(where, "adapter names must not be empty")
        if not isinstance(path, str) or not path:
            fail(entry, f"must be a non-empty path string, got {describe(path)}")
        loras[name] = path
    return loras


def _parse_lora_name(value: Any, where: str, loras: dict[str, str]) -> str | None:
    name = check_string(value, where)
    if not name:
        return None  # "" means no adapter, as in the reference tool
    if name not in loras:
        known = ", ".join(json.dumps(k) for k in loras) or "none"
        fail(where, f"adapter {json.dumps(name)} is not in available_lora_weights (available: {known})")
    return name


def _overridden(value: int | None) -> bool:
    return value is not None and not (type(value) is int and value == -1)



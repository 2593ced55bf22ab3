"""The llm_inference request-file format: parses a JSON file into the runtime's request types, one-line errors."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from kvforge.contract.files import loads_json
from kvforge.contract.validation import (
    MISSING,
    check_choice,
    check_int,
    check_number,
    check_string,
    describe,
    fail,
    get_bool,
    join_path,
    json_kind,
    one_line,
    optional,
    show,
    utf8_size,
)
from kvforge.runtime.types import (
    MEDIA_SENTINEL,
    CommitPolicy,
    LookupPolicy,
    MediaRef,
    Message,
    Request,
    SamplingParams,
)

T = TypeVar("T")

# Limits mirror TensorRT Edge-LLM's requestFileParser so a file accepted there is accepted here.
MAX_BATCH_SIZE = 16
MAX_NUM_LOGPROBS = 50
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
MAX_MESSAGES = 64
MAX_CONTENT_ITEMS = 18
MAX_CONTENT_BYTES = 128 * 1024
MAX_STOP_WORDS = 64  # every generated token is checked against each: a bound on per-step work
MAX_STOP_WORD_BYTES = 1024

ROLES = ("system", "user", "assistant", "tool")
MEDIA_TYPES = ("image", "audio", "video")
CONTENT_TYPES = ("text", *MEDIA_TYPES)
LOOKUP_POLICIES = tuple(p.value for p in LookupPolicy)
COMMIT_POLICIES = tuple(p.value for p in CommitPolicy)

# Per-request keys we interpret; anything else lands in Request.extra (test fixtures carry `reference`...).
REQUEST_KEYS = frozenset({
    "messages", "temperature", "top_p", "top_k", "max_generate_length", "num_logprobs", "logit_bias",
    "stop", "seed", "apply_chat_template", "add_generation_prompt", "lora_name",
    "save_system_prompt_kv_cache", "cache_salt", "disable_spec_decode", "parse_special_tokens",
})

_TOKEN_ID = re.compile(r"[0-9]+")


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
    get_bool(raw, "disable_spec_decode", prefix, False)  # checked for the seed's files; no speculative decoding yet
    return Request(
        index=index,
        messages=_parse_messages(raw.get("messages", MISSING), f"{prefix}.messages"),
        sampling=_parse_sampling(raw, prefix, defaults),
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
        temperature=pick("temperature", _temperature),
        top_p=pick("top_p", _top_p),
        top_k=pick("top_k", lambda v, f: check_int(v, f, 0)),
        max_generate_length=pick("max_generate_length", lambda v, f: check_int(v, f, 1)),
        num_logprobs=pick("num_logprobs", lambda v, f: check_int(v, f, 0, MAX_NUM_LOGPROBS)),
        logit_bias=pick("logit_bias", _logit_bias),
        stop=pick("stop", _stop),
        seed=pick("seed", _seed),
        reuse_context=defaults.reuse_context,  # policies are file-wide: never set per request in the file
        cache_generated_tokens=defaults.cache_generated_tokens,
    )


# A front end's own content items (llm_serve's `image_url`, `input_audio`): (item, its JSON path) -> its MediaRef.
MediaItemParser = Callable[[dict[str, Any], str], MediaRef]


def _parse_messages(value: Any, where: str, media_items: Mapping[str, MediaItemParser] | None = None) -> list[Message]:
    """`media_items` maps content types to their parsers; they take precedence over the file's own media items."""
    if value is MISSING:
        fail(where, "is required (a non-empty array of {role, content} objects)")
    if not isinstance(value, list) or not value:
        fail(where, f"must be a non-empty array, got {describe(value)}")
    if len(value) > MAX_MESSAGES:
        fail(where, f"must hold at most {MAX_MESSAGES} messages, got {len(value)}")
    return [_parse_message(raw, f"{where}[{i}]", media_items or {}) for i, raw in enumerate(value)]


def _parse_message(raw: Any, where: str, media_items: Mapping[str, MediaItemParser] | None = None) -> Message:
    if not isinstance(raw, dict):
        fail(where, f"must be a {{role, content}} object, got {json_kind(raw)}")
    role = _required(raw, "role", where, f"one of {', '.join(ROLES)}")
    check_choice(role, f"{where}.role", ROLES)
    content = _required(raw, "content", where, "a string or an array of content items")
    text, media = _parse_content(content, f"{where}.content", media_items or {})
    return Message(role=role, content=text, media=media)


def _parse_content(value: Any, where: str,
                   media_items: Mapping[str, MediaItemParser]) -> tuple[str, tuple[MediaRef, ...]]:
    media: list[MediaRef] = []
    if isinstance(value, str):
        text = value
    elif isinstance(value, list):
        if len(value) > MAX_CONTENT_ITEMS:
            fail(where, f"must hold at most {MAX_CONTENT_ITEMS} items, got {len(value)}")
        text = "".join(_parse_content_item(item, f"{where}[{i}]", media, media_items)
                       for i, item in enumerate(value))
    else:
        fail(where, f"must be a string or an array of content items, got {json_kind(value)}")
    size = utf8_size(text, where)
    if size > MAX_CONTENT_BYTES:
        fail(where, f"must be at most {MAX_CONTENT_BYTES} bytes of UTF-8, got {size}")
    if text.count(MEDIA_SENTINEL) != len(media):
        fail(where, "text must not contain U+FFFC (it stands for media items)")
    return text, tuple(media)


def _parse_content_item(item: Any, where: str, media: list[MediaRef],
                        media_items: Mapping[str, MediaItemParser]) -> str:
    if not isinstance(item, dict):
        fail(where, f'must be an object like {{"type": "text", "text": ...}}, got {json_kind(item)}')
    types = (*CONTENT_TYPES, *(t for t in media_items if t not in CONTENT_TYPES))
    kind = _required(item, "type", where, f"one of {', '.join(types)}")
    check_choice(kind, f"{where}.type", types)
    if kind in media_items:
        media.append(media_items[kind](item, where))
        return MEDIA_SENTINEL
    if kind in ("image", "audio"):
        path = check_string(_required(item, kind, where, f'a file path, for an "{kind}" item'), f"{where}.{kind}")
        if not path:
            fail(f"{where}.{kind}", "must be a file path, got an empty string")
        media.append(MediaRef(kind, path, where))
        return MEDIA_SENTINEL
    if kind in MEDIA_TYPES:
        fail(f"{where}.type", f'"{kind}" content is not supported yet; "text", "image" and "audio" items are')
    return check_string(_required(item, "text", where, 'a string, for a "text" item'), f"{where}.text")


def _required(obj: dict[str, Any], key: str, where: str, expected: str) -> Any:
    value = obj.get(key, MISSING)
    if value is MISSING:
        fail(f"{where}.{key}", f"is required ({expected})")
    return value


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


def _temperature(value: Any, where: str) -> float:
    number = check_number(value, where, "a finite number >= 0")
    if number < 0:
        fail(where, f"must be a finite number >= 0 (0 = greedy), got {show(value)}")
    return number


def _top_p(value: Any, where: str) -> float:
    number = check_number(value, where, "a number in (0, 1]")
    if not 0 < number <= 1:
        fail(where, f"must be a number in (0, 1], got {show(value)}")
    return number


def _logit_bias(value: Any, where: str) -> dict[int, float]:
    if not isinstance(value, dict):
        fail(where, f'must be an object like {{"token_id": bias}}, got {json_kind(value)}')
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        fail(where, f"must have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(value)}")
    bias: dict[int, float] = {}
    for key, raw in value.items():
        entry = f"{where}[{json.dumps(key)}]"
        if not isinstance(key, str) or not _TOKEN_ID.fullmatch(key):
            fail(entry, f"key must be a non-negative decimal token id, got {json.dumps(str(key))}")
        token_id = int(key)
        if token_id in bias:  # "7" and "007" name the same token
            fail(entry, f"token id {token_id} appears more than once")
        number = check_number(raw, entry, f"a finite number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if abs(number) > MAX_LOGIT_BIAS:
            fail(entry, f"must be a finite number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                         f"got {show(raw)}")
        bias[token_id] = number
    return bias


def _stop(value: Any, where: str) -> tuple[str, ...]:
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list):
        fail(where, f"must be a string or an array of strings, got {json_kind(value)}")
    if len(words) > MAX_STOP_WORDS:
        fail(where, f"must hold at most {MAX_STOP_WORDS} stop strings, got {len(words)}")
    for i, word in enumerate(words):
        item = where if isinstance(value, str) else f"{where}[{i}]"
        # An empty stop word would match before the first token and end every generation at once.
        if not isinstance(word, str) or not word:
            fail(item, f"must be a non-empty string, got {describe(word)}")
        if utf8_size(word, item) > MAX_STOP_WORD_BYTES:
            fail(item, f"must be at most {MAX_STOP_WORD_BYTES} bytes of UTF-8")
    return tuple(words)


def _seed(value: Any, where: str) -> int | None:
    return None if value is None else check_int(value, where, 0)


def _overridden(value: int | None) -> bool:
    return value is not None and not (type(value) is int and value == -1)



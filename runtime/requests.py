"""Turns an llm_inference request JSON file into checked dataclasses, so the runtime never sees bad input."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from kvforge.contract.errors import KvforgeError

T = TypeVar("T")

# Limits mirror TensorRT Edge-LLM's requestFileParser so a file accepted there is accepted here.
MAX_BATCH_SIZE = 16
MAX_NUM_LOGPROBS = 50
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
MAX_MESSAGES = 64
MAX_CONTENT_ITEMS = 18
MAX_CONTENT_BYTES = 128 * 1024

ROLES = ("system", "user", "assistant", "tool")
MEDIA_TYPES = ("image", "audio", "video")
CONTENT_TYPES = ("text", *MEDIA_TYPES)
LOOKUP_POLICIES = ("use_cache", "bypass")
COMMIT_POLICIES = ("including_generated_tokens", "prefill_state_only")

# Per-request keys we interpret; anything else lands in Request.extra (test fixtures carry `reference`...).
REQUEST_KEYS = frozenset({
    "messages", "temperature", "top_p", "top_k", "max_generate_length", "num_logprobs", "logit_bias",
    "stop", "seed", "apply_chat_template", "add_generation_prompt", "lora_name",
    "save_system_prompt_kv_cache", "cache_salt", "disable_spec_decode",
})

_TOKEN_ID = re.compile(r"[0-9]+")
_MISSING = object()


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 0.8
    top_k: int = 50  # 0 = disabled, 1 = greedy
    max_generate_length: int = 256
    num_logprobs: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    seed: int | None = None  # None = fresh entropy per run

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(slots=True)
class Message:
    role: str
    content: str  # text items of a content array are joined with ""


@dataclass(slots=True)
class Request:
    index: int  # flat position in the file; becomes `request_idx` in the output
    messages: list[Message]
    sampling: SamplingParams
    apply_chat_template: bool = True
    add_generation_prompt: bool = True
    lora_name: str | None = None
    save_system_prompt_kv_cache: bool = False
    cache_salt: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    disable_spec_decode: bool = False

    def plain_text(self) -> str:
        """The prompt used when apply_chat_template is false: contents concatenated as-is."""
        return "".join(m.content for m in self.messages)


@dataclass(slots=True)
class RequestFile:
    requests: list[Request]
    batch_size: int = 1
    context_cache_lookup_policy: str = "use_cache"
    context_cache_commit_policy: str = "including_generated_tokens"
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
            self.batch_size = _int(batch_size, "--batchSize", 1, MAX_BATCH_SIZE)
        if _overridden(max_generate_length):
            length = _int(max_generate_length, "--maxGenerateLength", 1)
            self._replace_sampling(max_generate_length=length)
        if _overridden(num_logprobs):
            count = _int(num_logprobs, "--numLogprobs", 0, MAX_NUM_LOGPROBS)
            self._replace_sampling(num_logprobs=count)
        return self

    def _replace_sampling(self, **changes: Any) -> None:
        for request in self.requests:
            request.sampling = replace(request.sampling, **changes)


class _ObjectWithDuplicates(dict):
    """A JSON object that remembers repeated keys, which json.loads would otherwise drop silently."""

    duplicates: tuple[str, ...] = ()


def _object_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = _ObjectWithDuplicates(pairs)
    if len(obj) != len(pairs):
        counts = Counter(key for key, _ in pairs)
        obj.duplicates = tuple(key for key, count in counts.items() if count > 1)
    return obj


def load_request_file(path: Path | str) -> RequestFile:
    """Read and validate a request file; every failure is a one-line KvforgeError on "inputFile"."""
    path = Path(path)
    shown = _one_line(str(path))
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: tolerate a BOM from Windows editors
    except FileNotFoundError:
        _fail("inputFile", f"request file not found: {shown}")
    except IsADirectoryError:
        _fail("inputFile", f"{shown} is a directory, expected a JSON file")
    except UnicodeDecodeError as exc:
        _fail("inputFile", f"{shown} is not valid UTF-8 (bad byte at offset {exc.start})")
    except OSError as exc:
        _fail("inputFile", f"cannot read {shown}: {_one_line(exc.strerror or str(exc))}")
    try:
        data = json.loads(text, object_pairs_hook=_object_hook)
    except json.JSONDecodeError as exc:
        _fail("inputFile", f"malformed JSON in {shown} at line {exc.lineno}, column {exc.colno}: {exc.msg}")
    except RecursionError:
        _fail("inputFile", f"malformed JSON in {shown}: nested too deeply")
    except ValueError as exc:  # e.g. an integer literal longer than Python's int-conversion limit
        _fail("inputFile", f"malformed JSON in {shown}: {_one_line(str(exc))}")
    return parse_request_file(data, source=str(path))


def parse_request_file(data: dict[str, Any], *, source: str = "") -> RequestFile:
    """Validate an already-decoded request file; unknown top-level keys are ignored."""
    if not isinstance(data, dict):
        _fail("inputFile", f"top level must be a JSON object, got {json_kind(data)}")
    # Top-level fields first, so an error there is reported before one inside a request.
    batch_size = _int(data.get("batch_size", 1), "batch_size", 1, MAX_BATCH_SIZE)
    defaults = _parse_sampling(data, "", SamplingParams())
    chat = _get_bool(data, "apply_chat_template", "", True)
    generation_prompt = _get_bool(data, "add_generation_prompt", "", True)
    enable_thinking = _get_bool(data, "enable_thinking", "", False)
    lookup_policy = _choice(data.get("context_cache_lookup_policy", LOOKUP_POLICIES[0]),
                            "context_cache_lookup_policy", LOOKUP_POLICIES)
    commit_policy = _choice(data.get("context_cache_commit_policy", COMMIT_POLICIES[0]),
                            "context_cache_commit_policy", COMMIT_POLICIES)
    loras = _parse_loras(data.get("available_lora_weights", {}), "available_lora_weights")
    raw_requests = data.get("requests", _MISSING)
    if raw_requests is _MISSING:
        _fail("requests", "is required (a non-empty array of request objects)")
    if not isinstance(raw_requests, list) or not raw_requests:
        _fail("requests", f"must be a non-empty array, got {_describe(raw_requests)}")
    requests = [_parse_request(raw, i, defaults, chat, generation_prompt, loras)
                for i, raw in enumerate(raw_requests)]
    return RequestFile(requests=requests, batch_size=batch_size, context_cache_lookup_policy=lookup_policy,
                       context_cache_commit_policy=commit_policy, available_lora_weights=loras,
                       enable_thinking=enable_thinking, source=source)


def _parse_request(raw: Any, index: int, defaults: SamplingParams, chat: bool, generation_prompt: bool,
                   loras: dict[str, str]) -> Request:
    prefix = f"requests[{index}]"
    if not isinstance(raw, dict):
        _fail(prefix, f"must be an object, got {json_kind(raw)}")
    return Request(
        index=index,
        messages=_parse_messages(raw.get("messages", _MISSING), f"{prefix}.messages"),
        sampling=_parse_sampling(raw, prefix, defaults),
        apply_chat_template=_get_bool(raw, "apply_chat_template", prefix, chat),
        add_generation_prompt=_get_bool(raw, "add_generation_prompt", prefix, generation_prompt),
        lora_name=_parse_lora_name(raw.get("lora_name", ""), f"{prefix}.lora_name", loras),
        save_system_prompt_kv_cache=_get_bool(raw, "save_system_prompt_kv_cache", prefix, False),
        cache_salt=_optional(raw, "cache_salt", prefix, _string),
        extra={k: v for k, v in raw.items() if k not in REQUEST_KEYS},
        disable_spec_decode=_get_bool(raw, "disable_spec_decode", prefix, False),
    )


def _parse_sampling(obj: dict[str, Any], prefix: str, defaults: SamplingParams) -> SamplingParams:
    """Sampling fields of `obj`, each falling back to `defaults` (the top level for a request)."""
    def pick(name: str, check: Callable[[Any, str], T]) -> T:
        value = obj.get(name, _MISSING)
        if value is _MISSING:
            default = getattr(defaults, name)
            return dict(default) if isinstance(default, dict) else default  # no shared mutable dicts
        return check(value, _join(prefix, name))

    return SamplingParams(
        temperature=pick("temperature", _temperature),
        top_p=pick("top_p", _top_p),
        top_k=pick("top_k", lambda v, f: _int(v, f, 0)),
        max_generate_length=pick("max_generate_length", lambda v, f: _int(v, f, 1)),
        num_logprobs=pick("num_logprobs", lambda v, f: _int(v, f, 0, MAX_NUM_LOGPROBS)),
        logit_bias=pick("logit_bias", _logit_bias),
        stop=pick("stop", _stop),
        seed=pick("seed", _seed),
    )


def _parse_messages(value: Any, where: str) -> list[Message]:
    if value is _MISSING:
        _fail(where, "is required (a non-empty array of {role, content} objects)")
    if not isinstance(value, list) or not value:
        _fail(where, f"must be a non-empty array, got {_describe(value)}")
    if len(value) > MAX_MESSAGES:
        _fail(where, f"must hold at most {MAX_MESSAGES} messages, got {len(value)}")
    return [_parse_message(raw, f"{where}[{i}]") for i, raw in enumerate(value)]


def _parse_message(raw: Any, where: str) -> Message:
    if not isinstance(raw, dict):
        _fail(where, f"must be a {{role, content}} object, got {json_kind(raw)}")
    role = _required(raw, "role", where, f"one of {', '.join(ROLES)}")
    _choice(role, f"{where}.role", ROLES)
    content = _required(raw, "content", where, "a string or an array of content items")
    return Message(role=role, content=_parse_content(content, f"{where}.content"))


def _parse_content(value: Any, where: str) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, list):
        if len(value) > MAX_CONTENT_ITEMS:
            _fail(where, f"must hold at most {MAX_CONTENT_ITEMS} items, got {len(value)}")
        text = "".join(_parse_content_item(item, f"{where}[{i}]") for i, item in enumerate(value))
    else:
        _fail(where, f"must be a string or an array of content items, got {json_kind(value)}")
    size = _utf8_size(text, where)
    if size > MAX_CONTENT_BYTES:
        _fail(where, f"must be at most {MAX_CONTENT_BYTES} bytes of UTF-8, got {size}")
    return text


def _parse_content_item(item: Any, where: str) -> str:
    if not isinstance(item, dict):
        _fail(where, f'must be an object like {{"type": "text", "text": ...}}, got {json_kind(item)}')
    kind = _required(item, "type", where, f"one of {', '.join(CONTENT_TYPES)}")
    _choice(kind, f"{where}.type", CONTENT_TYPES)
    if kind in MEDIA_TYPES:
        _fail(f"{where}.type", f'"{kind}" content is not supported yet; only "text" items are')
    return _string(_required(item, "text", where, 'a string, for a "text" item'), f"{where}.text")


def _required(obj: dict[str, Any], key: str, where: str, expected: str) -> Any:
    value = obj.get(key, _MISSING)
    if value is _MISSING:
        _fail(f"{where}.{key}", f"is required ({expected})")
    return value


def _parse_loras(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        _fail(where, f"must be an object mapping adapter name to path, got {json_kind(value)}")
    for name in getattr(value, "duplicates", ()):
        _fail(f"{where}[{json.dumps(name)}]", "adapter name appears more than once")
    loras: dict[str, str] = {}
    for name, path in value.items():
        entry = f"{where}[{json.dumps(name)}]"
        if not name:
            _fail(where, "adapter names must not be empty")
        if not isinstance(path, str) or not path:
            _fail(entry, f"must be a non-empty path string, got {_describe(path)}")
        loras[name] = path
    return loras


def _parse_lora_name(value: Any, where: str, loras: dict[str, str]) -> str | None:
    name = _string(value, where)
    if not name:
        return None  # "" means no adapter, as in the reference tool
    if name not in loras:
        known = ", ".join(json.dumps(k) for k in loras) or "none"
        _fail(where, f"adapter {json.dumps(name)} is not in available_lora_weights (available: {known})")
    return name


def _temperature(value: Any, where: str) -> float:
    number = _number(value, where, "a finite number >= 0")
    if number < 0:
        _fail(where, f"must be a finite number >= 0 (0 = greedy), got {_show(value)}")
    return number


def _top_p(value: Any, where: str) -> float:
    number = _number(value, where, "a number in (0, 1]")
    if not 0 < number <= 1:
        _fail(where, f"must be a number in (0, 1], got {_show(value)}")
    return number


def _logit_bias(value: Any, where: str) -> dict[int, float]:
    if not isinstance(value, dict):
        _fail(where, f'must be an object like {{"token_id": bias}}, got {json_kind(value)}')
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        _fail(where, f"must have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(value)}")
    bias: dict[int, float] = {}
    for key, raw in value.items():
        entry = f"{where}[{json.dumps(key)}]"
        if not isinstance(key, str) or not _TOKEN_ID.fullmatch(key):
            _fail(entry, f"key must be a non-negative decimal token id, got {json.dumps(str(key))}")
        token_id = int(key)
        if token_id in bias:  # "7" and "007" name the same token
            _fail(entry, f"token id {token_id} appears more than once")
        number = _number(raw, entry, f"a finite number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if abs(number) > MAX_LOGIT_BIAS:
            _fail(entry, f"must be a finite number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                         f"got {_show(raw)}")
        bias[token_id] = number
    return bias


def _stop(value: Any, where: str) -> tuple[str, ...]:
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list):
        _fail(where, f"must be a string or an array of strings, got {json_kind(value)}")
    for i, word in enumerate(words):
        item = where if isinstance(value, str) else f"{where}[{i}]"
        # An empty stop word would match before the first token and end every generation at once.
        if not isinstance(word, str) or not word:
            _fail(item, f"must be a non-empty string, got {_describe(word)}")
        _utf8_size(word, item)
    return tuple(words)


def _seed(value: Any, where: str) -> int | None:
    return None if value is None else _int(value, where, 0)


def _get_bool(obj: dict[str, Any], key: str, prefix: str, default: bool) -> bool:
    value = obj.get(key, default)  # an explicit null is a value, and rejected
    if not isinstance(value, bool):
        _fail(_join(prefix, key), f"must be true or false, got {_describe(value)}")
    return value


def _optional(obj: dict[str, Any], key: str, prefix: str, check: Callable[[Any, str], T]) -> T | None:
    value = obj.get(key, _MISSING)
    return None if value is _MISSING else check(value, _join(prefix, key))


def _int(value: Any, where: str, low: int, high: int | None = None) -> int:
    # bool is a subclass of int, and 2.0 is a float: both are rejected so typos don't pass silently.
    expected = f"an integer in {low}..{high}" if high is not None else f"an integer >= {low}"
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(where, f"must be {expected}, got {_describe(value)}")
    if value < low or (high is not None and value > high):
        _fail(where, f"must be {expected}, got {_show(value)}")
    return value


def _number(value: Any, where: str, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(where, f"must be {expected}, got {_describe(value)}")
    try:
        number = float(value)
    except OverflowError:  # a JSON integer too large for a double
        number = math.inf
    if not math.isfinite(number):
        _fail(where, f"must be {expected}, got {_show(value)}")
    return number


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        _fail(where, f"must be a string, got {_describe(value)}")
    return value


def _choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        options = ", ".join(json.dumps(c) for c in choices)
        _fail(where, f"must be one of {options}, got {_describe(value)}")
    return value


def _utf8_size(text: str, where: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:  # JSON allows "\ud800"; no tokenizer can encode it
        _fail(where, f"contains a lone surrogate at character {exc.start}; text must be valid Unicode")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def json_kind(value: Any) -> str:
    """The JSON name of a value's type, as a user writing the file thinks of it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _show(value: Any, limit: int = 40) -> str:
    """A short one-line rendering of a value for error messages."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # not JSON, or an int past Python's str-conversion limit
        text = f"<{json_kind(value)}>"
    text = _one_line(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _one_line(text: str) -> str:
    """Escape everything str.splitlines() would break on, and lone surrogates a terminal can't print."""
    for char in ("\n", "\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"):
        text = text.replace(char, char.encode("unicode_escape").decode("ascii"))
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _describe(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return f"an empty {json_kind(value)}" if not value else f"{json_kind(value)}"
    return f"{_show(value)} ({json_kind(value)})"


def _overridden(value: int | None) -> bool:
    return value is not None and not (type(value) is int and value == -1)


def _fail(where: str, message: str) -> NoReturn:
    raise KvforgeError(message, where)

"""The request types every front end produces (request files, the Python API, the server) and the cache policies."""

from __future__ import annotations

import json
import re
from dataclasses import InitVar, dataclass, field
from enum import Enum
from typing import Any

from kvforge.contract.validation import check_int, check_number, describe, fail, json_kind, show, utf8_size

# Limits mirror TensorRT Edge-LLM's requestFileParser so a file accepted there is accepted here.
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
MAX_STOP_WORDS = 64  # every generated token is checked against each: a bound on per-step work
MAX_STOP_WORD_BYTES = 1024
MAX_NUM_LOGPROBS = 50
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
MAX_REPETITION_PENALTY = 10.0  # vLLM's and llama.cpp's multiplicative penalty; 1 = off, past ~2 text degrades anyway

_TOKEN_ID = re.compile(r"[0-9]+")


class LookupPolicy(str, Enum):
    """Whether a request may read pages other requests published (the file's context_cache_lookup_policy)."""

    USE_CACHE = "use_cache"
    BYPASS = "bypass"  # neither looks up nor publishes: a cold, private run


class Deployment(str, Enum):
    """What state a sequence carries, which decides how the context cache reuses it (TensorRT Edge-LLM's modes).

    VANILLA: attention only, reuse by KV pages (plus partial-KV snapshots when budgeted). HYBRID: attention and
    recurrent layers; PURE_RECURRENT: recurrent layers only, no KV pages. Both recurrent kinds reuse only exact
    checkpoints: a recurrent state cannot be rebuilt from KV pages, so a page hit without a snapshot is useless.
    """

    VANILLA = "vanilla"
    HYBRID = "hybrid"
    PURE_RECURRENT = "pure_recurrent"


class CommitPolicy(str, Enum):
    """What a finished request publishes (the file's context_cache_commit_policy)."""

    INCLUDING_GENERATED_TOKENS = "including_generated_tokens"
    PREFILL_STATE_ONLY = "prefill_state_only"


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and stops, and how it uses the context cache.

    Defaults are the request file's (TensorRT Edge-LLM's). `reuse_context=False` is the lookup policy
    `bypass`; `cache_generated_tokens=False` is the commit policy `prefill_state_only`. Every field is checked on
    construction by the same functions request files and llm_serve use, so a value one refuses all refuse;
    `stop` may be one string, and `max_tokens` (vLLM's name) sets `max_generate_length`.
    """

    temperature: float = 1.0
    top_p: float = 0.8
    top_k: int = 50  # 0 = disabled, 1 = greedy
    max_generate_length: int = 256
    num_logprobs: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    seed: int | None = None  # None = fresh entropy per run
    reuse_context: bool = True
    cache_generated_tokens: bool = True
    speculative: bool = True  # False: the request's disable_spec_decode (no drafts, plain decode rows)
    presence_penalty: float = 0.0  # subtracted once from every token already generated (OpenAI's)
    frequency_penalty: float = 0.0  # subtracted per occurrence of a token already generated (OpenAI's)
    # OpenAI's {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}, or kvforge's
    # {"type": "grammar", "grammar": GBNF or Lark text}: the output is constrained by a grammar
    # (kvforge/runtime/sampling/grammar.py); such a request decodes without drafts.
    response_format: dict[str, Any] | None = None
    # Each sampled token's own logprob (SampleResult.logprob, OpenAI's logprobs=true) even with num_logprobs 0;
    # otherwise it is NaN there: the log-sum-exp over the vocabulary was ~40 % of a greedy step's sampling.
    token_logprob: bool = False  # positional construction keeps the fields before it
    # vLLM's and llama.cpp's min_p: after temperature, tokens below min_p x the best token's probability are dropped.
    min_p: float = 0.0
    # vLLM's (HF's) repetition_penalty: every token of the prompt or the output has a positive logit divided by it,
    # a negative one multiplied; 1 = off.
    repetition_penalty: float = 1.0
    max_tokens: InitVar[int | None] = None  # vLLM's alias of max_generate_length

    def __post_init__(self, max_tokens: int | None) -> None:
        if max_tokens is not None:
            check_int(max_tokens, "max_tokens", 1)
            if self.max_generate_length not in (SAMPLING_DEFAULT_LENGTH, max_tokens):
                fail("max_tokens", f"is {max_tokens} but max_generate_length is {self.max_generate_length}; give one")
            self.max_generate_length = max_tokens
        check_temperature(self.temperature, "temperature")
        check_top_p(self.top_p, "top_p")
        check_int(self.top_k, "top_k", 0)
        check_int(self.max_generate_length, "max_generate_length", 1)
        check_int(self.num_logprobs, "num_logprobs", 0, MAX_NUM_LOGPROBS)
        self.logit_bias = check_logit_bias(self.logit_bias, "logit_bias")
        self.stop = check_stop(self.stop, "stop")
        check_seed(self.seed, "seed")
        check_penalty(self.presence_penalty, "presence_penalty")
        check_penalty(self.frequency_penalty, "frequency_penalty")
        check_min_p(self.min_p, "min_p")
        check_repetition_penalty(self.repetition_penalty, "repetition_penalty")
        self.response_format = check_response_format(self.response_format, "response_format")
        if self.response_format is not None:
            self.speculative = False  # drafts would be verified against a grammar state one token behind

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def lookup_policy(self) -> LookupPolicy:
        return LookupPolicy.USE_CACHE if self.reuse_context else LookupPolicy.BYPASS

    @property
    def commit_policy(self) -> CommitPolicy:
        if self.cache_generated_tokens:
            return CommitPolicy.INCLUDING_GENERATED_TOKENS
        return CommitPolicy.PREFILL_STATE_ONLY


SAMPLING_DEFAULT_LENGTH = 256  # SamplingParams.max_generate_length's default, which max_tokens may replace


# The sampling field checks: SamplingParams runs them on construction, and request files and llm_serve's bodies
# (kvforge/runtime/inputs/checks.py re-exports them) run them on the JSON first, to name the field by its JSON path.

def check_temperature(value: Any, where: str) -> float:
    number = check_number(value, where, "a finite number >= 0")
    if number < 0:
        fail(where, f"must be a finite number >= 0 (0 = greedy), got {show(value)}")
    return number


def check_top_p(value: Any, where: str) -> float:
    number = check_number(value, where, "a number in (0, 1]")
    if not 0 < number <= 1:
        fail(where, f"must be a number in (0, 1], got {show(value)}")
    return number


def check_penalty(value: Any, where: str) -> float:
    expected = f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"
    number = check_number(value, where, expected)
    if abs(number) > MAX_PENALTY:
        fail(where, f"must be {expected}, got {show(value)}")
    return number


def check_min_p(value: Any, where: str) -> float:
    number = check_number(value, where, "a number in [0, 1]")
    if not 0 <= number <= 1:
        fail(where, f"must be a number in [0, 1] (0 = off), got {show(value)}")
    return number


def check_repetition_penalty(value: Any, where: str) -> float:
    expected = f"a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = off)"
    number = check_number(value, where, expected)
    if not 0 < number <= MAX_REPETITION_PENALTY:
        fail(where, f"must be {expected}, got {show(value)}")
    return number


def check_logit_bias(value: Any, where: str) -> dict[int, float]:
    """JSON's {"token_id": bias} (string keys), or the Python API's {token_id: bias}."""
    if not isinstance(value, dict):
        fail(where, f'must be an object like {{"token_id": bias}}, got {json_kind(value)}')
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        fail(where, f"must have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(value)}")
    bias: dict[int, float] = {}
    for key, raw in value.items():
        entry = f"{where}[{json.dumps(key if isinstance(key, (str, int)) else str(key))}]"
        if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            token_id = key
        elif isinstance(key, str) and _TOKEN_ID.fullmatch(key):
            token_id = int(key)
        else:
            fail(entry, f"key must be a non-negative decimal token id, got {json.dumps(str(key))}")
        if token_id in bias:  # "7" and "007" name the same token
            fail(entry, f"token id {token_id} appears more than once")
        number = check_number(raw, entry, f"a finite number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if abs(number) > MAX_LOGIT_BIAS:
            fail(entry, f"must be a finite number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                         f"got {show(raw)}")
        bias[token_id] = number
    return bias


def check_stop(value: Any, where: str) -> tuple[str, ...]:
    """One stop string, or an array (a list or tuple) of them."""
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, (list, tuple)):
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


def check_response_format(value: Any, where: str) -> dict[str, Any] | None:
    """OpenAI's response_format: {"type": "text"} (or None) means unconstrained and becomes None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        fail(where, f'must be an object like {{"type": "json_object"}}, got {json_kind(value)}')
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        fail(f"{where}.type", f"must be one of {', '.join(RESPONSE_FORMATS)}, got {describe(kind)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "grammar":  # kvforge's: a GBNF (llama.cpp) or Lark grammar, which llm_serve's `grammar` field becomes
        text = value.get("grammar")
        if not isinstance(text, str) or not text.strip():
            fail(f"{where}.grammar", f"must be a GBNF or Lark grammar text, got {json_kind(text)}")
        return {"type": "grammar", "grammar": text}
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        fail(f"{where}.json_schema", f"must be an object with a schema, got {json_kind(spec)}")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        fail(f"{where}.json_schema.schema", f"must be a JSON Schema object, got {json_kind(schema)}")
    name = spec.get("name", "response")
    if not isinstance(name, str):
        fail(f"{where}.json_schema.name", f"must be a string, got {json_kind(name)}")
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": spec.get("strict")}}


RESPONSE_FORMATS = ("text", "json_object", "json_schema", "grammar")


def check_seed(value: Any, where: str) -> int | None:
    return None if value is None else check_int(value, where, 0)


# Stands for one media item inside Message.content (U+FFFC OBJECT REPLACEMENT CHARACTER, meant for exactly this);
# text items may not contain it, so every occurrence is an item of Message.media, in order.
MEDIA_SENTINEL = "\ufffc"


@dataclass(frozen=True, slots=True)
class MediaRef:
    """A media content item as given: its kind ("image"), the file or the bytes themselves, and its JSON path.

    `data` holds media sent inline (llm_serve's base64 content parts); `path` then only describes it. `key` is
    the item's field holding the media (`image_url`, `input_audio`), when it is not named like the kind.
    """

    kind: str
    path: str
    where: str
    data: bytes | None = field(default=None, repr=False)
    key: str = ""

    @property
    def media_field(self) -> str:
        """The JSON path an error about the media itself names, e.g. `messages[0].content[1].image_url`."""
        return f"{self.where}.{self.key or self.kind}"


@dataclass(slots=True)
class Message:
    role: str
    content: str  # text items of a content array are joined with ""; a media item is MEDIA_SENTINEL
    media: tuple[MediaRef, ...] = ()
    # The {"type": "document"} items: (start, end) character spans in `content`, in order. Their text is in
    # `content` like any text item's, so a prompt reads the same with or without document reuse.
    documents: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class Request:
    """One request as a front end parsed it: messages (or a raw prompt) plus how to sample and cache."""

    index: int  # position among the requests it came with; `request_idx` in the output file
    messages: list[Message]
    sampling: SamplingParams
    apply_chat_template: bool = True
    add_generation_prompt: bool = True
    lora_name: str | None = None
    save_system_prompt_kv_cache: bool = False
    cache_salt: str | None = None
    # False: message content is plain text, so `<|im_start|>` typed by a user cannot forge a turn (the default);
    # True: special-token text in content becomes special tokens (the request file's parse_special_tokens).
    parse_special_tokens: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # keys the parser does not interpret (e.g. `reference`)

    def plain_text(self) -> str:
        """The prompt used when apply_chat_template is false: contents concatenated as-is."""
        return "".join(m.content for m in self.messages)

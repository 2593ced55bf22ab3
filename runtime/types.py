"""The request types every front end produces (request files, the Python API, the server) and the cache policies."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


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
    `bypass`; `cache_generated_tokens=False` is the commit policy `prefill_state_only`.
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def lookup_policy(self) -> LookupPolicy:
        return LookupPolicy.USE_CACHE if self.reuse_context else LookupPolicy.BYPASS

    @property
    def commit_policy(self) -> CommitPolicy:
        if self.cache_generated_tokens:
            return CommitPolicy.INCLUDING_GENERATED_TOKENS
        return CommitPolicy.PREFILL_STATE_ONLY


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

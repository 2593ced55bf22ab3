"""The checks of a request's chat messages and sampling fields, shared by every request parser (request files,
llm_serve's OpenAI bodies, kvforge.LLM's messages) so each field is refused with the same message everywhere."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvforge.contract.validation import (
    MISSING,
    check_choice,
    check_string,
    describe,
    fail,
    json_kind,
    utf8_size,
)
from kvforge.runtime.types import (  # noqa: F401  (the sampling checks, re-exported for the request parsers)
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_WORD_BYTES,
    MAX_STOP_WORDS,
    MEDIA_SENTINEL,
    MediaRef,
    Message,
    check_logit_bias,
    check_min_p,
    check_penalty,
    check_repetition_penalty,
    check_response_format,
    check_seed,
    check_stop,
    check_temperature,
    check_top_p,
)

# Limits mirror TensorRT Edge-LLM's requestFileParser so a file accepted there is accepted here; the content items
# go past its 18 (issue 52 item 9): a retrieval prompt holds dozens of passages, one item each, and the message's
# bytes (MAX_CONTENT_BYTES) bound the work whatever the count.
MAX_MESSAGES = 64
MAX_CONTENT_ITEMS = 256
MAX_CONTENT_BYTES = 128 * 1024
# What a media path may be before any file call sees it: POSIX's NAME_MAX per component and PATH_MAX overall
# (Linux and macOS; NTFS names are 255 UTF-16 units). Past them os calls raise ENAMETOOLONG, a NUL raises
# ValueError: both would escape as a traceback (a 500 in llm_serve) instead of an error naming the item.
MAX_PATH_NAME_BYTES = 255
MAX_PATH_BYTES = 4095

ROLES = ("system", "user", "assistant", "tool", "developer")  # developer: OpenAI's newer name for system
MEDIA_TYPES = ("image", "audio", "video")
CONTENT_TYPES = ("text", "document", *MEDIA_TYPES)
# Retrieved documents are context the caller supplies, so only these roles may carry them (issue 37).
DOCUMENT_ROLES = ("system", "user")


# A front end's own content items (llm_serve's `image_url`, `input_audio`): (item, its JSON path) -> its MediaRef.
MediaItemParser = Callable[[dict[str, Any], str], MediaRef]


def parse_messages(value: Any, where: str, media_items: Mapping[str, MediaItemParser] | None = None) -> list[Message]:
    """`media_items` maps content types to their parsers; they take precedence over the file's own media items."""
    if value is MISSING:
        fail(where, "is required (a non-empty array of {role, content} objects)")
    if not isinstance(value, list) or not value:
        fail(where, f"must be a non-empty array, got {describe(value)}")
    if len(value) > MAX_MESSAGES:
        fail(where, f"must hold at most {MAX_MESSAGES} messages, got {len(value)}")
    return [parse_message(raw, f"{where}[{i}]", media_items or {}) for i, raw in enumerate(value)]


def parse_message(raw: Any, where: str, media_items: Mapping[str, MediaItemParser] | None = None) -> Message:
    if not isinstance(raw, dict):
        fail(where, f"must be a {{role, content}} object, got {json_kind(raw)}")
    role = _required(raw, "role", where, f"one of {', '.join(ROLES)}")
    check_choice(role, f"{where}.role", ROLES)
    role = "system" if role == "developer" else role  # chat templates know only system
    content = _required(raw, "content", where, "a string or an array of content items")
    text, media, documents = _parse_content(content, f"{where}.content", media_items or {}, role)
    return Message(role=role, content=text, media=media, documents=documents)


def _parse_content(value: Any, where: str, media_items: Mapping[str, MediaItemParser],
                   role: str) -> tuple[str, tuple[MediaRef, ...], tuple[tuple[int, int], ...]]:
    media: list[MediaRef] = []
    documents: list[tuple[int, int]] = []
    if isinstance(value, str):
        text = value
    elif isinstance(value, list):
        if len(value) > MAX_CONTENT_ITEMS:
            fail(where, f"must hold at most {MAX_CONTENT_ITEMS} items, got {len(value)}")
        text = ""
        for i, item in enumerate(value):
            piece = _parse_content_item(item, f"{where}[{i}]", media, media_items, role)
            if isinstance(item, dict) and item.get("type") == "document" and "document" not in media_items:
                documents.append((len(text), len(text) + len(piece)))  # character span of the document in content
            text += piece
    else:
        fail(where, f"must be a string or an array of content items, got {json_kind(value)}")
    size = utf8_size(text, where)
    if size > MAX_CONTENT_BYTES:
        fail(where, f"must be at most {MAX_CONTENT_BYTES} bytes of UTF-8, got {size}")
    if text.count(MEDIA_SENTINEL) != len(media):
        fail(where, "text must not contain U+FFFC (it stands for media items)")
    return text, tuple(media), tuple(documents)


def _parse_content_item(item: Any, where: str, media: list[MediaRef],
                        media_items: Mapping[str, MediaItemParser], role: str) -> str:
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
        check_media_path(path, f"{where}.{kind}")
        media.append(MediaRef(kind, path, where))
        return MEDIA_SENTINEL
    if kind in MEDIA_TYPES:
        fail(f"{where}.type", f'"{kind}" content is not supported yet; "text", "image" and "audio" items are')
    if kind == "document":
        if role not in DOCUMENT_ROLES:
            fail(f"{where}.type", f'"document" items may only be in system and user messages, not in a "{role}" one')
        text = check_string(_required(item, "text", where, 'a non-empty string, for a "document" item'),
                            f"{where}.text")
        if not text:
            fail(f"{where}.text", 'must be a non-empty string, for a "document" item')
        return text
    return check_string(_required(item, "text", where, 'a string, for a "text" item'), f"{where}.text")


def check_media_path(path: str, where: str) -> str:
    """A media file path any file call can take: not empty, no NUL byte, names and length within POSIX's."""
    if not path:
        fail(where, "must be a file path, got an empty string")
    if "\x00" in path:
        fail(where, "must not contain a NUL byte (no file name can hold one)")
    encoded = path.encode("utf-8", "surrogatepass")  # a length only: never raises on a lone surrogate
    if len(encoded) > MAX_PATH_BYTES:
        fail(where, f"is a path of {len(encoded)} bytes, more than the {MAX_PATH_BYTES} a path can have")
    longest = max(len(part) for part in encoded.split(b"/"))
    if longest > MAX_PATH_NAME_BYTES:
        fail(where, f"holds a file name of {longest} bytes, more than the {MAX_PATH_NAME_BYTES} a name can have")
    return path


def _required(obj: dict[str, Any], key: str, where: str, expected: str) -> Any:
    value = obj.get(key, MISSING)
    if value is MISSING:
        fail(f"{where}.{key}", f"is required ({expected})")
    return value

"""JSON input checks with one-line errors that name the JSON path (request files, API bodies, profiles)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from kvforge.contract.errors import KvforgeError

T = TypeVar("T")
MISSING: Any = object()  # a key absent from its object (an explicit null is a value)


def get_bool(obj: dict[str, Any], key: str, prefix: str, default: bool) -> bool:
    value = obj.get(key, default)  # an explicit null is a value, and rejected
    if not isinstance(value, bool):
        fail(join_path(prefix, key), f"must be true or false, got {describe(value)}")
    return value


def optional(obj: dict[str, Any], key: str, prefix: str, check: Callable[[Any, str], T]) -> T | None:
    value = obj.get(key, MISSING)
    return None if value is MISSING else check(value, join_path(prefix, key))


def check_int(value: Any, where: str, low: int, high: int | None = None) -> int:
    # bool is a subclass of int, and 2.0 is a float: both are rejected so typos don't pass silently.
    expected = f"an integer in {low}..{high}" if high is not None else f"an integer >= {low}"
    if isinstance(value, bool) or not isinstance(value, int):
        fail(where, f"must be {expected}, got {describe(value)}")
    if value < low or (high is not None and value > high):
        fail(where, f"must be {expected}, got {show(value)}")
    return value


def check_number(value: Any, where: str, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(where, f"must be {expected}, got {describe(value)}")
    try:
        number = float(value)
    except OverflowError:  # a JSON integer too large for a double
        number = math.inf
    if not math.isfinite(number):
        fail(where, f"must be {expected}, got {show(value)}")
    return number


def check_string(value: Any, where: str) -> str:
    """A JSON string that is also valid Unicode: "\ud800" parses in JSON but cannot be encoded (hashed into a cache
    key, tokenized, written out), so it is refused here, where the field can still be named."""
    if not isinstance(value, str):
        fail(where, f"must be a string, got {describe(value)}")
    if not value.isascii():
        utf8_size(value, where)
    return value


def check_choice(value: Any, where: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        options = ", ".join(json.dumps(c) for c in choices)
        fail(where, f"must be one of {options}, got {describe(value)}")
    return value


def utf8_size(text: str, where: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:  # JSON allows "\ud800"; no tokenizer can encode it
        fail(where, f"contains a lone surrogate at character {exc.start}; text must be valid Unicode")


def join_path(prefix: str, name: str) -> str:
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


def show(value: Any, limit: int = 40) -> str:
    """A short one-line rendering of a value for error messages."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # not JSON, or an int past Python's str-conversion limit
        text = f"<{json_kind(value)}>"
    text = one_line(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def one_line(text: str) -> str:
    """Escape everything str.splitlines() would break on, and lone surrogates a terminal can't print."""
    for char in ("\n", "\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"):
        text = text.replace(char, char.encode("unicode_escape").decode("ascii"))
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` safe to print on a terminal, on one line: control characters (escape sequences, line breaks,
    bidi overrides) are shown escaped, and lone surrogates replaced."""
    text = _CONTROL.sub(lambda m: m[0].encode("unicode_escape").decode("ascii"), text)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def describe(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return f"an empty {json_kind(value)}" if not value else f"{json_kind(value)}"
    return f"{show(value)} ({json_kind(value)})"


def fail(where: str, message: str) -> NoReturn:
    raise KvforgeError(message, where)

"""config.json's field checks: a value against its schema entry (kind and range), one error naming the field."""

from __future__ import annotations

import math
from typing import Any

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.lora import LORA_TARGETS, is_target_list
from kvforge.contract.validation import describe


def check_field(spec: tuple[str, float | None, float | None], value: Any, field_name: str, where: str) -> Any:
    """`value` checked against a CONFIG_SCHEMA entry; InvalidConfig on `field_name` otherwise."""
    kind, low, high = spec

    def bad(expected: str) -> InvalidConfig:
        return InvalidConfig(f"must be {expected} in {where}, got {describe(value)}", field_name)

    def is_int(v: Any) -> bool:
        return type(v) is int

    if kind == "int":
        if not is_int(value) or not low <= value <= high:  # type: ignore[operator]
            raise bad(f"an integer in [{low}, {high}]")
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not low < value <= high:  # type: ignore[operator]
            raise bad(f"a finite number in ({low:g}, {high:g}]")
        value = float(value)
    elif kind == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
    elif kind == "str":
        if not isinstance(value, str):
            raise bad("a string")
    elif kind == "token?":
        if value is not None and not (is_int(value) and value >= 0):
            raise bad("null or a non-negative integer token id")
    elif kind == "tokens":
        if not isinstance(value, list) or len(value) > 64 or not all(is_int(v) and v >= 0 for v in value):
            raise bad("an array of at most 64 non-negative integer token ids")
        value = list(value)
    elif kind == "layers":  # the names themselves are checked by validate() against LAYER_TYPES
        if not isinstance(value, list) or len(value) > 1024 or not all(isinstance(v, str) for v in value):
            raise bad("an array of at most 1024 layer type names")
        value = list(value)
    elif kind == "ints":  # small non-negative integers (layer ids), at most `high` of them
        if not isinstance(value, list) or len(value) > high or \
                not all(is_int(v) and low <= v < high for v in value):  # type: ignore[operator]
            raise bad(f"an array of at most {high:g} integers in [{low:g}, {high:g})")
        value = list(value)
    elif kind == "strs":
        if not is_target_list(value):
            raise bad(f"an array of LoRA targets ({', '.join(LORA_TARGETS)})")
        value = list(value)
    return value


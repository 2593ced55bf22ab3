"""The grammar defaults a JSON schema is compiled with, as the field decodes ordinary (non-strict) schemas.

A schema as clients send it (OpenAI's tool examples, LangChain's `@tool`, pydantic models) rarely says
`"additionalProperties": false` and never bounds its numbers. Read by the letter of JSON Schema, such a schema lets a
constrained model add keys of its own and write digits until `max_tokens`: a forced tool call then never ends. The
field closes these doors, and so do we (docs/serving.md "Grammar defaults"):

- an object schema that lists `properties` and says nothing of extra keys (`additionalProperties`,
  `patternProperties`, `unevaluatedProperties`) takes no other key: llama.cpp's json-schema-to-grammar and xgrammar's
  strict mode (vLLM's default) read a missing `additionalProperties` as false, and OpenAI's strict mode requires it.
  An object without `properties` (`{"type": "object"}`, JSON mode) stays open: it names no key to keep to;
- an integer has at most 16 digits (llama.cpp's cap): bounds of ±(10^16 - 1) where the schema gives none (a bare
  `{"type": "integer"}` refers to one shared bounded definition, which compiles once);
- a number has at most 16 digits before the point and 10 after it (llama.cpp allows 16; llguidance's `multipleOf`,
  which carries the cap, takes no finer step than 1e-10), and no exponent.

The schema given is never changed: the defaults apply to a copy. An explicit keyword always wins.
"""

from __future__ import annotations

from typing import Any

INTEGER_LIMIT = 10**16 - 1  # 16 digits, as llama.cpp's INTEGRAL_PART ([1-9][0-9]{0,15})
NUMBER_LIMIT = 1e16
NUMBER_STEP = 1e-10  # at most 10 decimal places
_EXTRA_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords whose value is one subschema, a list of them, or a name → subschema map.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


# A bare number schema (a type and annotations only, the common case) becomes a reference to one bounded definition:
# llguidance compiles bounds into a lexeme per use, ~1 ms each, but a shared definition once (500 bounded integer
# properties: 615 ms inline, 48 ms shared, 42 ms unbounded; on SmolLM2's vocabulary).
SHARED = {"integer": ("kvforge_integer", {"type": "integer", "minimum": -INTEGER_LIMIT, "maximum": INTEGER_LIMIT}),
          "number": ("kvforge_number", {"type": "number", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT,
                                        "multipleOf": NUMBER_STEP})}
_ANNOTATIONS = frozenset({"type", "title", "description", "default", "examples", "$comment", "deprecated",
                          "readOnly", "writeOnly"})


def with_defaults(schema: Any) -> Any:
    """A copy of `schema` with the grammar defaults applied to it and every subschema."""
    if not isinstance(schema, dict):
        return schema
    defs = schema.get("$defs")
    taken = set(defs) if isinstance(defs, dict) else set()
    used: set[str] = set()
    out = _defaults(schema, taken, used, root=True)
    if used:
        out["$defs"] = {**(out.get("$defs") or {}), **{name: body for name, body in SHARED.values() if name in used}}
    return out


def _defaults(schema: Any, taken: set[str], used: set[str], root: bool = False) -> Any:
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ONE:
            out[key] = ([_defaults(v, taken, used) for v in value] if isinstance(value, list)
                        else _defaults(value, taken, used))
        elif key in _MANY and isinstance(value, list):
            out[key] = [_defaults(v, taken, used) for v in value]
        elif key in _NAMED and isinstance(value, dict):
            out[key] = {name: _defaults(v, taken, used) for name, v in value.items()}
        else:
            out[key] = value
    kinds = _types(out)
    if "properties" in out and not any(k in out for k in _EXTRA_KEYS):
        out["additionalProperties"] = False
    kind = out.get("type")
    shared = SHARED.get(kind) if isinstance(kind, str) else None
    if shared is not None and not root and set(out) <= _ANNOTATIONS and shared[0] not in taken:
        used.add(shared[0])
        return {**{k: v for k, v in out.items() if k != "type"}, "$ref": f"#/$defs/{shared[0]}"}
    if "integer" in kinds and "number" not in kinds:
        _bound(out, INTEGER_LIMIT)
    elif "number" in kinds:
        _bound(out, INTEGER_LIMIT if "integer" in kinds else NUMBER_LIMIT)
        out.setdefault("multipleOf", NUMBER_STEP)
    return out


def _types(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else set()


def _bound(schema: dict[str, Any], limit: float) -> None:
    """Bounds where the schema gives none (an exclusive bound counts as one)."""
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        schema["minimum"] = -limit
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        schema["maximum"] = limit

"""Chat templates come from engine dirs, i.e. from whoever made the model: render them sandboxed and bounded.

Jinja's sandbox stops attribute tricks but not work: `range` loops nested in loops, string doubling, and
huge repeat counts can run for hours or fill memory. Here a template also gets a wall-clock limit and size
limits, both enforced before the work rather than after it:

- time: checked on every line of the compiled template and on every Python call the render makes (filters,
  their key functions, the generators they chain), and on every item a filter consumes, so one expression
  chaining `sort` and `unique` cannot run past it either;
- size: every operation that builds a string, list or number (`*`, `+`, `~`, `%`, `**`, printing a value,
  `format`, `join`, `replace`, `indent`, `tojson`, string methods...) estimates what it would build from its
  inputs and refuses before allocating; whatever it returns is checked again.

A template that breaks a limit fails its request with one line; it never hangs the runtime or fills memory.
"""

from __future__ import annotations

import contextvars
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MappingView
from typing import Any

from jinja2 import TemplateError
from jinja2.compiler import CodeGenerator
from jinja2.nodes import Concat
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace

from kvforge.contract.errors import KvforgeError

TIME_LIMIT_S = 2.0  # a real template renders in well under a millisecond
OUTPUT_LIMIT_CHARS = 16 * 2**20  # 64 messages of 128 KiB plus markup fit with room to spare; also any one string
ITEM_LIMIT = 2**18  # items in any list built or consumed by a filter (a conversation has at most 64 messages)
INT_BITS_LIMIT = 2**16  # bits of any integer built (huge integers make `*` and str() slow)
_WIDTH = re.compile(r"\d{7,}")  # a format width or precision of a million or more
_DIGITS = re.compile(r"\d+")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")  # "{:{w}}": a width taken from the arguments
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
_DEADLINE: contextvars.ContextVar[float] = contextvars.ContextVar("chat_template_deadline", default=float("inf"))

# Filters that only iterate their input: it is handed to them metered (item count, deadline on every item).
_ITERATING_FILTERS = frozenset({"batch", "first", "groupby", "join", "list", "map", "max", "min", "reject",
                                "rejectattr", "select", "selectattr", "slice", "sort", "sum", "unique"})


class TemplateLimit(SecurityError):
    """A template exceeded its time or size limit."""


def _too_big(what: str = "a string or list") -> TemplateLimit:
    return TemplateLimit(f"the chat template builds {what} beyond its size limit")


def _check_deadline() -> None:
    if time.perf_counter() > _DEADLINE.get():
        raise TemplateLimit(f"the chat template ran longer than {TIME_LIMIT_S:g} s")


class _BoundedCodeGenerator(CodeGenerator):
    # `a ~ b` compiles to str_join((a, b)) in the template's own module, where no sandbox hook sees it;
    # route it through the environment so its size is bounded like `+`.
    def visit_Concat(self, node: Concat, frame: Any) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=_finalize, **options)
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals.pop("lipsum", None)  # generates text by the megabyte; no chat template writes lorem ipsum

    def bounded_concat(self, parts: tuple[Any, ...]) -> str:
        _limit_chars(sum(_text_size(p) for p in parts))
        joined = (markup_join if any(hasattr(p, "__html__") for p in parts) else str_join)(parts)
        return _check_size(joined)

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        if operator_name == "**":
            if abs(_as_number(right)) > 1024 or abs(_as_number(left)) > 2**64:
                raise TemplateLimit("the chat template raises a number to too large a power")
            if _is_int(left) and _is_int(right) and left.bit_length() * max(right, 0) > INT_BITS_LIMIT:
                raise _too_big("a number")
        elif operator_name == "*":
            for sized, count in ((left, right), (right, left)):
                if _is_int(count) and isinstance(sized, str):
                    _limit_chars(len(sized) * count)
                elif _is_int(count) and isinstance(sized, (list, tuple)):
                    _limit_items(len(sized) * count)
            if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > INT_BITS_LIMIT:
                raise _too_big("a number")
        elif operator_name == "+":
            if isinstance(left, str) and isinstance(right, str):
                _limit_chars(len(left) + len(right))
            elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
                _limit_items(len(left) + len(right))
            elif _is_int(left) and _is_int(right) and max(left.bit_length(), right.bit_length()) > INT_BITS_LIMIT:
                raise _too_big("a number")
        elif operator_name == "%" and isinstance(left, str):
            values = right if isinstance(right, tuple) else right.values() if isinstance(right, Mapping) else (right,)
            _check_format(left, "%", values)
        return _check_size(super().call_binop(context, operator_name, left, right))

    def wrap_str_format(self, value: Any) -> Any:  # "{:>1000000000}".format(x) reaches here as an attribute
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        template, is_map = value.__self__, value.__name__ == "format_map"
        if _WIDTH.search(template):
            raise TemplateLimit("the chat template formats with an excessive width")

        def bounded(*args: Any, **kwargs: Any) -> Any:
            mapping = args[0] if is_map and args and isinstance(args[0], Mapping) else {}
            _check_format(template, "{", (*args, *kwargs.values(), *mapping.values()))
            return _check_size(wrapper(*args, **kwargs))

        return bounded

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_arguments(args, kwargs)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            args = _check_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        return _check_size(super().call(__context, __obj, *args, **kwargs))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_number(value: Any) -> float:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _limit_chars(size: int) -> None:
    if size > OUTPUT_LIMIT_CHARS:
        raise _too_big()


def _limit_items(count: int) -> None:
    if count > ITEM_LIMIT:
        raise _too_big()


def _check_size(value: Any) -> Any:
    if isinstance(value, str):
        _limit_chars(len(value))
    elif isinstance(value, (list, tuple)):
        _limit_items(len(value))
    elif _is_int(value) and value.bit_length() > INT_BITS_LIMIT:
        raise _too_big("a number")
    return value


def _finalize(value: Any) -> Any:
    """Every printed `{{ value }}` passes here before str() turns it into text: a list of many references to one
    long string is small in memory but not as text."""
    if not isinstance(value, str):
        _limit_chars(_text_size(value))
    return value


def _text_size(value: Any, budget: int = OUTPUT_LIMIT_CHARS) -> int:
    """An upper bound of len(str(value)), computed without building it; stops counting past `budget`."""
    if isinstance(value, str):
        return len(value)
    sizes: dict[int, int] = {}  # id -> repr size: shared references are walked once
    open_ids: set[int] = set()  # containers being walked (a namespace can hold itself)

    def walk(item: Any) -> int:
        if isinstance(item, str):  # repr quotes, and escapes a character into at most 10 ("\U0001f600")
            return len(item) + 2 if item.isascii() and item.isprintable() else 10 * len(item) + 2
        if isinstance(item, (bool, type(None), float)):
            return 24
        if isinstance(item, int):
            return item.bit_length() // 3 + 2
        key = id(item)
        if key in sizes:
            return sizes[key]
        if key in open_ids:
            return 8  # repr writes "..." for a cycle
        if isinstance(item, Namespace):
            children: Iterable[Any] = object.__getattribute__(item, "_Namespace__attrs").items()
        elif isinstance(item, Mapping):
            children = item.items()
        elif isinstance(item, (list, tuple, set, frozenset, MappingView)):
            children = item
        else:
            return 256  # ranges, generators, macros, loop objects, undefined: a short fixed repr
        open_ids.add(key)
        total = 16
        for child in children:
            total += walk(child) + 4
            if total > budget:
                break
        open_ids.discard(key)
        sizes[key] = total
        return total

    return walk(value)


def _check_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    # Widths, counts and repeats passed as arguments (center(10**9), indent(width=...), "%*s"|format) would
    # allocate before any result could be checked.
    seen: set[int] = set()  # one long string passed a thousand times ([s] * 1000) is scanned once
    for value in (*args, *kwargs.values()):
        if _is_int(value) and abs(value) > OUTPUT_LIMIT_CHARS:
            raise TemplateLimit("the chat template passes a size argument beyond its limit")
        if isinstance(value, str) and id(value) not in seen and ("%" in value or "{" in value):
            seen.add(id(value))
            if _WIDTH.search(value):
                raise TemplateLimit("the chat template formats with an excessive width")


def _check_format(template: str, opener: str, values: Iterable[Any]) -> None:
    """`template % values` or `template.format(values)` builds at most the template, plus every width or precision
    written in it, plus each field filled with the largest value (a field may repeat one: "{0}{0}")."""
    if _WIDTH.search(template):
        raise TemplateLimit("the chat template formats with an excessive width")
    values = list(values)
    size = len(template)
    for match in _DIGITS.finditer(template):
        size += int(match.group())
        _limit_chars(size)
    largest = max((_text_size(v) for v in values), default=0)
    _limit_chars(size + template.count(opener) * largest)
    if (opener == "%" and "*" in template) or (opener == "{" and _NESTED_FIELD.search(template)):
        _limit_chars(size + sum(abs(v) for v in values if _is_int(v)))  # widths taken from the arguments


def _replaced_size(text: str, old: Any, new: Any, count: Any = -1) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(text)
    found = text.count(old) if old else len(text) + 1
    if _is_int(count) and count >= 0:
        found = min(found, count)
    return len(text) + found * max(len(new) - len(old), 0)


def _lines(text: str) -> int:
    return sum(text.count(c) for c in _LINE_BREAKS) + 1


def _check_str_method(owner: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Bound what a string method called from a template would build; returns the (possibly materialized) args."""
    if name == "replace" and len(args) >= 2:
        _limit_chars(_replaced_size(owner, *args[:3]))
    elif name == "join" and args:
        items = list(_metered(args[0], len(owner), text=True))  # a generator argument is walked once, metered
        args = (items, *args[1:])
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        _limit_chars(len(owner) + owner.count("\t") * (tab if _is_int(tab) else 8))
    elif name in ("split", "rsplit"):
        separator = args[0] if args else kwargs.get("sep")
        parts = owner.count(separator) + 1 if isinstance(separator, str) and separator else len(owner) // 2 + 1
        limit = args[1] if len(args) > 1 else kwargs.get("maxsplit", -1)
        _limit_items(min(parts, limit + 1) if _is_int(limit) and limit >= 0 else parts)
    elif name == "splitlines":
        _limit_items(_lines(owner))
    elif name in ("upper", "lower", "title", "capitalize", "swapcase", "casefold") and not owner.isascii():
        _limit_chars(3 * len(owner))  # "ﬃ".upper() is "FFI"
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        _limit_chars(len(owner) * max(longest, 1))
    return args


def _metered(iterable: Any, extra_chars: int = 0, text: bool = False) -> Iterator[Any]:
    """`iterable` item by item, within the item limit and the deadline; with `text`, the characters a join of the
    items with an `extra_chars` separator would build stay within the size limit too."""
    items = chars = 0
    for item in iterable:
        items += 1 + (len(item) if isinstance(item, (list, tuple)) else 0)  # sum(lists) copies every element
        _limit_items(items)
        if text:
            chars += _text_size(item) + extra_chars
            _limit_chars(chars)
        _check_deadline()
        yield item


def _filter_bound(name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a filter call whose result would exceed the size limit, judged from its inputs."""
    text = value if isinstance(value, str) else None
    if name == "format" and text is not None:
        _check_format(text, "%", (*args, *kwargs.values()))
    elif name == "replace" and text is not None and len(args) >= 2:
        _limit_chars(_replaced_size(text, *args[:3]))
    elif name == "indent" and text is not None:
        width = args[0] if args else kwargs.get("width", 4)
        prefix = len(width) if isinstance(width, str) else width if _is_int(width) else 4
        _limit_chars(len(text) + _lines(text) * prefix)
    elif name == "wordwrap" and text is not None:
        width = args[0] if args else kwargs.get("width", 79)
        wrap = args[2] if len(args) > 2 else kwargs.get("wrapstring") or "\n"
        breaks = len(text) // max(width if _is_int(width) else 1, 1) + _lines(text)
        _limit_chars(len(text) + breaks * (len(wrap) if isinstance(wrap, str) else 1))
    elif name in ("string", "pprint"):
        _limit_chars(_text_size(value))
    elif name in ("e", "escape", "forceescape", "xmlattr", "urlize", "urlencode"):
        _limit_chars(16 * _text_size(value))  # "&" -> "&amp;"; a short URL -> an <a href=...> element
    elif name == "tojson":
        indent = args[0] if args else kwargs.get("indent")
        width = len(indent) if isinstance(indent, str) else indent if _is_int(indent) else 0
        if width > 16:
            raise TemplateLimit("the chat template passes a size argument beyond its limit")
        _limit_chars((6 + 4 * width) * _text_size(value))  # "<" -> "\u003c"; indentation per line
    elif name in ("upper", "lower", "title", "capitalize") and text is not None and not text.isascii():
        _limit_chars(3 * len(text))
    elif name == "batch":
        count = args[0] if args else kwargs.get("linecount", 0)
        if _is_int(count):
            _limit_items(count)


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    skip = 2 if hasattr(function, "jinja_pass_arg") else 1  # (context or environment,) the filtered value

    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args[skip:], kwargs)
        if len(args) >= skip:
            value, rest = args[skip - 1], args[skip:]
            _filter_bound(name, value, rest, kwargs)
            if name in _ITERATING_FILTERS and not isinstance(value, Mapping):
                separator = rest[0] if rest else kwargs.get("d", "")
                extra = _text_size(separator) if name == "join" else 0
                args = (*args[:skip - 1], _metered(value, extra, text=name == "join"), *rest)
        return _check_size(function(*args, **kwargs))

    for attribute in ("jinja_pass_arg",):  # keep pass_context / pass_environment markers
        if hasattr(function, attribute):
            setattr(bounded, attribute, getattr(function, attribute))
    return bounded


class BoundedTemplate:
    """A compiled chat template rendered with a deadline and an output limit."""

    __slots__ = ("template",)

    def __init__(self, source: str) -> None:
        env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        self.template = env.from_string(source)  # TemplateSyntaxError for a corrupt template: the caller's line

    def render(self, where: str, **context: Any) -> str:
        deadline = time.perf_counter() + TIME_LIMIT_S
        filename = "<template>"  # the compiled code's file name for from_string templates

        def on_line(frame: Any, event: str, _arg: Any) -> Any:
            if time.perf_counter() > deadline:
                raise TemplateLimit(f"the chat template ran longer than {TIME_LIMIT_S:g} s")
            return on_line

        def on_call(frame: Any, event: str, _arg: Any) -> Any:
            # Every Python call the render makes (a filter, a sort key, a resumed generator) checks the clock,
            # so work inside one template line is bounded too; the template's own lines are traced line by line.
            if time.perf_counter() > deadline:
                raise TemplateLimit(f"the chat template ran longer than {TIME_LIMIT_S:g} s")
            return on_line if frame.f_code.co_filename == filename else None

        previous = sys.gettrace()
        token = _DEADLINE.set(deadline)
        parts: list[str] = []
        size = 0
        sys.settrace(on_call)
        try:
            for part in self.template.generate(**context):
                size += len(part)
                if size > OUTPUT_LIMIT_CHARS:
                    raise TemplateLimit(f"the chat template's output exceeds {OUTPUT_LIMIT_CHARS:,} characters")
                parts.append(part)
                _check_deadline()  # also if a trace hook was lost (a debugger, or an exception Jinja swallowed)
        except TemplateLimit as exc:
            raise KvforgeError(str(exc), where) from None
        except TemplateError as exc:
            raise KvforgeError(f"chat template failed: {_first_line(exc)}", where) from None
        except RecursionError:
            raise KvforgeError("chat template failed: recursion too deep", where) from None
        except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError, OverflowError,
                MemoryError) as exc:
            raise KvforgeError(f"chat template failed: {type(exc).__name__}: {_first_line(exc)}", where) from None
        finally:
            sys.settrace(previous)
            _DEADLINE.reset(token)
        return "".join(parts)


def _first_line(exc: BaseException) -> str:
    from kvforge.contract.validation import one_line

    text = str(exc).strip()
    return one_line(text.splitlines()[0] if text else type(exc).__name__)[:200]

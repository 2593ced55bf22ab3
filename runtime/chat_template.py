"""Chat templates come from engine dirs, i.e. from whoever made the model: render them sandboxed and bounded.

Jinja's sandbox stops attribute tricks but not work: `range` loops nested in loops, string doubling, and
huge repeat counts can run for hours or fill memory. Here a template also gets a wall-clock limit (checked
on every line of the compiled template through a trace hook, so loops that print nothing are caught too),
an output limit, and a size limit on every string or list it builds with `*`, `+`, `~`, `**` or a filter
argument. A template that breaks a limit fails its request with one line; it never hangs the runtime.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from typing import Any

from jinja2 import TemplateError
from jinja2.compiler import CodeGenerator
from jinja2.nodes import Concat
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from kvforge.contract.errors import KvforgeError

TIME_LIMIT_S = 2.0  # a real template renders in well under a millisecond
OUTPUT_LIMIT_CHARS = 16 * 2**20  # 64 messages of 128 KiB plus markup fit with room to spare
_WIDTH = re.compile(r"\d{7,}")  # a format width or precision of a million or more


class TemplateLimit(SecurityError):
    """A template exceeded its time or size limit."""


class _BoundedCodeGenerator(CodeGenerator):
    # `a ~ b` compiles to str_join((a, b)) in the template's own module, where no sandbox hook sees it;
    # route it through the environment so its result is size-checked like `+`.
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
        super().__init__(**options)
        self.filters = {name: _bounded_call(f) for name, f in self.filters.items()}

    def bounded_concat(self, parts: tuple[Any, ...]) -> str:
        joined = (markup_join if any(hasattr(p, "__html__") for p in parts) else str_join)(parts)
        return _check_size(joined)

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        if operator_name == "**" and (abs(_as_number(right)) > 1024 or abs(_as_number(left)) > 2**64):
            raise TemplateLimit("the chat template raises a number to too large a power")
        if operator_name == "*":
            for sized, count in ((left, right), (right, left)):
                if hasattr(sized, "__len__") and isinstance(count, int) and len(sized) * count > OUTPUT_LIMIT_CHARS:
                    raise TemplateLimit("the chat template builds a string or list beyond its size limit")
        if operator_name == "%" and isinstance(left, str) and _WIDTH.search(left):
            raise TemplateLimit("the chat template formats with an excessive width")
        return _check_size(super().call_binop(context, operator_name, left, right))

    def wrap_str_format(self, value: Any) -> Any:  # "{:>1000000000}".format(x) reaches here as an attribute
        if isinstance(getattr(value, "__self__", None), str) and _WIDTH.search(value.__self__):
            raise TemplateLimit("the chat template formats with an excessive width")
        return super().wrap_str_format(value)

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_arguments(args, kwargs)
        return _check_size(super().call(__context, __obj, *args, **kwargs))


def _as_number(value: Any) -> float:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, list, tuple)) and len(value) > OUTPUT_LIMIT_CHARS:
        raise TemplateLimit("the chat template builds a string or list beyond its size limit")
    return value


def _check_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    # Widths, counts and repeats passed as arguments (center(10**9), indent(width=...), "%*s"|format) would
    # allocate before any result could be checked.
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > OUTPUT_LIMIT_CHARS:
            raise TemplateLimit("the chat template passes a size argument beyond its limit")
        if isinstance(value, str) and _WIDTH.search(value) and ("%" in value or "{" in value):
            raise TemplateLimit("the chat template formats with an excessive width")


def _bounded_call(function: Callable[..., Any]) -> Callable[..., Any]:
    skip = 2 if hasattr(function, "jinja_pass_arg") else 1  # (context or environment,) the filtered value

    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args[skip:], kwargs)
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
            return on_line if frame.f_code.co_filename == filename else None

        previous = sys.gettrace()
        parts: list[str] = []
        size = 0
        sys.settrace(on_call)
        try:
            for part in self.template.generate(**context):
                size += len(part)
                if size > OUTPUT_LIMIT_CHARS:
                    raise TemplateLimit(f"the chat template's output exceeds {OUTPUT_LIMIT_CHARS:,} characters")
                parts.append(part)
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
        return "".join(parts)


def _first_line(exc: BaseException) -> str:
    from kvforge.contract.validation import one_line

    text = str(exc).strip()
    return one_line(text.splitlines()[0] if text else type(exc).__name__)[:200]



"""Per-type parts: what one resource type keeps in a lease, record, plan or publication, and read-only views of them.

Leases, records, plans and publications carry no field named after one resource type: each type keeps its own part
under its name (`holder.parts[kind.name]`) and only that type writes it. Code outside the cache that used to read a
per-type field (the engine's restores, the shared tier, tests) still reads it as an attribute through a view the type
registers (`Record.view("partial_slot", ...)`): a view returns its default when the holder has no such part.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

NO_PARTS: Mapping[str, Any] = MappingProxyType({})

View = tuple[str, Callable[[Any], Any], Any]  # (part name, read from the part, value when the part is absent)


class Parted:
    """A holder of per-type parts (a mixin for slotted dataclasses with a `parts` mapping)."""

    __slots__ = ()
    views: ClassVar[dict[str, View]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.views = {}

    def __getattr__(self, attr: str) -> Any:
        # Only called for names the holder lacks: a registered view, or the ordinary AttributeError.
        view = None if attr.startswith("_") else type(self).views.get(attr)
        if view is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}")
        name, read, default = view
        part = self.parts.get(name)  # type: ignore[attr-defined]
        return default if part is None else read(part)

    @classmethod
    def view(cls, attr: str, name: str, read: Callable[[Any], Any], default: Any = None) -> None:
        """Let callers outside type `name` read `attr` of a holder: `read(part)`, or `default` without a part."""
        if attr in cls.views and cls.views[attr][0] != name:
            raise AssertionError(f"{cls.__name__}.{attr} is already a view of part {cls.views[attr][0]}")
        cls.views[attr] = (name, read, default)

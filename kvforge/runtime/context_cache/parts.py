"""Per-type parts: what one resource type keeps in a lease, record, plan or publication.

Leases, records, plans and publications carry no field named after one resource type: each type keeps its own part
under its name (`holder.parts[kind.name]`) and only that type writes it. Code outside the cache reads a part
through the typed handles its type's module exports (`draft_of(lease)`, `restore_slot(lease)`,
`partial_slot(record)`, `document_reused_tokens(lease)`, ...), never by attribute.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

NO_PARTS: Mapping[str, Any] = MappingProxyType({})

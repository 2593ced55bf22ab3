"""What a request carries into the documents type and what its records and leases hold: kept apart from
types/document_chunks.py so the request side (sequence.py, other types) imports no coordinator logic."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvforge.contract import profile_schema as schema
from kvforge.runtime.context_cache.lease import Inputs


@dataclass(frozen=True, slots=True)
class DocumentInput:
    """A request's input to this type: its prompt's document spans (start, length), or (`produces`) that the request
    is a document's standalone prefill at position 0, whose published prompt becomes the stored form."""

    spans: tuple[tuple[int, int], ...] = ()
    produces: bool = False
    skipped: tuple[str, ...] = ()  # the reasons of the document items the input processor could give no span


NO_DOCUMENTS = DocumentInput()


def document_input(spans: Iterable[tuple[int, int]] = (), produces: bool = False,
                   skipped: Iterable[str] = ()) -> Inputs:
    """The per-type input entry of a request with these document spans (or a producer); empty without either."""
    entry = DocumentInput(tuple(spans), produces, tuple(skipped))
    return {schema.DOCUMENT_KV_PAGES: entry} if entry != NO_DOCUMENTS else {}


def documents_of(inputs: Inputs) -> DocumentInput:
    return inputs.get(schema.DOCUMENT_KV_PAGES, NO_DOCUMENTS)


@dataclass(frozen=True, slots=True)
class StoredDocument:
    """A record's part: the document's tokens and the slots of this pool holding its K/V at positions 0..n-1."""

    key: bytes
    tokens: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DocumentHit:
    """One document span of a request served from a stored form: tokens [start, start + repair) are recomputed,
    [start + repair, start + length) restored from `slots` (rotated by `start`)."""

    start: int
    length: int
    repair: int
    record_id: int
    slots: tuple[int, ...]

    @property
    def restored(self) -> tuple[int, int]:
        return self.start + self.repair, self.start + self.length

    @property
    def reused_tokens(self) -> int:
        return self.length - self.repair

"""Media items and documents placed in a prompt (light: sequences carry these without importing decoders)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvforge.runtime.context_cache.keys import MediaKey


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """One media item placed in a prompt: its placeholder span, identity, and the rows spliced over it.

    A split image's span runs from its first tile's first placeholder to its global image's last one, so it also
    covers the tile markers between them (text tokens the embedding table serves); `offsets` then says where in
    the span each encoder row goes. None: the span is all placeholders, row i at offset i."""

    key: MediaKey
    embeds: np.ndarray  # [placeholders, hidden] float32, read-only (may be shared with the encoder cache)
    offsets: np.ndarray | None = None  # [placeholders] int64, increasing, relative to start

    @property
    def start(self) -> int:
        return self.key.start

    @property
    def end(self) -> int:
        return self.key.start + self.key.length

    def splice(self, row_embeds: np.ndarray, begin: int, end: int) -> None:
        """Overwrite the placeholder positions among prompt positions [begin, end), held by row_embeds, with their
        encoder rows (a chunk may hold part of the span: exactly its rows are copied)."""
        lo, hi = max(begin, self.start), min(end, self.end)
        if lo >= hi:
            return
        if self.offsets is None:
            row_embeds[lo - begin:hi - begin] = self.embeds[lo - self.start:hi - self.start]
            return
        first, last = np.searchsorted(self.offsets, [lo - self.start, hi - self.start])
        row_embeds[self.start - begin + self.offsets[first:last]] = self.embeds[first:last]


@dataclass(frozen=True, slots=True)
class DocumentSpan:
    """A {"type": "document"} item's place in a prompt: its tokens are prompt tokens [start, start + length), and
    they are exactly the document's own tokenization (so its reuse key does not depend on what surrounds it)."""

    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

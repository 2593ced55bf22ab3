"""A media item placed in a prompt (light: sequences carry these without importing decoders or encoders)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvforge.runtime.context_cache.keys import MediaKey


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """One media item placed in a prompt: its placeholder span, identity, and the rows spliced over it."""

    key: MediaKey
    embeds: np.ndarray  # [length, hidden] float32, read-only (may be shared with the encoder cache)

    @property
    def start(self) -> int:
        return self.key.start

    @property
    def end(self) -> int:
        return self.key.start + self.key.length

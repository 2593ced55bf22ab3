"""The worker-side searches of the store for one sequence: its missing full pages (and a tail past them), or the
longest checkpoint it can resume from. Where a tail or checkpoint lives is the cache types' rule
(`partial_tails.tail_key`, `recurrent_checkpoints.checkpoint_key` and `resumable`), called here, never restated.

Pages alone are worthless to a recurrent model, so a checkpoint load is all or nothing; a page load publishes each
batch as it arrives and stops at the first page the store lacks or a read rejects.
"""

from __future__ import annotations

import numpy as np

from kvforge.runtime.context_cache.types.partial_tails import tail_key
from kvforge.runtime.context_cache.types.recurrent_checkpoints import checkpoint_key, resumable
from kvforge.runtime.execution.backend import KVStorage
from kvforge.runtime.execution.recurrent_state import RecurrentStates
from kvforge.runtime.shared_tier.io import BATCH_BYTES, Load, TierIO
from kvforge.runtime.shared_tier.layout import Layout
from kvforge.runtime.shared_tier.values import Decoded, ValueRejected


class TierSearch:
    """Runs one `Load` on a tier worker thread, through `io` (deadlines, counters) and `layout` (keys, codecs)."""

    def __init__(self, io: TierIO, layout: Layout, *, tokens_per_page: int, kv: KVStorage | None,
                 states: RecurrentStates | None) -> None:
        self.io = io
        self.layout = layout
        self.tokens_per_page = tokens_per_page
        self.kv = kv
        self.states = states

    def __call__(self, load: Load) -> None:
        if load.checkpoint:
            self._checkpoint(load)
        else:
            self._pages(load)

    def _page_like(self) -> list[np.ndarray]:
        return self.kv.read_page(0) if self.kv is not None else []

    def _pages(self, load: Load) -> None:
        seq, T, io = load.seq, self.tokens_per_page, self.io
        lease = seq.lease
        assert lease is not None and self.kv is not None
        first, last = load.reuse // T, (len(seq.prompt_ids) - 1) // T
        keys = lease.keys[first:last]
        present = io.call(load, io.store.exists, [self.layout.page.store_key(key) for key in keys])
        count = next((i for i, there in enumerate(present) if not there), len(keys))
        prompt = np.asarray(seq.prompt_ids, dtype=np.int32)
        like = self._page_like()
        got = self._get_pages(load, keys[:count], first, prompt, like, publish=True)
        if got is not None:
            self._tail(load, first + count, prompt, like)

    def _get_pages(self, load: Load, keys: list[bytes], first: int, prompt: np.ndarray, like: list[np.ndarray],
                   *, publish: bool) -> list[tuple[int, Decoded]] | None:
        """The pages of `keys` (page index `first` on), in batches near BATCH_BYTES; None if one is missing or
        rejected. `publish`: hand each batch to the engine thread as it arrives (a page load's partial progress
        counts; a checkpoint's does not)."""
        T, codec, io = self.tokens_per_page, self.layout.page, self.io
        limit = codec.max_bytes(T, like)
        per_batch = max(1, BATCH_BYTES // limit)
        pages: list[tuple[int, Decoded]] = []
        for begin in range(0, len(keys), per_batch):
            batch = keys[begin:begin + per_batch]
            store_keys = [codec.store_key(key) for key in batch]
            ready: list[tuple[int, Decoded]] = []
            whole = True  # every page so far decoded: the load may use the next one
            for offset, value in enumerate(io.call(load, io.store.get, store_keys, max_bytes=limit)):
                page = first + begin + offset
                if value is None:
                    whole = False
                    continue
                try:
                    decoded = codec.decode(value, batch[offset], like=like, tokens=prompt[page * T:(page + 1) * T])
                except ValueRejected:
                    # Checked although unusable past a gap: so every bad value read here is replaced (healed).
                    io.rejected(store_keys[offset])
                    whole = False
                    continue
                if whole:
                    ready.append((page, decoded))
            if publish:
                io.publish(load, ready)
            pages += ready
            if len(ready) < len(batch):
                return None
            io.remember(store_keys)
        return pages

    def _tail(self, load: Load, depth: int, prompt: np.ndarray, like: list[np.ndarray]) -> None:
        """After the full pages: a partial-KV tail the store lists past them (a record not ending on a page)."""
        lease, T = load.seq.lease, self.tokens_per_page
        assert lease is not None
        if depth * T >= len(prompt) - 1:
            return
        anchor = lease.keys[depth - 1] if depth else self.layout.root
        codec = self.layout.checkpoint
        for length in self._listed_lengths(load, [(depth, anchor)], prompt):
            key = tail_key(lease.keys, prompt, length, T, lease.extras, self.layout.root)
            [value] = self.io.call(load, self.io.store.get, [codec.store_key(key)],
                                   max_bytes=codec.max_bytes(length, like))
            if value is None:
                continue
            try:
                tail = codec.decode(value, key, like=like, tokens=prompt[:length])
            except ValueRejected:
                self.io.rejected(codec.store_key(key))
                continue
            self.io.publish(load, [(-1, tail)])
            return

    def _listed_lengths(self, load: Load, anchors: list[tuple[int, bytes]], prompt: np.ndarray) -> list[int]:
        """The endpoint lengths the directory lists under `anchors` ((depth, anchor) pairs) that this sequence
        could resume from (past its local hit, `resumable`, on its anchor's page), longest first."""
        slots = [(depth, anchor, slot) for depth, anchor in anchors for slot in self.layout.directory_slots(anchor)]
        io, T = self.io, self.tokens_per_page
        listed = io.call(load, io.store.get, [slot for _, _, slot in slots],
                         max_bytes=self.layout.length.max_bytes(1, []))
        lease = load.seq.lease
        media = lease.extras.media if lease is not None else ()
        lengths: set[int] = set()
        for (depth, anchor, _), value in zip(slots, listed, strict=True):
            if value is None:
                continue
            try:
                length = self.layout.listed_length(anchor, value)
            except ValueRejected:
                io.count(corrupt=1)  # the directory writer replaces a damaged entry itself
                continue
            # An entry listing a length off its anchor's page is not ours to follow (it would name no key).
            if load.reuse < length and length // T == depth and resumable(length, len(prompt), media):
                lengths.add(length)
        return sorted(lengths, reverse=True)

    def _checkpoint(self, load: Load) -> None:
        seq, T, io = load.seq, self.tokens_per_page, self.io
        lease = seq.lease
        assert lease is not None and self.states is not None
        prompt = np.asarray(seq.prompt_ids, dtype=np.int32)
        keys, root = lease.keys, self.layout.root
        depths = range(min(len(keys), (len(prompt) - 1) // T), load.reuse // T - 1, -1)
        lengths = self._listed_lengths(load, [(d, keys[d - 1] if d else root) for d in depths], prompt)
        state_like = [array[0] for array in self.states.arrays.values()]
        tail_like = self._page_like()
        codec = self.layout.checkpoint
        for length in lengths:
            depth = length // T
            key = checkpoint_key(keys, prompt, length, T, lease.extras, root)
            like = state_like + (tail_like if length % T else [])
            [value] = io.call(load, io.store.get, [codec.store_key(key)], max_bytes=codec.max_bytes(length, like))
            if value is None:
                continue
            try:
                checkpoint = codec.decode(value, key, like=like, tokens=prompt[:length])
            except ValueRejected:
                io.rejected(codec.store_key(key))
                continue
            first = load.reuse // T if self.kv is not None else depth  # pages the local hit lacks
            pages = self._get_pages(load, list(keys[first:depth]), first, prompt, tail_like, publish=False)
            if pages is None:
                continue  # a page of it is gone: a shorter checkpoint may still be whole
            io.publish(load, [*pages, (-1, checkpoint)])
            io.remember([codec.store_key(key)])
            return

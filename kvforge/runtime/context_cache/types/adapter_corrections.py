"""Corrected adapters as a cache type: per-page factors P = x A stored beside base pages, so an ordinary adapter can
start from the base model's K/V plus a low-rank correction (issue 39 item 2, opt-in, off by default).

Decisions, written down as the issue asks:

- **What is stored: the factors, not x.** While a base request runs on an engine with corrected adapters, every call
  returns hidden states at every new position and the engine computes, per corrected adapter, P_k = x A_k and
  P_v = x A_v for every layer (2r floats per token and layer, float32: `FactorCapture`, this type's part of the base
  lease). When the base lease publishes, each whole page's factors go into one slot of this type's pool per
  adapter, keyed by (adapter digest, the base page's key), and the record holds those slots like it holds its pages;
  a page another record already stored factors for shares that slot. A page whose factors were not computed (reused
  from a record made before the adapter was corrected, loaded from a shared tier, or with media) has none.
- **Budget:** `adapter_correction_pages` slots (default: the KV pool's pages times the corrected adapters, enough
  for every cached page of every one). When the pool is full, new pages publish without factors (counted): the
  corrections are an optimisation, never a reason to evict pages.
- **The shared tier does not save factors**: a page loaded from it has none, and the adapter computes from there.
- **A corrected request** (`KeyExtras.corrected`: its keys are the base pages' keys) reuses the longest run of
  leading whole base pages that have factors for its adapter: it takes fresh pages, the base K/V are copied into
  them with dK = rot((P_k B_k)) and dV = P_v B_v added (`CorrectionCopier`), rounded to the pool's dtype. The
  copies are its own: the lease never publishes or indexes anything (they are approximate, and its own pages are
  keyed as base pages), so nothing it computed is ever found by another request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvforge.contract import profile_schema as schema
from kvforge.contract.errors import InvalidConfig
from kvforge.contract.paging import pages_for
from kvforge.runtime.context_cache.lease import Admission, Inputs, Lease
from kvforge.runtime.context_cache.metrics import CounterBlock
from kvforge.runtime.context_cache.planner import PlanKind, ReusePlan
from kvforge.runtime.context_cache.pools import ResourcePool
from kvforge.runtime.context_cache.protocol import CacheSetup, CacheTypeBase, Lookup, Publication
from kvforge.runtime.context_cache.records import Record
from kvforge.runtime.context_cache.support import PLAIN_DECODING, CacheSupport, ReuseOff, Tier, refusal
from kvforge.runtime.context_cache.types.document_inputs import documents_of
from kvforge.runtime.context_cache.types.draft_paths import is_speculative
from kvforge.runtime.types import Deployment

CORRECTION_OPTIONS = ("adapter_correction_pages",)


class CorrectionCopier(Protocol):
    """The engine side (kvforge/runtime/execution/corrections.py): which adapters are corrected, and the corrected
    copy."""

    @property
    def digests(self) -> tuple[bytes, ...]:
        """The corrected adapters' digests (empty until adapters are loaded)."""
        ...

    @property
    def num_adapters(self) -> int:
        """How many adapters the option names (sizes the default budget)."""
        ...

    def correct(self, digest: bytes, src_pages: list[int], dst_pages: list[int], factors: list[np.ndarray]) -> None:
        """Write base page src_pages[i] plus the correction from factors[i] [T, L, 2, r] into dst_pages[i] (the
        i-th page of the sequence: positions i*T ..). Reads every source before writing any destination."""
        ...


class FactorCapture:
    """A base lease's factors as its calls compute them: page index -> {digest: [T, L, 2, r]} and which rows are
    filled. A page is usable once every row is (a lease that reused the page from the cache computes none)."""

    __slots__ = ("tokens_per_page", "pages", "filled")

    def __init__(self, tokens_per_page: int) -> None:
        self.tokens_per_page = tokens_per_page
        self.pages: dict[int, dict[bytes, np.ndarray]] = {}
        self.filled: dict[int, np.ndarray] = {}

    def add(self, start: int, factors: dict[bytes, np.ndarray]) -> None:
        """Factors [n, L, 2, r] per digest of positions [start, start + n)."""
        if not factors:
            return
        T = self.tokens_per_page
        count = len(next(iter(factors.values())))
        position = start
        while position < start + count:
            page, row = divmod(position, T)
            take = min(T - row, start + count - position)
            stored = self.pages.setdefault(page, {})
            for digest, values in factors.items():
                if digest not in stored:
                    stored[digest] = np.zeros((T, *values.shape[1:]), np.float32)
                stored[digest][row:row + take] = values[position - start:position - start + take]
            self.filled.setdefault(page, np.zeros(T, bool))[row:row + take] = True
            position += take

    def page(self, index: int, digest: bytes) -> np.ndarray | None:
        filled = self.filled.get(index)
        if filled is None or not filled.all():
            return None
        return self.pages[index].get(digest)


@dataclass(frozen=True, slots=True)
class CorrectionHit:
    """A corrected admission's part of its plan: the base pages to copy and the factor slots (pinned) to add."""

    digest: bytes
    base_pages: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StoredFactors:
    """A record's part: (digest, page key, slot) for each page and adapter it keeps factors for."""

    entries: tuple[tuple[bytes, bytes, int], ...]

    @property
    def slots(self) -> tuple[int, ...]:
        return tuple(slot for _, _, slot in self.entries)


# The profile's `adapter_corrections` block: base pages copied and corrected for corrected adapters' requests, factor
# slots written, pages published without factors (the pool was full). /metrics reads the per-adapter profile instead.
CORRECTION_COUNTERS = CounterBlock(schema.ADAPTER_CORRECTIONS, schema.CORRECTION_KEYS)


# Its row of the support matrix: cached base pages to start from (reuse on), attention-only engines (a recurrent
# layer's state past the conversation is the adapter's own), plain decoding; the tier saves the base pages only.
CORRECTION_SUPPORT = CacheSupport(
    "adapter corrections", "lora_corrections", (Deployment.VANILLA,), PLAIN_DECODING, window_group=True,
    tier=Tier.NOT_SAVED, reuse_off=ReuseOff.REFUSED, refusals={
        "reuse": "corrected adapters start from cached base pages: they need enable_context_reuse",
        "deployment": "recurrent and hybrid engines cannot correct adapters: their state past the conversation is "
                      "the adapter's own",
        "spec": "corrected adapters run without speculative decoding; use --specDecode none"},
    note="llama-family engines exported with every layer's hidden states")


def check_deployment(deployment: Deployment) -> None:
    """The support row's deployments (refused in one line naming `lora_corrections`)."""
    found = refusal(CORRECTION_SUPPORT, deployment=deployment, spec_decode=PLAIN_DECODING[0], reuse=True,
                    window_group=False, shared_cache=False)
    if found is not None:
        raise found


def build_adapter_corrections(setup: CacheSetup, name: str) -> AdapterCorrections | None:
    """Only with context reuse on and an engine that opted in (`lora_corrections`)."""
    copier: CorrectionCopier | None = setup.copier(name)
    if not setup.enabled or copier is None:
        return None
    check_deployment(setup.deployment)
    budget = setup.options.get("adapter_correction_pages")
    budget = setup.num_pages * max(copier.num_adapters, 1) if budget is None else budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise InvalidConfig(f"must be an integer >= 0, got {budget!r}", "adapter_correction_pages")
    return AdapterCorrections(ResourcePool(name, budget), setup.tokens_per_page, copier)


class AdapterCorrections(CacheTypeBase):
    """Factor slots by (adapter digest, base page key); corrected admissions copy base pages and add corrections."""

    __slots__ = ("name", "pool", "tokens_per_page", "copier", "counts", "_by_key", "_key_of", "_data")

    def __init__(self, pool: ResourcePool, tokens_per_page: int, copier: CorrectionCopier) -> None:
        self.name = pool.name
        self.pool = pool
        self.tokens_per_page = tokens_per_page
        self.copier = copier
        self.counts = CORRECTION_COUNTERS.zeros()
        self._by_key: dict[tuple[bytes, bytes], int] = {}
        self._key_of: dict[int, tuple[bytes, bytes]] = {}
        self._data: dict[int, np.ndarray] = {}  # slot -> factors [T, L, 2, r]
        pool.on_free = self._forget

    def _forget(self, slot: int) -> None:
        key = self._key_of.pop(slot, None)
        if key is not None and self._by_key.get(key) == slot:
            del self._by_key[key]
        self._data.pop(slot, None)

    def has_factors(self, digest: bytes, page_key: bytes) -> bool:
        return (digest, page_key) in self._by_key

    # --- lookup -------------------------------------------------------------------------------------

    def find_longest_hit(self, lookup: Lookup, agreed: ReusePlan) -> ReusePlan:
        """Any other request: as agreed. A corrected one: never the base pages themselves; the leading whole base
        pages the types before found (their keys are the base keys) that have factors for this adapter, as copies
        (fresh pages for the whole input), and nothing else the other types offered (a tail snapshot, documents)."""
        if not lookup.extras.corrected:
            return agreed
        digest, T = lookup.extras.adapter_digest, self.tokens_per_page
        total = pages_for(len(lookup.tokens), T)
        base, slots = [], []
        if not (is_speculative(lookup.inputs) or documents_of(lookup.inputs).produces):
            for index, page in enumerate(agreed.hit_pages):
                slot = self._by_key.get((digest, lookup.keys[index]))
                if slot is None:
                    break
                base.append(page)
                slots.append(slot)
        if not base:
            return ReusePlan(PlanKind.NO_REUSABLE_PREFIX, 0, 0, (), total)
        reuse = len(base) * T
        return ReusePlan(PlanKind.STANDARD, reuse, reuse, (), total).with_part(
            self.name, CorrectionHit(digest, tuple(base), tuple(slots)))

    def hit_slots(self, plan: ReusePlan) -> tuple[int, ...]:
        hit = plan.parts.get(self.name)
        return () if hit is None else hit.slots

    # --- a lease's part ------------------------------------------------------------------------------

    def admit(self, lease: Lease, plan: ReusePlan, inputs: Inputs, slots: list[int]) -> None:
        """A corrected lease never publishes; with a hit, its first pages become corrected copies of the base pages
        now (the attention type admitted first: the pages are allocated), and the factor slots are unpinned. The
        base pages were not pinned: were one evicted for this admission, its bytes are still there, since nothing
        writes the pool before the copy, which reads every source first."""
        if lease.extras.corrected:
            lease.may_publish = False
        hit = plan.parts.get(self.name)
        if hit is None:
            return
        factors = [self._data[slot] for slot in hit.slots]
        self.copier.correct(hit.digest, list(hit.base_pages), lease.page_ids[:len(hit.base_pages)], factors)
        self.counts[schema.ADAPTER_CORRECTED_PAGES] += len(hit.base_pages)
        self.pool.unpin(hit.slots)

    def on_admitted(self, lease: Lease, admission: Admission, num_tokens: int) -> None:
        """A base lease that may publish collects factors while corrected adapters are loaded (not with media: the
        engine's x for a media position is not the embedding row)."""
        if lease.may_publish and not lease.extras.adapter_digest and not lease.extras.media and self.copier.digests:
            lease.parts[self.name] = FactorCapture(self.tokens_per_page)

    # --- publication: a base lease's whole pages keep their factors ---------------------------------

    def capture(self, lease: Lease, publication: Publication) -> bool:
        """Fill the record's part: a page and adapter with factors stored already share that slot; new factors take
        a free slot, if any (none: the page goes without, counted). Returns False: nothing waits on a device."""
        captured = lease.parts.get(self.name)
        digests = self.copier.digests
        if not digests or not publication.keys:
            return False
        entries = []
        new: list[int] = []
        for index, key in enumerate(publication.keys[:len(publication.page_ids)]):
            for digest in digests:
                slot = self._by_key.get((digest, key))
                if slot is None:
                    values = captured.page(index, digest) if isinstance(captured, FactorCapture) else None
                    if values is None:
                        continue
                    if not self.pool.can_allocate(1):
                        self.counts[schema.CORRECTION_SKIPPED_PAGES] += 1
                        continue
                    slot = self.pool.allocate(1)[0]
                    self._data[slot] = values.copy()
                    self._key_of[slot] = (digest, key)
                    self._by_key[(digest, key)] = slot
                    new.append(slot)
                    self.counts[schema.CORRECTION_STORED_PAGES] += 1
                entries.append((digest, key, slot))
        if new:
            publication.reserved.setdefault(self.name, []).extend(new)  # the commit unpins them
        if entries:
            publication.parts[self.name] = StoredFactors(tuple(entries))
        return False

    def counters(self) -> dict[str, int]:
        return self.counts

    def held(self, record: Record) -> tuple[int, ...]:
        stored = record.parts.get(self.name)
        return () if stored is None else stored.slots

    def audit(self, records: Sequence[Record], leases: Iterable[Lease]) -> None:
        held = {slot for record in records for slot in self.held(record)}
        assert set(self._by_key.values()) <= held, "factors no record holds"
        for record in records:
            stored = record.parts.get(self.name)
            if stored is not None:
                assert all(key in record.keys for _, key, _ in stored.entries), "factors of a page the record lacks"

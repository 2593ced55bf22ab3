"""Documents as a cache type: a retrieved document's K/V, stored once, restored wherever the document lands (issue 37).

Decisions, written down as the issue asks:

- **The stored form is a standalone prefill at position 0.** K/V computed inside a request depends on what preceded
  the document there, so it is never stored. The scheduler queues one short internal request per document that has
  no stored form yet (its prompt is exactly the document's tokens); when that request publishes its prompt, this
  type copies its pages into its own pool (`document_kv_pages`) and files them under `document_key`. The same
  record keeps the document's pages as an ordinary, exact prefix record too.
- **Restoring is a per-token-row copy with K rotated.** A document rarely starts on a page boundary, and rotation
  moves positions, not slots: token i of the stored form goes to position start + i of the request, whatever page
  and slot that is (a page the prefix filled partly included), its K rotated by `start` (`DocumentKVStore`). The
  copy is made at admission, before the request computes anything; the kernel reads a row's cached positions only
  below its start, so tokens before a document never see it.
- **On a sliding-window group** (`--slidingWindowPool`, issue 53) the sliding layers' rows live in window pages a
  row allocates as it grows and frees behind its window. The stored form keeps each layer's page of its own group
  (the producer still holds its last window: all a later position reads of a document). At admission the global
  rows are copied; each window page of a restored range is written when the row gets it (`on_grown`, before the call
  that reads it), and a page behind the window is never allocated, read or written. The hits' slots stay pinned
  until then. The record's window checkpoint is the group's to take back alone (`part_drops_alone`): the stored form
  outlives it, so a group sized for its rows alone still reuses documents.
- **Repair recomputes the first tokens of each document in place** (`first-page`: one page of tokens; `overlap`:
  that, and all of the document closest to the question; `attention`: that, and the documents the question's
  attention falls on, within a budget, chosen in a first pass over the question (types/document_repair.py);
  `full`: all of them, which must give exactly a cold run's tokens; `none`: nothing). Repair is contiguous, so
  it is plain causal attention with today's kernel. The scheduler ends a chunk where a restored range begins and
  moves `num_computed_tokens` past it.
- **Approximate K/V never becomes findable under exact keys.** `lease.exact_tokens` is set to the first restored
  position: nothing from there on is indexed in flight or published. Exact prefix reuse before it works as before.
- **Short documents** (issue 53): a document of at least `MIN_DOCUMENT_TOKENS` tokens is reusable whatever the page
  size, because the store keeps rows, not pages: a document shorter than a page is stored as its standalone
  prefill's one partial page (its publication keeps that tail: `keeps_tail_of`), and restored row by row into
  whatever page its position maps to, like any document's last partial page.
- Documents shorter than `MIN_DOCUMENT_TOKENS`, documents overlapping media, documents holding the prompt's last
  token (it must be computed for logits), requests with an activated LoRA and documents starting inside the exact
  hit (or its snapshot-restored page) are computed as ordinary prompt tokens.
- **What is not reused is counted by reason** (issue 53): `skipped_too_short` (under `MIN_DOCUMENT_TOKENS`),
  `skipped_edge_merge` (the input processor could not tell the document's tokens apart: inputs/processor.py),
  `skipped_refused` (every other reason above but the exact hit, which reuses the document as prefix pages).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Protocol

import numpy as np

from kvforge.contract import profile_schema as schema
from kvforge.contract.errors import InvalidConfig
from kvforge.contract.paging import pages_for
from kvforge.runtime.context_cache.keys import KeyExtras, document_key, media_in_page
from kvforge.runtime.context_cache.lease import Admission, Inputs, Lease, Prerequisite
from kvforge.runtime.context_cache.metrics import CounterBlock, Sample
from kvforge.runtime.context_cache.planner import ReusePlan
from kvforge.runtime.context_cache.pools import ResourcePool
from kvforge.runtime.context_cache.protocol import CacheSetup, CacheTypeBase, Lookup, Publication
from kvforge.runtime.context_cache.records import Record, RecordStore
from kvforge.runtime.context_cache.support import WITHOUT_DRAFT_MODEL, CacheSupport, ReuseOff, Tier
from kvforge.runtime.context_cache.types.document_inputs import (
    DocumentHit,
    StoredDocument,
    document_input,
    documents_of,
)
from kvforge.runtime.context_cache.types.document_repair import (
    ATTENTION_METER,
    DEFAULT_REPAIR_BUDGET,
    MassMeter,
    QuestionPass,
    check_budget,
    chosen_repairs,
    closest_to_question,
    start_pass,
)
from kvforge.runtime.types import Deployment

DOCUMENT_OPTIONS = ("document_reuse", "document_repair", "document_repair_budget")
REPAIR_NONE, REPAIR_FIRST_PAGE, REPAIR_OVERLAP, REPAIR_FULL = "none", "first-page", "overlap", "full"
REPAIR_ATTENTION = "attention"  # first-page, then what the question's attention reads (issue 53)
REPAIR_POLICIES = (REPAIR_NONE, REPAIR_FIRST_PAGE, REPAIR_OVERLAP, REPAIR_FULL, REPAIR_ATTENTION)
# experiments/reuse/document_reuse.py on SmolLM2 (16 requests, 3 of 8 reports each): first-page answered 8/16 right
# against full prefill's 9/16 with 42 % of prompt tokens cached and a quarter of the TTFT; none 2/16; overlap no better
# than first-page for more recomputation (docs/document-reuse.md).
DEFAULT_REPAIR = REPAIR_FIRST_PAGE
# The shortest document reused: below it a document's standalone prefill, lookup and row copy cost more than the
# few tokens it saves (issue 53: "a document of at least 16 tokens is reusable whatever the page size").
MIN_DOCUMENT_TOKENS = 16


def _samples(cache: Mapping[str, object]) -> Iterable[Sample]:
    """/metrics: `documents_<key>` for each counter (`documents_skipped_<reason>` for the skips), once a request
    carried a document (--documentReuse)."""
    block = cache.get(schema.DOCUMENTS)
    if isinstance(block, Mapping) and any(block.values()):
        for key, value in block.items():
            yield Sample("counter", f"documents_{key}", f"The profile's context_cache.documents.{key}.", value)


# The profile's `documents` block: document items admitted requests carried, spans restored, tokens restored and
# recomputed, pages of stored K/V rotated into requests, standalone prefills that produced a stored form, and the
# items that could not be reused, by reason (profile_schema).
DOCUMENT_COUNTERS = CounterBlock(schema.DOCUMENTS, schema.DOCUMENT_KEYS, _samples)
# Its row of the support matrix: attention-only engines (a recurrent state depends on the whole prefix), no draft
# model (a draft has no stored documents); beside a sliding-window group too (issue 53: a document's sliding-layer
# rows go into the window pages as the row allocates them, `on_grown`); the tier saves its records' pages but not
# the stored forms. Keys re-rotate by each pool layer's own RoPE (Gemma's layer types included: issue 53); the
# engine config checks the rotations numerically.
DOCUMENT_SUPPORT = CacheSupport(
    "documents", "document_reuse", (Deployment.VANILLA,), WITHOUT_DRAFT_MODEL, window_group=True,
    tier=Tier.NOT_SAVED, reuse_off=ReuseOff.IMPLIES, refusals={
        "deployment": "document reuse needs an attention-only engine; this one is {deployment} (a recurrent state "
                      "depends on the whole prefix, so a document's state cannot be moved)",
        "spec": "document reuse does not combine with --specDecode {method}: its draft model has no stored "
                "documents; use --specDecode ngram or none"},
    note="keys move by each layer's own RoPE (Gemma 3/4 included); on a sliding-window group its sliding layers "
         "get the rows their window reads, and that group's refusals (`ngram`, a shared tier) still apply")


class DocumentCopier(Protocol):
    """Moves document K/V bytes (kvforge/runtime/execution/kv_store.py `DocumentKVStore`, the setup's copier for
    this type): this module never touches them."""

    def capture(self, page_ids: list[int], slots: list[int], tables: Mapping[str, Sequence[int]]) -> None: ...

    def restore(self, slots: list[int], page_ids: Sequence[int], start: int, first: int, last: int,
                group: str | None = None) -> None: ...


@dataclass(frozen=True, slots=True)
class DocumentPart:
    """This type's part of a plan and a lease: the hits of a request, or (a standalone prefill) the key it produces
    and the slots reserved for its stored form."""

    hits: tuple[DocumentHit, ...] = ()
    produces: bytes = b""
    tokens: tuple[int, ...] = ()  # a producer's document
    # The slots the lease pins: a producer's (until released), or its hits' until every page group has their rows.
    slots: tuple[int, ...] = ()
    # A lease's logical pages, per page group beside the global one, holding restored rows that group has no page
    # for yet (a window group allocates them as the row reaches them: they are copied then, `on_grown`).
    waiting: dict[str, set[int]] = field(default_factory=dict, compare=False)
    question: QuestionPass | None = None  # `attention`: the first pass over the question, while it runs

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def restored_spans(self) -> tuple[tuple[int, int], ...]:
        return tuple(hit.restored for hit in self.hits if hit.reused_tokens)

    @property
    def reused_tokens(self) -> int:
        return sum(hit.reused_tokens for hit in self.hits)


def document_reused_tokens(lease: Lease) -> int:
    part = lease.parts.get(schema.DOCUMENT_KV_PAGES)
    return 0 if part is None else part.reused_tokens


def build_document_chunks(setup: CacheSetup, name: str) -> DocumentChunks | None:
    """Only with document reuse on (and context reuse, which it implies); attention-only deployments only."""
    if not (setup.enabled and setup.options.get("document_reuse")):
        return None
    if setup.deployment is not Deployment.VANILLA:
        raise InvalidConfig("document reuse needs an attention-only engine: a recurrent state depends on the whole "
                            "prefix, so a document's state cannot be moved", "document_reuse")
    repair = setup.options.get("document_repair", DEFAULT_REPAIR)
    if repair not in REPAIR_POLICIES:
        raise InvalidConfig(f"must be one of {', '.join(REPAIR_POLICIES)}, got {repair!r}", "document_repair")
    budget = check_budget(setup.options.get("document_repair_budget", DEFAULT_REPAIR_BUDGET))
    # The stored forms get as many slots as the pool has pages (the store maps a slot's memory only when written).
    return DocumentChunks(ResourcePool(name, setup.num_pages), setup.tokens_per_page, setup.chain_root, repair,
                          setup.copier(name), setup.records, setup.page_tables, budget,
                          setup.copier(ATTENTION_METER) if repair == REPAIR_ATTENTION else None)


class DocumentChunks(CacheTypeBase):
    """Stored documents, found by `document_key` wherever a request places them. Each stored form is a record's part
    (the record of its standalone prefill), so the coordinator's LRU evicts documents like any record."""

    __slots__ = ("name", "pool", "tokens_per_page", "chain_root", "repair", "copier", "records", "metrics",
                 "group_tables", "_by_key", "_producing", "budget", "meter")

    def __init__(self, pool: ResourcePool, tokens_per_page: int, chain_root: bytes, repair: str,
                 copier: DocumentCopier | None, records: RecordStore,
                 group_tables: Callable[[Lease], Mapping[str, list[int]]] = lambda lease: {},
                 budget: float = DEFAULT_REPAIR_BUDGET, meter: MassMeter | None = None) -> None:
        self.name = pool.name
        self.pool = pool
        self.tokens_per_page = tokens_per_page
        self.chain_root = chain_root
        self.repair = repair
        self.copier = copier  # None: bookkeeping only (the cache's own tests)
        self.records = records
        self.group_tables = group_tables  # a lease's other page groups' tables (a window group's: issue 53)
        self.metrics = DOCUMENT_COUNTERS.zeros()
        self._by_key: dict[bytes, Record] = {}  # document key -> the record holding its stored form
        self._producing: dict[bytes, Lease] = {}  # document key -> the running standalone prefill producing it
        self.budget = budget  # `attention`: the fraction of a request's document tokens its pass may recompute
        self.meter = meter  # `attention`: the attention kernel's mass output (None: it stays first-page)

    # --- which spans are documents to reuse ----------------------------------------------------------

    def eligible(self, tokens: np.ndarray, documents: Iterable[tuple[int, int]], extras: KeyExtras,
                 after: int = 0) -> list[tuple[bytes, int, int]]:
        """(key, start, length) of the spans this type may serve: MIN_DOCUMENT_TOKENS long, wholly after `after`, not
        holding the last token, without media, and not under an activated LoRA (its positions before the
        invocation are base K/V, which a standalone prefill of the document would not reproduce)."""
        found = []
        for start, length in documents:
            if start < after or self.skip_reason(len(tokens), start, length, extras):
                continue
            found.append((document_key(tokens[start:start + length], extras, self.chain_root, start), start, length))
        return found

    def skip_reason(self, num_tokens: int, start: int, length: int, extras: KeyExtras) -> str:
        """Why this type cannot serve the span (profile_schema.SKIP_REASONS), or "" when it can."""
        end = start + length
        if length < MIN_DOCUMENT_TOKENS:
            return schema.SKIP_TOO_SHORT
        if extras.adapter_start or end >= num_tokens or media_in_page(extras.media, start, end) \
                or length > self._capacity_tokens:
            return schema.SKIP_REFUSED
        return ""

    def prerequisites(self, admission: Admission) -> list[Prerequisite]:
        """A standalone prefill of each span of `admission` whose document has no stored form and no standalone
        prefill running: the scheduler queues one for each (first come: a span whose key it queued already it
        skips)."""
        documents = documents_of(admission.inputs)
        if documents.produces or not documents.spans:
            return []
        tokens = np.asarray(admission.token_ids, dtype=np.int32)
        return [Prerequisite(key, start, length, document_input(produces=True)) for key, start, length in
                self.eligible(tokens, documents.spans, admission.extras)
                if key not in self._by_key and key not in self._producing]

    def restored_spans(self, lease: Lease) -> tuple[tuple[int, int], ...]:
        """The lease's restored document ranges [start, end): the scheduler moves its computing past them."""
        part = lease.parts.get(self.name)
        return () if part is None else part.restored_spans

    def repair_pass(self, lease: Lease, computed: int) -> tuple[int, int]:
        """`attention`: the first pass ends before the prompt's last token; there the question's mass per document
        is read, the budget spent (document_repair.py) and computing resumes at the first newly repaired token."""
        part = lease.parts.get(self.name)
        if part is None or part.question is None:
            return computed, 0
        if computed < part.question.end:
            return computed, part.question.end
        reading = self.meter.read(part.question.watch)  # type: ignore[union-attr]
        self.metrics[schema.DOCUMENT_ATTENTION_PASSES] += reading.rows > 0
        hits = chosen_repairs(reading, part.hits, self.budget)
        lease.parts[self.name] = replace(part, hits=hits, question=None)
        resume = computed
        for old, new in zip(part.hits, hits, strict=True):
            if new.repair > old.repair:
                extra = new.repair - old.repair
                self.metrics[schema.DOCUMENT_ATTENTION_REPAIRED_TOKENS] += extra
                self.metrics[schema.DOCUMENT_REPAIRED_TOKENS] += extra
                self.metrics[schema.DOCUMENT_REUSED_TOKENS] -= extra
                resume = min(resume, old.start + old.repair)
        return resume, 0

    @property
    def _capacity_tokens(self) -> int:
        return self.pool.capacity * self.tokens_per_page

    def stored(self, key: bytes) -> bool:
        return key in self._by_key

    # --- lookup -------------------------------------------------------------------------------------

    def find_longest_hit(self, lookup: Lookup, agreed: ReusePlan) -> ReusePlan:
        """A standalone prefill reserves slots for its stored form; any other request gets a hit per stored
        document placed after the exact prefix the types before agreed on. Pages and reuse point stay as agreed:
        document hits are not a prefix."""
        tokens, T = lookup.tokens, self.tokens_per_page
        documents = documents_of(lookup.inputs)
        if documents.produces:
            key = document_key(tokens, lookup.extras, self.chain_root)
            slots = pages_for(len(tokens), T)
            if len(tokens) < MIN_DOCUMENT_TOKENS or key in self._by_key or slots > self.pool.capacity \
                    or lookup.extras.adapter_start:
                return agreed
            return agreed.with_part(self.name, DocumentPart(produces=key, tokens=tuple(tokens.tolist())))
        hits = []
        # After the agreed hit's last page: a partial-KV snapshot hit is restored over its whole page, after this
        # type's copies, so a document starting inside that page is computed.
        after = pages_for(agreed.reuse_tokens, T) * T
        for key, start, length in self.eligible(tokens, documents.spans, lookup.extras, after):
            record = self._by_key.get(key)
            if record is None:
                continue
            stored: StoredDocument = record.parts[self.name]
            if list(stored.tokens) != tokens[start:start + length].tolist():
                continue  # a hash collision: compute it
            repair = {REPAIR_NONE: 0, REPAIR_FULL: length}.get(self.repair, min(T, length))
            hits.append(DocumentHit(start, length, repair, record.record_id, stored.slots))
        if hits and self.repair == REPAIR_OVERLAP:
            hits = closest_to_question(hits, tokens, documents.spans)
        return agreed.with_part(self.name, DocumentPart(hits=tuple(hits))) if hits else agreed

    def keeps_tail_of(self, lease: Lease) -> bool:
        """A standalone prefill of a document shorter than a page publishes its one partial page: that is the
        stored form (the record has no full page; its tail key makes it one of its own)."""
        part = self._producer(lease)
        return part is not None and part.length < self.tokens_per_page

    def waits_for(self, lookup: Lookup) -> bool:
        """A request whose document is being produced waits for it (then restores it instead of computing it)."""
        documents = documents_of(lookup.inputs)
        if not self._producing or documents.produces:
            return False
        return any(key in self._producing for key, _, _ in self.eligible(lookup.tokens, documents.spans,
                                                                          lookup.extras))

    def in_flight_pages(self) -> Mapping[bytes, Lease]:
        return MappingProxyType(self._producing)

    def hit_slots(self, plan: ReusePlan) -> tuple[int, ...]:
        part = plan.parts.get(self.name)
        return () if part is None else tuple(s for hit in part.hits if hit.reused_tokens for s in hit.slots)

    # --- a lease's part ------------------------------------------------------------------------------

    def admission_slots(self, plan: ReusePlan, inputs: Inputs) -> int:
        part = plan.parts.get(self.name)
        return pages_for(part.length, self.tokens_per_page) if part is not None and part.produces else 0

    def admit(self, lease: Lease, plan: ReusePlan, inputs: Inputs, slots: list[int]) -> None:
        """A producer keeps its reserved slots; a request with hits gets its documents copied into its global pages
        now (allocated: the attention type admitted first); the hits' slots stay pinned until every other page
        group has their rows too (`on_grown`)."""
        part = plan.parts.get(self.name)
        if part is None:
            return
        if part.produces:
            lease.parts[self.name] = DocumentPart(produces=part.produces, tokens=part.tokens, slots=tuple(slots))
            return
        lease.parts[self.name] = part
        for hit in part.hits:
            self.metrics[schema.DOCUMENT_HITS] += 1
            self.metrics[schema.DOCUMENT_REPAIRED_TOKENS] += hit.repair
            self.metrics[schema.DOCUMENT_REUSED_TOKENS] += hit.reused_tokens
            if self.records.get(hit.record_id) is not None:  # (its eviction for this admission's pages is allowed)
                self.records.touch(hit.record_id)  # a reused document stays resident longest
            if not hit.reused_tokens:
                continue
            if self.copier is not None:
                self.copier.restore(list(hit.slots), lease.page_ids, hit.start, hit.repair, hit.length)
            self.metrics[schema.DOCUMENT_ROTATED_PAGES] += pages_for(hit.reused_tokens, self.tokens_per_page)
            lease.exact_tokens = min(lease.exact_tokens, hit.restored[0])
        lease.parts[self.name] = replace(part, slots=self.hit_slots(plan))  # pinned by _try_acquire

    def on_admitted(self, lease: Lease, admission: Admission, num_tokens: int) -> None:
        part = lease.parts.get(self.name)
        if part is not None and part.hits:
            # The global rows were copied in `admit`; each other page group's rows go into its pages once it has
            # them: those the admission gave it now, the rest as the row grows (every type has admitted by now).
            T = self.tokens_per_page
            pages = {page for hit in part.hits if hit.reused_tokens
                     for page in range(hit.restored[0] // T, pages_for(hit.restored[1], T))}
            groups = self.group_tables(lease) if self.copier is not None else {}
            lease.parts[self.name] = replace(part, waiting={group: set(pages) for group in groups})
            self.on_grown(lease)
            part = lease.parts[self.name]  # on_grown may have unpinned the hits' slots: never keep a stale part
        if part is not None and part.produces:
            self._producing.setdefault(part.produces, lease)
        elif not (documents := documents_of(admission.inputs)).produces:
            # Every document item counts as seen; those that cannot be reused count by reason, once per request.
            self.metrics[schema.DOCUMENTS_SEEN] += len(documents.spans) + len(documents.skipped)
            reasons = [*documents.skipped, *(self.skip_reason(len(admission.token_ids), start, length, admission.extras)
                                            for start, length in documents.spans)]
            for reason in filter(None, reasons):
                self.metrics[schema.DOCUMENTS_SKIPPED[reason]] += 1
            if part is not None and part.reused_tokens and self.repair == REPAIR_ATTENTION:
                # The question: the prompt after its last document (as `overlap` reads it).
                question = max(start + length for start, length in documents.spans)
                watched = start_pass(self.meter, lease.page_ids, self.tokens_per_page, question, num_tokens)
                if watched is not None:
                    lease.parts[self.name] = replace(part, question=watched)

    def on_grown(self, lease: Lease) -> None:
        """Restored rows whose pages another group (a window group) just gave the lease are copied into them now,
        before the call that reads them. A group's table reaches the row's extent: a page inside it without a slot
        (negative) fell behind the row's window, is never read and is never copied. Once no page waits, the hits'
        slots are unpinned (the record alone keeps them)."""
        part = lease.parts.get(self.name)
        if part is None or part.produces or not part.slots:
            return
        for group, table in self.group_tables(lease).items():
            waiting = part.waiting.get(group, set())
            ready = {page for page in waiting if page < len(table) and table[page] >= 0}
            waiting.difference_update({page for page in waiting if page < len(table)})
            if ready and self.copier is not None:
                only = [slot if page in ready else -1 for page, slot in enumerate(table)]
                for hit in part.hits:
                    if hit.reused_tokens:
                        self.copier.restore(list(hit.slots), only, hit.start, hit.repair, hit.length, group)
        if not any(part.waiting.values()):
            self.pool.unpin(part.slots)
            lease.parts[self.name] = replace(part, slots=())

    def pinned(self, lease: Lease) -> tuple[int, ...]:
        part = lease.parts.get(self.name)
        return () if part is None else part.slots

    def release(self, lease: Lease) -> None:
        part = lease.parts.get(self.name)
        if part is not None and part.question is not None:
            self.meter.read(part.question.watch)  # type: ignore[union-attr]  # disarmed: its pages go back
        if part is None:
            return
        if part.produces and self._producing.get(part.produces) is lease:
            del self._producing[part.produces]
        self.pool.unpin(part.slots)  # a captured stored form stays with its record's cache reference

    # --- publication: a standalone prefill's prompt becomes the stored form ---------------------------

    def _producer(self, lease: Lease) -> DocumentPart | None:
        part = lease.parts.get(self.name)
        return part if part is not None and part.produces and part.slots else None

    def capture(self, lease: Lease, publication: Publication) -> bool:
        part = self._producer(lease)
        if part is None or len(publication.tokens) != part.length:  # only the whole document at once
            return False
        publication.parts[self.name] = self._store(lease, part)
        return True

    def upgrade(self, existing: Record, lease: Lease) -> Record | None:
        """The document's full pages were a record already (its pages loaded from a shared tier, or a prompt that
        began with them), so publishing the standalone prefill found that record: it takes the stored form too.
        The producer publishes only once its whole prompt, the document, is computed."""
        part = self._producer(lease)
        if part is None or self.name in existing.parts or self._by_key.get(part.produces) is not None \
                or part.tokens[:len(existing.token_ids)] != existing.token_ids:
            return None
        return existing.with_part(self.name, self._store(lease, part))

    def _store(self, lease: Lease, part: DocumentPart) -> StoredDocument:
        if self.copier is not None:
            self.copier.capture(lease.page_ids[:len(part.slots)], list(part.slots), self.group_tables(lease))
        self.metrics[schema.DOCUMENTS_PRODUCED] += 1
        return StoredDocument(part.produces, part.tokens, part.slots)

    def held(self, record: Record) -> tuple[int, ...]:
        stored = record.parts.get(self.name)
        return () if stored is None else stored.slots

    def on_commit(self, record: Record) -> None:
        stored = record.parts.get(self.name)
        if stored is not None:
            self._by_key[stored.key] = record
            self._producing.pop(stored.key, None)  # requests waiting for it may restore it now

    def on_evict(self, record: Record) -> None:
        stored = record.parts.get(self.name)
        if stored is not None and self._by_key.get(stored.key) is record:
            del self._by_key[stored.key]

    def counters(self) -> dict[str, int]:
        return self.metrics

    def audit(self, records: Sequence[Record], leases: Iterable[Lease]) -> None:
        for record in records:
            stored = record.parts.get(self.name)
            if stored is None:
                continue
            assert self._by_key.get(stored.key) is record, "a stored document lookups cannot find"
            assert len(stored.slots) == pages_for(len(stored.tokens), self.tokens_per_page)
        assert all(self.records.get(record.record_id) is record for record in self._by_key.values()), \
            "a stored document of an evicted record"

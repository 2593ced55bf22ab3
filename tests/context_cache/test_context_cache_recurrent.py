"""The context cache on hybrid and pure recurrent deployments, no model: exact-checkpoint plans, capture, eviction.

A fake snapshot store stands in for the engine: a "recurrent state" is the tuple of tokens a lease has computed
(what a real recurrence is a function of), and a "KV page" is the tuple of token ids written into it. A restore
is correct exactly when the restored state equals the input's prefix of `reuse_tokens` tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.profile_schema import PLAN_NO_REUSABLE_PREFIX, PLAN_STANDARD
from kvforge.runtime.context_cache.keys import KeyExtras, MediaKey
from kvforge.runtime.context_cache.manager import Admission, ContextCacheManager, Deployment, Lease
from kvforge.runtime.context_cache.protocol import PublishResult
from kvforge.runtime.context_cache.types.partial_tails import partial_slot, restore_slot, restore_tokens
from kvforge.runtime.context_cache.types.recurrent_checkpoints import recurrent_slot, restore_recurrent_slot
from kvforge.runtime.types import LookupPolicy

T = 4  # tokens per page
HYBRID, PURE = Deployment.HYBRID, Deployment.PURE_RECURRENT


def tokens(n: int, offset: int = 0) -> list[int]:
    return list(range(offset, offset + n))


class FakeStates:
    """The engine's side: per-lease computed tokens, KV pages holding token ids, and both snapshot stores."""

    def __init__(self) -> None:
        self.manager: ContextCacheManager  # set once the manager built with this copier exists
        self.computed: dict[int, tuple[int, ...]] = {}  # id(lease) -> tokens its state has consumed
        self.pages: dict[int, tuple[int, ...]] = {}
        self.recurrent: dict[int, tuple[int, ...]] = {}
        self.partial: dict[int, tuple[int, ...]] = {}
        self.calls: list[tuple[str, int]] = []

    def capture_recurrent(self, lease: Lease, slot: int) -> None:
        self.recurrent[slot] = self.computed[id(lease)]
        self.calls.append(("recurrent", slot))

    def capture_partial(self, page: int, slot: int) -> None:
        self.partial[slot] = self.pages[page]
        self.calls.append(("partial", slot))

    def admit(self, ids: list[int], salt: str | None = None, adapter: bytes = b"",
              media: tuple[MediaKey, ...] = ()) -> Lease:
        """Acquire and restore as the engine would; asserts the restored state is this input's exact prefix."""
        lease = self.manager.try_acquire(Admission(ids, KeyExtras(adapter, salt, media)))
        assert lease is not None
        n, m = lease.reuse_tokens, self.manager
        assert n < len(ids), "at least one token must compute (its logits give the next token)"
        if restore_recurrent_slot(lease) is None:
            assert n == 0, "reuse without a recurrent snapshot would resume from a zero state"
            state: tuple[int, ...] = ()
        else:
            state = self.recurrent[restore_recurrent_slot(lease)]
        assert state == tuple(ids[:n])
        if m.paged:
            assert len(lease.page_ids) == -(-len(ids) // T)
            for i in range(n // T):
                assert self.pages[lease.page_ids[i]] == tuple(ids[i * T:(i + 1) * T])
            if n % T:
                assert restore_slot(lease) is not None and restore_tokens(lease) == n % T
                self.pages[lease.page_ids[n // T]] = self.partial[restore_slot(lease)]
        else:
            assert lease.page_ids == [] and restore_slot(lease) is None
        self.computed[id(lease)] = state
        m.check_invariants()
        m.finish_restore(lease)
        return lease

    def compute(self, lease: Lease, ids: list[int], upto: int) -> None:
        """Run the lease's tokens up to `upto`: its state and its own pages now hold them."""
        assert self.manager.try_grow(lease, upto)
        self.computed[id(lease)] = tuple(ids[:upto])
        if self.manager.paged:
            for i in range(-(-upto // T)):
                self.pages[lease.page_ids[i]] = tuple(ids[i * T:min((i + 1) * T, upto)])

    def run(self, ids: list[int], *, at: tuple[int, ...] = (), salt: str | None = None, adapter: bytes = b"",
            media: tuple[MediaKey, ...] = ()) -> tuple[Lease, list[PublishResult]]:
        """One request: admit, compute to each boundary in `at` publishing a checkpoint there, then the end."""
        lease = self.admit(ids, salt, adapter, media)
        outcomes = []
        for length in [*at, len(ids)]:
            if length > lease.reuse_tokens:
                self.compute(lease, ids, length)
                outcomes.append(self.manager.publish(lease, ids[:length], boundary=length != len(ids)))
                self.manager.check_invariants()
        self.manager.release(lease)
        self.manager.check_invariants()
        return lease, outcomes


def manager(deployment: Deployment, recurrent: int = 8, partial: int = 8, num_pages: int = 32,
            max_records: int = 1024) -> tuple[ContextCacheManager, FakeStates]:
    fake = FakeStates()
    fake.manager = m = ContextCacheManager(num_pages if deployment is HYBRID else 0, T, enabled=True,
                                           max_records=max_records, partial_kv_snapshot_slots=partial,
                                           recurrent_snapshot_slots=recurrent, deployment=deployment, copier=fake)
    return m, fake


both = pytest.mark.parametrize("deployment", [HYBRID, PURE])


# --- plans ------------------------------------------------------------------------------------------

@both
def test_mid_prefill_checkpoints_and_the_longest_exact_one_wins(deployment: Deployment) -> None:
    m, fake = manager(deployment)
    _, outcomes = fake.run(tokens(12), at=(3, 6, 8))  # four captures at growing lengths on one lease
    assert outcomes == [PublishResult.COMMITTED] * 4 and len(m.records) == 4
    assert m.metrics.boundary_captures == 3 and m.metrics.endpoint_captures == 1
    assert fake.admit(tokens(12) + [99]).reuse_tokens == 12
    assert fake.admit(tokens(12)).reuse_tokens == 8  # the whole input never: one token must compute
    assert fake.admit(tokens(10) + [99]).reuse_tokens == 8
    assert fake.admit(tokens(7) + [99, 98]).reuse_tokens == 6
    assert fake.admit(tokens(5) + [99]).reuse_tokens == 3
    assert fake.admit(tokens(2) + [99]).reuse_tokens == 0  # no checkpoint that short
    profile = m.profile()
    assert profile["hybrid"] == {"restores": 5, "snapshot_pressure_skips": 0, "capture_synchronizations": 4}
    assert profile["plans"] == {PLAN_STANDARD: 5, PLAN_NO_REUSABLE_PREFIX: 2, "full_input_rewind": 0}
    assert profile["resource_pools"]["recurrent_snapshots"] == {"free": 4, "capacity": 8}


def test_the_checkpoint_an_admission_resumes_from_is_never_its_own_eviction_victim() -> None:
    """Evicting for the admission's new pages walks records LRU first; the checkpoint it resumes from (pinned, so
    evicting it frees nothing) must stay: the admission touches it, and a later turn needs it."""
    m, fake = manager(HYBRID, num_pages=6)
    fake.run(tokens(10))  # A: two full pages and a checkpoint at 10, the least recently used record
    fake.run(tokens(8, offset=100))  # B: two more pages; 2 of 6 pages free
    lease = fake.admit(tokens(10) + [99] * 11)  # 6 pages: A's 2 hits + 4 new, so B must go and A must stay
    assert lease.reuse_tokens == 10 and m.metrics.records_evicted == 1 and len(m.records) == 1
    m.release(lease)
    assert fake.admit(tokens(10) + [98]).reuse_tokens == 10


def test_hybrid_never_uses_a_base_only_page_hit() -> None:
    m, fake = manager(HYBRID)
    fake.run(tokens(10))  # pages 0 and 1 are indexed, but the only checkpoint is at 10
    lease = fake.admit(tokens(8) + [99, 98])  # shares two full pages, diverges inside the third
    assert (lease.reuse_tokens, restore_recurrent_slot(lease), lease.plan_kind) == (0, None, PLAN_NO_REUSABLE_PREFIX)
    vanilla = ContextCacheManager(32, T, enabled=True)  # the same pages would be a hit for an attention-only model
    first = vanilla.try_acquire(Admission(tokens(10)))
    assert first is not None and vanilla.publish(first, tokens(10)) == PublishResult.COMMITTED
    again = vanilla.try_acquire(Admission(tokens(8) + [99, 98]))
    assert again is not None and again.reuse_tokens == 8 and restore_recurrent_slot(again) is None


def test_hybrid_checkpoint_holds_a_partial_snapshot_iff_unaligned() -> None:
    m, fake = manager(HYBRID)
    fake.run(tokens(11), at=(6, 8))
    by_length = {len(r.token_ids): r for r in m.records.least_recent_first()}
    assert partial_slot(by_length[8]) is None and recurrent_slot(by_length[8]) is not None
    assert partial_slot(by_length[6]) is not None and partial_slot(by_length[11]) is not None
    assert fake.partial[partial_slot(by_length[6])] == (4, 5)  # the tail page's two valid tokens
    lease = fake.admit(tokens(6) + [99])
    assert (lease.reuse_tokens, restore_tokens(lease)) == (6, 2)
    assert lease.page_ids[0] == by_length[6].page_ids[0] and lease.page_ids[1] not in by_length[6].page_ids
    aligned = fake.admit(tokens(8) + [99])
    assert (aligned.reuse_tokens, restore_slot(aligned), restore_tokens(aligned)) == (8, None, 0)


@both
def test_adapter_and_salt_isolate_checkpoints(deployment: Deployment) -> None:
    m, fake = manager(deployment)
    fake.run(tokens(6))
    fake.run(tokens(6), salt="tenant")
    fake.run(tokens(6), adapter=b"lora-a")
    assert len(m.records) == 3  # same tokens, three identities
    assert fake.admit(tokens(6) + [9]).reuse_tokens == 6
    assert fake.admit(tokens(6) + [9], salt="other").reuse_tokens == 0
    assert fake.admit(tokens(6) + [9], adapter=b"lora-b").reuse_tokens == 0
    for salt, adapter in (("tenant", b""), (None, b"lora-a")):
        assert fake.admit(tokens(6) + [9], salt=salt, adapter=adapter).reuse_tokens == 6
        *_, record = m.records.least_recent_first()  # the checkpoint it resumed from was touched last
        assert (record.extras.cache_salt, record.extras.adapter_digest) == (salt, adapter)


@both
def test_no_resume_inside_a_media_span(deployment: Deployment) -> None:
    m, fake = manager(deployment)
    image = (MediaKey(2, 6, b"pixels"),)
    fake.run(tokens(10), at=(5, 8), media=image)
    assert fake.admit(tokens(10) + [1], media=image).reuse_tokens == 10
    assert fake.admit(tokens(9), media=image).reuse_tokens == 8  # the span ends at 8
    assert fake.admit(tokens(7), media=image).reuse_tokens == 0  # 5 falls inside the span
    assert fake.admit(tokens(10) + [1], media=(MediaKey(2, 6, b"other"),)).reuse_tokens == 0


@both
def test_publishing_the_same_checkpoint_twice_touches_it_without_a_capture(deployment: Deployment) -> None:
    m, fake = manager(deployment)
    fake.run(tokens(6))
    calls = len(fake.calls)
    lease = fake.admit(tokens(6))  # resumes from nothing shorter: computes all 6 again
    assert lease.reuse_tokens == 0
    fake.compute(lease, tokens(6), 6)
    assert m.publish(lease, tokens(6)) == PublishResult.EXISTING and len(fake.calls) == calls
    m.release(lease)
    assert m.metrics.publications_existing == 1
    m.check_invariants()


def test_bypass_and_disabled_never_look_up_or_capture() -> None:
    m, fake = manager(PURE)
    fake.run(tokens(6))
    lease = m.try_acquire(Admission(tokens(6) + [1], lookup_policy=LookupPolicy.BYPASS))
    assert lease is not None and lease.reuse_tokens == 0 and m.publish(lease, tokens(6) + [1]) == PublishResult.SKIPPED
    m.release(lease)
    off = ContextCacheManager(0, T, enabled=False, deployment=PURE)
    assert off.recurrent_snapshots.capacity == 0 and off.fits_alone(10**6)
    lease = off.try_acquire(Admission(tokens(6)))
    assert lease is not None and lease.page_ids == [] and off.publish(lease, tokens(6)) == PublishResult.SKIPPED
    off.release(lease)
    off.check_invariants()


# --- pure recurrent: no pages -----------------------------------------------------------------------

def test_pure_recurrent_leases_hold_no_pages_and_always_fit() -> None:
    m, fake = manager(PURE)
    assert m.pages.capacity == 0 and m.fits_alone(10**6) and m.partial_snapshots.capacity == 0
    lease = fake.admit(tokens(50))
    assert lease.page_ids == [] and m.try_grow(lease, 10**6) and lease.page_ids == []
    m.index_computed(lease, tokens(50), 50)
    assert len(m.index) == 0 and not m.prefix_in_flight(Admission(tokens(50)))
    fake.compute(lease, tokens(50), 50)
    assert m.publish(lease, tokens(50)) == PublishResult.COMMITTED
    record = next(m.records.least_recent_first())
    assert record.page_ids == () and len(record.keys) == 12 and partial_slot(record) is None  # keys of 12 blocks
    m.release(lease)
    m.check_invariants()


# --- budgets, pressure and eviction -----------------------------------------------------------------

def test_budgets_that_hold_no_slot_are_rejected_and_pure_recurrent_ignores_a_page_count() -> None:
    with pytest.raises(InvalidConfig, match="recurrent") as error:
        ContextCacheManager(0, T, enabled=True, deployment=PURE)
    assert error.value.field == "context_cache_recurrent_snapshot_pool_bytes"
    with pytest.raises(InvalidConfig) as error:
        ContextCacheManager(8, T, enabled=True, recurrent_snapshot_slots=1, deployment=HYBRID)
    assert error.value.field == "context_cache_partial_kv_snapshot_pool_bytes"
    pure = ContextCacheManager(8, T, enabled=True, recurrent_snapshot_slots=1, deployment=PURE)  # the build's pool size
    assert pure.pages.capacity == 0 and pure.fits_alone(10**6)
    assert ContextCacheManager(8, T, enabled=False, deployment=HYBRID).recurrent_snapshots.capacity == 0


@both
def test_capture_with_every_slot_pinned_is_skipped_and_counted(deployment: Deployment) -> None:
    m, fake = manager(deployment, recurrent=1, partial=1)
    fake.run(tokens(6))
    pending = m.try_acquire(Admission(tokens(6) + [7]))  # restores the only slot: pinned until finish_restore
    assert pending is not None and restore_recurrent_slot(pending) is not None
    other = fake.admit(tokens(5, 100))
    fake.compute(other, tokens(5, 100), 5)
    assert m.publish(other, tokens(5, 100)) == PublishResult.SKIPPED  # never an error
    m.release(other)
    assert m.profile()["hybrid"]["snapshot_pressure_skips"] == 1 and len(m.records) == 1
    m.check_invariants()
    m.finish_restore(pending)
    m.release(pending)
    _, outcomes = fake.run(tokens(5, 100))  # the slot is evictable again
    assert outcomes == [PublishResult.COMMITTED] and len(m.records) == 1
    assert m.profile()["reclaimed_resources"]["recurrent_snapshots"] == 1


def test_hybrid_unaligned_capture_needs_a_partial_slot_but_aligned_does_not() -> None:
    m, fake = manager(HYBRID, recurrent=4, partial=1)
    fake.run(tokens(6))  # holds the only partial slot
    pending = m.try_acquire(Admission(tokens(6) + [7]))  # pins it
    assert pending is not None and restore_slot(pending) is not None
    _, unaligned = fake.run(tokens(6, 100))
    _, aligned = fake.run(tokens(8, 200))
    assert (unaligned, aligned) == ([PublishResult.SKIPPED], [PublishResult.COMMITTED])
    assert m.metrics.snapshot_pressure_skips == 1
    assert m.recurrent_snapshots.num_free == 2  # the skipped capture returned the recurrent slot it reserved
    m.release(pending)  # aborted before it ran: both restores unpinned, nothing counted
    assert m.metrics.restores == 0
    m.check_invariants()


@both
def test_eviction_frees_snapshot_slots_with_their_record(deployment: Deployment) -> None:
    m, fake = manager(deployment, recurrent=2, partial=2)
    for offset in (0, 100, 200):
        fake.run(tokens(6, offset))
    assert {r.token_ids[0] for r in m.records.least_recent_first()} == {100, 200}
    profile = m.profile()
    assert profile["resource_pools"]["recurrent_snapshots"] == {"free": 0, "capacity": 2}
    assert profile["reclaimed_resources"]["recurrent_snapshots"] == 1
    if deployment is HYBRID:  # the evicted record's partial slot and its one full page went with it
        assert profile["reclaimed_resources"]["partial_kv_snapshots"] == 1
        assert profile["reclaimed_resources"]["base_kv_pages"] == 1
        assert profile["resource_pools"]["partial_kv_snapshots"] == {"free": 0, "capacity": 2}
    assert fake.admit(tokens(6, 100) + [1]).reuse_tokens == 6
    assert fake.admit(tokens(6, 0) + [1]).reuse_tokens == 0


@both
def test_record_limit_evicts_checkpoints_and_their_slots(deployment: Deployment) -> None:
    m, fake = manager(deployment, max_records=1)
    fake.run(tokens(10), at=(5,))
    assert len(m.records) == 1 and m.recurrent_snapshots.num_free == 7
    assert fake.admit(tokens(10) + [1]).reuse_tokens == 10
    m0, fake0 = manager(deployment, max_records=0)
    assert fake0.run(tokens(6))[1] == [PublishResult.COMMITTED]  # committed, then evicted at once
    assert len(m0.records) == 0 and m0.recurrent_snapshots.num_free == 8
    assert m0.partial_snapshots.num_free == m0.partial_snapshots.capacity


@both
def test_one_slot_budgets_carry_a_chat_turn_by_turn(deployment: Deployment) -> None:
    """Every turn resumes from the previous turn's end and replaces it: one slot of each kind is enough."""
    m, fake = manager(deployment, recurrent=1, partial=1, num_pages=16)
    chat = tokens(5)
    fake.run(chat)
    for turn in range(1, 6):
        chat = chat + tokens(3 + turn, 100 * turn)
        lease, outcomes = fake.run(chat)
        assert lease.reuse_tokens == len(chat) - 3 - turn and outcomes == [PublishResult.COMMITTED]
        assert len(m.records) == 1
    assert m.metrics.restores == 5 and m.metrics.snapshot_pressure_skips == 0


def test_hybrid_checkpoint_projects_onto_the_canonical_pages() -> None:
    m, fake = manager(HYBRID)
    a = fake.admit(tokens(10))
    b = fake.admit(tokens(9))  # concurrent: computes the same first two pages on its own pages
    fake.compute(a, tokens(10), 10)
    fake.compute(b, tokens(9), 9)
    assert m.publish(a, tokens(10)) == PublishResult.COMMITTED and m.publish(b, tokens(9)) == PublishResult.COMMITTED
    rec_a, rec_b = sorted(m.records.least_recent_first(), key=lambda r: len(r.token_ids), reverse=True)
    assert rec_b.page_ids == rec_a.page_ids == tuple(a.page_ids[:2])  # first committer's pages
    assert fake.partial[partial_slot(rec_b)] == (8,)  # captured from b's own tail page
    m.release(a)
    m.release(b)
    m.check_invariants()
    assert m.pages.num_free == 30  # a's two full pages stay for both records; every other page is free
    assert fake.admit(tokens(9) + [5]).reuse_tokens == 9


@both
def test_decode_end_checkpoint_serves_the_next_turn(deployment: Deployment) -> None:
    m, fake = manager(deployment)
    prompt, answer = tokens(7), [50, 51, 52]
    lease = fake.admit(prompt)
    fake.compute(lease, prompt, 7)
    assert m.publish(lease, prompt) == PublishResult.COMMITTED  # prefill end
    fake.compute(lease, prompt + answer, 9)  # decode: the last sampled token is not computed yet
    assert m.publish(lease, (prompt + answer)[:9]) == PublishResult.COMMITTED  # decode end (including generated tokens)
    m.release(lease)
    assert fake.admit(prompt + answer + [60, 61]).reuse_tokens == 9


def test_vanilla_records_hold_no_recurrent_slot() -> None:
    m = ContextCacheManager(8, T, enabled=True, recurrent_snapshot_slots=4)
    assert m.recurrent_snapshots.capacity == 0 and m.deployment is Deployment.VANILLA and not m.checkpoints
    lease = m.try_acquire(Admission(tokens(9)))
    assert lease is not None and m.publish(lease, np.asarray(tokens(9))) == PublishResult.COMMITTED
    assert recurrent_slot(next(m.records.least_recent_first())) is None
    m.release(lease)
    m.check_invariants()

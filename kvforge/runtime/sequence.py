"""One request in flight: its tokens, how many have K/V in the pool, its lease and what it generated.

A sequence has no prefill or decode phase. It holds `num_tokens` tokens (prompt + generated) and
`num_computed_tokens` of them have K/V in the pool; each step computes some of the difference, and when
the two meet the step's logits give the next token. A decode step is the case where the difference
is the one token sampled last; a preempted sequence starts again from its reuse point.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from kvforge.contract.lora import NEVER_ACTIVATED
from kvforge.runtime.adapters import NOT_INVOKED, LoraAdapter, activation_start
from kvforge.runtime.context_cache.keys import KeyExtras
from kvforge.runtime.context_cache.lease import Admission, Inputs, Lease
from kvforge.runtime.context_cache.types.document_inputs import document_input
from kvforge.runtime.context_cache.types.draft_paths import speculative_input
from kvforge.runtime.media_spans import DocumentSpan, MediaSpan
from kvforge.runtime.sampling.grammar import CompiledGrammar
from kvforge.runtime.sampling.sampler import Sampler, SampleResult
from kvforge.runtime.types import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE = "waiting_for_remote"  # admitted: its pages are being filled from a shared tier
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, Enum):
    EOS = "end-of-sequence"
    LENGTH = "max-length"
    STOP = "stop-words"
    ABORTED = "aborted"
    ERROR = "error"  # this row failed inside a step (Sequence.error says why); the other rows went on


@dataclass(slots=True)
class EngineRequest:
    """A request ready for the engine: token ids checked against its limits, adapter resolved."""

    prompt_ids: list[int]
    sampling: SamplingParams
    adapter: LoraAdapter | None = None
    cache_salt: str | None = None
    system_prompt_ids: list[int] = field(default_factory=list)  # legacy save_system_prompt_kv_cache
    system_prompt_key: tuple[str, str] | None = None
    media: tuple[MediaSpan, ...] = ()  # placeholder spans with their encoder rows, in prompt order
    message_boundaries: tuple[int, ...] = ()  # prompt token counts where an earlier chat message ends
    documents: tuple[DocumentSpan, ...] = ()  # the prompt's document items whose tokens could be told apart, in order
    documents_skipped: tuple[str, ...] = ()  # why each other document item has no span (profile_schema.SKIP_REASONS)
    # An internal request the scheduler queued: a document's standalone prefill at position 0, whose published
    # prompt becomes the document's stored form (kvforge/runtime/context_cache/types/document_chunks.py). Never a
    # front end's.
    produces_document: bool = False
    # Activated LoRA: the first adapted position, found from the adapter and the prompt when the request is made
    # (kvforge/runtime/adapters.py activation_start), so every front end and API caller gets PEFT's rule; 0 = every one.
    adapter_start: int = -1
    # The response_format's compiled grammar (kvforge/runtime/sampling/grammar.py), when compiled before the request
    # reached the engine (llm_serve compiles off the engine thread); None: add_request compiles it, through the cache.
    grammar: CompiledGrammar | None = None
    # Inputs to cache types beyond the fields above, by type name (a request a type queued for itself carries what
    # that type gave it: kvforge/runtime/context_cache/lease.py Prerequisite). Never a front end's.
    cache_inputs: Inputs = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.adapter_start < 0:
            self.adapter_start = activation_start(self.adapter, self.prompt_ids)


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    request: EngineRequest
    sampler: Sampler
    arrival: int  # admission order: FCFS, and the newest running sequence is preempted first
    status: Status = Status.WAITING
    lease: Lease | None = None
    num_computed_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens served from a cache at the first admission
    # The spans requests queued for this one produce (its cache types' prerequisites: documents' standalone
    # prefills), by their end: restoring them counts as cached only as far as that request found its tokens in a
    # cache (a shared tier's pages); the rest was computed for this request (issue 52 item 3).
    produced_for: dict[int, Sequence] = field(default_factory=dict)
    num_preemptions: int = 0
    output_ids: list[int] = field(default_factory=list)
    samples: list[SampleResult] = field(default_factory=list)
    output_text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None  # why a step failed this sequence alone (finish_reason ERROR)
    admission: Admission | None = None  # kept across retries so page keys are hashed once
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    checkpoints: tuple[int, ...] = ()  # sorted prompt positions where a recurrent state is captured mid-prefill
    spec_token_ids: list[int] = field(default_factory=list)  # a drafter's proposal for the next step, not yet verified
    # A tree proposal: spec_parents[i] is the index of draft i's parent among spec_token_ids (-1: the pending token),
    # parents before children; empty = a chain (draft i follows draft i - 1).
    spec_parents: list[int] = field(default_factory=list)
    # A sequence whose draft owns K/V (the speculation table's "own pool" rows): its admissions take draft pages (and
    # reuse only coherent draft paths).
    drafts_with_kv: bool = False
    # A request the scheduler queued itself because a cache type needs it first (a document's standalone prefill):
    # its output goes to no front end.
    internal: bool = False

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the engine before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    def tokens_to_next_checkpoint(self) -> int:
        """Tokens from the computed ones to the next checkpoint (a large number when none is left)."""
        for position in self.checkpoints:
            if position > self.num_computed_tokens:
                return position - self.num_computed_tokens
        return 1 << 62

    @property
    def is_prefilling(self) -> bool:
        """Computes more than the one token sampled last (a verify row's drafts do not make it a prefill)."""
        return self.num_pending_tokens > 1 or not self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def adapter_label(self) -> str:
        if self.request.adapter is None:
            return "base"
        # An activated LoRA whose invocation is absent ran as the base model (PEFT's rule): the label says so.
        return self.request.adapter.name + (NOT_INVOKED if self.request.adapter_start == NEVER_ACTIVATED else "")

    def all_token_ids(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    def resident_token_ids(self) -> list[int]:
        """Tokens whose K/V the pool holds: the prompt and every generated token but the last sampled."""
        return self.all_token_ids()[:self.num_computed_tokens]

    def next_admission(self) -> Admission:
        """What to ask the pool for: every token so far (a preempted sequence recomputes its output too)."""
        tokens = self.all_token_ids()
        if self.admission is None or len(self.admission.token_ids) != len(tokens):
            sampling = self.request.sampling
            adapter = self.request.adapter
            corrected = adapter is not None and adapter.corrected  # keyed as base pages: see KeyExtras.corrected
            extras = KeyExtras(adapter.digest if adapter else b"", self.request.cache_salt,
                               tuple(span.key for span in self.request.media),
                               NEVER_ACTIVATED if corrected else self.request.adapter_start, corrected)
            inputs = {**speculative_input(self.drafts_with_kv),
                      **document_input(((d.start, d.length) for d in self.request.documents),
                                       self.request.produces_document, self.request.documents_skipped),
                      **self.request.cache_inputs}
            self.admission = Admission(tokens, extras, sampling.lookup_policy,
                                       indexable_tokens=len(self.request.prompt_ids), inputs=inputs)
        return self.admission

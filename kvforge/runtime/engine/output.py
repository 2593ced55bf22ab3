"""What a request produced: stop rules applied to sampled tokens, detokenized text, logprobs and timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvforge.runtime.inputs.tokenizer import ChatTokenizer
from kvforge.runtime.sampling.sampler import SampleResult
from kvforge.runtime.sequence import FinishReason, Sequence


@dataclass(slots=True)
class RequestTiming:
    ttft_ms: float  # arrival (add_request) to the first token
    prefill_ms: float  # first scheduled to the first token (time waiting for pages excluded)
    decode_ms: float  # first token to the last
    preemptions: int = 0


@dataclass(slots=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step: `new_token_ids` were sampled in that step; `text`, `logprobs` and
    `timing` are filled once `finished`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    cached_tokens: int  # prompt tokens served from a cache (the first admission's hit)
    logprobs: list[list[TopLogprob]] | None = None  # per generated token, best first (num_logprobs > 0)
    timing: RequestTiming | None = None
    adapter: str = "base"
    samples: list[SampleResult] = field(default_factory=list, repr=False)
    error: str | None = None  # finish_reason "error": why the engine failed this request alone
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # LLM.chat with tools: OpenAI tool calls


class OutputProcessor:
    """Applies end-of-sequence, stop strings, max_generate_length and the KV capacity to each sampled token."""

    __slots__ = ("tokenizer", "eos_ids", "capacity")

    def __init__(self, tokenizer: ChatTokenizer, eos_ids: frozenset[int], capacity: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.capacity = capacity

    def accept(self, seq: Sequence, sample: SampleResult) -> None:
        """Append a sampled token; set the finish reason when a rule ends the sequence."""
        seq.samples.append(sample)
        seq.output_ids.append(sample.token_id)
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        if sample.token_id in self.eos_ids:
            seq.finish_reason = FinishReason.EOS
            return
        stops = seq.request.sampling.stop
        if stops:
            text = self.tokenizer.decode(seq.output_ids)
            constraint = seq.sampler.constraint
            if constraint is None:
                hits = [i for i in (text.find(s) for s in stops) if i >= 0]
                cut = min(hits) if hits else None
            else:  # stops apply only where the grammar may end (kvforge/runtime/sampling/grammar.py)
                cut = constraint.stop_at(text, stops, lambda k: len(self.tokenizer.decode(seq.output_ids[:k])))
            if cut is not None:
                seq.output_text = text[:cut]
                seq.finish_reason = FinishReason.STOP
                return
        if len(seq.output_ids) >= seq.request.sampling.max_generate_length or seq.num_tokens > self.capacity:
            seq.finish_reason = FinishReason.LENGTH

    def output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        """The step's output for `seq`. Text and logprobs are rendered once, when it finishes; before that
        the output carries token ids only (streaming front ends detokenize incrementally)."""
        finished = seq.is_finished
        text, logprobs = "", None
        if finished:
            if seq.finish_reason is not FinishReason.STOP:
                seq.output_text = self.tokenizer.decode(seq.output_ids)
            text = seq.output_text
            if seq.request.sampling.num_logprobs > 0:
                logprobs = [[TopLogprob(token_id, self.tokenizer.token_text(token_id), logprob)
                             for token_id, logprob in s.top_logprobs] for s in seq.samples]
        return RequestOutput(seq.request_id, seq.prompt_ids, list(seq.output_ids), new_token_ids, text, finished,
                             seq.finish_reason.value if seq.finish_reason else None, seq.reused_tokens, logprobs,
                             _timing(seq) if finished else None, seq.adapter_label, seq.samples, seq.error)


def _timing(seq: Sequence) -> RequestTiming:
    end = seq.finish_time or time.perf_counter()
    first_token = seq.first_token_time or end
    scheduled = seq.first_scheduled_time or seq.arrival_time
    return RequestTiming((first_token - seq.arrival_time) * 1e3, (first_token - scheduled) * 1e3,
                         (end - first_token) * 1e3, seq.num_preemptions)

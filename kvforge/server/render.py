"""Engine outputs → OpenAI response bodies and stream chunks, and stream text that is sent only once it is final."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvforge.runtime.engine import RequestOutput, SampleResult
from kvforge.runtime.inputs.tokenizer import ChatTokenizer
from kvforge.runtime.inputs.tools import read_calls
from kvforge.server.protocol import ApiCall

# end-of-sequence and stop strings both end a completion naturally; the length limit is OpenAI's "length".
FINISH_REASONS = {"end-of-sequence": "stop", "stop-words": "stop", "max-length": "length"}
NO_LOGPROB = -9999.0  # what OpenAI reports for a token of probability 0 (JSON has no -inf)


@dataclass(slots=True)
class Renderer:
    """Bodies and chunks for one call, in the shape of its endpoint (chat.completion or text_completion)."""

    call: ApiCall
    request_id: str
    tokenizer: ChatTokenizer
    created: int = field(default_factory=lambda: int(time.time()))
    text_offset: int = 0  # completions' logprobs.text_offset runs on across chunks

    def body(self, output: RequestOutput) -> dict[str, Any]:
        """The non-streamed response."""
        choice: dict[str, Any] = {"index": 0, "logprobs": self.logprobs(output.samples)}
        if self.call.chat:
            content, calls = self.tool_calls(output)
            choice["message"] = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        else:
            calls, choice["text"] = [], output.text
        choice["finish_reason"] = "tool_calls" if calls else finish_reason(output)
        return {**self._head(""), "choices": [choice], "usage": usage(output)}

    @property
    def reads_tool_calls(self) -> bool:
        """Whether the answer may hold tool calls: then a stream sends it whole at the end, calls read."""
        return self.call.tools is not None and self.call.tools.choice != "none"

    def tool_calls(self, output: RequestOutput) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished chat answer; calls only from an answer that ended naturally."""
        if not self.reads_tool_calls or finish_reason(output) != "stop":
            return output.text, []
        assert self.call.tools is not None
        return read_calls(output.text, self.call.tools)

    def tool_chunk(self, output: RequestOutput, samples: list[SampleResult]) -> dict[str, Any]:
        """The last chunk of a streamed answer that may hold tool calls: its content and calls at once."""
        content, calls = self.tool_calls(output)
        chunk = self.chunk(content or "", samples, "tool_calls" if calls else finish_reason(output))
        if calls:
            chunk["choices"][0]["delta"]["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return chunk

    def chunk(self, text: str | None, samples: list[SampleResult], reason: str | None) -> dict[str, Any]:
        """One streamed chunk; chat's first chunk (text None) carries the assistant role."""
        choice: dict[str, Any] = {"index": 0}
        if self.call.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if text is None else (
                {"content": text} if text else {})
        else:
            choice["text"] = text or ""
        choice["logprobs"] = self.logprobs(samples) if samples else None
        choice["finish_reason"] = reason
        return {**self._head(".chunk"), "choices": [choice]}

    def usage_chunk(self, output: RequestOutput) -> dict[str, Any]:
        return {**self._head(".chunk"), "choices": [], "usage": usage(output)}

    def logprobs(self, samples: list[SampleResult]) -> dict[str, Any] | None:
        if not self.call.logprobs:
            return None
        if self.call.chat:
            return {"content": [{**self._entry(s.token_id, s.logprob),
                                 "top_logprobs": [self._entry(t, lp) for t, lp in s.top_logprobs]} for s in samples]}
        tokens = [self.tokenizer.token_text(s.token_id) for s in samples]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [_finite(s.logprob) for s in samples],
                "top_logprobs": [self._by_text(s) for s in samples] if self.call.sampling.num_logprobs else None,
                "text_offset": offsets}

    def _by_text(self, sample: SampleResult) -> dict[str, float]:
        """Completions key alternatives by text; two tokens with the same text keep the better one."""
        alternatives: dict[str, float] = {}
        for token_id, logprob in sample.top_logprobs:
            alternatives.setdefault(self.tokenizer.token_text(token_id), _finite(logprob))
        return alternatives

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.tokenizer.token_text(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}

    def _head(self, suffix: str) -> dict[str, Any]:
        kind = "chat.completion" + suffix if self.call.chat else "text_completion"  # completions: one name
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.call.model}


def usage(output: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.cached_tokens}}


def finish_reason(output: RequestOutput) -> str | None:
    return FINISH_REASONS.get(output.finish_reason or "")


class TextStreamer:
    """Streamed text that never has to be taken back: a trailing U+FFFD (an incomplete UTF-8 sequence) and a
    tail that could still grow into a stop string are held back until the next tokens settle them.

    Each step decodes only the tokens since the previous step plus that step's window (which keeps the
    tokenizer's spacing at the boundary right), so a long answer costs linear, not quadratic, decoding.
    """

    __slots__ = ("tokenizer", "stops", "shown", "pending", "prefix", "read")

    def __init__(self, tokenizer: ChatTokenizer, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.shown = ""  # text sent so far
        self.pending = ""  # decoded, but held back: it may be the start of a stop string
        self.prefix = self.read = 0  # token window [prefix, read) decoded last time

    def push(self, token_ids: list[int]) -> str:
        """The new text the tokens so far settle (often "")."""
        before = self.tokenizer.decode(token_ids[self.prefix:self.read])
        after = self.tokenizer.decode(token_ids[self.prefix:])
        if after.endswith("\ufffd") or len(after) <= len(before) or not after.startswith(before):
            return ""
        self.pending += after[len(before):]
        self.prefix, self.read = self.read, len(token_ids)
        delta = self.pending[:len(self.pending) - held_for_stop(self.pending, self.stops)]
        self.pending = self.pending[len(delta):]
        self.shown += delta
        return delta

    def finish(self, final_text: str) -> str:
        """What is left of the finished request's text (cut at its stop string by the engine)."""
        return final_text[len(self.shown):] if final_text.startswith(self.shown) else ""


def held_for_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string (such a tail never reaches
    into text already sent: it would have been held back then)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def _finite(logprob: float) -> float:
    return max(float(logprob), NO_LOGPROB)

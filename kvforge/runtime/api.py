"""The Python API: `kvforge.LLM` runs prompts or chats on an engine dir through the engine loop.

    from kvforge import LLM, SamplingParams

    llm = LLM("out/engines/smollm2")  # context reuse is on by default: enable_context_reuse=False turns it off
    params = SamplingParams(temperature=0, max_generate_length=32)
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params)
    print(out.text, out.cached_tokens)
    for delta in llm.stream("Once upon a time", params):
        print(delta.text, end="", flush=True)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvforge.contract.engine_dir import load_engine_dir
from kvforge.runtime.engine.config import EngineConfig, make_engine_config
from kvforge.runtime.engine.engine import Engine, EngineRequest, RequestOutput, snapshot_budgets
from kvforge.runtime.file_loop import drain
from kvforge.runtime.inputs.checks import parse_message
from kvforge.runtime.inputs.tools import (
    ToolSpec,
    answer_calls,
    forced_format,
    grammar_field,
    parse_tools,
    tool_messages,
    with_tools,
)
from kvforge.runtime.types import Message, Request, SamplingParams

Prompt = str | Sequence[int]
ChatMessages = Sequence[Mapping[str, Any]]


@dataclass(slots=True)
class StreamDelta:
    """One step of a streamed request: the tokens sampled in it and the text they added."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    output: RequestOutput  # the full state; text, logprobs and timing are final when finished


# Turns a MODEL that is not an engine dir (a GGUF file, an HF dir, a bundled name, an ONNX dir) into one. The runtime
# loads engine dirs only; `kvforge.LLM` (the package's front door, a front end) installs the exporter-and-builder
# resolver here (kvforge.tools.testcases.models.model_engine), which layering keeps out of the runtime's imports.
MODEL_RESOLVER: Callable[[str | Path], Path] | None = None


class LLM:
    """An engine dir loaded for generation. Every call drives the same step loop as llm_inference."""

    def __init__(self, engine_dir: str | Path, *, lora_weights: Mapping[str, str] | None = None,
                 engine: Engine | None = None, **engine_options: Any) -> None:
        """`engine_dir`: an engine dir or, through `kvforge.LLM`, a MODEL as `llm_serve MODEL` takes it (a GGUF
        file, an HF checkpoint dir, `smollm2-135m-instruct`, an ONNX dir), exported and built once into
        ~/.cache/kvforge/models. `engine_options` are EngineConfig's fields as keywords (`num_threads=2,
        enable_context_reuse=False`, ...), with its defaults but for context reuse, which is on, with the snapshot
        budgets llm_build printed for the engine (`with_build_budgets`) unless given (0 turns a pool off);
        kvforge/runtime/engine/config.py declares each with what it does. Another keyword is a TypeError, checked
        even when `engine` is given."""
        config = make_engine_config({"enable_context_reuse": True, **engine_options})
        if engine is None and MODEL_RESOLVER is not None:
            engine_dir = MODEL_RESOLVER(engine_dir)
        self.engine = engine or Engine(engine_dir, with_build_budgets(config, engine_dir, given=set(engine_options)))
        # A shared tier's worker threads hold the tier, and the tier the KV pool and the store's connections: an
        # engine with shared_cache= is only freed once closed. So an LLM closes the engine it made when it is
        # collected (or at exit) if nobody called close(); an engine the caller lent stays the caller's to close.
        self._closer = weakref.finalize(self, self.engine.close) if engine is None else None
        if lora_weights:
            self.engine.load_adapters(dict(lora_weights))

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None, *,
                 lora_name: str | None = None, cache_salt: str | None = None) -> list[RequestOutput]:
        """Complete raw prompts (text, or token-id lists) as they are, without a chat template."""
        requests = [self._raw_request(p, sampling_params, lora_name, cache_salt) for p in _as_list(prompts)]
        return self._run(requests)

    def chat(self, messages: ChatMessages | Sequence[ChatMessages], sampling_params: SamplingParams | None = None,
             *, lora_name: str | None = None, cache_salt: str | None = None,
             enable_thinking: bool = False, parse_special_tokens: bool = False,
             tools: Sequence[Mapping[str, Any]] | None = None,
             tool_choice: str | Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Answer one conversation (a list of {role, content}) or several, through the engine's chat template.
        Content is plain text unless `parse_special_tokens` (then `<|im_start|>` in content is a special token).

        `tools` (OpenAI function tools) and `tool_choice` ("auto", the default; "none"; "required"; or
        {"type": "function", "function": {"name": ...}}) work as in llm_serve's generic format: the tools are
        described in the system message; "required" or a named function constrains the answer to one call whose
        arguments follow the function's schema. The calls read from an answer that ended by itself are in
        `RequestOutput.tool_calls` (OpenAI's shape, `arguments` a JSON string); `text` stays what the model wrote.
        An assistant message may carry `tool_calls` and a `tool` message a result, as OpenAI's messages do."""
        spec = parse_tools({"tools": None if tools is None else list(tools),
                            "tool_choice": dict(tool_choice) if isinstance(tool_choice, Mapping) else tool_choice})
        params = sampling_params or SamplingParams()
        if spec is not None:
            params = replace(params, response_format=forced_format(spec, params.response_format))
            if params.response_format is not None:  # refused naming `tools`; add_request then finds it cached
                self.engine.grammars.compile(params.response_format, grammar_field(params.response_format, spec.forced))
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        requests = [self._chat_request(c, params, lora_name, cache_salt, enable_thinking, parse_special_tokens,
                                       spec) for c in conversations]  # type: ignore[arg-type]
        outputs = self._run(requests)
        if spec is not None:
            for output in outputs:
                output.tool_calls = answer_calls(output.text, output.finish_reason, spec)
        return outputs

    def stream(self, prompt: Prompt | ChatMessages, sampling_params: SamplingParams | None = None, *,
               lora_name: str | None = None, cache_salt: str | None = None) -> Iterator[StreamDelta]:
        """Yield tokens as they are sampled: a str or token ids is a raw prompt, a list of messages a chat."""
        if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], Mapping):
            request = self._raw_request(prompt, sampling_params, lora_name, cache_salt)  # type: ignore[arg-type]
        else:
            request = self._chat_request(prompt, sampling_params, lora_name, cache_salt, False)  # type: ignore[arg-type]
        request_id = self.engine.add_request(request)
        shown = ""
        tokenizer = self.engine.info.tokenizer
        try:
            while True:
                for output in self.engine.step():
                    if output.request_id != request_id:
                        continue
                    if output.finished:
                        yield StreamDelta(request_id, output.new_token_ids, output.text[len(shown):]
                                          if output.text.startswith(shown) else output.text, True, output)
                        return
                    text = tokenizer.decode(output.token_ids)
                    # Hold back text that may still change (an incomplete UTF-8 sequence decodes to U+FFFD).
                    stable = text if not text.endswith("\ufffd") else shown
                    delta, shown = stable[len(shown):], stable
                    yield StreamDelta(request_id, output.new_token_ids, delta, False, output)
        finally:
            self.engine.abort(request_id)  # a consumer that stops early cancels the request (no-op when done)

    def close(self) -> None:
        """Finish saving to the shared tier (with shared_cache; bounded) and release its connections. Idempotent;
        leaving a `with` block or dropping the LLM does the same."""
        if self._closer is not None:
            self._closer()  # runs engine.close once, and never again at collection or exit
        else:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def context_cache_metrics(self) -> dict[str, Any]:
        """The profile's `context_cache` block: admissions, hits, reused tokens, records, pool occupancy."""
        return self.engine.cache_profile()

    # --- helpers ------------------------------------------------------------------------------------

    def _run(self, requests: list[EngineRequest]) -> list[RequestOutput]:
        ids = [self.engine.add_request(r) for r in requests]
        by_id = {o.request_id: o for o in drain(self.engine, set(ids))}
        return [by_id[i] for i in ids]

    def _raw_request(self, prompt: Prompt, params: SamplingParams | None, lora_name: str | None,
                     cache_salt: str | None) -> EngineRequest:
        return self.engine.prepare(prompt, params or SamplingParams(), lora_name=lora_name, cache_salt=cache_salt)

    def _chat_request(self, conversation: ChatMessages, params: SamplingParams | None, lora_name: str | None,
                      cache_salt: str | None, enable_thinking: bool,
                      parse_special_tokens: bool = False, tools: ToolSpec | None = None) -> EngineRequest:
        # An assistant's earlier tool_calls become the text the model wrote for them (as llm_serve reads them).
        conversation = tool_messages([dict(m) for m in conversation])
        # Content is a string or, for media, the request file's items: [{"type": "image", "image": path}, ...].
        messages = [Message(str(m["role"]), str(m["content"])) if isinstance(m.get("content"), str)
                    else parse_message(dict(m), f"messages[{i}]") for i, m in enumerate(conversation)]
        messages = with_tools(messages, tools) if tools is not None else messages
        request = Request(0, messages, params or SamplingParams(), lora_name=lora_name, cache_salt=cache_salt,
                          parse_special_tokens=parse_special_tokens)
        return self.engine.prepare(request, enable_thinking=enable_thinking, where="")  # errors name "messages"


def with_build_budgets(config: EngineConfig, engine_dir: str | Path, given: set[str] | None = None) -> EngineConfig:
    """With reuse on, each snapshot pool left at 0 and not in `given` gets the budget llm_build printed for the engine
    (64 retained contexts): partial-KV snapshots reuse a cached prompt's last page to the token (a short chat's
    earlier turns are reused although they end inside a page), and recurrent and hybrid engines need theirs to reuse
    at all."""
    names = [name for name in ("context_cache_partial_kv_snapshot_pool_bytes",
                               "context_cache_recurrent_snapshot_pool_bytes")
             if not getattr(config, name) and name not in (given or set())]
    if not config.enable_context_reuse or not names:
        return config
    budgets = snapshot_budgets(load_engine_dir(Path(engine_dir)), partial_kv=True)
    return replace(config, **{name: size for name, size in budgets.items() if name in names})


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):  # one prompt given as token ids
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]

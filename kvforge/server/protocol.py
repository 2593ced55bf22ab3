"""OpenAI request bodies → what the engine runs: checked field by field, errors naming the field as `param`.

Checks reuse the request file's (`kvforge.runtime.inputs.request_file`) so a value the file refuses is refused here
with the same words. Extensions: `reuse_context` / `cache_generated_tokens` (strict booleans, the cache
policies), `cache_salt`, `lora_name`, `top_k`. Media content parts (`image_url`, `input_audio`) are read by
`kvforge.server.media`. `n` > 1 and a list of prompts (completions) become one engine request per choice
(`ApiCall.choices`); `developer` messages are system messages. `response_format` (JSON mode, JSON schema) constrains
the output with a grammar (`kvforge.runtime.sampling.grammar`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from kvforge.contract.errors import KvforgeError
from kvforge.contract.validation import check_int, check_string, describe, fail, get_bool, json_kind
from kvforge.runtime.engine.engine import CompiledGrammar, Engine, EngineRequest
from kvforge.runtime.inputs.checks import (
    check_logit_bias,
    check_min_p,
    check_penalty,
    check_repetition_penalty,
    check_response_format,
    check_seed,
    check_stop,
    check_temperature,
    check_top_p,
    parse_messages,
)
from kvforge.runtime.inputs.tools import (
    ToolSpec,
    forced_format,
    grammar_field,
    parse_tools,
    tool_messages,
    with_tools,
)
from kvforge.runtime.types import Message, Request, SamplingParams
from kvforge.server.media import MediaPolicy

T = TypeVar("T")
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 16  # n × prompts: each choice is a sequence in the engine, so a bound on what one body may ask
# Known OpenAI fields this server cannot honour: refused unless they hold their neutral value. Fields this module
# does not read at all are ignored, as vLLM and llama-server ignore them (docs/serving.md, "Unknown fields"): they
# are either metadata (`user`, `metadata`, `store`, `service_tier`) or another server's extensions.
NEUTRAL = {"best_of": 1, "echo": False, "suffix": None, "functions": None,
           # Output this server cannot produce (audio out, predicted outputs, web search): a silent text-only
           # answer would look like the model ignored the request.
           "audio": None, "prediction": None, "web_search_options": None}
MAX_TEMPERATURE = 2.0  # OpenAI's range: [0, 2]
MODALITIES = ("text",)  # output modalities this server produces
COMPLETION_NEUTRAL = {"tools": None, "tool_choice": None}  # tools are chat's (kvforge/runtime/inputs/tools.py)


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, offending param and code."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class ApiCall:
    """One parsed /v1/chat/completions or /v1/completions body."""

    chat: bool
    model: str
    messages: list[Message]  # chat
    prompt: str | list[int] | None  # completion: text or token ids (the first, with several prompts)
    sampling: SamplingParams
    max_tokens: int | None  # None: chat runs to the KV capacity
    stream: bool
    include_usage: bool
    logprobs: bool
    lora_name: str | None
    cache_salt: str | None  # the client's; the server combines it with the tenant's
    parse_special_tokens: bool = False  # kvforge extension: special-token text in content becomes special tokens
    n: int = 1  # choices per prompt
    prompts: tuple[str | list[int], ...] = ()  # completion: every prompt, in order (choices come prompt by prompt)
    tools: ToolSpec | None = None  # chat: the tools and tool_choice; the answer's calls are read back (render.py)

    def choices(self) -> list[ApiCall]:
        """One call per choice, in the order of `choices[i]`: for each prompt, its n sequences. The j-th of n gets
        seed + j (equal seeds would give n equal answers); each gets its own copy of the messages, which
        engine_request empties."""
        prompts = self.prompts or (self.prompt,)
        seed = self.sampling.seed
        return [replace(self, messages=list(self.messages), prompt=prompt, prompts=(), n=1,
                        sampling=self.sampling if seed is None else replace(self.sampling, seed=seed + j))
                for prompt in prompts for j in range(self.n)]

    @property
    def grammar_field(self) -> str:
        """The field a refused grammar names: `tools` for a forced call's, `grammar` for GBNF, else
        `response_format`."""
        return grammar_field(self.sampling.response_format, self.tools is not None and self.tools.forced)

    def engine_request(self, engine: Engine, cache_salt: str, grammar: CompiledGrammar | None = None) -> EngineRequest:
        """Tokenize (chat template for chat) and check against the engine; runs on a preparation worker, beside the
        engine thread's steps (EngineLoop.prepare), so it reads only the engine's immutable parts. `grammar`: the
        response_format's, compiled beforehand on the engine's grammar worker (RequestHandle.start)."""
        if self.chat:
            request = Request(0, self.messages, self.sampling, lora_name=self.lora_name, cache_salt=cache_salt,
                              parse_special_tokens=self.parse_special_tokens)
            built = engine.prepare(request, where="")  # errors name "messages"
            self.messages.clear()  # the media bytes in them are spent: a long answer must not hold them
        else:
            built = engine.prepare(self.prompt or [], self.sampling, lora_name=self.lora_name, cache_salt=cache_salt)
        room = engine.info.max_kv_cache_capacity - len(built.prompt_ids)
        built.sampling = replace(built.sampling, max_generate_length=max(1, self.max_tokens or room))
        built.grammar = grammar
        return built


def parse_call(body: Any, chat: bool, models: dict[str, str | None], media: MediaPolicy | None = None) -> ApiCall:
    """Check a decoded body. `models` maps each servable model id to its adapter (None for the base model);
    `media` says where media content parts may come from (default: inline only)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {json_kind(body)}")
    try:
        return _parse(body, chat, models, media or MediaPolicy())
    except KvforgeError as exc:
        raise ApiError(400, exc.message, exc.field) from None


def _parse(body: dict[str, Any], chat: bool, models: dict[str, str | None], media: MediaPolicy) -> ApiCall:
    if body.get("model") is None:  # named plainly: "must be a string, got null" left clients guessing which field
        fail("model", f"model is required: the id of the model to use ({', '.join(sorted(models))})")
    model = check_string(body.get("model"), "model")
    if model not in models:
        raise ApiError(404, f"the model {model!r} does not exist; this server has {', '.join(sorted(models))}",
                       "model", code="model_not_found")
    for name, neutral in (NEUTRAL if chat else {**NEUTRAL, **COMPLETION_NEUTRAL}).items():
        if body.get(name, neutral) not in (neutral, None):  # named in the message too: clients print only that
            fail(name, f"{name} is not supported by this server (only {json.dumps(neutral)})")
    _modalities(body)
    lora_name = _adapter(body, models[model], models)
    logprobs, top = _logprobs(body, chat)
    tools = parse_tools(body) if chat else None
    if chat:
        messages, prompt = parse_messages(tool_messages(body.get("messages")), "messages", media.parsers()), None
        messages = with_tools(messages, tools) if tools is not None else messages
    else:
        messages, prompt = [], None
    response_format = forced_format(tools, _output_format(body))
    prompts = () if chat else _prompts(body.get("prompt"))
    n = _given(body, "n", lambda v, f: check_int(v, f, 1, MAX_CHOICES), 1)
    if n * max(len(prompts), 1) > MAX_CHOICES:
        fail("n", f"asks for {n} choices for each of {len(prompts)} prompts; at most {MAX_CHOICES} in all")
    sampling = SamplingParams(
        temperature=_given(body, "temperature", _temperature, 1.0),
        top_p=_given(body, "top_p", check_top_p, 1.0),
        top_k=_given(body, "top_k", lambda v, f: check_int(v, f, 0), 0),
        num_logprobs=top,
        token_logprob=logprobs,
        logit_bias=_given(body, "logit_bias", check_logit_bias, {}),
        stop=_given(body, "stop", check_stop, ()),
        seed=_given(body, "seed", check_seed, None),
        reuse_context=get_bool(body, "reuse_context", "", True),  # strict: null is refused too
        cache_generated_tokens=get_bool(body, "cache_generated_tokens", "", True),
        presence_penalty=_given(body, "presence_penalty", check_penalty, 0.0),
        frequency_penalty=_given(body, "frequency_penalty", check_penalty, 0.0),
        response_format=response_format,  # grammar-constrained (a forced tool call's own, with tools)
        min_p=_given(body, "min_p", check_min_p, 0.0),  # vLLM's and llama-server's extensions
        repetition_penalty=_given(body, "repetition_penalty", check_repetition_penalty, 1.0),
    )
    return ApiCall(chat, model, messages, prompts[0] if prompts else prompt, sampling, _max_tokens(body, chat),
                   _given(body, "stream", _boolean, False), _include_usage(body), logprobs, lora_name,
                   _given(body, "cache_salt", check_string, None),
                   get_bool(body, "parse_special_tokens", "", False), n, prompts, tools)


def _output_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """`response_format`, or llama-server's `grammar` (GBNF; Lark too, as llguidance reads it): one of them; a
    `response_format` of type "grammar" is the Python API's and request files' spelling, not the body's."""
    response_format = _given(body, "response_format", check_response_format, None)
    if response_format is not None and response_format["type"] == "grammar":
        fail("response_format.type", 'must be "text", "json_object" or "json_schema" (a GBNF grammar goes in the '
             '"grammar" field)')
    text = body.get("grammar")
    if text is None:
        return response_format
    if not isinstance(text, str) or not text.strip():
        fail("grammar", f"must be a GBNF grammar text, got {json_kind(text)}")
    if response_format is not None:
        fail("grammar", "cannot be given with a response_format other than text (both constrain the answer)")
    if body.get("tool_choice") not in (None, "none", "auto"):
        fail("grammar", "cannot be given with a tool_choice that forces a call (the call is the format)")
    return {"type": "grammar", "grammar": text}


def _given(body: dict[str, Any], name: str, check: Callable[[Any, str], T], default: T) -> T:
    """A standard OpenAI field: absent or null means its default."""
    value = body.get(name)
    return default if value is None else check(value, name)


def _temperature(value: Any, where: str) -> float:
    """OpenAI's range, [0, 2]: a client sending 5 meant something the API does not offer."""
    number = check_temperature(value, where)
    if number > MAX_TEMPERATURE:
        fail(where, f"must be a number in [0, {MAX_TEMPERATURE:g}] (OpenAI's range), got {number:g}")
    return number


def _modalities(body: dict[str, Any]) -> None:
    """OpenAI's output modalities: this server answers with text only, so ["audio"] is refused, not ignored."""
    value = body.get("modalities")
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        fail("modalities", f'must be an array of strings like ["text"], got {json_kind(value)}')
    other = [m for m in value if m not in MODALITIES]
    if other:
        fail("modalities", f"modalities {json.dumps(other)} are not supported by this server: it answers with text "
                           'only (["text"])')


def _boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        fail(where, f"must be true or false, got {describe(value)}")
    return value


def _adapter(body: dict[str, Any], by_model: str | None, models: dict[str, str | None]) -> str | None:
    """`lora_name` (an extension) or a model id that names an adapter, as vLLM serves them; not two different."""
    name = _given(body, "lora_name", check_string, None) or None
    if name is not None and name not in {a for a in models.values() if a}:
        loaded = ", ".join(sorted(a for a in models.values() if a)) or "none"
        fail("lora_name", f"adapter {name!r} is not loaded (loaded: {loaded}; load adapters with --loraWeights)")
    if name and by_model and name != by_model:
        fail("lora_name", f"names adapter {name!r} but model names adapter {by_model!r}")
    return name or by_model


def _logprobs(body: dict[str, Any], chat: bool) -> tuple[bool, int]:
    """(whether to return logprobs, how many alternatives per token)."""
    if not chat:  # completions: `logprobs` is the number of alternatives, null for none
        value = body.get("logprobs")
        return (False, 0) if value is None else (True, check_int(value, "logprobs", 0, MAX_TOP_LOGPROBS))
    wanted = _given(body, "logprobs", _boolean, False)
    top = _given(body, "top_logprobs", lambda v, f: check_int(v, f, 0, MAX_TOP_LOGPROBS), 0)
    if top and not wanted:
        fail("top_logprobs", "needs logprobs: true")
    return wanted, top


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            return check_int(body[name], name, 1)
    return None if chat else COMPLETION_DEFAULT_MAX_TOKENS


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        fail("stream_options", f"must be an object, got {json_kind(options)}")
    return _given(options, "include_usage", lambda v, f: _boolean(v, f"stream_options.{f}"), False)


def _prompts(value: Any) -> tuple[str | list[int], ...]:
    """The prompts: a string, token ids, or an array of either (one choice set per prompt)."""
    if isinstance(value, str) or _token_ids(value):
        return (_prompt(value, "prompt"),)
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) > MAX_CHOICES:
            fail("prompt", f"must hold at most {MAX_CHOICES} prompts, got {len(value)}")
        return tuple(_prompt(p, f"prompt[{i}]") for i, p in enumerate(value))
    fail("prompt", f"must be a string, an array of token ids, or an array of those, got {json_kind(value)}")


def _prompt(value: Any, where: str) -> str | list[int]:
    if isinstance(value, str):
        return check_string(value, where)
    if _token_ids(value):
        return value
    fail(where, f"must be a string or a non-empty array of token ids, got {json_kind(value)}")


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def error_from(exc: KvforgeError, chat: bool) -> ApiError:
    """An engine-side refusal as a 400 naming the request field to change."""
    field = _PARAMS.get(exc.field or "", exc.field)
    if field == "messages" and not chat:
        field = "prompt"
    return ApiError(400, exc.message, field)


# Domain names the engine's errors carry → the request field a client changes to fix them.
_PARAMS: dict[str, str] = {"max_kv_pool_pages": "max_tokens"}

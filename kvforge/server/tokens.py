"""/tokenize and /detokenize bodies in the shapes vLLM and llama.cpp serve, so their clients count tokens here too."""

from __future__ import annotations

from typing import Any

from kvforge.contract.validation import check_int, check_string, fail, get_bool, json_kind
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.inputs.checks import parse_messages
from kvforge.runtime.inputs.tokenizer import ChatTokenizer
from kvforge.runtime.types import Message, Request, SamplingParams
from kvforge.server.media import MediaPolicy

MAX_DETOKENIZE_TOKENS = 1 << 20  # a bound on the decode work one body may ask for


def tokenize_input(body: Any, models: dict[str, str | None],
                   media: MediaPolicy) -> tuple[str | list[Message], bool]:
    """The text (vLLM's `prompt`, llama.cpp's `content`) or the chat (vLLM's `messages`) to tokenize, and for a chat
    whether the assistant's turn is opened (vLLM's `add_generation_prompt`, default true)."""
    body = _object(body, models)
    generation = get_bool(body, "add_generation_prompt", "", True)
    given = [name for name in ("prompt", "content", "messages") if name in body]
    if len(given) != 1:
        fail("prompt", "give exactly one of prompt (or content) and messages, got "
                       f"{' and '.join(given) if given else 'neither'}")
    if given[0] == "messages":
        return parse_messages(body["messages"], "messages", media.parsers()), generation
    return check_string(body[given[0]], given[0]), generation


def tokenize(engine: Engine, what: str | list[Message], add_generation_prompt: bool = True) -> list[int]:
    """The ids /v1/completions (text) or /v1/chat/completions (messages, through the chat template) would run;
    on a preparation worker, like those requests' own tokenization."""
    if isinstance(what, str):
        return engine.info.tokenizer.encode(what)
    request = Request(0, what, SamplingParams(), add_generation_prompt=add_generation_prompt)
    return engine.prepare(request, where="").prompt_ids


def tokenize_response(ids: list[int], max_model_len: int) -> dict[str, Any]:
    """vLLM's fields (count, max_model_len, tokens) and llama.cpp's (tokens) at once."""
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}


def detokenize(body: Any, models: dict[str, str | None], tokenizer: ChatTokenizer, vocab_size: int) -> dict[str, Any]:
    """vLLM's `prompt` and llama.cpp's `content`: the text of `tokens`, special tokens left out."""
    tokens = _object(body, models).get("tokens")
    if not isinstance(tokens, list):
        fail("tokens", f"must be an array of token ids, got {json_kind(tokens)}")
    if len(tokens) > MAX_DETOKENIZE_TOKENS:
        fail("tokens", f"must hold at most {MAX_DETOKENIZE_TOKENS} token ids, got {len(tokens)}")
    ids = [check_int(t, f"tokens[{i}]", 0, vocab_size - 1) for i, t in enumerate(tokens)]
    text = tokenizer.decode(ids)
    return {"prompt": text, "content": text}


def _object(body: Any, models: dict[str, str | None]) -> dict[str, Any]:
    if not isinstance(body, dict):
        fail("body", f"must be a JSON object, got {json_kind(body)}")
    model = body.get("model")
    if model is not None and model not in models:  # optional, as in vLLM; a wrong one is still a mistake
        fail("model", f"the model {model!r} does not exist; this server has {', '.join(sorted(models))}")
    return body

"""Grammar-constrained decoding for `response_format`: a per-sequence llguidance matcher that masks logits."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvforge.contract.errors import KvforgeError

# One LLTokenizer per engine tokenizer: building one walks the whole vocabulary (~1 s on a 50k vocabulary). Weak
# keys: a closed engine's tokenizer, and its LLTokenizer, are freed with it.
_LL_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def grammar_for(response_format: dict[str, Any]) -> str:
    """llguidance's grammar text for a checked response_format (see kvforge/runtime/types.py's
    check_response_format)."""
    from llguidance import LLMatcher

    if response_format["type"] == "json_object":
        schema: dict[str, Any] = {"type": "object"}  # any JSON object, as OpenAI's JSON mode promises
    else:
        schema = response_format["json_schema"]["schema"]
    # Compact separators: a model that cannot stop emitting whitespace must still end its object.
    return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def check_grammar(response_format: dict[str, Any], where: str) -> None:
    """Refuse, naming `where`, a schema llguidance cannot compile (checked without a tokenizer, before any engine)."""
    try:
        from llguidance import LLMatcher
    except ImportError:
        raise KvforgeError("needs the llguidance package: pip install 'kvforge[serve]'", where) from None
    try:
        error = LLMatcher.validate_grammar(grammar_for(response_format))
    except ValueError as exc:
        error = str(exc)
    if error and not error.startswith("WARNING"):
        raise KvforgeError(f"the schema cannot be compiled: {error.splitlines()[0]}", where)


class GrammarConstraint:
    """The grammar state of one sequence: masks its logits rows and advances with each token it commits.

    The state lives in the sequence's Sampler only; the context cache never sees it, so a reused prefix page
    carries no request's constraint to another (the constraint changes sampling, never page identity).
    """

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the tokenizer's; a wider (padded) logits row is masked past it
        self._bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """A [vocab_size] bool vector: the tokens the grammar accepts next (EOS once it is complete)."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._bitmask)
        self._check()
        return np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)

    def mask(self, logits: np.ndarray) -> None:
        """Set the logits of every token the grammar refuses to -inf, in place."""
        allowed = self.allowed()
        width = min(logits.size, self.vocab_size)
        logits[:width][~allowed[:width]] = -np.inf
        logits[width:] = -np.inf

    def advance(self, token_id: int) -> None:
        if not self.matcher.is_stopped():  # past the end only EOS was allowed, and EOS ends the sequence
            self.matcher.consume_token(token_id)
            self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise KvforgeError(f"the output grammar failed: {self.matcher.get_error()}", "response_format")


def constraint_for(response_format: dict[str, Any] | None, tokenizer: Any,
                   eos_token_ids: Iterable[int]) -> GrammarConstraint | None:
    """A fresh constraint for one sequence (None without a response_format); `tokenizer` is the engine's HF
    `tokenizers.Tokenizer`. Refuses a schema llguidance cannot compile, naming response_format."""
    if response_format is None or response_format["type"] == "text":
        return None
    try:
        from llguidance import LLMatcher, LLTokenizer
    except ImportError:
        raise KvforgeError("needs the llguidance package: pip install 'kvforge[serve]'", "response_format") from None
    ll_tokenizer = _LL_TOKENIZERS.get(tokenizer)
    if ll_tokenizer is None:
        ll_tokenizer = LLTokenizer(tokenizer.to_str(), eos_token=sorted(eos_token_ids) or None)
        _LL_TOKENIZERS[tokenizer] = ll_tokenizer
    try:
        grammar = grammar_for(response_format)
    except ValueError as exc:
        raise KvforgeError(f"the schema cannot be compiled: {exc}", "response_format") from None
    matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
    if matcher.is_error():
        message = matcher.get_error().splitlines()[0] if matcher.get_error() else "unknown error"
        raise KvforgeError(f"the schema cannot be compiled: {message}", "response_format")
    return GrammarConstraint(matcher, ll_tokenizer.vocab_size)


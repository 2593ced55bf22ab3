"""Grammar-constrained decoding for `response_format` and forced tool calls: grammars compiled once per schema, off
the engine thread and under a budget, then a per-sequence llguidance matcher that masks logits.

A compile can cost a second (a schema of thousands of properties) and a mask a step's worth of lexer work, so both
are bounded (docs/hardening.md "Grammars"): the schema's size, llguidance's own fuel and item limits (which bound a
compile's and every token's mask work), and a wall-clock budget per compile. Compiles run on the engine's one grammar
worker (`GrammarCompiler`), never on the engine thread or the server's event loop, and their results (refusals
included) are cached by the schema's text, so `n` choices and repeated requests compile once.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvforge.contract.errors import KvforgeError
from kvforge.runtime.sampling.schema_defaults import with_defaults

# One LLTokenizer per engine tokenizer: building one walks the whole vocabulary (~1 s on a 50k vocabulary). Weak
# keys: a closed engine's tokenizer, and its LLTokenizer, are freed with it.
_LL_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()

MAX_SCHEMA_BYTES = 128 * 1024  # the response_format (a forced call's tools) as compact JSON: OpenAI's strict mode
#                                allows ~120,000 characters of names and values; a 5,000-property schema is 190 KiB
COMPILE_BUDGET_S = 2.0  # wall clock per compile, measured on the grammar worker; a slower one is refused (cached)
CACHE_ENTRIES = 64  # compiled grammars (or refusals) kept, least recently used dropped first
# llguidance's ParserLimits, given explicitly so the bound is ours, not a library default that may move: fuel is
# lexer work (~50k/ms building, ~14k/ms while masking), items are Earley items (~20k/ms). A compile past them, or a
# token whose mask would be, ends in an error naming the field instead of a stall.
LIMITS = {"max_items_in_row": 2000, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000,
          "step_max_items": 50_000, "max_lexer_states": 250_000, "max_grammar_size": 500_000,
          "verbose_errors": False}  # an error is one line, without the parser state (another tenant's schema)
# One token's mask, on the engine thread, wall clock: past it the sequence ends with an error (`finish_reason`
# "error") instead of stalling every other stream a token at a time. The fuel above bounds the work to ~15 ms
# (a 49k vocabulary); this catches whatever that misses, timed after the fact (a mask cannot be interrupted).
MASK_BUDGET_S = 0.25
NEEDS = "needs the llguidance package: pip install 'kvforge[serve]'"


def grammar_for(response_format: dict[str, Any]) -> str:
    """llguidance's grammar text for a checked response_format (see kvforge/runtime/types.py's
    check_response_format), with the grammar defaults (kvforge/runtime/sampling/schema_defaults.py)."""
    from llguidance import LLMatcher, grammar_from

    if response_format["type"] == "grammar":  # GBNF, converted to llguidance's Lark (Lark text passes as it is)
        return grammar_from("gbnf", response_format["grammar"])
    if response_format["type"] == "json_object":
        schema: dict[str, Any] = {"type": "object"}  # any JSON object, as OpenAI's JSON mode promises
    else:
        schema = with_defaults(response_format["json_schema"]["schema"])
    # Compact separators: a model that cannot stop emitting whitespace must still end its object.
    return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def _check_size(response_format: dict[str, Any], where: str) -> str:
    """The format's compact JSON (the cache key), refused past MAX_SCHEMA_BYTES."""
    text = json.dumps(response_format, separators=(",", ":"), ensure_ascii=False)
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SCHEMA_BYTES:
        raise KvforgeError(f"the {_noun(response_format)} is {size} bytes as JSON; at most {MAX_SCHEMA_BYTES} are "
                           "compiled", where)
    return text


def _noun(response_format: dict[str, Any]) -> str:
    return "grammar" if response_format["type"] == "grammar" else "schema"


class GrammarConstraint:
    """The grammar state of one sequence: masks its logits rows and advances with each token it commits.

    The state lives in the sequence's Sampler only; the context cache never sees it, so a reused prefix page
    carries no request's constraint to another (the constraint changes sampling, never page identity).
    """

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the tokenizer's; a wider (padded) logits row is masked past it
        self._bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
        self.accepting = [matcher.is_accepting()]  # after 0, 1, ... committed tokens: may the answer end there?

    def allowed(self) -> np.ndarray:
        """A [vocab_size] bool vector: the tokens the grammar accepts next (EOS once it is complete)."""
        from llguidance.numpy import fill_next_token_bitmask

        start = time.perf_counter()
        fill_next_token_bitmask(self.matcher, self._bitmask)
        self._check()
        elapsed = time.perf_counter() - start
        if elapsed > MASK_BUDGET_S:
            raise KvforgeError(f"the grammar took {elapsed:.2f} s to mask one token; the budget is "
                               f"{MASK_BUDGET_S:g} s", "response_format")
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
        self.accepting.append(self.matcher.is_accepting())

    def stop_at(self, text: str, stops: tuple[str, ...], ends: Callable[[int], int]) -> int | None:
        """Where a stop string cuts `text` (the answer so far), or None: with a grammar, a stop counts only where
        the text before it is a complete answer, at a token boundary the grammar accepted (`ends(k)` is the text's
        length after k tokens), so a stop never cuts an answer the grammar promised; a JSON object ends the
        answer as it closes, so inside one a stop is only text."""
        ends_at = {ends(k) for k, accepting in enumerate(self.accepting) if accepting}
        hits = [i for stop in stops for i in _occurrences(text, stop) if i in ends_at]
        return min(hits) if hits else None

    def _check(self) -> None:
        if self.matcher.is_error():
            message = (self.matcher.get_error() or "unknown error").splitlines()[0]
            raise KvforgeError(f"the output grammar failed: {message}", "response_format")


def _occurrences(text: str, word: str) -> Iterator[int]:
    start = text.find(word)
    while start >= 0:
        yield start
        start = text.find(word, start + 1)


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A compiled grammar, shared by every sequence of its schema: each gets a copy of the (never advanced)
    template matcher, which costs no compile."""

    matcher: Any
    vocab_size: int

    def constraint(self) -> GrammarConstraint:
        return GrammarConstraint(self.matcher.deep_copy(), self.vocab_size)


class GrammarCompiler:
    """Compiles an engine's grammars on one worker thread of its own, with a cache keyed by the format's JSON text.

    `submit` returns at once (the key, the size check and the compile all run on the worker), so neither the
    server's event loop nor the engine thread ever waits on a compile; the worker is single, so a burst of hostile
    schemas queues behind itself, not in front of the engine. llguidance drops the GIL while it compiles.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer  # the engine's HF `tokenizers.Tokenizer`, immutable
        self._eos = sorted(eos_token_ids)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvforge-grammar")
        self._cache: OrderedDict[str, CompiledGrammar | str] = OrderedDict()  # touched by the worker only
        self.compiles = 0  # grammars actually compiled (cache misses), for tests and the curious

    def submit(self, response_format: dict[str, Any], where: str = "response_format") -> Future[CompiledGrammar]:
        """The compiled grammar of a checked response_format, on a future; a refusal is a KvforgeError naming
        `where` (`response_format`, or `tools` for a forced call's grammar)."""
        return self._pool.submit(self._compiled, response_format, where)

    def compile(self, response_format: dict[str, Any], where: str = "response_format") -> CompiledGrammar:
        """`submit`, waited for (kvforge.LLM and llm_inference, which have no other tenant to stall)."""
        return self.submit(response_format, where).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compiled(self, response_format: dict[str, Any], where: str) -> CompiledGrammar:
        key = _check_size(response_format, where)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._build(response_format)
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        if isinstance(found, str):
            raise KvforgeError(found, where)
        return found

    def _build(self, response_format: dict[str, Any]) -> CompiledGrammar | str:
        """A compiled grammar, or the refusal's message (cached like a grammar: a hostile schema costs once)."""
        try:
            from llguidance import LLMatcher, LLParserLimits
        except ImportError:
            return NEEDS
        ll_tokenizer = self._ll_tokenizer()
        self.compiles += 1
        start = time.perf_counter()
        try:
            grammar = grammar_for(response_format)
        except ValueError as exc:
            return f"the {_noun(response_format)} cannot be compiled: {str(exc).splitlines()[0]}"
        matcher = LLMatcher(ll_tokenizer, grammar, log_level=0, limits=LLParserLimits(**LIMITS))
        if not matcher.is_error():  # the first mask is computed here too: a grammar that fails at once is refused
            probe = matcher.deep_copy()
            probe.compute_bitmask()
            if probe.is_error():
                matcher = probe
        if matcher.is_error():
            message = matcher.get_error().splitlines()[0] if matcher.get_error() else "unknown error"
            return f"the {_noun(response_format)} cannot be compiled: {message}"
        elapsed = time.perf_counter() - start
        if elapsed > COMPILE_BUDGET_S:
            return (f"the {_noun(response_format)} took {elapsed:.1f} s to compile; the budget is "
                    f"{COMPILE_BUDGET_S:g} s")
        return CompiledGrammar(matcher, ll_tokenizer.vocab_size)

    def _ll_tokenizer(self) -> Any:
        from llguidance import LLTokenizer

        with _LL_LOCK:
            ll_tokenizer = _LL_TOKENIZERS.get(self._tokenizer)
            if ll_tokenizer is None:
                ll_tokenizer = LLTokenizer(self._tokenizer.to_str(), eos_token=self._eos or None)
                _LL_TOKENIZERS[self._tokenizer] = ll_tokenizer
        return ll_tokenizer

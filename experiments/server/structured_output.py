"""What response_format's grammar costs per generated token, against one decode step of the same engine, and what the
grammar defaults (kvforge/runtime/sampling/schema_defaults.py) cost in compile and mask time.

Run as `python -m experiments.server.structured_output --engineDir DIR`.
It generates a JSON-schema answer, then replays its
tokens through a fresh constraint, timing the mask and the advance of each token on a logits row of the engine's
vocabulary; the decode step is an unconstrained greedy answer's decode time per token. Prints both and the ratio.
Then it compiles an ordinary schema (no additionalProperties, unbounded numbers) with and without the defaults and
replays one answer through both.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from kvforge import LLM, SamplingParams
from kvforge.runtime.sampling.grammar import LIMITS, GrammarConstraint, grammar_for
from kvforge.runtime.sampling.schema_defaults import with_defaults

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
ORDINARY = {"type": "object", "required": ["name", "age", "height"],  # as LangChain's @tool sends one
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "height": {"type": "number"}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engineDir", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with LLM(str(args.engineDir), num_threads=args.threads, enable_context_reuse=False) as llm:
        free = SamplingParams(temperature=0.0, max_generate_length=48, reuse_context=False)
        steps = []
        for _ in range(args.repeats):
            [out] = llm.chat(MESSAGES, free)
            if len(out.token_ids) > 1:
                steps.append(out.timing.decode_ms / (len(out.token_ids) - 1))
        [constrained] = llm.chat(MESSAGES, SamplingParams(temperature=0.8, seed=3, max_generate_length=96,
                                                          response_format=FORMAT))
        engine = llm.engine
        vocab = engine.engine_dir.model.vocab_size
        row = np.random.default_rng(0).standard_normal(vocab)
        costs = []
        for _ in range(args.repeats):
            constraint = engine.grammars.compile(FORMAT).constraint()
            for token in constrained.token_ids:
                logits = row.copy()
                started = time.perf_counter()
                constraint.mask(logits)
                constraint.advance(token)
                costs.append((time.perf_counter() - started) * 1e3)
        defaults_cost(llm, args.repeats)
    step, mask = statistics.median(steps), statistics.median(costs)
    print(f"engine {args.engineDir} (vocabulary {vocab}): constrained answer {constrained.text!r}")
    print(f"decode step {step:.3f} ms/token; grammar mask + advance {mask:.3f} ms/token (median of {len(costs)}, "
          f"p90 {np.percentile(costs, 90):.3f}); {100 * mask / step:.1f} % of a decode step")


def defaults_cost(llm: LLM, repeats: int) -> None:
    """Compile and per-token mask time of ORDINARY with the grammar defaults and without them (as llguidance reads
    the schema by the letter), replaying one answer the defaults allow through both."""
    from llguidance import LLMatcher, LLParserLimits

    fmt = {"type": "json_schema", "json_schema": {"name": "ordinary", "schema": ORDINARY}}
    [answer] = llm.chat(MESSAGES, SamplingParams(temperature=0.8, seed=3, max_generate_length=96, response_format=fmt))
    ll_tokenizer = llm.engine.grammars._ll_tokenizer()
    row = np.random.default_rng(0).standard_normal(llm.engine.engine_dir.model.vocab_size)
    for label, grammar in (("defaults", grammar_for(fmt)),
                           ("by the letter", LLMatcher.grammar_from_json_schema(
                               ORDINARY, defaults={"whitespace_flexible": False}))):
        compiles, masks = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            matcher = LLMatcher(ll_tokenizer, grammar, log_level=0, limits=LLParserLimits(**LIMITS))
            compiles.append((time.perf_counter() - started) * 1e3)
            constraint = GrammarConstraint(matcher, ll_tokenizer.vocab_size)
            for token in answer.token_ids:
                logits = row.copy()
                started = time.perf_counter()
                constraint.mask(logits)
                constraint.advance(token)
                masks.append((time.perf_counter() - started) * 1e3)
        print(f"{label}: compile {statistics.median(compiles):.2f} ms, mask + advance {statistics.median(masks):.3f} "
              f"ms/token (p90 {np.percentile(masks, 90):.3f})")
    print(f"the answer replayed: {answer.text!r} (defaults: {with_defaults(ORDINARY)})")


if __name__ == "__main__":
    main()

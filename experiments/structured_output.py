"""What response_format's grammar costs per generated token, against one decode step of the same engine.

Run as `python experiments/structured_output.py --engineDir DIR`. It generates a JSON-schema answer, then replays its
tokens through a fresh constraint, timing the mask and the advance of each token on a logits row of the engine's
vocabulary; the decode step is an unconstrained greedy answer's decode time per token. Prints both and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from kvforge import LLM, SamplingParams
from kvforge.runtime.sampling.grammar import constraint_for

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


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
            constraint = constraint_for(FORMAT, engine.tokenizer.tokenizer, engine.engine_dir.model.eos_token_ids)
            assert constraint is not None
            for token in constrained.token_ids:
                logits = row.copy()
                started = time.perf_counter()
                constraint.mask(logits)
                constraint.advance(token)
                costs.append((time.perf_counter() - started) * 1e3)
    step, mask = statistics.median(steps), statistics.median(costs)
    print(f"engine {args.engineDir} (vocabulary {vocab}): constrained answer {constrained.text!r}")
    print(f"decode step {step:.3f} ms/token; grammar mask + advance {mask:.3f} ms/token (median of {len(costs)}, "
          f"p90 {np.percentile(costs, 90):.3f}); {100 * mask / step:.1f} % of a decode step")


if __name__ == "__main__":
    main()

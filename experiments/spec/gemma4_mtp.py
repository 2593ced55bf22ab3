"""Gemma4-style MTP on SmolLM2 with a random assistant of the public shape, against plain decoding, in one run.

No public Gemma4 assistant targets SmolLM2 (Google's read Gemma4 bases, which kvforge cannot export yet), so the
assistant is random: 4 Q-only layers 256 wide (6 query heads) reading SmolLM2's last layer's K/V, centroid-sparse
logits (2,048 centroids, top 32, as transformers' defaults). Its guesses are almost never accepted, so this measures
what MTP drafting costs, not what a trained assistant gains:

- the cost of one base verify call of k + 1 tokens against one decode step, at 64 and 1,536 tokens of context (the
  engine's own backend, medians), and of one assistant step there (k steps draft a round);
- decode tok/s with the assistant against plain, and the acceptance length, on a question about a ~1,500-token
  document (same tokens as plain is checked);
- TTFT of a second question on the document, warm (reuse on: the base's pages are all the assistant needs) vs cold.

    python -m experiments.spec.gemma4_mtp --onnxDir out/onnx/smollm2-mtpbase --threads 2
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from experiments._common import Progress, bench_parser, write_json
from experiments.spec._common import (
    BUILD,
    CONTEXTS,
    DOCUMENT_TOKENS,
    MAX_GENERATE,
    call_ms,
    chat_request,
    decode_figures,
    decode_line,
    run_one,
    ttft_figures,
    ttft_line,
)
from kvforge.builder.build import build_engine
from kvforge.contract.engine_dir import BASE_HIDDEN_INPUT, DRAFT_HIDDEN_INPUT
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.tools.bench.text import fit_document, spec_messages
from kvforge.tools.export.drafts.gemma4_assistant import export_gemma4_assistant, write_random_gemma4_assistant

DRAFT_STEP = 6  # --specDraftStep's default: a verify call of 7 tokens


def main() -> None:
    parser = bench_parser(__doc__, repeats=5)
    args = parser.parse_args()
    progress = Progress()
    with tempfile.TemporaryDirectory(prefix="kvforge-mtp-") as tmp:
        root = Path(tmp)
        progress("building the base")
        build_engine(args.onnxDir, root / "engine", replace(BUILD, spec_base=True))
        progress("exporting and building a random Gemma4 assistant")
        write_random_gemma4_assistant(args.onnxDir, root / "hf", seed=1, num_layers=4, hidden_size=256,
                                      num_heads=6, num_centroids=2048, centroid_top_k=32)
        export_gemma4_assistant(root / "hf", args.onnxDir, root / "onnx")
        build_engine(root / "onnx", root / "engine" / "draft", replace(BUILD, spec_draft=True, cpu_attention="kernel"))
        plain = Engine(root / "engine", EngineConfig(num_threads=args.threads))
        document, doc_tokens = fit_document(plain.tokenizer.encode, DOCUMENT_TOKENS)
        questions = next(iter(spec_messages(document).values()))
        H = plain.engine_dir.model.hidden_size
        progress("plain")
        base_run = run_one(plain, chat_request(plain, questions[0], reuse=False))
        config = EngineConfig(num_threads=args.threads, spec_decode="gemma4_mtp", spec_draft_step=DRAFT_STEP)
        engine = Engine(root / "engine", config)
        row: dict[str, Any] = {"draft_step": DRAFT_STEP}
        progress("verify and assistant call costs")
        assistant = engine.proposer.backend  # type: ignore[union-attr]
        for context in CONTEXTS:
            decode = call_ms(engine.backend, H, 1, context, args.repeats)
            verify = call_ms(engine.backend, H, DRAFT_STEP + 1, context, args.repeats)
            step = call_ms(assistant, H, 1, context, args.repeats,
                           {BASE_HIDDEN_INPUT: np.zeros((1, 1, H), np.float32),
                            DRAFT_HIDDEN_INPUT: np.zeros((1, 1, H), np.float32)})
            row |= {f"decode_ms@{context}": decode, f"verify_{DRAFT_STEP + 1}_ms@{context}": verify,
                    f"verify_over_decode@{context}": verify / decode, f"assistant_step_ms@{context}": step,
                    f"round_over_decode@{context}": (verify + DRAFT_STEP * step) / decode}
        progress("decoding")
        run = run_one(engine, chat_request(engine, questions[0], reuse=False))
        row |= decode_figures(run, base_run)
        progress("warm vs cold TTFT")
        warm_engine = Engine(root / "engine", replace(config, enable_context_reuse=True))
        run_one(warm_engine, chat_request(warm_engine, questions[0]))
        warm = run_one(warm_engine, chat_request(warm_engine, questions[1]))
        cold = run_one(warm_engine, chat_request(warm_engine, questions[1], reuse=False))
        pools = warm_engine.profile().get("context_cache", {}).get("resource_pools", {})
        row |= ttft_figures(warm, cold) | {"draft_kv_pages": pools.get("draft_kv_pages", {}).get("capacity", 0)}
    k = DRAFT_STEP
    print(f"\nGemma4 MTP bench: SmolLM2 from {args.onnxDir}, a random 4-layer assistant (256 wide, 2,048 centroids), "
          f"{args.threads} threads, document {doc_tokens} tokens, greedy, {MAX_GENERATE} tokens; total "
          f"{progress.elapsed:.0f} s\n")
    for c in CONTEXTS:
        print(f"@{c}: decode step {row[f'decode_ms@{c}']:.1f} ms, verify {k + 1} tokens "
              f"{row[f'verify_{k + 1}_ms@{c}']:.1f} ms = {row[f'verify_over_decode@{c}']:.2f}x, assistant step "
              f"{row[f'assistant_step_ms@{c}']:.1f} ms "
              f"(a round of {k} steps + verify = {row[f'round_over_decode@{c}']:.2f}x a decode step)")
    print(decode_line(row))
    print(ttft_line(row, f"draft pool pages {row['draft_kv_pages']}"))
    write_json(args.json, row)


if __name__ == "__main__":
    main()

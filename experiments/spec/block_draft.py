"""Block drafts (DFlash, DSpark, JetSpec) on SmolLM2 with random drafts of the real shape, against plain decoding.

No public DFlash, DSpark or JetSpec draft targets a model this small, so the drafts are random (5 qwen3 layers at
SmolLM2's width; DFlash's and JetSpec's block of 16, DSpark's of 7; JetSpec also as a tree of each depth's top 2):
their guesses are almost never accepted, so this measures what block drafting costs, not what a trained draft
gains. In one run, per row:

- the cost of one base verify call of k + 1 tokens against one decode step, at 64 and 1,536 tokens of context (the
  engine's own backend, medians); and of one draft block call there;
- decode tok/s with the method against plain, and the acceptance length, on a question about a ~1,500-token
  document (same tokens as plain is checked);
- TTFT of a second question on the document, warm (reuse on, the draft's pages restored without replay) vs cold.

    python -m experiments.spec.block_draft --onnxDir out/onnx/smollm2-blockbase --threads 2 \\
        [--methods jetspec,jetspec-top2]
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
from kvforge.contract.engine_dir import BASE_HIDDEN_INPUT, CONTEXT_TOKEN_MASK_INPUT
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.tools.bench.text import fit_document, spec_messages
from kvforge.tools.export.drafts.block_draft import export_block_draft, write_random_block_draft

# Rows: name -> (--specDecode method, block, --specDraftTopK); the public drafts' blocks.
METHODS = {"dflash": ("dflash", 16, 1), "dspark": ("dspark", 7, 1), "jetspec": ("jetspec", 16, 1),
           "jetspec-top2": ("jetspec", 16, 2)}


def main() -> None:
    parser = bench_parser(__doc__, repeats=5)
    parser.add_argument("--methods", default=",".join(METHODS), help="rows to run, comma-separated")
    args = parser.parse_args()
    rows = {name: METHODS[name] for name in args.methods.split(",")}
    progress = Progress()
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvforge-block-") as tmp:
        root = Path(tmp)
        progress("building the base")
        build_engine(args.onnxDir, root / "engine", replace(BUILD, spec_base=True))
        for method, block in sorted({(m, b) for m, b, _ in rows.values()}):
            progress(f"exporting and building a random {method} draft")
            write_random_block_draft(args.onnxDir, root / f"{method}_hf", kind=method, num_layers=5,
                                     block_size=block, seed=1, markov_rank=256)
            export_block_draft(root / f"{method}_hf", args.onnxDir, root / f"{method}_onnx")
            build_engine(root / f"{method}_onnx", root / f"{method}_engine",
                         replace(BUILD, spec_draft=True, cpu_attention="kernel"))
        plain = Engine(root / "engine", EngineConfig(num_threads=args.threads))
        document, doc_tokens = fit_document(plain.tokenizer.encode, DOCUMENT_TOKENS)
        questions = next(iter(spec_messages(document).values()))
        H = plain.engine_dir.model.hidden_size
        progress("plain")
        base_run = run_one(plain, chat_request(plain, questions[0], reuse=False))
        costs: dict[str, Any] = {}
        for context in CONTEXTS:
            costs[f"decode_ms@{context}"] = call_ms(plain.backend, H, 1, context, args.repeats)
        for name, (method, block, top_k) in rows.items():
            progress(f"{name}: verify and draft call costs")
            config = EngineConfig(num_threads=args.threads, spec_decode=method, spec_draft_top_k=top_k,
                                  spec_draft_engine_dir=str(root / f"{method}_engine"))
            engine = Engine(root / "engine", config)
            row: dict[str, Any] = {"block": block}
            draft = engine.proposer.backend  # type: ignore[union-attr]
            width = engine.proposer.base_width  # type: ignore[union-attr]
            for context in CONTEXTS:
                verify = call_ms(engine.backend, H, block, context, args.repeats)
                row[f"verify_{block}_ms@{context}"] = verify
                row[f"verify_over_decode@{context}"] = verify / costs[f"decode_ms@{context}"]
                extra = {BASE_HIDDEN_INPUT: np.zeros((1, block, width), np.float32),
                         CONTEXT_TOKEN_MASK_INPUT: np.zeros((1, block, 1), np.float32)}
                row[f"draft_block_ms@{context}"] = call_ms(draft, H, block, context, args.repeats, extra, masked=True)
            progress(f"{name}: decoding")
            run = run_one(engine, chat_request(engine, questions[0], reuse=False))
            row |= decode_figures(run, base_run)
            progress(f"{name}: warm vs cold TTFT")
            warm_engine = Engine(root / "engine", replace(config, enable_context_reuse=True))
            run_one(warm_engine, chat_request(warm_engine, questions[0]))
            warm = run_one(warm_engine, chat_request(warm_engine, questions[1]))
            cold = run_one(warm_engine, chat_request(warm_engine, questions[1], reuse=False))
            cache = warm_engine.profile().get("context_cache", {})
            row |= ttft_figures(warm, cold) | {
                "full_page_replays": cache.get("speculative", {}).get("full_page_replays", 0)}
            figures[name] = row
    figures["costs"] = costs
    print(f"\nblock-draft bench: SmolLM2 from {args.onnxDir}, random 5-layer drafts, {args.threads} threads, "
          f"document {doc_tokens} tokens, greedy, {MAX_GENERATE} tokens; total {progress.elapsed:.0f} s\n")
    print("   " + "  ".join(f"decode step @{c}: {costs[f'decode_ms@{c}']:.1f} ms" for c in CONTEXTS))
    for method, row in figures.items():
        if method == "costs":
            continue
        b = row["block"]
        print(f"{method} (block {b}): " + ", ".join(
            f"verify {b} tokens @{c} {row[f'verify_{b}_ms@{c}']:.1f} ms = {row[f'verify_over_decode@{c}']:.2f}x "
            f"a decode step, draft call {row[f'draft_block_ms@{c}']:.1f} ms" for c in CONTEXTS))
        print("   " + decode_line(row))
        print("   " + ttft_line(row, f"replays {row['full_page_replays']}"))
    write_json(args.json, figures)


if __name__ == "__main__":
    main()

"""Speculative decoding (prompt lookup, and EAGLE3 with a draft checkpoint) against plain decoding, in one run.

Workloads on SmolLM2 (chat template, greedy, EOS allowed): questions whose answers quote a ~1,500-token document,
a summary of that document, and unrelated chat (nothing to copy: what speculation costs when it cannot help).
Per workload and mode: decode tok/s (generated tokens after the first / time from the first token to the last),
TTFT, and for ngram the acceptance length (tokens committed per verify row) and rate. Outputs are compared token for
token with plain decoding. Modes alternate per request.

    python -m experiments.spec.spec_decode --onnxDir out/onnx/smollm2 --threads 2 --repeats 2
    python -m experiments.spec.spec_decode --onnxDir out/onnx/smollm2-base --eagle3Draft out/eagle3/smollm2-draft \\
        --threads 2

With --eagle3Draft (a Hugging Face EAGLE3 checkpoint, e.g. scripts/train_eagle3.py's; --onnxDir then needs the
hidden states it reads, llm_export --hiddenStateLayers) the base is built with --specBase, the draft exported and
built into its draft folder, and "eagle3 k=N" modes join (with --eagle3TopK K > 1, "eagle3 k=N topK" trees). Last,
with reuse on, the TTFT of a second question on the same document warm (its pages reused) against cold, per
speculative mode: what the EAGLE3 final-page replay costs a hit.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from experiments._common import Progress, bench_parser, median, run_alone, write_json
from experiments._common import chat_request as common_chat_request
from kvforge.builder.build import BuildOptions, build_engine
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import SamplingParams
from kvforge.tools.bench.text import SPEC_KINDS, fit_document, spec_messages

BUILD = BuildOptions(max_input_len=2048, max_kv_cache_capacity=2304, max_batch_size=1, tokens_per_page=128)
DOCUMENT_TOKENS = 1500
MAX_GENERATE = 160  # the prompts are llm_bench's spec_decode workload's (kvforge.tools.bench.text.spec_messages)


def chat_request(engine: Engine, text: str) -> EngineRequest:
    return common_chat_request(engine, text, SamplingParams(temperature=0.0, max_generate_length=MAX_GENERATE))


def run_one(engine: Engine, request: EngineRequest) -> dict[str, Any]:
    output = run_alone(engine, request)
    assert output.timing is not None
    generated = len(output.token_ids)
    profile = engine.profile()
    spec = profile.get("spec_decode_generation", {})
    return {"tokens": output.token_ids, "generated": generated, "ttft_ms": output.timing.ttft_ms,
            "decode_tok_s": (generated - 1) * 1e3 / output.timing.decode_ms if output.timing.decode_ms else 0.0,
            "acceptance_length": spec.get("acceptance_length", 1.0),
            "acceptance_rate": spec.get("average_acceptance_rate", 0.0),
            "verify_rows": spec.get("total_iterations", 0)}


def main() -> None:
    parser = bench_parser(__doc__, repeats=2)
    parser.add_argument("--draftSteps", type=int, nargs="+", default=[4, 8], help="--specDraftStep values to try")
    parser.add_argument("--eagle3Draft", type=Path, default=None,
                        help="an EAGLE3 draft checkpoint (Hugging Face format) for the --onnxDir base")
    parser.add_argument("--eagle3Steps", type=int, nargs="+", default=[2, 4], help="EAGLE3 --specDraftStep values")
    parser.add_argument("--eagle3TopK", type=int, nargs="+", default=[1],
                        help="EAGLE3 --specDraftTopK values (1: chains; k > 1: trees, as deep as each step value)")
    parser.add_argument("--eagle3VerifySize", type=int, default=0, help="trees' --specVerifySize (0: the default)")
    args = parser.parse_args()
    progress = Progress()
    with tempfile.TemporaryDirectory(prefix="kvforge-spec-") as tmp:
        engine_dir = Path(tmp) / "engine"
        build_engine(args.onnxDir, engine_dir, replace(BUILD, spec_base=args.eagle3Draft is not None))
        modes = {"plain": EngineConfig(num_threads=args.threads)}
        for k in args.draftSteps:
            modes[f"ngram k={k}"] = EngineConfig(num_threads=args.threads, spec_decode="ngram", spec_draft_step=k)
        if args.eagle3Draft is not None:
            from kvforge.tools.export.drafts.eagle3 import export_eagle3

            export_eagle3(args.eagle3Draft, args.onnxDir, Path(tmp) / "draft_onnx")
            build_engine(Path(tmp) / "draft_onnx", engine_dir / "draft", replace(BUILD, spec_draft=True))
            for k in args.eagle3Steps:
                for top in args.eagle3TopK:
                    name = f"eagle3 k={k}" + (f" top{top}" if top > 1 else "")
                    modes[name] = EngineConfig(num_threads=args.threads, spec_decode="eagle3", spec_draft_step=k,
                                               spec_draft_top_k=top,
                                               spec_verify_size=args.eagle3VerifySize if top > 1 else 0)
        engines = {name: Engine(engine_dir, config) for name, config in modes.items()}
        first = next(iter(engines.values()))
        document, doc_tokens = fit_document(first.tokenizer.encode, DOCUMENT_TOKENS)
        workloads = {SPEC_KINDS[kind]: texts for kind, texts in spec_messages(document).items()}
        results: dict[str, dict[str, list[dict[str, Any]]]] = {w: {m: [] for m in modes} for w in workloads}
        for repeat in range(args.repeats):
            for workload, texts in workloads.items():
                for text in texts:
                    order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
                    for mode in order:
                        progress(f"repeat {repeat + 1}/{args.repeats}: {workload}, {mode}")
                        engine = engines[mode]
                        results[workload][mode].append(run_one(engine, chat_request(engine, text)))
        questions = next(iter(workloads.values()))
        reuse = {}
        for mode, config in modes.items():
            if len(questions) < 2:
                break
            progress(f"warm vs cold TTFT: {mode}")
            engine = Engine(engine_dir, replace(config, enable_context_reuse=True))
            run_one(engine, chat_request(engine, questions[0]))  # publishes the document's pages
            # Warm first: the pool holds one sequence, so the cold run (lookup bypassed) evicts the document's pages.
            warm = run_one(engine, chat_request(engine, questions[1]))
            cold_request = chat_request(engine, questions[1])
            cold_request.sampling.reuse_context = False
            cold = run_one(engine, cold_request)
            cache = engine.profile().get("context_cache", {})
            reuse[mode] = {"cold_ttft_ms": cold["ttft_ms"], "warm_ttft_ms": warm["ttft_ms"],
                           "reused_tokens": cache.get("reused_tokens", 0),
                           "full_page_replays": cache.get("speculative", {}).get("full_page_replays", 0),
                           "same_tokens": warm["tokens"] == cold["tokens"]}
    print(f"\nspeculative decoding bench: SmolLM2 engine from {args.onnxDir}, {args.threads} threads, "
          f"{args.repeats} repeats, document {doc_tokens} tokens, greedy, max_generate_length {MAX_GENERATE}; "
          f"total {progress.elapsed:.0f} s\n")
    figures: dict[str, Any] = {}
    header = f"   {'mode':<18} {'decode tok/s':>12} {'vs plain':>9} {'TTFT ms':>9} {'accept len':>10} " \
             f"{'accept rate':>11} {'same tokens':>11}"
    for workload, by_mode in results.items():
        print(f"{workload}: {len(workloads[workload])} prompt(s)")
        print(header)
        plain_rate = median([r["decode_tok_s"] for r in by_mode["plain"]])
        figures[workload] = {}
        for mode, runs in by_mode.items():
            rate = median([r["decode_tok_s"] for r in runs])
            same = all(r["tokens"] == p["tokens"] for r, p in zip(runs, by_mode["plain"], strict=True))
            row = {"decode_tok_s": rate, "vs_plain": rate / plain_rate if plain_rate else 0.0,
                   "ttft_ms": median([r["ttft_ms"] for r in runs]),
                   "acceptance_length": median([r["acceptance_length"] for r in runs]),
                   "acceptance_rate": median([r["acceptance_rate"] for r in runs]),
                   "generated": median([r["generated"] for r in runs]), "same_tokens": same}
            figures[workload][mode] = row
            print(f"   {mode:<18} {rate:12.1f} {row['vs_plain']:9.2f} {row['ttft_ms']:9.0f} "
                  f"{row['acceptance_length']:10.2f} {row['acceptance_rate']:11.2f} {str(same):>11}")
        print()
    if reuse:
        print("warm vs cold TTFT on a second question about the document (reuse on; the first published it):")
        print(f"   {'mode':<18} {'cold ms':>9} {'warm ms':>9} {'warm/cold':>9} {'reused':>7} {'replays':>7} "
              f"{'same':>5}")
        for mode, row in reuse.items():
            row["warm_over_cold"] = row["warm_ttft_ms"] / row["cold_ttft_ms"] if row["cold_ttft_ms"] else 0.0
            print(f"   {mode:<18} {row['cold_ttft_ms']:9.0f} {row['warm_ttft_ms']:9.0f} {row['warm_over_cold']:9.2f} "
                  f"{row['reused_tokens']:7d} {row['full_page_replays']:7d} {str(row['same_tokens']):>5}")
        figures["warm_vs_cold_ttft"] = reuse
    write_json(args.json, figures)


if __name__ == "__main__":
    main()

"""Documents across processes through the shared tier (issue 53, item 6): what a second process, its own cache
empty, reuses of the documents a first process computed into a fresh Redis.

Process A serves the retrieval workload of `document_reuse.py` (seed 0) with `--documentReuse --sharedCache` into a
fresh Redis database and exits (its writes are flushed at close). Process B then serves *different* requests over
the same reports: another seed (other reports asked, another order, other timestamps) and the questions reworded.
B runs its requests three times, each on a fresh engine (empty local cache), in this order:

- cold: no reuse at all (the reference for TTFT and answers);
- local: `--documentReuse`, no tier (B alone: each report is produced the first time B sees it);
- tier: `--documentReuse --sharedCache` on A's Redis (a report's standalone prefill loads the full pages A stored);
- tier-full (with --checkFull): tier with `--documentRepair full`, whose tokens must equal cold's.

Per run: cached tokens over prompt tokens and over document tokens, the tier's hits and loaded tokens, median and
mean TTFT, TTFT over the requests that bring B a report it has not seen, answers right, and whether the generated
tokens equal cold's. `tier` against `local` is the tier's gain; with `--policy full` both must equal cold.

    python -m experiments.reuse.document_tier --engineDir out/engines/smollm2 --threads 2 \\
        --json out/document_tier.json
    python -m experiments.reuse.document_tier --quick   # the tiny random engine: checks the script only
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from experiments._common import rerun_command
from experiments.reuse._common import reports, workload
from tests.support.stores import RedisServer  # the tests' store harness

PHASES = ("cold", "local", "tier")
WORKER_TIMEOUT_S = 900


def reworded(requests: list[tuple[list[dict[str, Any]], str]]) -> list[tuple[list[dict[str, Any]], str]]:
    """The same requests with their question asked in other words (the documents are untouched)."""
    out = []
    for messages, answer in requests:
        system, user = messages
        *parts, question = user["content"]
        text = question["text"].replace("What colour was the", "Which colour did the crew paint the")
        text = text.replace(" painted? Answer with one word.", "? Reply with the colour only.")
        out.append(([system, {"role": "user", "content": [*parts, {"type": "text", "text": text}]}], answer))
    return out


def requests_for(process: str, args: argparse.Namespace) -> list[tuple[list[dict[str, Any]], str]]:
    docs = reports(args.reports, args.filler)
    if process == "A":
        return workload(docs, args.requests, args.shown, args.seed)
    return reworded(workload(docs, args.requests, args.shown, args.seed + 1))


def run_phase(args: argparse.Namespace, phase: str, requests: list[tuple[list[dict[str, Any]], str]]
              ) -> dict[str, Any]:
    """One fresh engine (empty local cache) serving `requests` in order."""
    from kvforge import LLM, SamplingParams

    options: dict[str, Any] = {"num_threads": args.threads, "enable_context_reuse": phase != "cold"}
    if phase != "cold":
        options.update(document_reuse=True, document_repair="full" if phase == "tier-full" else args.policy)
    if phase.startswith("tier"):
        options["shared_cache"] = args.url
    llm = LLM(str(args.engineDir), **options)
    sampling = SamplingParams(temperature=0, max_generate_length=args.maxTokens)
    encode = llm.engine.tokenizer.encode
    seen: set[str] = set()
    results = []
    try:
        for messages, answer in requests:
            documents = [p["text"] for p in messages[1]["content"] if p["type"] == "document"]
            [output] = llm.chat(messages, sampling)
            assert output.timing is not None
            results.append({"tokens": output.token_ids, "prompt": len(output.prompt_token_ids),
                            "document_tokens": sum(len(encode(d)) for d in documents),
                            "cached": output.cached_tokens, "ttft_ms": output.timing.ttft_ms,
                            "brings_new": bool(set(documents) - seen), "right": answer in output.text.lower()})
            seen.update(documents)
        cache = llm.context_cache_metrics()
    finally:
        llm.close()
    return {"results": results, "documents": cache.get("documents", {}), "shared_tier": cache.get("shared_tier", {})}


def worker(args: argparse.Namespace) -> None:
    """One process: each asked phase on its own fresh engine, then one JSON line on stdout."""
    requests = requests_for(args.process, args)
    print(json.dumps({phase: run_phase(args, phase, requests) for phase in args.phases.split(",")}))


def run_process(args: argparse.Namespace, process: str, phases: list[str]) -> dict[str, Any]:
    argv, env = rerun_command(__spec__.name if __spec__ else "experiments.reuse.document_tier")
    command = [*argv, "--role", "worker", "--process", process, "--phases", ",".join(phases), "--url", args.url,
               "--engineDir", str(args.engineDir)]
    for flag in ("threads", "requests", "reports", "shown", "filler", "maxTokens", "seed", "policy"):
        command += [f"--{flag}", str(getattr(args, flag))]
    proc = subprocess.run(command, capture_output=True, text=True, check=False, timeout=WORKER_TIMEOUT_S, env=env)
    if proc.returncode:
        raise SystemExit(f"process {process} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    cold = runs["cold"]["results"]
    cold_ttft = statistics.median(r["ttft_ms"] for r in cold)
    cold_new = [r["ttft_ms"] for r in cold if r["brings_new"]]
    summary = {}
    for phase, run in runs.items():
        results = run["results"]
        new = [r["ttft_ms"] for r, c in zip(results, cold, strict=True) if c["brings_new"]]
        tier = run["shared_tier"]
        summary[phase] = {
            "cached_share_of_prompt": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
            # Prefix pages before the first document are counted too: the workload's timestamp keeps them near 0.
            "cached_share_of_documents": sum(r["cached"] for r in results) / sum(r["document_tokens"] for r in results),
            "tier_hits": tier.get("hits", 0), "tier_lookups": tier.get("lookups", 0),
            "tier_loaded_tokens": tier.get("loaded_tokens", 0),
            "tier_faults": tier.get("errors", 0) + tier.get("timeouts", 0) + tier.get("corrupt", 0),
            "median_ttft_ms": statistics.median(r["ttft_ms"] for r in results),
            "ttft_vs_cold": statistics.median(r["ttft_ms"] for r in results) / cold_ttft,
            "mean_ttft_ms": statistics.mean(r["ttft_ms"] for r in results),
            "new_report_requests": len(new),
            "new_report_ttft_vs_cold": statistics.mean(new) / statistics.mean(cold_new) if new else None,
            "answers_right": sum(r["right"] for r in results),
            "same_tokens_as_cold": sum(r["tokens"] == c["tokens"] for r, c in zip(results, cold, strict=True)),
            "documents": run["documents"],
        }
    return summary


def quick_engine(root: Path) -> Path:
    """The tiny random llama with 16-token pages, as document_reuse.py --quick builds it."""
    from kvforge.builder.build import BuildOptions, build_engine
    from kvforge.tools.export.sources.synthetic import synthetic_model
    from kvforge.tools.export.writer import write_onnx_dir

    write_onnx_dir(synthetic_model("tiny-llama"), root / "onnx")
    build_engine(root / "onnx", root / "engine",
                 BuildOptions(max_input_len=1024, max_kv_cache_capacity=2048, max_batch_size=1, tokens_per_page=16))
    return root / "engine"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engineDir", type=Path, help="the engine (make demo builds out/engines/smollm2)")
    parser.add_argument("--quick", action="store_true", help="a tiny random engine and a short workload")
    parser.add_argument("--policy", default="first-page", choices=("none", "first-page", "overlap", "full"),
                        help="--documentRepair for A and for B's local and tier runs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--reports", type=int, default=8)
    parser.add_argument("--shown", type=int, default=3)
    parser.add_argument("--filler", type=int, default=6)
    parser.add_argument("--maxTokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--checkFull", action="store_true", help="B also runs `tier` with --documentRepair full "
                        "(row tier-full): its tokens must equal cold's")
    parser.add_argument("--url", help="a Redis (redis://HOST:PORT/DB) to use instead of a fresh one started here; "
                        "its database must be empty")
    parser.add_argument("--role", choices=("main", "worker"), default="main", help=argparse.SUPPRESS)
    parser.add_argument("--process", choices=("A", "B"), default="A", help=argparse.SUPPRESS)
    parser.add_argument("--phases", default=",".join(PHASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "worker":
        worker(args)
        return
    if (args.engineDir is None) == (not args.quick):
        parser.error("give --engineDir or --quick")
    with tempfile.TemporaryDirectory() as scratch:
        if args.quick:
            args.engineDir = quick_engine(Path(scratch))
            args.requests, args.filler = min(args.requests, 6), min(args.filler, 1)
        summary = measure(args, Path(scratch))
    report(summary, args)


def measure(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """A into a fresh Redis (or args.url), then B's three runs: the summary per B run, plus A's own."""
    if args.url:
        return _measure(args)
    with RedisServer(scratch / "redis") as redis:
        args.url = redis.url
        try:
            return _measure(args)
        finally:
            args.url = None


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    first = run_process(args, "A", ["tier"])
    second = run_process(args, "B", [*PHASES, *(["tier-full"] if args.checkFull else [])])
    summary = summarize(second)
    summary["A"] = {k: v for k, v in summarize({"cold": first["tier"], "tier": first["tier"]})["tier"].items()
                    if k not in ("ttft_vs_cold", "same_tokens_as_cold", "new_report_ttft_vs_cold")}
    return summary


def report(summary: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"policy {args.policy}; {args.requests} requests per process")
    print(f"{'run':<11} {'cached/prompt':>13} {'cached/docs':>11} {'tier hits':>9} {'loaded':>7} {'TTFT ms':>8}"
          f" {'vs cold':>7} {'new-report TTFT vs cold':>23} {'right':>6} {'= cold':>7}")
    for phase in ("A", *PHASES, *(["tier-full"] if "tier-full" in summary else [])):
        row = summary[phase]
        new = row.get("new_report_ttft_vs_cold")
        print(f"{('A tier' if phase == 'A' else 'B ' + phase):<11} {row['cached_share_of_prompt']:>13.1%}"
              f" {row['cached_share_of_documents']:>11.1%} {row['tier_hits']:>9} {row['tier_loaded_tokens']:>7}"
              f" {row['median_ttft_ms']:>8.1f} {row.get('ttft_vs_cold', float('nan')):>7.2f}"
              f" {'-' if new is None else f'{new:.2f}':>23} {row['answers_right']:>3}/{args.requests:<2}"
              f" {row.get('same_tokens_as_cold', '-'):>4}/{args.requests:<2}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"settings": settings, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()

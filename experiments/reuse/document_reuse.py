"""Document reuse on a retrieval workload (issue 37): token hit rate, TTFT against cold, and agreement with full
prefill for each repair policy.

The workload: N short reports, each with one fact (which machine, which site, which colour). Each request shows K
of them in a shuffled order behind a system prompt with a fresh timestamp, as documents, then asks about the fact of
one report it shows. Every policy runs the same requests in the same order on its own engine (batch of one):

- cold: no reuse at all (the reference: full prefill);
- prefix: --enableContextReuse only (the timestamp and the shuffling leave it almost nothing);
- none, first-page, overlap, full (and any other policy the engine offers): --documentReuse with that
  --documentRepair.

Per policy: cached tokens / prompt tokens, median TTFT and its ratio to cold's, answers right (the fact's word
among the answer's first tokens, with a 95 % Wilson interval), and top-1 agreement with cold over the first 16
generated tokens (the share of positions holding cold's token, and the requests whose first 8 and 16 tokens are all
cold's). The agreement against the
policies' repair budget (tokens recomputed / document tokens) is the issue's curve: one point per policy.

    python -m experiments.reuse.document_reuse --engineDir out/engines/smollm2 --threads 2 \\
        --json out/document_reuse.json
    python -m experiments.reuse.document_reuse --quick   # a tiny random engine: checks the script, measures nothing

Issue 53's workload: 64 requests over 16 reports, 3 to 5 shown per request:

    python -m experiments.reuse.document_reuse --engineDir out/engines/smollm2 --requests 64 --reports 16 \
        --shown 3-5 --policies none,first-page,overlap,attention --json out/document_reuse_64.json

`--form plain` sends the same requests as plain text, the way RAG clients do (the reports and the question in one
user message, joined by blank lines, no document parts), with `--documentSegments paragraphs` on for the reusing
policies (issue 53 item 5); `--form both` runs the marked and the plain form and prints the plain form's cached share
against the marked form's, policy by policy. Each form is compared with its own cold run (their prompts differ by the
separators).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

from experiments.reuse._common import reports, workload
from kvforge import LLM, SamplingParams
from kvforge.runtime.context_cache.types.document_chunks import REPAIR_POLICIES

POLICIES = ("cold", "prefix", *REPAIR_POLICIES)
AGREEMENT_TOKENS = 16
PREFIX_TOKENS = 8  # issue 53: the first 8 generated tokens equal cold's in >= 70 % of requests
FORMS = ("marked", "plain", "both")
Requests = list[tuple[list[dict[str, Any]], str]]


def plain_text(requests: Requests) -> Requests:
    """The requests as a client that does not mark documents sends them: each user message's parts as one text, the
    reports and the question joined by blank lines."""
    out = []
    for messages, answer in requests:
        system, user = messages
        texts = [part["text"] for part in user["content"] if part["text"].strip()]
        out.append(([system, {"role": "user", "content": "\n\n".join(text.strip() for text in texts)}], answer))
    return out


def wilson(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion (it stays inside [0, 1] at 0 or n successes)."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def shown_range(text: str) -> int | tuple[int, int]:
    """--shown: K, or LOW-HIGH (a count drawn per request)."""
    low, _, high = text.partition("-")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shown: give K or LOW-HIGH, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"--shown: need 1 <= LOW <= HIGH, got {text!r}")
    return bounds if high else bounds[0]


def engine_option(text: str) -> tuple[str, Any]:
    """--engineOption KEY=VALUE: a kvforge.LLM keyword for the reusing policies (a JSON value, else a string)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--engineOption: give KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def engine_options(policy: str, threads: int, shared_cache: str | None = None,
                   segments: bool = False, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    options: dict[str, Any] = {"num_threads": threads, "enable_context_reuse": policy != "cold"}
    if policy not in ("cold", "prefix"):
        options.update(document_reuse=True, document_repair=policy, **(extra or {}))
        if segments:
            options["document_segments"] = "paragraphs"
    if shared_cache and policy != "cold":
        options["shared_cache"] = shared_cache
    return options


def run_policy(engine_dir: Path, policy: str, requests: Requests, threads: int, max_tokens: int,
               shared_cache: str | None = None, segments: bool = False,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    llm = LLM(str(engine_dir), **engine_options(policy, threads, shared_cache, segments, extra))
    sampling = SamplingParams(temperature=0, max_generate_length=max_tokens)
    results = []
    try:
        for messages, answer in requests:
            [output] = llm.chat(messages, sampling)
            assert output.timing is not None
            results.append({"tokens": output.token_ids, "text": output.text, "prompt": len(output.prompt_token_ids),
                            "cached": output.cached_tokens, "ttft_ms": output.timing.ttft_ms,
                            "right": answer in output.text.lower()})
        documents = llm.context_cache_metrics().get("documents", {}) if policy != "cold" else {}
    finally:
        llm.close()
    return {"results": results, "documents": documents}


def agreement(tokens: list[int], reference: list[int]) -> float:
    """The share of the reference's first tokens (up to AGREEMENT_TOKENS) this answer holds at the same position."""
    reference = reference[:AGREEMENT_TOKENS]
    if not reference:
        return 1.0
    return sum(a == b for a, b in zip(tokens, reference, strict=False)) / len(reference)


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    cold = runs["cold"]["results"]
    cold_ttft = statistics.median(r["ttft_ms"] for r in cold)
    summary = {}
    for policy, run in runs.items():
        results, documents = run["results"], run["documents"]
        agree = [agreement(r["tokens"], c["tokens"]) for r, c in zip(results, cold, strict=True)]
        document_tokens = documents.get("reused_tokens", 0) + documents.get("repaired_tokens", 0)
        ttft = statistics.median(r["ttft_ms"] for r in results)
        right = sum(r["right"] for r in results)
        summary[policy] = {
            "token_hit_rate": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
            "median_ttft_ms": ttft,
            "ttft_vs_cold": ttft / cold_ttft,
            "requests": len(results),
            "answers_right": right,
            "answers_right_95": wilson(right, len(results)),
            "identical_8": sum(r["tokens"][:PREFIX_TOKENS] == c["tokens"][:PREFIX_TOKENS]
                               for r, c in zip(results, cold, strict=True)),
            "top1_agreement": statistics.mean(agree),
            "identical_16": sum(r["tokens"][:AGREEMENT_TOKENS] == c["tokens"][:AGREEMENT_TOKENS]
                                for r, c in zip(results, cold, strict=True)),
            "repair_budget": documents.get("repaired_tokens", 0) / document_tokens if document_tokens else None,
            "documents": documents,
        }
    return summary


def issue_targets(summary: dict[str, Any]) -> dict[str, bool]:
    """Issue 37's and 53's targets on this workload, for the policies that ran (on SmolLM2 they are the issues'
    numbers; issue 53's are for its workload of 64 requests)."""
    out = {}
    if "none" in summary:
        none = summary["none"]
        out["none: cached >= 70 % of prompt tokens and median TTFT <= 0.4x cold"] = \
            none["token_hit_rate"] >= 0.7 and none["ttft_vs_cold"] <= 0.4
    if "first-page" in summary:  # the default policy
        default, cold = summary["first-page"], summary["cold"]
        out["first-page (default): at most one answer fewer than full prefill, cached >= 40 %"] = \
            default["answers_right"] >= cold["answers_right"] - 1 and default["token_hit_rate"] >= 0.4
    if "attention" in summary:
        row, cold = summary["attention"], summary["cold"]
        out["attention: cached >= 75 %, median TTFT <= 0.45x cold"] = \
            row["token_hit_rate"] >= 0.75 and row["ttft_vs_cold"] <= 0.45
        out["attention: answers right >= cold's - 1 per 16 requests"] = \
            row["answers_right"] >= cold["answers_right"] - row["requests"] / 16
        out["attention: first 8 tokens equal cold's in >= 70 % of requests"] = \
            row["identical_8"] >= 0.7 * row["requests"]
    if "full" in summary:
        out["full: token-exact with cold"] = summary["full"]["identical_16"] == summary["cold"]["identical_16"]
    return out


def quick_engine(root: Path) -> Path:
    """The tiny random llama, built for prompts of a few hundred tokens: checks the script end to end in seconds."""
    from kvforge.builder.build import BuildOptions, build_engine
    from kvforge.tools.export.sources.synthetic import synthetic_model
    from kvforge.tools.export.writer import write_onnx_dir

    write_onnx_dir(synthetic_model("tiny-llama"), root / "onnx")
    build_engine(root / "onnx", root / "engine",
                 BuildOptions(max_input_len=2048, max_kv_cache_capacity=4096, max_batch_size=1, tokens_per_page=16))
    return root / "engine"


def print_summary(summary: dict[str, Any], requests: int) -> None:
    print(f"{'policy':<11} {'hit rate':>8} {'TTFT ms':>8} {'vs cold':>7} {'right (95 % interval)':>21} {'top-1':>6}"
          f" {'same 8':>7} {'same 16':>7} {'repair':>6}")
    for policy, row in summary.items():
        budget = "-" if row["repair_budget"] is None else f"{row['repair_budget']:.2f}"
        low, high = row["answers_right_95"]
        right = f"{row['answers_right']}/{requests} ({low:.2f}-{high:.2f})"
        print(f"{policy:<11} {row['token_hit_rate']:>8.1%} {row['median_ttft_ms']:>8.1f} {row['ttft_vs_cold']:>7.2f}"
              f" {right:>21} {row['top1_agreement']:>6.2f}"
              f" {row['identical_8']:>3}/{requests:<3} {row['identical_16']:>3}/{requests:<3} {budget:>6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engineDir", type=Path, help="the engine (make demo builds out/engines/smollm2)")
    parser.add_argument("--quick", action="store_true", help="a tiny random engine and a short workload")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--reports", type=int, default=8, help="reports to draw from (n)")
    parser.add_argument("--shown", type=shown_range, default=3, help="reports per request: K, or LOW-HIGH drawn per "
                        "request (issue 53's workload: 3-5)")
    parser.add_argument("--engineOption", type=engine_option, action="append", default=[], metavar="KEY=VALUE",
                        help="a kvforge.LLM keyword for the reusing policies, e.g. document_repair_budget=0.2")
    parser.add_argument("--filler", type=int, default=6, help="filler paragraphs per report (its length; 6: about "
                        "270 SmolLM2 tokens, two of make demo's 128-token pages)")
    parser.add_argument("--fillerSentences", type=int, help="instead of --filler: this many filler sentences (4: "
                        "about 67 SmolLM2 tokens, half of a 128-token page: the short documents of issue 53)")
    parser.add_argument("--maxTokens", type=int, default=AGREEMENT_TOKENS)
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated; cold is always run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--form", choices=FORMS, default="marked", help="documents as parts (marked), as plain text "
                        "with --documentSegments paragraphs (plain), or both, compared")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--sharedCache", help="a KV tier (redis://HOST:PORT/DB) for the reusing policies: run the "
                        "script twice with one policy (--policies none), and the second process's hit rate is what "
                        "it reused of what the first computed")
    args = parser.parse_args()
    policies = ["cold", *[p for p in args.policies.split(",") if p and p != "cold"]]
    unknown = set(policies) - set(POLICIES)
    if unknown or (args.engineDir is None) == (not args.quick):
        parser.error(f"give --engineDir or --quick; policies are {', '.join(POLICIES)}" +
                     (f" (not {', '.join(sorted(unknown))})" if unknown else ""))
    forms = ["marked", "plain"] if args.form == "both" else [args.form]
    summaries = {}
    with tempfile.TemporaryDirectory() as scratch:
        if args.quick:
            engine_dir = quick_engine(Path(scratch))
            args.requests, args.filler = min(args.requests, 6), min(args.filler, 1)
        else:
            engine_dir = args.engineDir
        requests = workload(reports(args.reports, args.filler, args.fillerSentences), args.requests, args.shown,
                            args.seed)
        for form in forms:
            sent = plain_text(requests) if form == "plain" else requests
            runs = {policy: run_policy(engine_dir, policy, sent, args.threads, args.maxTokens, args.sharedCache,
                                       segments=form == "plain", extra=dict(args.engineOption))
                    for policy in policies}
            summaries[form] = summarize(runs)
    for form, summary in summaries.items():
        print(f"\n{form} form" + (" (--documentSegments paragraphs)" if form == "plain" else ""))
        print_summary(summary, args.requests)
    summary = summaries[forms[0]]
    curve = sorted((row["repair_budget"], row["top1_agreement"], policy) for policy, row in summary.items()
                   if row["repair_budget"] is not None)
    print(f"\nagreement against repair budget ({forms[0]} form; share of document tokens recomputed):")
    for budget, agree, policy in curve:
        print(f"  {budget:5.2f} {'#' * round(agree * 40):<40} {agree:.2f} {policy}")
    segmentation: dict[str, dict[str, Any]] = {}
    if len(forms) == 2:
        print("\nplain text with segmentation against marked documents (cached share, answers right):")
        for policy in [p for p in policies if p not in ("cold", "prefix")]:
            marked_row, plain_row = summaries["marked"][policy], summaries["plain"][policy]
            ratio = plain_row["token_hit_rate"] / marked_row["token_hit_rate"] if marked_row["token_hit_rate"] else None
            segmentation[policy] = {"cached_ratio": ratio, "answers_right_marked": marked_row["answers_right"],
                                    "answers_right_plain": plain_row["answers_right"]}
            shown = "-" if ratio is None else f"{ratio:.2f}x"
            print(f"  {policy:<11} {shown:>6}  right {plain_row['answers_right']}/{args.requests} plain, "
                  f"{marked_row['answers_right']}/{args.requests} marked")
    targets = issue_targets(summary)
    if segmentation:
        targets["plain text with segmentation: cached >= 0.9x the marked form's, each reusing policy"] = all(
            row["cached_ratio"] >= 0.9 for row in segmentation.values() if row["cached_ratio"] is not None)
    for name, met in targets.items():
        print(f"{'met ' if met else 'MISSED'} {name}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": vars(args) | {"engineDir": str(args.engineDir), "json": None},
                                         "summary": summary, "forms": summaries, "segmentation": segmentation,
                                         "targets": targets, "loadavg": Path("/proc/loadavg").read_text().strip()},
                                        indent=2, default=str))


if __name__ == "__main__":
    main()

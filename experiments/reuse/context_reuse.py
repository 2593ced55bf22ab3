"""Context reuse: TTFT with and without the context cache, bookkeeping cost, and 0%-hit throughput.

Four measurements on one engine, in one run, on the CPU backend (medians over --repeats). Every request
runs alone through the engine loop (Engine.add_request + file_loop.drain):

1. shared document: a report fitted to exactly 12 pages (1,536 tokens) followed by four questions (raw
   prompts, no chat template, max_generate_length 1). cold = reuse_context=False (lookup `bypass`); warm =
   reuse_context=True (`use_cache`) after question 1 published the document; ideal = the question tokens
   alone prefilled with no cache (ignores their attention to the cached context); floor = runner.forward
   alone for the uncached suffix on the cached pages (the engine's cost including that attention, without
   the engine loop around it);
2. a 6-turn chat (chat template, the model's own answers as assistant turns, commit policy
   including_generated_tokens) with the same figures per turn;
3. cache bookkeeping per request: every context-cache manager call the warm request makes (in-flight
   check, acquire, grow, in-flight indexing, publish, release), from the manager's own
   `bookkeeping_nanoseconds` counter, as a share of the cold prefill (its engine calls) of the same prompt;
4. tokens/s of 8 distinct 300-token prompts (0% hits) with reuse off (enable_context_reuse=False) vs on
   (use_cache), each prompt run in every mode back to back in alternating order to cancel drift; a control
   mode (bypass on the reuse-on engine) shows how much two ORT sessions differ on this machine.

Repeats use fresh cache salts, so every repeat sees the same misses and hits.

    python -m experiments.reuse.context_reuse --onnxDir out/onnx/smollm2 --threads 2 --repeats 3 --json out.json
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from experiments._common import Progress, bench_parser, build_and_open, fit_document, greedy, median, write_json
from experiments.reuse._common import Bench, Run, engine_floor, make_request
from kvforge.builder.build import BuildOptions
from kvforge.runtime.sequence import EngineRequest
from kvforge.tools.bench.text import CHAT_SYSTEM, CHAT_TURNS, QUESTIONS, UNRELATED_OPENERS

TOKENS_PER_PAGE = 128
DOC_PAGES = 12  # the shared document is fitted to exactly this many pages, so the questions start a page
CHAT_MAX_GENERATE = 24
THROUGHPUT_PROMPTS = 8
THROUGHPUT_PROMPT_TOKENS = 300
THROUGHPUT_MAX_GENERATE = 16
TARGET_WARM_OVER_IDEAL = 1.15
TARGET_BOOKKEEPING_SHARE = 0.01
TARGET_ZERO_HIT_RATIO = 0.99

# --- workload text (the report, questions and chat are in kvforge.tools.bench.text) ---------------------

# Openers differ from the first token on, so no two throughput prompts share even a partial page.
THROUGHPUT_OPENERS = UNRELATED_OPENERS


def suffix_request(request: EngineRequest, start: int) -> EngineRequest:
    """The tokens from `start` on as a prompt of their own, without salt: the ideal cost of computing only them."""
    return EngineRequest(request.prompt_ids[start:], replace(request.sampling, max_generate_length=1))


# --- the four measurements ----------------------------------------------------------------------------


FIGURES = ("cold", "warm", "ideal", "floor", "cold_prefill", "bookkeeping_us")


def ttft_row(samples: dict[str, list[float]], info: dict[str, Any]) -> dict[str, Any]:
    """Medians of one prompt's samples and the ratios between them (floor is absent on a miss)."""
    m = {name: median(values) for name, values in samples.items() if values}
    return {**info, "cold_ttft_ms": m["cold"], "warm_ttft_ms": m["warm"], "ideal_ttft_ms": m["ideal"],
            "floor_ms": m.get("floor"), "warm_over_ideal": m["warm"] / m["ideal"],
            "cold_over_warm": m["cold"] / m["warm"],
            "warm_over_floor": m["warm"] / m["floor"] if "floor" in m else None,
            "cold_prefill_ms": m["cold_prefill"], "bookkeeping_us": m["bookkeeping_us"], "samples": samples}


def measure(bench: Bench, request: EngineRequest, samples: dict[str, list[float]],
            ideal_start: int | None = None) -> tuple[Run, Run]:
    """warm (use_cache), cold (bypass), ideal (the tokens from ideal_start, default the uncached suffix,
    alone with no cache) and, on a hit, the engine floor; appends their times to `samples`."""
    warm = bench.run(request, reuse=True)
    cold = bench.run(request, reuse=False)
    cached = warm.cached_tokens
    ideal = bench.run(suffix_request(request, cached if ideal_start is None else ideal_start), reuse=False)
    samples["cold"].append(cold.ttft_ms)
    samples["cold_prefill"].append(cold.prefill_ms)
    samples["warm"].append(warm.ttft_ms)
    samples["ideal"].append(ideal.ttft_ms)
    samples["bookkeeping_us"].append(warm.bookkeeping_us)
    if cached:
        floor_ms, floor_start = engine_floor(bench.engine, request)
        assert floor_start == cached, "the floor lease reused a different prefix than the warm request"
        samples["floor"].append(floor_ms)
    return warm, cold


def shared_document(bench: Bench, repeats: int, checks: list[str]) -> dict[str, Any]:
    engine = bench.engine
    encode = engine.tokenizer.encode
    doc_text, doc_tokens = fit_document(encode, DOC_PAGES * TOKENS_PER_PAGE)
    samples: list[dict[str, list[float]]] = [{name: [] for name in FIGURES} for _ in QUESTIONS]
    info: list[dict[str, Any]] = [{} for _ in QUESTIONS]
    for r in range(repeats):
        salt = f"doc-{r}"  # a fresh salt per repeat: question 1 misses again, 2-4 hit what 1 published
        for qi, question in enumerate(QUESTIONS):
            messages = [{"role": "user", "content": doc_text + question}]
            request = make_request(engine, messages, max_generate_length=1, chat=False, salt=salt)
            if request.prompt_ids[:doc_tokens] != encode(doc_text):
                checks.append(f"doc Q{qi + 1}: the document tokens change when the question follows")
            # The ideal is the question alone (from the document's end) for Q1's miss as for the hits.
            warm, cold = measure(bench, request, samples[qi], ideal_start=doc_tokens)
            expected_cached = 0 if qi == 0 else doc_tokens - doc_tokens % TOKENS_PER_PAGE
            if warm.cached_tokens != expected_cached:
                checks.append(f"doc Q{qi + 1} repeat {r}: cached_tokens {warm.cached_tokens} != {expected_cached}")
            if warm.token_ids != cold.token_ids:
                checks.append(f"doc Q{qi + 1} repeat {r}: warm token {warm.token_ids} != cold {cold.token_ids}")
            info[qi] = {"label": f"Q{qi + 1}", "question": question.strip(), "prompt_tokens": len(request.prompt_ids),
                        "cached_tokens": warm.cached_tokens, "suffix_tokens": len(request.prompt_ids) - doc_tokens,
                        "token": engine.tokenizer.token_text(warm.token_ids[0]),
                        "cold_token_id": cold.token_ids[0], "warm_token_id": warm.token_ids[0]}
    return {"document_tokens": doc_tokens, "document_pages": doc_tokens / TOKENS_PER_PAGE,
            "document_words": len(doc_text.split()), "chat_template": False,
            "questions": [ttft_row(s, i) for s, i in zip(samples, info, strict=True)]}


def chat(bench: Bench, repeats: int, checks: list[str]) -> dict[str, Any]:
    engine = bench.engine
    samples: list[dict[str, list[float]]] = [{name: [] for name in FIGURES} for _ in CHAT_TURNS]
    info: list[dict[str, Any]] = [{} for _ in CHAT_TURNS]
    answers_first: list[str] = []
    for r in range(repeats):
        salt = f"chat-{r}"  # a fresh salt per repeat: turn 1 starts from an empty cache every time
        messages = [{"role": "system", "content": CHAT_SYSTEM}]
        answers = []
        for ti, turn in enumerate(CHAT_TURNS):
            messages.append({"role": "user", "content": turn})
            request = make_request(engine, messages, max_generate_length=CHAT_MAX_GENERATE, chat=True, salt=salt)
            warm, cold = measure(bench, request, samples[ti])
            cached = warm.cached_tokens
            if warm.token_ids != cold.token_ids:
                checks.append(f"chat turn {ti + 1} repeat {r}: warm and cold answers differ")
            answers.append(warm.output.text)
            messages.append({"role": "assistant", "content": warm.output.text})
            if r == 0:
                info[ti] = {"label": f"T{ti + 1}", "prompt_tokens": len(request.prompt_ids), "cached_tokens": cached,
                            "completion_tokens": len(warm.token_ids)}
            elif cached != info[ti]["cached_tokens"]:
                checks.append(f"chat turn {ti + 1} repeat {r}: cached_tokens {cached} != {info[ti]['cached_tokens']}")
        if r == 0:
            answers_first = answers
        elif answers != answers_first:
            checks.append(f"chat repeat {r}: the conversation differs from repeat 0")
    return {"chat_template": True, "max_generate_length": CHAT_MAX_GENERATE, "answers": answers_first,
            "turns": [ttft_row(s, i) for s, i in zip(samples, info, strict=True)]}


def throughput_prompts(encode: Callable[[str], list[int]], doc_text: str) -> list[list[int]]:
    """Eight distinct prompts of exactly THROUGHPUT_PROMPT_TOKENS tokens, each from its own opener word."""
    words = doc_text.split()
    prompts = []
    for i, opener in enumerate(THROUGHPUT_OPENERS):
        start = (i * 131) % max(len(words) - 400, 1)
        ids = encode(f"{opener} " + " ".join(words[start:start + 400]))
        assert len(ids) >= THROUGHPUT_PROMPT_TOKENS, "throughput prompt too short"
        prompts.append(ids[:THROUGHPUT_PROMPT_TOKENS])
    return prompts


def zero_hit_throughput(on: Bench, off: Bench, repeats: int, control: bool, checks: list[str]) -> dict[str, Any]:
    """Per repeat, every prompt runs once per mode, modes adjacent and their order alternating, so drift
    (other load, thermal) hits all modes alike; a fresh salt per repeat keeps `on` at 0% hits."""
    encode = on.engine.tokenizer.encode
    doc_text, _ = fit_document(encode, DOC_PAGES * TOKENS_PER_PAGE)
    prompts = throughput_prompts(encode, doc_text)
    if len({p[0] for p in prompts}) != len(prompts):
        checks.append("throughput prompts share a first token")
    modes = ["off", "on", *(["bypass"] if control else [])]
    runs = {"off": (off, True), "on": (on, True), "bypass": (on, False)}
    passes: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for r in range(repeats):
        totals = {mode: {"tokens": 0.0, "wall_ms": 0.0, "bookkeeping_us": 0.0, "prefill_ms": 0.0} for mode in modes}
        for i, ids in enumerate(prompts):
            order = modes if (r + i) % 2 == 0 else modes[::-1]
            for mode in order:
                bench, reuse = runs[mode]
                request = EngineRequest(ids, greedy(THROUGHPUT_MAX_GENERATE), cache_salt=f"tp-{r}")
                run = bench.run(request, reuse)
                if run.cached_tokens:
                    checks.append(f"throughput {mode}: a request hit the cache")
                t = totals[mode]
                t["tokens"] += len(run.output.prompt_token_ids) + len(run.token_ids)
                t["wall_ms"] += run.wall_ms
                t["bookkeeping_us"] += run.bookkeeping_us
                t["prefill_ms"] += run.prefill_ms
        for mode, t in totals.items():
            passes[mode].append({**t, "tok_s": t["tokens"] / (t["wall_ms"] / 1e3)})
    tok_s = {mode: median([p["tok_s"] for p in ps]) for mode, ps in passes.items()}
    result = {"prompts": len(prompts), "prompt_tokens": THROUGHPUT_PROMPT_TOKENS,
              "max_generate_length": THROUGHPUT_MAX_GENERATE, "off_tok_s": tok_s["off"], "on_tok_s": tok_s["on"],
              "on_over_off": tok_s["on"] / tok_s["off"],
              "paired_on_over_off": [on_["tok_s"] / off_["tok_s"]
                                     for on_, off_ in zip(passes["on"], passes["off"], strict=True)],
              "on_bookkeeping_us_per_request": median([p["bookkeeping_us"] / len(prompts) for p in passes["on"]]),
              "off_prefill_ms_per_request": median([p["prefill_ms"] / len(prompts) for p in passes["off"]]),
              "passes": passes}
    if control:
        result["bypass_tok_s"] = tok_s["bypass"]
        result["bypass_over_off"] = tok_s["bypass"] / tok_s["off"]
        result["on_over_bypass"] = tok_s["on"] / tok_s["bypass"]
    return result


# --- report -------------------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def print_ttft_table(rows: list[dict[str, Any]]) -> None:
    print(f"   {'':4}{'prompt':>7}{'cached':>7}{'new':>6}{'cold ms':>10}{'warm ms':>10}{'ideal ms':>10}{'floor ms':>10}"
          f"{'warm/ideal':>11}{'warm/floor':>11}{'cold/warm':>10}")
    for row in rows:
        new = row["prompt_tokens"] - row["cached_tokens"]
        if row["cached_tokens"]:
            hit = f"{row['floor_ms']:10.1f}{row['warm_over_ideal']:11.3f}{row['warm_over_floor']:11.3f}"
        else:
            hit = f"{'-':>10}{'(miss)':>11}{'-':>11}"
        print(f"   {row['label']:4}{row['prompt_tokens']:7d}{row['cached_tokens']:7d}{new:6d}"
              f"{row['cold_ttft_ms']:10.1f}{row['warm_ttft_ms']:10.1f}{row['ideal_ttft_ms']:10.1f}{hit}{row['cold_over_warm']:10.2f}")


def pooled(rows: list[dict[str, Any]], numerator: str, denominator: str) -> float:
    """Sum of one median figure over the hit rows divided by the sum of another (0 without hits)."""
    hits = [row for row in rows if row["cached_tokens"]]
    total = sum(row[denominator] for row in hits)
    return sum(row[numerator] for row in hits) / total if total else 0.0


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--noBypassControl", dest="bypass_control", action="store_false",
                        help="skip section 4's control mode: lookup bypass on the reuse-on engine (its ORT session)")
    args = parser.parse_args()
    progress = Progress()
    checks: list[str] = []

    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = Path(tmp) / "engine"
        options = BuildOptions(max_input_len=2048, max_kv_cache_capacity=2560, max_batch_size=1,
                               tokens_per_page=TOKENS_PER_PAGE, max_kv_pool_pages=256)
        # Two engines, each with its own ORT session (as two llm_inference processes would have).
        on = Bench(build_and_open(args.onnxDir, engine_dir, options, args.threads, reuse=True))
        off = Bench(build_and_open(args.onnxDir, engine_dir, options, args.threads, reuse=False))
        # Warmup: ORT initialization and arena growth for every shape measured later: a document-length
        # prefill + decode, then a hit on it (the cached-context path), under a salt no measured request uses;
        # and the throughput shape on both engines.
        encode = on.engine.tokenizer.encode
        doc_text, _ = fit_document(encode, DOC_PAGES * TOKENS_PER_PAGE)
        for question in QUESTIONS[:2]:
            warmup = make_request(on.engine, [{"role": "user", "content": doc_text + question}],
                                  max_generate_length=2, chat=False, salt="warmup")
            on.run(warmup, reuse=True)
        short = EngineRequest(encode(doc_text)[:THROUGHPUT_PROMPT_TOKENS], greedy(2))
        for bench in (off, on):
            bench.run(short, reuse=False)
        progress("built and warmed up; 1/4 shared document")
        document = shared_document(on, args.repeats, checks)
        progress("2/4 chat")
        conversation = chat(on, args.repeats, checks)
        progress("4/4 zero-hit throughput")
        throughput = zero_hit_throughput(on, off, args.repeats, args.bypass_control, checks)
        progress("done")
        cache_profile = on.engine.cache.profile()
    elapsed = progress.elapsed
    load_start, load_end = progress.load_start, os.getloadavg()

    questions, turns = document["questions"], conversation["turns"]
    doc_ratio = pooled(questions, "warm_ttft_ms", "ideal_ttft_ms")
    doc_worst = max(q["warm_over_ideal"] for q in questions if q["cached_tokens"])
    chat_ratio = pooled(turns, "warm_ttft_ms", "ideal_ttft_ms")
    chat_worst = max((t["warm_over_ideal"] for t in turns if t["cached_tokens"]), default=0.0)
    book_rows = [(f"doc {q['label']}", q) for q in questions] + [(f"chat {t['label']}", t) for t in turns]
    shares = [row["bookkeeping_us"] / 1e3 / row["cold_prefill_ms"] for _, row in book_rows]
    tp_share = throughput["on_bookkeeping_us_per_request"] / 1e3 / throughput["off_prefill_ms_per_request"]
    worst_share = max([*shares, tp_share])

    print(f"context reuse bench: SmolLM2-135M-Instruct, {args.threads} threads, {args.repeats} repeats (medians), "
          f"{TOKENS_PER_PAGE}-token pages, engine maxInputLen 2048 / capacity 2560 / 256 pool pages")
    print(f"load average (1 min) at start {load_start[0]:.2f}, at end {load_end[0]:.2f} (this bench keeps "
          f"{args.threads} threads busy); total {elapsed:.0f} s")
    print("TTFT = RequestOutput.timing.ttft_ms: add_request to the first token (scheduling, acquire, the engine "
          "calls, sampling)\n")

    print(f"1. shared document: {document['document_tokens']} tokens by the runtime tokenizer "
          f"({document['document_pages']:.0f} full pages, {document['document_words']} words) + 4 questions; raw "
          "prompts (no chat template), greedy, max_generate_length 1")
    print("   cold = lookup bypass; warm = use_cache, Q1 misses (cold in the warm engine) and publishes the "
          "document, Q2-Q4 hit it;")
    print("   ideal = the question tokens alone with no cache (ignores their attention to the cached context); "
          "floor = runner.forward")
    print("   alone for the uncached suffix on the cached pages (engine cost incl. that attention, no engine loop "
          "around it)")
    print_ttft_table(questions)
    for q in questions:
        same = "same" if q["cold_token_id"] == q["warm_token_id"] else "DIFFERENT"
        print(f"   {q['label']} {q['question']!r}: greedy token {q['token']!r}, cold id {q['cold_token_id']}, "
              f"warm id {q['warm_token_id']}: {same}")
    print(f"   hits Q2-Q4 (pooled): warm/ideal {doc_ratio:.3f} (worst {doc_worst:.3f}), warm/floor "
          f"{pooled(questions, 'warm_ttft_ms', 'floor_ms'):.3f}, ideal/floor "
          f"{pooled(questions, 'ideal_ttft_ms', 'floor_ms'):.3f}, cold/warm speedup "
          f"{pooled(questions, 'cold_ttft_ms', 'warm_ttft_ms'):.1f}x\n")

    print(f"2. 6-turn chat: chat template, system prompt + full history with the model's own answers, greedy, "
          f"max_generate_length {CHAT_MAX_GENERATE}, commit including_generated_tokens")
    print("   ideal = the uncached suffix alone with no cache; floor as above")
    print_ttft_table(turns)
    same = "identical" if not any(c.startswith("chat") for c in checks) else "DIFFERENT"
    print(f"   hit turns (pooled): warm/ideal {chat_ratio:.3f} (worst {chat_worst:.3f}), warm/floor "
          f"{pooled(turns, 'warm_ttft_ms', 'floor_ms'):.3f}, cold/warm speedup "
          f"{pooled(turns, 'cold_ttft_ms', 'warm_ttft_ms'):.2f}x; warm and cold answers (24 tokens each) {same}\n")

    print("3. bookkeeping per request: every context-cache manager call of the warm request (in-flight check, "
          "acquire = hash + plan, grow, indexing, publish, release;")
    print("   the manager's bookkeeping_nanoseconds) vs the cold prefill (its engine calls) of the same prompt")
    print(f"   {'':10}{'manager calls us':>28}{'cold prefill ms':>17}{'share':>10}")
    for (label, row), share in zip(book_rows, shares, strict=True):
        print(f"   {label:10}{row['bookkeeping_us']:28.1f}{row['cold_prefill_ms']:17.1f}{share:10.4%}")
    print(f"   {'0%-hit':10}{throughput['on_bookkeeping_us_per_request']:28.1f}"
          f"{throughput['off_prefill_ms_per_request']:17.1f}{tp_share:10.4%}")
    print(f"   manager metrics.planning_nanoseconds over the whole run (acquire only): "
          f"{cache_profile.get('planning_nanoseconds', 0) / 1e6:.1f} ms\n")

    print(f"4. 0% hit throughput: {throughput['prompts']} distinct {THROUGHPUT_PROMPT_TOKENS}-token prompts "
          f"(distinct first tokens), max_generate_length {THROUGHPUT_MAX_GENERATE}, (prompt + generated) tokens / "
          "wall time of the request (add_request to its last step)")
    print("   every prompt runs once per mode per repeat, modes adjacent, order alternating")
    print(f"   reuse off (enable_context_reuse=False)  {throughput['off_tok_s']:8.1f} tok/s")
    print(f"   reuse on  (use_cache, fresh salt)       {throughput['on_tok_s']:8.1f} tok/s   on/off "
          f"{throughput['on_over_off']:.3f}; per repeat "
          f"{', '.join(f'{x:.3f}' for x in throughput['paired_on_over_off'])}")
    if args.bypass_control:
        print(f"   control: reuse-on engine, bypass        {throughput['bypass_tok_s']:8.1f} tok/s   bypass/off "
              f"{throughput['bypass_over_off']:.3f} (same ORT session as 'on')")
        print(f"   on/bypass (reuse cost alone, one session) {throughput['on_over_bypass']:.3f}; bypass/off is the "
              "difference between two ORT sessions of the same engine")
    print()

    targets = {
        "doc_warm_over_ideal": (doc_ratio, doc_ratio <= TARGET_WARM_OVER_IDEAL, f"<= {TARGET_WARM_OVER_IDEAL}"),
        "chat_warm_over_ideal": (chat_ratio, 0 < chat_ratio <= TARGET_WARM_OVER_IDEAL,
                                 f"<= {TARGET_WARM_OVER_IDEAL}"),
        "bookkeeping_share_worst": (worst_share, worst_share < TARGET_BOOKKEEPING_SHARE,
                                    f"< {TARGET_BOOKKEEPING_SHARE:.0%}"),
        "zero_hit_on_over_off": (throughput["on_over_off"], throughput["on_over_off"] >= TARGET_ZERO_HIT_RATIO,
                                 f">= {TARGET_ZERO_HIT_RATIO}"),
        "warm_equals_cold_tokens": (len(checks), not checks, "0 failed checks"),
    }
    print("summary")
    for name, (value, ok, target) in targets.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"   {verdict(ok)}  {name:26}{shown:>10}   target {target}")
    for check in checks:
        print(f"   check failed: {check}")

    if args.json:
        figures = {"threads": args.threads, "repeats": args.repeats, "seconds": elapsed,
                   "load_average_start": load_start, "load_average_end": load_end,
                   "shared_document": document, "chat": conversation, "zero_hit_throughput": throughput,
                   "bookkeeping": {"per_request": [{"request": label, "bookkeeping_us": row["bookkeeping_us"],
                                                    "cold_prefill_ms": row["cold_prefill_ms"], "share": share}
                                                   for (label, row), share in zip(book_rows, shares, strict=True)],
                                   "zero_hit_share": tp_share, "worst_share": worst_share},
                   "context_cache_profile": cache_profile,
                   "targets": {name: {"value": value, "pass": ok, "target": target}
                               for name, (value, ok, target) in targets.items()},
                   "checks_failed": checks}
        write_json(args.json, figures)
    if checks:
        raise SystemExit("some checks failed (see 'check failed' above)")


if __name__ == "__main__":
    main()

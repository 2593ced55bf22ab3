"""Scheduling: what continuous batching and in-flight prefix sharing buy over the request file's static batches.

Two measurements on one SmolLM2 engine (maxBatchSize 4, maxInputLen 1536, capacity 1792, 128-token pages,
the default 512-token prefill chunks), in one run, medians over --repeats with the modes alternating:

a. mixed workload: 16 raw prompts of 50-1,500 tokens (English text cut to exact token counts) generating
   4-128 tokens each (greedy, EOS suppressed by logit_bias so every length is exact), lengths spread
   evenly and shuffled by a fixed seed, reuse off. static = the request file's semantics (batches of 4 in
   file order, each starting when the last one ends: Scheduling.STATIC); continuous = all 16 handed to
   the scheduler at once (Scheduling.CONTINUOUS). Both run through file_loop.run_request_file; the
   greedy outputs of the two modes are compared token by token.
b. burst: 8 requests sharing one uncached ~1,500-token document, each with its own short question
   (max_generate_length 8), all added at once; reuse on (the engine default: followers wait for the
   pages another request is computing, then hit them) vs reuse off (every request prefills the
   document). Fresh cache salts per repeat, so every repeat starts uncached.

    python -m experiments.engine.scheduling --onnxDir out/onnx/smollm2 --threads 2 --repeats 3 --json out.json
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from experiments._common import (
    Progress,
    bench_parser,
    build_and_open,
    fit_document,
    greedy,
    median,
    text_tokens,
    write_json,
)
from kvforge.builder.build import BuildOptions
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.engine.output import RequestOutput
from kvforge.runtime.file_loop import Scheduling, drain, run_request_file
from kvforge.runtime.inputs.request_file import RequestFile
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import Message, Request, SamplingParams

TOKENS_PER_PAGE = 128
BUILD = BuildOptions(max_input_len=1536, max_kv_cache_capacity=1792, max_batch_size=4,
                     tokens_per_page=TOKENS_PER_PAGE)
SEED = 20240611
MIXED_REQUESTS = 16
MIXED_PROMPT_TOKENS = (50, 1500)
MIXED_GENERATE = (4, 128)
TARGET_CONTINUOUS_OVER_STATIC = 1.3
BURST_DOCUMENT_TOKENS = 1500
BURST_MAX_GENERATE = 8
BURST_QUESTIONS = [
    "\n\nQuestion: Which company supplied the turbine blades? Answer:",
    "\n\nQuestion: How many turbines make up the array? Answer:",
    "\n\nQuestion: Who chaired the review board? Answer:",
    "\n\nQuestion: When did construction begin? Answer:",
    "\n\nQuestion: How long is the export cable? Answer:",
    "\n\nQuestion: What was the capital cost of the project? Answer:",
    "\n\nQuestion: Which vessel lowered the frames? Answer:",
    "\n\nQuestion: What is the levelised cost of electricity? Answer:",
]


def exact_length(engine: Engine, max_generate_length: int) -> SamplingParams:
    """Greedy with every end-of-sequence token suppressed, so the request generates exactly this many tokens;
    one logprob per token gives the chosen ids back in the response dicts (the greedy token is the top one)."""
    no_eos = {token: -100.0 for token in engine.engine_dir.model.eos_token_ids}  # the checked bound
    return greedy(max_generate_length, logit_bias=no_eos, num_logprobs=1)


def fresh_counters(engine: Engine) -> None:
    """Start the profile (prefill/generation counters, stages) and the scheduler's counters from zero."""
    engine.reset_counters()


# --- a. continuous vs static on a mixed workload ------------------------------------------------------


def mixed_workload(engine: Engine) -> tuple[RequestFile, list[EngineRequest]]:
    """16 requests (batch_size 4) with prompt and generation lengths spread evenly, shuffled by SEED."""
    rng = np.random.default_rng(SEED)
    prompt_lengths = rng.permutation(np.linspace(*MIXED_PROMPT_TOKENS, MIXED_REQUESTS).round().astype(int))
    generate_lengths = rng.permutation(np.linspace(*MIXED_GENERATE, MIXED_REQUESTS).round().astype(int))
    text = text_tokens(engine.tokenizer.encode, 2 * MIXED_PROMPT_TOKENS[1])
    requests, prepared = [], []
    for i, (n, g) in enumerate(zip(prompt_lengths.tolist(), generate_lengths.tolist(), strict=True)):
        start = int(rng.integers(0, len(text) - n))  # each prompt its own cut of the text
        ids = text[start:start + n]
        sampling = exact_length(engine, g)
        requests.append(Request(i, [Message("user", engine.tokenizer.decode(ids))], sampling,
                                apply_chat_template=False, add_generation_prompt=False))
        prepared.append(EngineRequest(ids, sampling))
    return RequestFile(requests, batch_size=BUILD.max_batch_size), prepared


def run_mixed(engine: Engine, request_file: RequestFile, prepared: list[EngineRequest],
              scheduling: Scheduling) -> dict[str, Any]:
    fresh_counters(engine)
    started = time.perf_counter()
    responses = run_request_file(engine, request_file, prepared, scheduling)
    wall_s = time.perf_counter() - started
    generated = sum(r["usage"]["completion_tokens"] for r in responses)
    prompt = sum(r["usage"]["prompt_tokens"] for r in responses)
    stats = engine.scheduler.stats
    return {"wall_s": wall_s, "generated_tokens": generated, "prompt_tokens": prompt,
            "generated_tok_s": generated / wall_s, "total_tok_s": (generated + prompt) / wall_s,
            "steps": stats.steps, "mixed_steps": stats.mixed_steps, "max_running": stats.max_running,
            "preemptions": stats.preemptions,
            "token_ids": [[step[0]["token_id"] for step in r["logprobs"]] for r in responses]}


def continuous_vs_static(engine: Engine, repeats: int, progress: Callable[[str], None]) -> dict[str, Any]:
    request_file, prepared = mixed_workload(engine)
    expected = [r.sampling.max_generate_length for r in prepared]
    modes = [Scheduling.STATIC, Scheduling.CONTINUOUS]
    passes: dict[str, list[dict[str, Any]]] = {mode.value: [] for mode in modes}
    for r in range(repeats):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            progress(f"a. repeat {r + 1}/{repeats}: {mode.value}")
            passes[mode.value].append(run_mixed(engine, request_file, prepared, mode))
    reference = passes["static"][0]["token_ids"]
    exact = all([len(ids) for ids in p["token_ids"]] == expected for ps in passes.values() for p in ps)
    mismatches = [sum(a != b for a, b in zip(reference, p["token_ids"], strict=True))
                  for ps in passes.values() for p in ps]
    summary = {mode: {key: median([p[key] for p in ps])
                      for key in ("wall_s", "generated_tok_s", "total_tok_s", "steps", "mixed_steps")}
               for mode, ps in passes.items()}
    for mode, ps in passes.items():
        summary[mode]["max_running"] = max(p["max_running"] for p in ps)
        summary[mode]["preemptions"] = max(p["preemptions"] for p in ps)
    cont, stat = summary["continuous"], summary["static"]
    for p in (*passes["static"], *passes["continuous"]):
        del p["token_ids"]
    return {
        "requests": len(prepared), "batch_size": request_file.batch_size, "seed": SEED,
        "prompt_tokens": [len(r.prompt_ids) for r in prepared], "max_generate_length": expected,
        "total_prompt_tokens": sum(len(r.prompt_ids) for r in prepared), "total_generate_tokens": sum(expected),
        "exact_lengths": exact,
        "static": stat, "continuous": cont,
        "generated_tok_s_ratio": cont["generated_tok_s"] / stat["generated_tok_s"],
        "total_tok_s_ratio": cont["total_tok_s"] / stat["total_tok_s"],
        "wall_ratio_static_over_continuous": stat["wall_s"] / cont["wall_s"],
        "paired_ratios": [c["generated_tok_s"] / s["generated_tok_s"]
                          for s, c in zip(passes["static"], passes["continuous"], strict=True)],
        "mismatched_requests_max": max(mismatches),
        "passes": passes,
    }


# --- b. burst sharing of one uncached document --------------------------------------------------------


def burst_requests(engine: Engine, salt: str) -> list[EngineRequest]:
    encode = engine.tokenizer.encode
    doc_text, _ = fit_document(encode, BURST_DOCUMENT_TOKENS)
    return [EngineRequest(encode(doc_text + question), exact_length(engine, BURST_MAX_GENERATE), cache_salt=salt)
            for question in BURST_QUESTIONS]


def run_burst(engine: Engine, requests: list[EngineRequest]) -> tuple[dict[str, Any], list[list[int]]]:
    fresh_counters(engine)
    started = time.perf_counter()
    ids = [engine.add_request(r) for r in requests]
    by_id: dict[str, RequestOutput] = {o.request_id: o for o in drain(engine, set(ids))}
    wall_s = time.perf_counter() - started
    outputs = [by_id[i] for i in ids]
    ttft = [o.timing.ttft_ms for o in outputs if o.timing is not None]
    prefill = engine.profile()["prefill"]
    stats = engine.scheduler.stats
    return ({"wall_s": wall_s, "computed_tokens": prefill["computed_tokens"],
             "reused_tokens": prefill["reused_tokens"], "cached_tokens": [o.cached_tokens for o in outputs],
             "p50_ttft_ms": median(ttft), "max_ttft_ms": max(ttft), "steps": stats.steps,
             "inflight_prefix_waits": stats.inflight_prefix_waits},
            [o.token_ids for o in outputs])


def burst_sharing(on: Engine, off: Engine, repeats: int, progress: Callable[[str], None]) -> dict[str, Any]:
    engines = {"reuse_on": on, "reuse_off": off}
    passes: dict[str, list[dict[str, Any]]] = {mode: [] for mode in engines}
    mismatches = []
    for r in range(repeats):
        requests = burst_requests(on, salt=f"burst-{r}")  # a fresh salt: the document is uncached again
        tokens: dict[str, list[list[int]]] = {}
        for mode in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            progress(f"b. repeat {r + 1}/{repeats}: {mode}")
            figures, tokens[mode] = run_burst(engines[mode], requests)
            passes[mode].append(figures)
        mismatches.append(sum(a != b for a, b in zip(tokens["reuse_on"], tokens["reuse_off"], strict=True)))
    summary = {mode: {key: median([p[key] for p in ps])
                      for key in ("wall_s", "computed_tokens", "reused_tokens", "p50_ttft_ms", "max_ttft_ms", "steps",
                                  "inflight_prefix_waits")}
               for mode, ps in passes.items()}
    on_, off_ = summary["reuse_on"], summary["reuse_off"]
    return {
        "requests": len(BURST_QUESTIONS), "document_tokens": BURST_DOCUMENT_TOKENS,
        "prompt_tokens": [len(r.prompt_ids) for r in burst_requests(on, salt="")],
        "max_generate_length": BURST_MAX_GENERATE, "reuse_on": on_, "reuse_off": off_,
        "computed_tokens_off_over_on": off_["computed_tokens"] / on_["computed_tokens"],
        "p50_ttft_off_over_on": off_["p50_ttft_ms"] / on_["p50_ttft_ms"],
        "max_ttft_off_over_on": off_["max_ttft_ms"] / on_["max_ttft_ms"],
        "wall_off_over_on": off_["wall_s"] / on_["wall_s"],
        "mismatched_requests_max": max(mismatches), "passes": passes,
    }


# --- report -------------------------------------------------------------------------------------------


def warm_up(engine: Engine, requests: list[EngineRequest]) -> None:
    """ORT initialization and arena growth: the largest shapes (4 rows of 512-token chunks, 4 decode rows)
    once, unprofiled and without touching the cache."""
    enabled, engine.profiler.enabled = engine.profiler.enabled, False
    try:
        drain(engine, {engine.add_request(r) for r in requests})
    finally:
        engine.profiler.enabled = enabled


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    progress = Progress()
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = Path(tmp) / "engine"
        off = build_and_open(args.onnxDir, engine_dir, BUILD, args.threads, reuse=False)
        # The reuse-on engine shares the ORT session and pool: the two never run interleaved, and every burst
        # repeat has its own salt, so records the other engine's runs overwrote are never looked up.
        on = build_and_open(args.onnxDir, engine_dir, BUILD, args.threads, reuse=True, runner=off.backend)
        text = text_tokens(off.tokenizer.encode, 2 * MIXED_PROMPT_TOKENS[1])
        warm_up(off, [EngineRequest(text[i * 300:i * 300 + 1500], exact_length(off, 4)) for i in range(4)])
        progress("built and warmed up; a. continuous vs static")
        mixed = continuous_vs_static(off, args.repeats, progress)
        progress("b. burst sharing")
        burst = burst_sharing(on, off, args.repeats, progress)
        progress("done")
        pool_pages = off.cache.pages.capacity
        chunk = off.scheduler.prefill_chunk_tokens
    elapsed = progress.elapsed

    stat, cont = mixed["static"], mixed["continuous"]
    ratio = mixed["generated_tok_s_ratio"]
    print(f"scheduling bench: SmolLM2-135M-Instruct, {args.threads} threads, {args.repeats} repeats (medians, modes "
          f"alternating); engine maxBatchSize {BUILD.max_batch_size}, maxInputLen {BUILD.max_input_len}, capacity "
          f"{BUILD.max_kv_cache_capacity}, {pool_pages} pool pages of {TOKENS_PER_PAGE} tokens, prefill chunks of "
          f"{chunk}; total {elapsed:.0f} s, load average {progress.load_start[0]:.2f} at start\n")

    print(f"a. mixed workload: {mixed['requests']} raw prompts of {min(mixed['prompt_tokens'])}-"
          f"{max(mixed['prompt_tokens'])} tokens ({mixed['total_prompt_tokens']} in all), "
          f"{min(mixed['max_generate_length'])}-{max(mixed['max_generate_length'])} generated "
          f"({mixed['total_generate_tokens']} in all), greedy, EOS suppressed, reuse off, seed {SEED}")
    print(f"   static = batches of {mixed['batch_size']} in file order (Scheduling.STATIC); continuous = all at once "
          "(Scheduling.CONTINUOUS)")
    print(f"   {'':12}{'wall s':>9}{'gen tok/s':>11}{'total tok/s':>13}{'steps':>8}{'mixed steps':>13}"
          f"{'max running':>13}{'preemptions':>13}")
    for name, row in (("static", stat), ("continuous", cont)):
        print(f"   {name:12}{row['wall_s']:9.1f}{row['generated_tok_s']:11.2f}{row['total_tok_s']:13.1f}"
              f"{row['steps']:8.0f}{row['mixed_steps']:13.0f}{row['max_running']:13d}{row['preemptions']:13d}")
    print(f"   continuous/static: generated tok/s {ratio:.3f} (per repeat "
          f"{', '.join(f'{x:.3f}' for x in mixed['paired_ratios'])}), total tok/s {mixed['total_tok_s_ratio']:.3f}, "
          f"wall static/continuous {mixed['wall_ratio_static_over_continuous']:.3f}")
    print(f"   greedy outputs: {mixed['mismatched_requests_max']} of {mixed['requests']} requests differ between "
          f"static and continuous (worst run); every request generated exactly its length: {mixed['exact_lengths']}\n")

    on_, off_ = burst["reuse_on"], burst["reuse_off"]
    print(f"b. burst: {burst['requests']} requests on one uncached {burst['document_tokens']}-token document "
          f"({min(burst['prompt_tokens'])}-{max(burst['prompt_tokens'])} prompt tokens), different questions, "
          f"max_generate_length {burst['max_generate_length']}, all added at once")
    print(f"   {'':12}{'computed tok':>14}{'reused tok':>12}{'p50 TTFT ms':>13}{'max TTFT ms':>13}{'wall s':>9}"
          f"{'steps':>8}{'in-flight waits':>17}")
    for name, row in (("reuse off", off_), ("reuse on", on_)):
        print(f"   {name:12}{row['computed_tokens']:14.0f}{row['reused_tokens']:12.0f}{row['p50_ttft_ms']:13.0f}"
              f"{row['max_ttft_ms']:13.0f}{row['wall_s']:9.1f}{row['steps']:8.0f}{row['inflight_prefix_waits']:17.0f}")
    print(f"   off/on: computed tokens {burst['computed_tokens_off_over_on']:.2f}x, p50 TTFT "
          f"{burst['p50_ttft_off_over_on']:.2f}x, max TTFT {burst['max_ttft_off_over_on']:.2f}x, wall "
          f"{burst['wall_off_over_on']:.2f}x; greedy outputs differing on vs off: {burst['mismatched_requests_max']} "
          f"of {burst['requests']} (worst repeat)\n")

    ok = ratio >= TARGET_CONTINUOUS_OVER_STATIC
    print(f"summary\n   {'PASS' if ok else 'MISS'}  continuous/static generated tok/s {ratio:.3f}   target >= "
          f"{TARGET_CONTINUOUS_OVER_STATIC}")
    write_json(args.json, {"threads": args.threads, "repeats": args.repeats, "seconds": elapsed,
                           "load_average_start": progress.load_start,
                           "build": {"max_input_len": BUILD.max_input_len,
                                     "max_kv_cache_capacity": BUILD.max_kv_cache_capacity,
                                     "max_batch_size": BUILD.max_batch_size, "tokens_per_page": TOKENS_PER_PAGE,
                                     "max_kv_pool_pages": pool_pages, "prefill_chunk_tokens": chunk},
                           "continuous_vs_static": mixed, "burst_sharing": burst,
                           "target_continuous_over_static": {"value": ratio, "pass": ok,
                                                             "target": TARGET_CONTINUOUS_OVER_STATIC}})


if __name__ == "__main__":
    main()

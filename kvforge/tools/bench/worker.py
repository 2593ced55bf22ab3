"""One engine of llm_bench, in a process of its own: `python -m kvforge.tools.bench.worker JOB.json`.

A process per engine makes the peak RSS that engine's alone, keeps engines from disturbing each other (their
thread pools, allocators and caches) and lets a peer crash without taking the run down. The parent writes the
job (engine, token ids of every request, settings), then asks for one repeat at a time (see `serve`).

Every engine is driven the same way: greedy decoding of exactly `max_tokens` tokens (end of sequence
suppressed, so every engine decodes the same count), the clock read when the request is handed over, when its
first token is available and when its last one is. TTFT = first - start; decode tok/s = (tokens - 1) / (last -
first). A *session* is one repeat of one workload: it starts with nothing cached from earlier sessions (a fresh
cache salt for kvforge, a reset context for llama.cpp; the other peers keep nothing between requests).

A point of the decode_context workload that an engine cannot run (its context plus the generated tokens beyond
what the engine takes, or an error while it runs) is skipped with the reason; the other points still run.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

from kvforge.contract.speculation import SPEC_OFF  # the contract only: no engine part loads before the job says

KVFORGE, TRANSFORMERS, LLAMA_CPP, ORT_GENAI = "kvforge", "transformers", "llama.cpp", "onnxruntime-genai"
DECODE_CONTEXT = "decode_context"  # workloads.DECODE_CONTEXT (a worker imports no more of kvforge than it needs)


@dataclass(slots=True)
class Trace:
    label: str
    role: str
    prompt_tokens: int
    ttft_ms: float
    decode_ms: float  # first token to last
    tokens: int
    token_ids: list[int]
    cached_tokens: int | None  # prompt tokens the engine did not compute (None: it does not say)
    spec: dict[str, int] | None = None  # a speculative engine's counters for this request (SPEC_COUNTERS)

    @classmethod
    def timed(cls, label: str, role: str, prompt: list[int], start: float, times: list[float], ids: list[int],
              cached: int | None, spec: dict[str, int] | None = None) -> Trace:
        return cls(label, role, len(prompt), (times[0] - start) * 1e3, (times[-1] - times[0]) * 1e3, len(ids),
                   ids, cached, spec)


# A speculative engine's counters, cumulative (Driver.speculation); a trace holds one request's difference.
# verify_rows: decode rows that verified drafts; draft_tokens: drafts verified; accepted_tokens: drafts kept;
# committed_tokens: tokens those rows committed (kept drafts + one each). kvforge's profile names them
# spec_decode_generation.total_iterations / total_draft_tokens / total_accepted_tokens / total_generated_tokens.
SPEC_COUNTERS = ("verify_rows", "draft_tokens", "accepted_tokens", "committed_tokens")


class Driver(Protocol):
    def start_session(self, session: str) -> None: ...

    def generate(self, prompt: list[int], max_tokens: int) -> Iterator[tuple[int, int | None, float]]:
        """Yield (token id, cached prompt tokens or None, time.perf_counter() when the token was available) per
        greedy token."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def limit(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a prompt of prompt_tokens and max_tokens generated tokens is too long for this engine (None: it fits)."""
        ...

    def speculation(self) -> dict[str, int] | None:
        """The SPEC_COUNTERS so far (None: this engine does not speculate)."""
        ...


def too_long(what: str, limit: int | None, prompt_tokens: int, max_tokens: int) -> str | None:
    """The reason a prompt and its generated tokens exceed a limit of `what` tokens (None: they fit, or no limit)."""
    if limit is None or prompt_tokens + max_tokens <= limit:
        return None
    return f"{prompt_tokens:,} + {max_tokens} generated tokens exceed its {what} ({limit:,})"


def peak_rss_bytes() -> int:
    """This process's peak resident set. Linux's VmHWM belongs to the process's own memory map; ru_maxrss would
    also count the parent's resident set at fork time (it survives exec), so it is only the fallback."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux (bytes on macOS)


# --- kvforge ---------------------------------------------------------------------------------------------


class KvforgeDriver:
    def __init__(self, path: Path, threads: int, reuse: bool, spec_decode: str = SPEC_OFF,
                 spec_draft_step: int | None = None, spec_draft_top_k: int | None = None) -> None:
        from kvforge.contract.engine_dir import load_engine_dir
        from kvforge.runtime.engine.engine import Engine, EngineConfig, snapshot_budgets

        # Recurrent and hybrid engines reuse exact checkpoints only: with reuse on they get the pools they need.
        engine_dir = load_engine_dir(path)
        self.build = engine_dir.build
        budgets = snapshot_budgets(engine_dir) if reuse else {}  # the declared default slot count
        spec = {"spec_decode": spec_decode}  # llm_inference's --specDecode / --specDraftStep
        if spec_draft_step is not None:
            spec["spec_draft_step"] = spec_draft_step
        if spec_draft_top_k is not None:
            spec["spec_draft_top_k"] = spec_draft_top_k
        self.speculative = spec_decode != SPEC_OFF
        config = EngineConfig(num_threads=threads, enable_context_reuse=reuse, **budgets, **spec)
        self.engine = Engine(path, config)
        self.spec_settings = {"draft_step": config.spec_draft_step, "draft_top_k": config.spec_draft_top_k,
                              "ngram_sizes": [
            config.spec_prompt_lookup_max, config.spec_prompt_lookup_min]} if self.speculative else None
        # -100 is the bound SamplingParams checks (OpenAI's ban): far below any logit of a real model.
        self.no_eos = {token: -100.0 for token in self.engine.info.model.eos_token_ids}
        self.salt: str | None = None

    def start_session(self, session: str) -> None:
        self.salt = session  # a salt no earlier session used: nothing it published can hit

    def generate(self, prompt: list[int], max_tokens: int) -> Iterator[tuple[int, int | None, float]]:
        from kvforge.runtime.engine.engine import EngineRequest
        from kvforge.runtime.types import SamplingParams

        params = SamplingParams(temperature=1.0, top_k=1, top_p=1.0, max_generate_length=max_tokens,
                                logit_bias=self.no_eos)
        request_id = self.engine.add_request(EngineRequest(list(prompt), params, cache_salt=self.salt))
        finished = False
        try:
            while not finished:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        finished = output.finished
                        for token in output.new_token_ids:
                            yield token, output.cached_tokens, time.perf_counter()
        finally:
            if not finished:  # an error (a skipped decode_context point): it must not run on into the next request
                self.engine.abort(request_id)

    def encode(self, text: str) -> list[int]:
        return self.engine.info.tokenizer.encode(text)

    def limit(self, prompt_tokens: int, max_tokens: int) -> str | None:
        if prompt_tokens > self.build.max_input_len:
            return f"{prompt_tokens:,} prompt tokens exceed its maxInputLen ({self.build.max_input_len:,})"
        return too_long("maxKVCacheCapacity", self.build.max_kv_cache_capacity, prompt_tokens, max_tokens)

    def speculation(self) -> dict[str, int] | None:
        """The profile's spec_decode_generation block (absent until a row has verified drafts)."""
        if not self.speculative:
            return None
        block = self.engine.profile().get("spec_decode_generation", {})
        names = ("total_iterations", "total_draft_tokens", "total_accepted_tokens", "total_generated_tokens")
        return {counter: int(block.get(name, 0)) for counter, name in zip(SPEC_COUNTERS, names, strict=True)}


# --- transformers --------------------------------------------------------------------------------------


class TransformersDriver:
    """transformers' generate() in float32 on the same weights (a GGUF is dequantized as transformers loads it)."""

    def __init__(self, path: Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        torch.set_num_interop_threads(1)
        source = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name} if path.is_file() \
            else {"pretrained_model_name_or_path": path}
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(**source)

    def start_session(self, session: str) -> None:
        pass  # generate() keeps nothing between calls

    def generate(self, prompt: list[int], max_tokens: int) -> Iterator[tuple[int, int | None, float]]:
        stamped: list[tuple[int, float]] = []
        first = [True]

        class Streamer:  # generate() calls put() with the prompt first, then with each new token as it is chosen
            def put(self, value: Any) -> None:
                if first[0]:
                    first[0] = False
                else:
                    stamped.append((int(value.reshape(-1)[0]), time.perf_counter()))

            def end(self) -> None:
                pass

        torch = self.torch
        ids = torch.tensor([prompt], dtype=torch.long)
        with torch.inference_mode():  # min_new_tokens keeps end of sequence out until max_tokens are there
            self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False, streamer=Streamer(),
                                pad_token_id=self.model.generation_config.eos_token_id)
        for token, stamp in stamped:
            yield token, None, stamp

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def limit(self, prompt_tokens: int, max_tokens: int) -> str | None:
        positions = getattr(self.model.config, "max_position_embeddings", None)
        return too_long("max_position_embeddings", positions, prompt_tokens, max_tokens)

    def speculation(self) -> dict[str, int] | None:
        return None


# --- llama.cpp -----------------------------------------------------------------------------------------


class LlamaCppDriver:
    """llama-cpp-python's token loop (Llama.generate) with its own prompt cache: the KV of the previous call stays
    in the context, and a prompt sharing a prefix with it computes only the rest. With prompt lookup asked, its own
    prompt-lookup decoding (llama_cpp.llama_speculative.LlamaPromptLookupDecoding as the draft model): generate()
    evaluates the pending token and the drafts in one call and keeps the drafts the model agrees with."""

    def __init__(self, path: Path, threads: int, n_ctx: int, spec_decode: str = SPEC_OFF,
                 spec_draft_step: int | None = None) -> None:
        from llama_cpp import Llama

        self.counter: DraftCounter | None = None
        self.spec_settings: dict[str, Any] | None = None
        draft = None
        if spec_decode != SPEC_OFF:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            lookup = LlamaPromptLookupDecoding() if spec_draft_step is None \
                else LlamaPromptLookupDecoding(num_pred_tokens=spec_draft_step)
            self.counter = draft = DraftCounter(lookup)
            self.spec_settings = {"draft_step": lookup.num_pred_tokens, "ngram_sizes": [lookup.max_ngram_size, 1]}
        # logits_all with a draft model: llama-cpp-python (0.3.x) turns it on itself but sizes its scores buffer
        # from the argument, so a prompt past n_batch (512) failed with "could not broadcast ... into shape (0,)".
        # It computes logits at every prompt position: TTFT pays, decode does not.
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         verbose=False, seed=0, draft_model=draft, logits_all=draft is not None)

    def start_session(self, session: str) -> None:
        self.llm.reset()  # forget the previous prompt: the next one computes from the start

    def generate(self, prompt: list[int], max_tokens: int) -> Iterator[tuple[int, int | None, float]]:
        cached = 0
        for a, b in zip(self.llm.input_ids[:self.llm.n_tokens].tolist(), prompt, strict=False):
            if a != b:
                break
            cached += 1
        cached = min(cached, len(prompt) - 1)  # a fully cached prompt replays its last token for the logits
        # generate() never stops by itself (end of sequence is the caller's rule): we take exactly max_tokens.
        tokens = self.llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
        try:
            for count, token in enumerate(tokens, 1):
                if self.counter is not None:
                    self.counter.committed()
                yield int(token), cached, time.perf_counter()
                if count >= max_tokens:
                    break
        finally:
            if self.counter is not None:
                self.counter.close_row()

    def encode(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    def limit(self, prompt_tokens: int, max_tokens: int) -> str | None:
        return too_long("n_ctx", self.llm.n_ctx(), prompt_tokens, max_tokens)

    def speculation(self) -> dict[str, int] | None:
        return dict(self.counter.totals) if self.counter is not None else None


class DraftCounter:
    """llama-cpp-python's draft model, counting what it proposes and what is kept (llama-cpp-python counts
    nothing): generate() asks the draft model once after each evaluation, so the tokens it yields between two
    draft calls are what one verify row (the pending token plus that call's drafts) committed; a row whose call
    proposed nothing is a plain decode row. The last row of a request is cut where the bench stops taking tokens
    (--maxTokens), so it may count fewer kept drafts than the model would have kept."""

    def __init__(self, lookup: Any) -> None:
        self.lookup = lookup
        self.totals = dict.fromkeys(SPEC_COUNTERS, 0)
        self.drafts: int | None = None  # the open row's drafts (None: no row open, e.g. during the prompt)
        self.yielded = 0

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        self.close_row()
        drafts = self.lookup(input_ids, **kwargs)
        self.drafts, self.yielded = len(drafts), 0
        return drafts

    def committed(self) -> None:
        self.yielded += 1

    def close_row(self) -> None:
        if self.drafts and self.yielded:
            self.totals["verify_rows"] += 1
            self.totals["draft_tokens"] += self.drafts
            self.totals["accepted_tokens"] += min(self.yielded - 1, self.drafts)
            self.totals["committed_tokens"] += self.yielded
        self.drafts, self.yielded = None, 0


# --- onnxruntime-genai ---------------------------------------------------------------------------------


class OrtGenaiDriver:
    """onnxruntime-genai's Generator on a model folder (its own builder's output), one generator per request."""

    def __init__(self, path: Path, threads: int) -> None:
        import onnxruntime_genai as og

        config = og.Config(str(path))
        options = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
        self.og = og
        self.model = og.Model(config)
        self.tokenizer = og.Tokenizer(self.model)
        genai_config = json.loads((path / "genai_config.json").read_text(encoding="utf-8"))
        self.context_length: int | None = genai_config.get("model", {}).get("context_length")

    def start_session(self, session: str) -> None:
        pass  # a new Generator per request keeps nothing

    def generate(self, prompt: list[int], max_tokens: int) -> Iterator[tuple[int, int | None, float]]:
        og = self.og
        params = og.GeneratorParams(self.model)
        total = len(prompt) + max_tokens
        params.set_search_options(do_sample=False, max_length=total, min_length=total)
        generator = og.Generator(self.model, params)
        generator.append_tokens(list(prompt))
        count = 0
        while count < max_tokens and not generator.is_done():
            generator.generate_next_token()
            yield int(generator.get_next_tokens()[0]), None, time.perf_counter()
            count += 1

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text)]

    def limit(self, prompt_tokens: int, max_tokens: int) -> str | None:
        return too_long("context_length", self.context_length, prompt_tokens, max_tokens)

    def speculation(self) -> dict[str, int] | None:
        return None


# --- the run -------------------------------------------------------------------------------------------


def make_driver(spec: dict[str, Any], threads: int, n_ctx: int) -> Driver:
    path = Path(spec["path"])
    kind = spec["kind"]
    speculative = {"spec_decode": spec.get("spec_decode", SPEC_OFF), "spec_draft_step": spec.get("spec_draft_step")}
    if kind == KVFORGE:
        return KvforgeDriver(path, threads, spec["reuse"], **speculative,
                             spec_draft_top_k=spec.get("spec_draft_top_k"))
    if kind == TRANSFORMERS:
        return TransformersDriver(path, threads)
    if kind == LLAMA_CPP:
        return LlamaCppDriver(path, threads, n_ctx, **speculative)
    if kind == ORT_GENAI:
        return OrtGenaiDriver(path, threads)
    raise ValueError(f"unknown engine kind {kind!r}")


def run_request(driver: Driver, request: dict[str, Any], max_tokens: int) -> Trace:
    prompt = request["prompt_ids"]
    ids: list[int] = []
    times: list[float] = []
    cached: int | None = None
    before = driver.speculation()
    start = time.perf_counter()
    for token, cached_now, stamp in driver.generate(prompt, max_tokens):
        times.append(stamp)
        ids.append(token)
        cached = cached_now
    if not ids:
        raise RuntimeError(f"{request['label']}: the engine generated no token")
    after = driver.speculation()  # read after the last token's time: outside what is measured
    spec = {k: after[k] - before[k] for k in SPEC_COUNTERS} if after is not None and before is not None else None
    return Trace.timed(request["label"], request["role"], prompt, start, times, ids, cached, spec)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def too_long_points(driver: Driver, job: dict[str, Any]) -> dict[str, str]:
    """label → why this engine cannot run it, for the decode_context points too long for it."""
    points = [r for w in job["workloads"] for r in w["requests"] if r["role"] == DECODE_CONTEXT]
    reasons = {r["label"]: driver.limit(len(r["prompt_ids"]), job["max_tokens"]) for r in points}
    return {label: reason for label, reason in reasons.items() if reason is not None}


def run_repeat(driver: Driver, job: dict[str, Any], repeat: int,
               skipped: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    """One pass over every workload, each from a fresh session. A decode_context point in `skipped` is not run;
    one that raises joins it with the error (and is not tried again)."""
    name = job["engine"]["name"]
    traces: dict[str, list[dict[str, Any]]] = {}
    for workload in job["workloads"]:
        progress(f"{name}: repeat {repeat + 1}/{job['repeats']}, {workload['name']}")
        driver.start_session(f"llm_bench-{workload['name']}-{repeat}")
        runs = [run_point(driver, r, job["max_tokens"], skipped, name) if r["role"] == DECODE_CONTEXT
                else run_request(driver, r, job["max_tokens"]) for r in workload["requests"]]
        traces[workload["name"]] = [asdict(trace) for trace in runs if trace is not None]
    return traces


def run_point(driver: Driver, request: dict[str, Any], max_tokens: int, skipped: dict[str, str],
              name: str) -> Trace | None:
    """A decode_context point, or None when it is skipped: known not to fit, or failing now (then recorded)."""
    if request["label"] in skipped:
        return None
    try:
        return run_request(driver, request, max_tokens)
    except Exception as exc:  # a point this engine cannot run is skipped, not fatal
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        skipped[request["label"]] = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        progress(f"{name}: {request['label']} skipped: {skipped[request['label']]}")
        return None


def serve(job: dict[str, Any], commands: TextIO, replies: TextIO) -> None:
    """Load and warm up, say so, then answer one JSON line per command line: {"run": REPEAT} → that repeat's
    traces; {"quit": true} → the peak RSS, and exit. The parent runs one engine's repeat at a time, engines in
    turn, so a machine whose load drifts (shared by other work) weighs on every engine alike."""

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    spec = job["engine"]
    started = time.perf_counter()
    driver = make_driver(spec, job["threads"], job["n_ctx"])
    load_s = time.perf_counter() - started
    rss_after_load = peak_rss_bytes()
    own = driver.encode(job["check_text"])
    progress(f"{spec['name']}: loaded in {load_s:.1f} s; warming up")
    driver.start_session("llm_bench-warmup")
    for request in job["warmup"]:
        if driver.limit(len(request["prompt_ids"]), 2) is None:  # too long only beside decode_context alone
            run_request(driver, request, 2)
    skipped = too_long_points(driver, job)
    reply({"ready": True, "load_s": load_s, "rss_after_load_bytes": rss_after_load,
           "tokenizer_agrees": own == job["check_ids"], "spec_settings": getattr(driver, "spec_settings", None)})
    for line in commands:
        command = json.loads(line)
        if command.get("quit"):
            reply({"peak_rss_bytes": peak_rss_bytes(), "skipped_points": skipped})
            return
        reply({"repeat": command["run"], "workloads": run_repeat(driver, job, command["run"], skipped)})


def main(argv: list[str] | None = None) -> None:
    [job_path] = (argv if argv is not None else sys.argv[1:])[:1]
    # Replies travel on the original stdout; whatever a library prints there goes to stderr instead.
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    serve(json.loads(Path(job_path).read_text(encoding="utf-8")), sys.stdin, replies)


if __name__ == "__main__":
    main()

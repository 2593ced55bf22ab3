"""One engine's run of llm_bench, in a process of its own: `python -m kvforge.tools.bench.worker JOB.json OUT.json`.

A process per engine makes the peak RSS that engine's alone, keeps engines from disturbing each other (their
thread pools, allocators and caches) and lets a peer crash without taking the run down. The parent writes the
job (engine, token ids of every request, settings) and reads the result; nothing else passes between them.

Every engine is driven the same way: greedy decoding of exactly `max_tokens` tokens (end of sequence
suppressed, so every engine decodes the same count), the clock read when the request is handed over, when its
first token is available and when its last one is. TTFT = first - start; decode tok/s = (tokens - 1) / (last -
first). A *session* is one repeat of one workload: it starts with nothing cached from earlier sessions (a fresh
cache salt for kvforge, a reset context for llama.cpp; the other peers keep nothing between requests).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

KVFORGE, TRANSFORMERS, LLAMA_CPP, ORT_GENAI = "kvforge", "transformers", "llama.cpp", "onnxruntime-genai"


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

    @classmethod
    def timed(cls, label: str, role: str, prompt: list[int], start: float, times: list[float], ids: list[int],
              cached: int | None) -> Trace:
        return cls(label, role, len(prompt), (times[0] - start) * 1e3, (times[-1] - times[0]) * 1e3, len(ids),
                   ids, cached)


class Driver(Protocol):
    def start_session(self, session: str) -> None: ...

    def generate(self, prompt: list[int], max_tokens: int) -> Iterator[tuple[int, int | None, float]]:
        """Yield (token id, cached prompt tokens or None, time.perf_counter() when the token was available) per
        greedy token."""
        ...

    def encode(self, text: str) -> list[int]: ...


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# --- kvforge ---------------------------------------------------------------------------------------------


class KvforgeDriver:
    def __init__(self, path: Path, threads: int, reuse: bool) -> None:
        from kvforge.runtime.engine import Engine, EngineConfig

        self.engine = Engine(path, EngineConfig(num_threads=threads, enable_context_reuse=reuse))
        self.no_eos = {token: -1e9 for token in self.engine.engine.model.eos_token_ids}
        self.salt: str | None = None

    def start_session(self, session: str) -> None:
        self.salt = session  # a salt no earlier session used: nothing it published can hit

    def generate(self, prompt: list[int], max_tokens: int) -> Iterator[tuple[int, int | None, float]]:
        from kvforge.runtime.sequence import EngineRequest
        from kvforge.runtime.types import SamplingParams

        params = SamplingParams(temperature=1.0, top_k=1, top_p=1.0, max_generate_length=max_tokens,
                                logit_bias=self.no_eos)
        request_id = self.engine.add_request(EngineRequest(list(prompt), params, cache_salt=self.salt))
        finished = False
        while not finished:
            for output in self.engine.step():
                if output.request_id == request_id:
                    finished = output.finished
                    for token in output.new_token_ids:
                        yield token, output.cached_tokens, time.perf_counter()

    def encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)


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


# --- llama.cpp -----------------------------------------------------------------------------------------


class LlamaCppDriver:
    """llama-cpp-python's token loop (Llama.generate) with its own prompt cache: the KV of the previous call stays
    in the context, and a prompt sharing a prefix with it computes only the rest."""

    def __init__(self, path: Path, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         verbose=False, seed=0)

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
        for count, token in enumerate(tokens, 1):
            yield int(token), cached, time.perf_counter()
            if count >= max_tokens:
                break

    def encode(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)


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


# --- the run -------------------------------------------------------------------------------------------


def make_driver(spec: dict[str, Any], threads: int, n_ctx: int) -> Driver:
    path = Path(spec["path"])
    kind = spec["kind"]
    if kind == KVFORGE:
        return KvforgeDriver(path, threads, spec["reuse"])
    if kind == TRANSFORMERS:
        return TransformersDriver(path, threads)
    if kind == LLAMA_CPP:
        return LlamaCppDriver(path, threads, n_ctx)
    if kind == ORT_GENAI:
        return OrtGenaiDriver(path, threads)
    raise ValueError(f"unknown engine kind {kind!r}")


def run_request(driver: Driver, request: dict[str, Any], max_tokens: int) -> Trace:
    prompt = request["prompt_ids"]
    ids: list[int] = []
    times: list[float] = []
    cached: int | None = None
    start = time.perf_counter()
    for token, cached_now, stamp in driver.generate(prompt, max_tokens):
        times.append(stamp)
        ids.append(token)
        cached = cached_now
    if not ids:
        raise RuntimeError(f"{request['label']}: the engine generated no token")
    return Trace.timed(request["label"], request["role"], prompt, start, times, ids, cached)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(job: dict[str, Any]) -> dict[str, Any]:
    spec, max_tokens = job["engine"], job["max_tokens"]
    started = time.perf_counter()
    driver = make_driver(spec, job["threads"], job["n_ctx"])
    load_s = time.perf_counter() - started
    rss_after_load = peak_rss_bytes()
    own = driver.encode(job["check_text"])
    progress(f"{spec['name']}: loaded in {load_s:.1f} s; warming up")
    driver.start_session("llm_bench-warmup")
    for request in job["warmup"]:
        run_request(driver, request, 2)
    workloads: dict[str, list[list[dict[str, Any]]]] = {w["name"]: [] for w in job["workloads"]}
    for repeat in range(job["repeats"]):  # repeats outermost: drift of the machine spreads over every workload
        for workload in job["workloads"]:
            progress(f"{spec['name']}: repeat {repeat + 1}/{job['repeats']}, {workload['name']}")
            driver.start_session(f"llm_bench-{workload['name']}-{repeat}")
            traces = [run_request(driver, request, max_tokens) for request in workload["requests"]]
            workloads[workload["name"]].append([asdict(t) for t in traces])
    return {"name": spec["name"], "kind": spec["kind"], "status": "ok", "load_s": load_s,
            "rss_after_load_bytes": rss_after_load, "peak_rss_bytes": peak_rss_bytes(),
            "tokenizer_agrees": own == job["check_ids"], "workloads": workloads}


def main(argv: list[str] | None = None) -> None:
    job_path, out_path = (argv if argv is not None else sys.argv[1:])[:2]
    result = run(json.loads(Path(job_path).read_text(encoding="utf-8")))
    Path(out_path).write_text(json.dumps(result) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

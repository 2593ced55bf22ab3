"""Context reuse: TTFT with and without the context cache, bookkeeping cost, and 0%-hit throughput.

Four measurements on one engine, in one run, on the CPU backend (medians over --repeats):

1. shared document: a report fitted to exactly 12 pages (1,536 tokens) followed by four questions (raw
   prompts, no chat template, max_generate_length 1). cold = lookup `bypass`; warm = lookup `use_cache`
   after question 1 published the document; ideal = the question tokens alone prefilled with no cache
   (ignores their attention to the cached context); floor = runner.forward alone for the uncached suffix
   on the cached pages (the engine's cost including that attention, without the runtime around it);
2. a 6-turn chat (chat template, the model's own answers as assistant turns, commit policy
   including_generated_tokens) with the same figures per turn;
3. cache bookkeeping per request: acquire + publish + release, timed by wrapping the manager's methods
   here (not in the library), as a share of the cold prefill of the same prompt;
4. tokens/s of 8 distinct 300-token prompts (0% hits) with reuse off (enable_context_reuse=False) vs on
   (use_cache), each prompt run in every mode back to back in alternating order to cancel drift; a control
   mode (bypass on the reuse-on runtime) shows how much two ORT sessions differ on this machine.

Repeats use fresh cache salts, so every repeat sees the same misses and hits.

    python bench/context_reuse.py --onnxDir onnx/smollm2 --threads 2 --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.runtime.context_cache.keys import KeyExtras
from kvforge.runtime.context_cache.manager import BYPASS, USE_CACHE, Admission, ContextCacheManager
from kvforge.runtime.llm_runtime import CachePolicies, LLMRuntime, PreparedRequest
from kvforge.runtime.profile import Profiler
from kvforge.runtime.request_file import Request, parse_request_file
from kvforge.runtime.runner import StepInputs

TOKENS_PER_PAGE = 128
DOC_PAGES = 12  # the shared document is fitted to exactly this many pages, so the questions start a page
CHAT_MAX_GENERATE = 24
THROUGHPUT_PROMPTS = 8
THROUGHPUT_PROMPT_TOKENS = 300
THROUGHPUT_MAX_GENERATE = 16
TARGET_WARM_OVER_IDEAL = 1.15
TARGET_BOOKKEEPING_SHARE = 0.01
TARGET_ZERO_HIT_RATIO = 0.99

# --- workload text ------------------------------------------------------------------------------------

DOCUMENT_SECTIONS = [
    "Technical Report TR-117: Commissioning of the Harbor Point Tidal Energy Array\n"
    "Prepared by the Joint Engineering Office of Kestrel Marine Power and the Port of Alderney Bay.",

    "1. Summary\n"
    "This report describes the design, installation and first eighteen months of operation of the Harbor "
    "Point tidal energy array, a group of fourteen seabed-mounted turbines anchored in the narrow channel "
    "between Alderney Bay and the open sea. Construction began in March 2019 and the final turbine was "
    "connected to the grid in October 2021. During its first full year the array delivered 41.6 gigawatt "
    "hours of electricity, enough for roughly eleven thousand homes, at an average capacity factor of "
    "thirty-four percent. The review board, chaired by Dr. Imogen Vasquez, concluded that the project met "
    "every contractual target except the availability figure for the winter months, which fell short "
    "because of cable faults described in section 6.",

    "2. Site selection\n"
    "Three candidate sites were surveyed between 2014 and 2016. The channel at Harbor Point was chosen "
    "because its peak spring currents reach 3.9 metres per second, its depth of 32 to 41 metres leaves "
    "enough clearance above the rotors for shipping, and its bed of fractured granite offers a firm base "
    "for gravity foundations. The two rejected sites, at Gull Rock and at the mouth of the Fenner estuary, "
    "had faster currents but either lay across a busy ferry route or sat on shifting sand that would have "
    "required piled foundations at nearly twice the cost. Acoustic Doppler profilers recorded the flow for "
    "two full years so that the designers could estimate turbulence, wave loading and the asymmetry "
    "between flood and ebb tides, which at this site amounts to about eleven percent.",

    "3. Turbine design\n"
    "Each turbine has a three-bladed rotor of eighteen metres diameter driving a permanent magnet "
    "generator rated at 1.2 megawatts. The blades were supplied by Norrland Composites of Umea, who built "
    "them from glass and carbon fibre laminates with a polyurethane leading-edge coating to resist "
    "cavitation and abrasion by suspended sediment. The nacelle can yaw through 180 degrees so that the "
    "rotor faces the current on both the flood and the ebb tide; an earlier fixed-pitch prototype that "
    "relied on symmetric blades lost about nine percent of its annual output and was abandoned in 2017. "
    "Power electronics in each nacelle convert the variable frequency output to direct current at 1,500 "
    "volts, which is carried ashore through a shared export cable.",

    "4. Foundations and installation\n"
    "The turbines stand on triangular steel frames ballasted with 260 tonnes of iron ore concrete. The "
    "frames were lowered by the heavy-lift vessel Storm Petrel during slack water, when the current falls "
    "below half a metre per second for roughly forty minutes. Divers were not used below twenty metres; "
    "instead a remotely operated vehicle connected the wet-mate electrical connectors and inspected every "
    "frame for level and scour. Installation of the fourteen frames took nineteen working days spread "
    "over two summers, and weather delays accounted for eleven of the lost days. One frame was set down "
    "on a ledge that had not appeared in the bathymetric survey and had to be lifted and repositioned "
    "three metres to the north.",

    "5. Grid connection\n"
    "A single 33 kilovolt export cable, 6.8 kilometres long, runs from a subsea hub to an onshore "
    "substation at Quarry Lane. The cable route avoids a protected eelgrass meadow by following the old "
    "harbour breakwater for two kilometres. The substation contains the inverters, a 20 megawatt hour "
    "lithium iron phosphate battery that smooths the output across slack water, and the protection relays "
    "required by the regional network operator. Because tidal output is predictable years in advance, the "
    "operator accepts day-ahead schedules from the array with a tolerance of only four percent, much "
    "tighter than the fifteen percent it allows for wind farms.",

    "6. Operating experience\n"
    "Availability averaged 92.4 percent over the first eighteen months, against a target of 95 percent. "
    "Almost all of the shortfall came from two faults in the inter-array cables during storms in January "
    "and February 2022, when rocks moved by the swell abraded the cable armour. Repairs had to wait for a "
    "spell of calm weather and took twenty-three days in total. The rotors themselves performed well: "
    "blade inspections after one year found erosion depths below 0.3 millimetres, a quarter of the design "
    "allowance. Marine growth on the frames was heavier than expected, with mussels and kelp adding about "
    "four tonnes to each structure, but it has not yet affected the turbines.",

    "7. Environmental monitoring\n"
    "Seals, porpoises and diving seabirds were monitored with hydrophones, underwater cameras and shore "
    "observers. Over 9,600 hours of footage, biologists recorded 212 close approaches by seals and no "
    "confirmed collisions with a rotor. Harbour porpoises appear to avoid the channel during peak flow "
    "regardless of the turbines, a pattern already seen in the baseline survey of 2016. Noise from the "
    "generators is audible to hydrophones at up to 1.4 kilometres but stays below the level at which "
    "behavioural responses are expected. The eelgrass meadow next to the cable route has grown by about "
    "six percent since installation.",

    "8. Costs\n"
    "The capital cost of the project was 96 million euros, of which the turbines accounted for 38 percent, "
    "foundations and installation for 29 percent, the grid connection for 18 percent and engineering, "
    "consenting and contingency for the remainder. Operation and maintenance cost 3.1 million euros in the "
    "first full year. The levelised cost of electricity is estimated at 178 euros per megawatt hour, about "
    "forty percent lower than the previous generation of tidal projects but still well above offshore wind. "
    "The board expects a second phase of twenty larger turbines to reach 120 euros per megawatt hour by "
    "sharing the existing export cable and substation.",

    "9. Lessons learned\n"
    "First, inter-array cables in rocky channels need heavier armour or burial in trenches cut into the "
    "rock; the cheaper surface-laid design saved 1.2 million euros but cost more than that in lost "
    "output. Second, the slack-water installation window is shorter than tidal tables predict when swell "
    "is present, so schedules should assume thirty minutes rather than forty. Third, the remotely operated "
    "vehicle proved more reliable than divers and should be used for all subsea connections. Fourth, the "
    "battery at the substation paid for itself within two years by allowing the array to bid into the "
    "evening peak instead of selling at whatever price prevailed at slack water.",

    "10. Recommendations\n"
    "The review board recommends that phase two proceed, that all new inter-array cables be trenched, that "
    "the monitoring programme continue for at least five more years, and that blade inspections move from "
    "an annual to a two-year cycle given the low erosion observed so far. It also recommends that the "
    "data set of flow measurements, turbine performance and wildlife observations be published so that "
    "other developers can compare sites on a common basis.",
]

# The fitting glossary is cut after as many terms as needed to land the document on DOC_PAGES pages.
GLOSSARY = [
    "ebb tide", "flood tide", "slack water", "nacelle", "yaw drive", "capacity factor", "availability",
    "export cable", "wet-mate connector", "scour", "bathymetry", "gravity foundation", "levelised cost",
    "spring tide", "neap tide", "cavitation", "hydrophone", "inverter", "substation", "armour", "trench",
    "swell", "kelp", "mussel", "porpoise", "seal", "eelgrass", "ballast", "frame", "rotor", "blade",
    "laminate", "coating", "generator", "relay", "schedule", "tolerance", "battery", "phase", "cycle",
    "survey", "profiler", "turbulence", "sediment", "granite",
]

QUESTIONS = [
    "\n\nWhich company supplied the turbine blades? Answer:",
    "\n\nHow many turbines make up the array? Answer:",
    "\n\nWho chaired the review board? Answer:",
    "\n\nIn which month and year did construction begin? Answer:",
]

CHAT_SYSTEM = (
    "You are a patient tutor who explains physics and engineering to adult learners. Answer in short, "
    "plain sentences, use everyday examples, avoid formulas unless the learner asks for them, and check "
    "that each answer builds on what was said earlier in the conversation. If a question is unclear, say "
    "what you assume before answering. Keep a friendly tone and never invent numbers you are not sure of."
)
CHAT_TURNS = [
    "What causes the tides in the ocean?",
    "Why are there two high tides a day instead of one?",
    "How can a turbine make electricity from a tidal current?",
    "Is tidal power more predictable than wind power? Why?",
    "What problems do engineers face when they put machines on the seabed?",
    "Summarise our conversation in two sentences.",
]

# Openers differ from the first token on, so no two throughput prompts share even a partial page.
THROUGHPUT_OPENERS = ["Zebras", "Quietly", "Yesterday", "Pottery", "Every", "Marble", "Nobody", "Under"]


def fit_document(encode, target_tokens: int) -> tuple[str, int]:
    """The report plus a glossary cut so that `text` tokenizes to exactly target_tokens (if possible).

    The text ends in punctuation and every question starts with a newline, so the document's tokens are
    the same alone and followed by a question (a trailing blank line would tokenize differently).
    """
    body = "\n\n".join(DOCUMENT_SECTIONS) + "\n\nGlossary: "
    best = (body, len(encode(body)))
    for count in range(1, len(GLOSSARY) + 1):
        for ending in (".", " etc.", " and others.", ", among others."):
            text = body + ", ".join(GLOSSARY[:count]) + ending
            n = len(encode(text))
            if n == target_tokens:
                return text, n
            if best[1] < n <= target_tokens:
                best = (text, n)
    return best


# --- running requests ---------------------------------------------------------------------------------


def make_request(messages: list[dict[str, str]], *, max_generate_length: int, chat: bool,
                 salt: str | None = None, num_logprobs: int = 1) -> Request:
    request: dict[str, Any] = {"messages": messages}
    if salt is not None:
        request["cache_salt"] = salt
    return parse_request_file({"temperature": 1.0, "top_k": 1, "top_p": 1.0, "num_logprobs": num_logprobs,
                               "max_generate_length": max_generate_length, "apply_chat_template": chat,
                               "add_generation_prompt": chat, "requests": [request]}).requests[0]


class Bookkeeping:
    """Times the manager's acquire/publish/release by wrapping them on the instance (bench only)."""

    METHODS = ("acquire", "publish", "release")

    def __init__(self, manager: ContextCacheManager) -> None:
        self.ns = dict.fromkeys(self.METHODS, 0)
        for name in self.METHODS:
            setattr(manager, name, self._timed(name, getattr(manager, name)))

    def _timed(self, name: str, method):
        def timed(*args, **kwargs):
            started = time.perf_counter_ns()
            try:
                return method(*args, **kwargs)
            finally:
                self.ns[name] += time.perf_counter_ns() - started
        return timed

    def take(self) -> dict[str, float]:
        """Microseconds per method since the last take (one request)."""
        taken = {name: ns / 1e3 for name, ns in self.ns.items()}
        self.ns = dict.fromkeys(self.METHODS, 0)
        return taken


class Bench:
    def __init__(self, runtime: LLMRuntime) -> None:
        self.runtime = runtime
        self.book = Bookkeeping(runtime.cache)

    def run(self, prepared: PreparedRequest, lookup: str) -> dict[str, Any]:
        """One request alone; adds wall_ms, output token ids and bookkeeping microseconds."""
        self.book.take()
        started = time.perf_counter()
        response = self.runtime.generate([prepared], 0, Profiler(enabled=False), CachePolicies(lookup=lookup))[0]
        response["wall_ms"] = (time.perf_counter() - started) * 1e3
        response["bookkeeping_us"] = self.book.take()
        response["token_ids"] = [entry[0]["token_id"] for entry in response.get("logprobs", [])]
        return response


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def suffix_request(prepared: PreparedRequest, start: int, request: Request) -> PreparedRequest:
    """The tokens from `start` on as a prompt of their own: the ideal cost of computing only them."""
    return PreparedRequest(request, "", prepared.prompt_ids[start:])


def engine_floor(bench: Bench, prepared: PreparedRequest) -> tuple[float, int]:
    """(ms, reused tokens): the engine call alone for the uncached suffix, on top of the cached pages.

    A use_cache lease gives the same hit pages the warm request got; only runner.forward is timed (no
    tokenization, sampling, publication or response), and nothing is published, so the cache is unchanged.
    """
    runtime = bench.runtime
    extras = KeyExtras(cache_salt=prepared.request.cache_salt)
    lease = runtime.cache.acquire(Admission(prepared.prompt_ids, extras, USE_CACHE))
    try:
        start = lease.reuse_tokens
        suffix = prepared.prompt_ids[start:]
        step = StepInputs(runtime.embedding[suffix][None], np.array([len(suffix)], dtype=np.int32),
                          np.array([start], dtype=np.int32), [lease.page_ids])
        started = time.perf_counter()
        runtime.runner.forward(step)
        return (time.perf_counter() - started) * 1e3, start
    finally:
        runtime.cache.release(lease)
        bench.book.take()


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


def measure(bench: Bench, prepared: PreparedRequest, ideal_request: Request, samples: dict[str, list[float]],
            ideal_start: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """warm (use_cache), cold (bypass), ideal (the tokens from ideal_start, default the uncached suffix,
    alone with no cache) and, on a hit, the engine floor; appends their times to `samples`."""
    warm = bench.run(prepared, USE_CACHE)
    cold = bench.run(prepared, BYPASS)
    cached = warm["usage"]["cached_tokens"]
    ideal = bench.run(suffix_request(prepared, cached if ideal_start is None else ideal_start, ideal_request),
                      BYPASS)
    samples["cold"].append(cold["timing"]["ttft_ms"])
    samples["cold_prefill"].append(cold["timing"]["prefill_ms"])
    samples["warm"].append(warm["timing"]["ttft_ms"])
    samples["ideal"].append(ideal["timing"]["ttft_ms"])
    samples["bookkeeping_us"].append(sum(warm["bookkeeping_us"].values()))
    if cached:
        floor_ms, floor_start = engine_floor(bench, prepared)
        assert floor_start == cached, "the floor lease reused a different prefix than the warm request"
        samples["floor"].append(floor_ms)
    return warm, cold


def shared_document(bench: Bench, repeats: int, checks: list[str]) -> dict[str, Any]:
    encode = bench.runtime.tokenizer.encode
    doc_text, doc_tokens = fit_document(encode, DOC_PAGES * TOKENS_PER_PAGE)
    samples: list[dict[str, list[float]]] = [{name: [] for name in FIGURES} for _ in QUESTIONS]
    info: list[dict[str, Any]] = [{} for _ in QUESTIONS]
    for r in range(repeats):
        salt = f"doc-{r}"  # a fresh salt per repeat: question 1 misses again, 2-4 hit what 1 published
        for qi, question in enumerate(QUESTIONS):
            messages = [{"role": "user", "content": doc_text + question}]
            prepared = bench.runtime.prepare(make_request(messages, max_generate_length=1, chat=False, salt=salt))
            if prepared.prompt_ids[:doc_tokens] != encode(doc_text):
                checks.append(f"doc Q{qi + 1}: the document tokens change when the question follows")
            # The ideal is the question alone (from the document's end) for Q1's miss as for the hits.
            warm, cold = measure(bench, prepared, prepared.request, samples[qi], ideal_start=doc_tokens)
            expected_cached = 0 if qi == 0 else doc_tokens - doc_tokens % TOKENS_PER_PAGE
            if warm["usage"]["cached_tokens"] != expected_cached:
                checks.append(f"doc Q{qi + 1} repeat {r}: cached_tokens {warm['usage']['cached_tokens']} "
                              f"!= {expected_cached}")
            if warm["token_ids"] != cold["token_ids"]:
                checks.append(f"doc Q{qi + 1} repeat {r}: warm token {warm['token_ids']} != cold {cold['token_ids']}")
            info[qi] = {"label": f"Q{qi + 1}", "question": question.strip(), "prompt_tokens": len(prepared.prompt_ids),
                        "cached_tokens": warm["usage"]["cached_tokens"],
                        "suffix_tokens": len(prepared.prompt_ids) - doc_tokens,
                        "token": bench.runtime.tokenizer.token_text(warm["token_ids"][0]),
                        "cold_token_id": cold["token_ids"][0], "warm_token_id": warm["token_ids"][0]}
    return {"document_tokens": doc_tokens, "document_pages": doc_tokens / TOKENS_PER_PAGE,
            "document_words": len(doc_text.split()), "chat_template": False,
            "questions": [ttft_row(s, i) for s, i in zip(samples, info, strict=True)]}


def chat(bench: Bench, repeats: int, checks: list[str]) -> dict[str, Any]:
    samples: list[dict[str, list[float]]] = [{name: [] for name in FIGURES} for _ in CHAT_TURNS]
    info: list[dict[str, Any]] = [{} for _ in CHAT_TURNS]
    answers_first: list[str] = []
    for r in range(repeats):
        salt = f"chat-{r}"  # a fresh salt per repeat: turn 1 starts from an empty cache every time
        messages = [{"role": "system", "content": CHAT_SYSTEM}]
        answers = []
        for ti, turn in enumerate(CHAT_TURNS):
            messages.append({"role": "user", "content": turn})
            prepared = bench.runtime.prepare(make_request(messages, max_generate_length=CHAT_MAX_GENERATE, chat=True,
                                                          salt=salt))
            ideal_request = make_request(messages, max_generate_length=1, chat=True)
            warm, cold = measure(bench, prepared, ideal_request, samples[ti])
            cached = warm["usage"]["cached_tokens"]
            if warm["token_ids"] != cold["token_ids"]:
                checks.append(f"chat turn {ti + 1} repeat {r}: warm and cold answers differ")
            answers.append(warm["output_text"])
            messages.append({"role": "assistant", "content": warm["output_text"]})
            if r == 0:
                info[ti] = {"label": f"T{ti + 1}", "prompt_tokens": len(prepared.prompt_ids), "cached_tokens": cached,
                            "completion_tokens": warm["usage"]["completion_tokens"]}
            elif cached != info[ti]["cached_tokens"]:
                checks.append(f"chat turn {ti + 1} repeat {r}: cached_tokens {cached} != {info[ti]['cached_tokens']}")
        if r == 0:
            answers_first = answers
        elif answers != answers_first:
            checks.append(f"chat repeat {r}: the conversation differs from repeat 0")
    return {"chat_template": True, "max_generate_length": CHAT_MAX_GENERATE, "answers": answers_first,
            "turns": [ttft_row(s, i) for s, i in zip(samples, info, strict=True)]}


def throughput_prompts(encode, doc_text: str) -> list[list[int]]:
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
    encode = on.runtime.tokenizer.encode
    doc_text, _ = fit_document(encode, DOC_PAGES * TOKENS_PER_PAGE)
    prompts = throughput_prompts(encode, doc_text)
    if len({p[0] for p in prompts}) != len(prompts):
        checks.append("throughput prompts share a first token")
    modes = ["off", "on", *(["bypass"] if control else [])]
    runs = {"off": (off, USE_CACHE), "on": (on, USE_CACHE), "bypass": (on, BYPASS)}
    passes: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for r in range(repeats):
        totals = {mode: {"tokens": 0.0, "wall_ms": 0.0, "bookkeeping_us": 0.0, "prefill_ms": 0.0} for mode in modes}
        for i, ids in enumerate(prompts):
            order = modes if (r + i) % 2 == 0 else modes[::-1]
            for mode in order:
                bench, lookup = runs[mode]
                request = make_request([{"role": "user", "content": "-"}], max_generate_length=THROUGHPUT_MAX_GENERATE,
                                       chat=False, salt=f"tp-{r}", num_logprobs=0)
                response = bench.run(PreparedRequest(request, "", ids), lookup)
                if response["usage"]["cached_tokens"]:
                    checks.append(f"throughput {mode}: a request hit the cache")
                t = totals[mode]
                t["tokens"] += response["usage"]["prompt_tokens"] + response["usage"]["completion_tokens"]
                t["wall_ms"] += response["wall_ms"]
                t["bookkeeping_us"] += sum(response["bookkeeping_us"].values())
                t["prefill_ms"] += response["timing"]["prefill_ms"]
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnxDir", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--noBypassControl", dest="bypass_control", action="store_false",
                        help="skip section 4's control mode: lookup bypass on the reuse-on runtime (its ORT session)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    started = time.perf_counter()
    load_start = os.getloadavg()
    checks: list[str] = []

    def progress(step: str) -> None:
        print(f"[{time.perf_counter() - started:5.0f}s, load {os.getloadavg()[0]:.2f}] {step}", file=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = Path(tmp) / "engine"
        build_engine(args.onnxDir, engine_dir, BuildOptions(max_input_len=2048, max_kv_cache_capacity=2560,
                                                            max_batch_size=1, tokens_per_page=TOKENS_PER_PAGE,
                                                            max_kv_pool_pages=256))
        on = Bench(LLMRuntime(engine_dir, args.threads, enable_context_reuse=True))
        off = Bench(LLMRuntime(engine_dir, args.threads, enable_context_reuse=False))
        # Warmup: ORT initialization and arena growth for every shape measured later: a document-length
        # prefill + decode, then a hit on it (the cached-context path), under a salt no measured request uses;
        # and the throughput shape on both runtimes.
        encode = on.runtime.tokenizer.encode
        doc_text, _ = fit_document(encode, DOC_PAGES * TOKENS_PER_PAGE)
        for question in QUESTIONS[:2]:
            warmup = make_request([{"role": "user", "content": doc_text + question}], max_generate_length=2,
                                  chat=False, salt="warmup")
            on.run(on.runtime.prepare(warmup), USE_CACHE)
        short = PreparedRequest(warmup, "", encode(doc_text)[:THROUGHPUT_PROMPT_TOKENS])
        for bench in (off, on):
            bench.run(short, BYPASS)
        progress("built and warmed up; 1/4 shared document")
        document = shared_document(on, args.repeats, checks)
        progress("2/4 chat")
        conversation = chat(on, args.repeats, checks)
        progress("4/4 zero-hit throughput")
        throughput = zero_hit_throughput(on, off, args.repeats, args.bypass_control, checks)
        progress("done")
        cache_profile = on.runtime.cache.profile()
    elapsed = time.perf_counter() - started
    load_end = os.getloadavg()

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
    print("TTFT = response timing.ttft_ms (prefill + first sample; acquire() runs before it and is under "
          "bookkeeping)\n")

    print(f"1. shared document: {document['document_tokens']} tokens by the runtime tokenizer "
          f"({document['document_pages']:.0f} full pages, {document['document_words']} words) + 4 questions; raw "
          "prompts (no chat template), greedy, max_generate_length 1")
    print("   cold = lookup bypass; warm = use_cache, Q1 misses (cold in the warm runtime) and publishes the "
          "document, Q2-Q4 hit it;")
    print("   ideal = the question tokens alone with no cache (ignores their attention to the cached context); "
          "floor = runner.forward")
    print("   alone for the uncached suffix on the cached pages (engine cost incl. that attention, no runtime "
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

    print("3. bookkeeping per request: acquire + publish + release of the warm request (hash + plan + publish), "
          "vs the cold prefill of the same prompt")
    print(f"   {'':10}{'acquire+publish+release us':>28}{'cold prefill ms':>17}{'share':>10}")
    for (label, row), share in zip(book_rows, shares, strict=True):
        print(f"   {label:10}{row['bookkeeping_us']:28.1f}{row['cold_prefill_ms']:17.1f}{share:10.4%}")
    print(f"   {'0%-hit':10}{throughput['on_bookkeeping_us_per_request']:28.1f}"
          f"{throughput['off_prefill_ms_per_request']:17.1f}{tp_share:10.4%}")
    print(f"   manager metrics.planning_nanoseconds over the whole run (acquire only): "
          f"{cache_profile.get('planning_nanoseconds', 0) / 1e6:.1f} ms\n")

    print(f"4. 0% hit throughput: {throughput['prompts']} distinct {THROUGHPUT_PROMPT_TOKENS}-token prompts "
          f"(distinct first tokens), max_generate_length {THROUGHPUT_MAX_GENERATE}, (prompt + generated) tokens / "
          "wall time of generate()")
    print("   every prompt runs once per mode per repeat, modes adjacent, order alternating")
    print(f"   reuse off (enable_context_reuse=False)  {throughput['off_tok_s']:8.1f} tok/s")
    print(f"   reuse on  (use_cache, fresh salt)       {throughput['on_tok_s']:8.1f} tok/s   on/off "
          f"{throughput['on_over_off']:.3f}; per repeat "
          f"{', '.join(f'{x:.3f}' for x in throughput['paired_on_over_off'])}")
    if args.bypass_control:
        print(f"   control: reuse-on runtime, bypass       {throughput['bypass_tok_s']:8.1f} tok/s   bypass/off "
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
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    if checks:
        raise SystemExit("some checks failed (see 'check failed' above)")


if __name__ == "__main__":
    main()

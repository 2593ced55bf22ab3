"""Fixtures for the docs examples: the tiny engine and ONNX dir every example page's working directory links to."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvforge.builder.build import BuildOptions, build_engine

# The tiny tokenizer is byte-level (one token per byte), so prose examples need room: 2,048-token prompts.
DOCS_BUILD = BuildOptions(max_input_len=2048, max_kv_cache_capacity=4096, max_batch_size=4, tokens_per_page=16)


@pytest.fixture(scope="session")
def docs_engine_dir(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine `engines/smollm2` of every example's working directory; built once per session."""
    path = tmp_path_factory.mktemp("docs_engine")
    build_engine(tiny_onnx_dir, path, DOCS_BUILD)
    return path

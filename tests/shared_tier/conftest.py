"""Engines the tier tests share: each synthetic family built once per session, on first use, with one set of options."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

TIER_BUILD = BuildOptions(max_input_len=256, max_kv_cache_capacity=512, max_batch_size=4, tokens_per_page=16)


@pytest.fixture(scope="session")
def tier_engine(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tier_engine(family, seed=0)`: the engine dir of that synthetic family and weights seed (another seed is
    another fingerprint), built with TIER_BUILD the first time a test asks. Tests only read these dirs."""
    root = tmp_path_factory.mktemp("tier_engines")
    built: dict[tuple[str, int], Path] = {}

    def engine(family: str, seed: int = 0) -> Path:
        if (family, seed) not in built:
            folder = root / f"{family}-{seed}"
            write_onnx_dir(synthetic_model(family, seed=seed), folder / "onnx")
            build_engine(folder / "onnx", folder / "engine", TIER_BUILD)
            built[family, seed] = folder / "engine"
        return built[family, seed]

    return engine

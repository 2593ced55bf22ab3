"""The key of llm_test's and llm_bench's cached engines follows the lowering's sources, so an engine built before an
op's inputs changed (within one development version) is rebuilt instead of failing to load."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvforge.builder.build import BuildOptions
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir
from kvforge.tools.testcases import engines


def test_the_lowering_sources_cover_the_builder_and_the_kernel() -> None:
    names = {path.name for path in engines.lowering_sources()}
    assert {"build.py", "lower_matmul.py", "lower_ort.py", "ops.py", "matmul_blocks.cc", "paged_attention.cc",
            "ort_op.h"} <= names


def test_a_changed_lowering_source_changes_only_the_lowering_part_of_the_key(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    write_onnx_dir(synthetic_model("tiny-llama"), tmp_path / "onnx")
    source = tmp_path / "lowering.py"
    monkeypatch.setattr(engines, "lowering_sources", lambda: [source])
    source.write_text("inputs = 4\n")
    before = engines.engine_key(tmp_path / "onnx", BuildOptions())
    source.write_text("inputs = 2\n")
    after = engines.engine_key(tmp_path / "onnx", BuildOptions())
    assert before["lowering"] != after["lowering"]
    assert {k: v for k, v in before.items() if k != "lowering"} == {k: v for k, v in after.items() if k != "lowering"}

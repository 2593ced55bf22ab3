"""llm_serve with prompt-lookup speculative decoding: answers equal the plain server's, and /metrics shows drafts."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from support.server_harness import MODEL, build_server_engine, idle_audit, live_server
from test_server import metric_values

PROMPTS = ["the cat sat on the mat, the cat sat on the", "abc abc abc abc abc abc abc abc", "1 2 3 1 2 3 1 2 3 1 2"]


@pytest.fixture(scope="module")
def engine_dir(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_server_engine(tiny_onnx_dir, tmp_path_factory.mktemp("spec_server_engine"))


def answers(engine_dir: Path, tmp_path: Path, **config: object) -> tuple[list[str], dict[str, float]]:
    with live_server(engine_dir, tmp_path, **config) as server:
        with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as client:
            texts = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text
                     for p in PROMPTS]
        metrics = metric_values(server)
        server.on_engine(idle_audit)
    return texts, metrics


def test_speculative_server_answers_like_the_plain_one_and_reports_acceptance(engine_dir: Path,
                                                                             tmp_path: Path) -> None:
    plain, plain_metrics = answers(engine_dir, tmp_path / "plain")
    spec, metrics = answers(engine_dir, tmp_path / "spec", spec_decode="ngram", spec_draft_step=4)
    assert spec == plain
    assert "kvforge_spec_decode_draft_tokens_total" not in plain_metrics
    drafts = metrics["kvforge_spec_decode_draft_tokens_total"]
    accepted = metrics["kvforge_spec_decode_accepted_tokens_total"]
    assert drafts > 0 and 0 <= accepted <= drafts
    assert metrics["kvforge_spec_decode_acceptance_rate"] == pytest.approx(accepted / drafts)


def test_an_eagle3_server_answers_like_the_plain_one(tiny_eagle3_engine_dir: Path, tmp_path: Path) -> None:
    plain, _ = answers(tiny_eagle3_engine_dir, tmp_path / "plain")
    spec, metrics = answers(tiny_eagle3_engine_dir, tmp_path / "eagle3", spec_decode="eagle3", spec_draft_step=3)
    assert spec == plain
    assert metrics["kvforge_spec_decode_draft_tokens_total"] > 0

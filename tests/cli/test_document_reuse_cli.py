"""llm_inference --documentReuse / --documentRepair (issue 37): documents reused across a request file's requests and
reported, `full` answering as a cold run, and bad values refused with one line, exit 2 and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli_checks import assert_one_line_error

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

REPORTS = ["Pump 3 stopped at noon.", "The north gate is shut."]  # 23 and 23 bytes: a page and more each


def request(system: str, reports: list[str], question: str) -> dict:
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": [*({"type": "document", "text": r} for r in reports),
                                                      {"type": "text", "text": question}]}]}


@pytest.fixture
def input_file(tmp_path: Path) -> Path:
    path = tmp_path / "in.json"
    path.write_text(json.dumps({"batch_size": 1, "temperature": 0, "max_generate_length": 4,
                                "apply_chat_template": False,
                                "requests": [request("t=1\n", REPORTS, "\nPump?"),
                                             request("t=22\n", REPORTS[::-1], "\nGate?")]}), encoding="utf-8")
    return path


def run(run_cli, engine_dir: Path, input_file: Path, tmp_path: Path, *flags: str) -> tuple[list[dict], dict]:
    output_file, profile_file = tmp_path / "out.json", tmp_path / "profile.json"
    proc = run_cli(["llm_inference", "--engineDir", engine_dir, "--inputFile", input_file, "--outputFile",
                    output_file, "--profileOutputFile", profile_file, *flags])
    assert proc.returncode == 0, proc.stderr
    return (json.loads(output_file.read_text())["responses"],
            json.loads(profile_file.read_text()).get("context_cache", {}))


def test_documents_are_reused_and_full_repair_answers_as_cold(run_cli, tiny_engine_dir: Path, input_file: Path,
                                                                tmp_path: Path) -> None:
    reused, cache = run(run_cli, tiny_engine_dir, input_file, tmp_path, "--documentReuse", "--documentRepair", "none")
    assert cache["documents"]["document_hits"] == 4 and cache["documents"]["documents_produced"] == 2
    # The first request's documents were computed for it (issue 52 item 3); the second finds them stored.
    assert reused[0]["usage"]["cached_tokens"] == 0 and reused[1]["usage"]["cached_tokens"] >= sum(map(len, REPORTS))
    cold, _ = run(run_cli, tiny_engine_dir, input_file, tmp_path)
    full, cache = run(run_cli, tiny_engine_dir, input_file, tmp_path, "--documentReuse", "--documentRepair", "full")
    assert [r["output_text"] for r in full] == [r["output_text"] for r in cold]
    assert cache["documents"]["repaired_tokens"] == 2 * sum(map(len, REPORTS))


def test_an_unknown_repair_policy_is_one_line_and_writes_nothing(run_cli, tiny_engine_dir: Path, input_file: Path,
                                                                 tmp_path: Path) -> None:
    output_file = tmp_path / "out.json"
    proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", input_file, "--outputFile",
                    output_file, "--documentReuse", "--documentRepair", "most"])
    assert_one_line_error(proc, "--documentRepair", "none, first-page, overlap, full", "most")
    assert not output_file.exists()


def test_llm_test_takes_the_options(run_cli, tiny_engine_dir: Path, input_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "outputs"
    proc = run_cli(["llm_test", "--engineDir", tiny_engine_dir, "--documentReuse", "--documentRepair", "none",
                    "--outputDir", out, input_file])
    assert proc.returncode == 0, proc.stderr
    profile = json.loads((out / "in.profile.json").read_text())
    assert profile["context_cache"]["documents"]["document_hits"] == 4
    bad = run_cli(["llm_test", "--engineDir", tiny_engine_dir, "--documentRepair", "most", input_file])
    assert_one_line_error(bad, "--documentRepair", "none, first-page, overlap, full")

"""The README's Python example and its `llm_bench` line run as a user runs them: `python example.py` and the console
script in the root of a checkout after `make demo`, where the folder `kvforge/` (the sources) sits beside the script
and the working directory and comes first on Python's path. Before the sources moved under kvforge/ that folder held
part of the package and shadowed the installed one: `No module named 'kvforge.runtime'` for the script, and every
engine of llm_bench failing while it exited 0 with a blank chart."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_doc_examples import REPO, parse_blocks

BIN_DIR = Path(sys.executable).parent
# The README's llm_bench line measures 1,550-token prompts 3 times: shortened here, the engines and workloads kept.
QUICK_BENCH = ["--repeats", "1", "--promptTokens", "64", "--maxTokens", "4", "--contextTokens", "64"]


def readme_block(lang: str, needle: str) -> str:
    """The README's `lang` block that contains `needle` (one, or the test says the README changed)."""
    found = [b.text for b in parse_blocks(REPO / "README.md") if b.lang == lang and needle in b.text]
    assert len(found) == 1, f"README.md has {len(found)} {lang} blocks with {needle!r}"
    return found[0]


@pytest.fixture(scope="module")
def checkout_root(smollm2_demo_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The root of a checkout after `make demo`: every top-level entry of this checkout (kvforge/ among them) linked,
    and `out/` holding make demo's ONNX dir and engine (the real SmolLM2)."""
    root = tmp_path_factory.mktemp("checkout")
    for entry in REPO.iterdir():
        if entry.name not in ("out", ".git", ".venv") and not entry.name.startswith("."):
            (root / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    (root / "out" / "engines").mkdir(parents=True)
    (root / "out" / "onnx").mkdir()
    (root / "out" / "engines" / "smollm2").symlink_to(smollm2_demo_engine_dir, target_is_directory=True)
    (root / "out" / "onnx" / "smollm2").symlink_to(smollm2_demo_engine_dir.parent / "onnx", target_is_directory=True)
    assert (root / "kvforge" / "runtime").is_dir()  # the sources are what a script there imports first
    return root


def user_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_DEBUG"}
    env.update(PATH=f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}", NO_COLOR="1", TERM="dumb", COLUMNS="200")
    return env


@pytest.mark.model
def test_readme_python_example_runs_as_a_script_in_the_checkout_root(checkout_root: Path) -> None:
    (checkout_root / "example.py").write_text(readme_block("python", "from kvforge import LLM"), encoding="utf-8")
    result = subprocess.run([sys.executable, "example.py"], cwd=checkout_root, env=user_env(), capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-1500:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2, result.stdout
    cached = [int(line.rsplit(" ", 1)[1]) for line in lines]
    # The README's comment: nothing cached for the first question, the first request's prompt for the second.
    promised = re.search(r"# (\d+), then (\d+)", readme_block("python", "from kvforge import LLM"))
    assert promised and cached == [int(promised[1]), int(promised[2])], (cached, promised)


@pytest.mark.model
def test_readme_llm_bench_line_runs_its_kvforge_engine_in_the_checkout_root(checkout_root: Path) -> None:
    line = readme_block("bash", "llm_bench ").replace("\\\n", " ")
    command = [*line.split(), *QUICK_BENCH]
    result = subprocess.run(command, cwd=checkout_root, env=user_env(), capture_output=True, text=True, timeout=600,
                            check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-2000:]
    figures = json.loads((checkout_root / "bench.json").read_text(encoding="utf-8"))
    status = {e["name"]: e["status"] for e in figures["engines"]}
    assert status["int4"] == "ok", figures["engines"]
    assert all(s in ("ok", "skipped") for s in status.values()), status  # a peer absent here is skipped, not failed
    assert (checkout_root / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

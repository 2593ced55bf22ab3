"""`llm_serve MODEL`, `llm_inference MODEL` (issue 51 item 5): a GGUF file, HF dir, bundled name or ONNX dir is
exported and built once into a cache keyed by the source, the flags and the kernel version (llm_bench's
`cached_engine`), with limits chosen from the model and the machine and printed; the next run finds both."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest
from conftest import BIN_DIR
from test_export_sources import _tiny_hf_weights, write_tiny_gguf

from kvforge.contract.errors import KvforgeError
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.testcases import models

HI = {"max_generate_length": 4, "requests": [{"messages": [{"role": "user", "content": "hello"}]}]}


def run(args: list[str], cache: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_DEBUG"}
    env.update(XDG_CACHE_HOME=str(cache), NO_COLOR="1", TERM="dumb", COLUMNS="300")
    return subprocess.run([str(BIN_DIR / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_llm_inference_takes_a_gguf_file_exports_and_builds_it_once(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.Q8.gguf"
    write_tiny_gguf(gguf, _tiny_hf_weights(tied=True))
    (tmp_path / "hi.json").write_text(json.dumps(HI))
    first = run(["llm_inference", str(gguf), "--inputFile", "hi.json", "--outputFile", "out.json"], tmp_path / "c",
                tmp_path)
    assert first.returncode == 0, first.stderr
    assert json.loads((tmp_path / "out.json").read_text())["responses"][0]["output_text"] is not None
    assert f"{gguf}: exported" in first.stderr and f"{gguf}: built" in first.stderr, first.stderr
    limits = re.search(r"limits: prompts up to ([\d,]+) tokens, ([\d,]+) per request", first.stderr)
    assert limits and limits[2] == "128", first.stderr  # the tiny GGUF's 128 positions bound it
    again = run(["llm_inference", str(gguf), "--inputFile", "hi.json", "--outputFile", "out.json"], tmp_path / "c",
                tmp_path)
    assert again.returncode == 0 and "found exported" in again.stderr and "found built" in again.stderr
    assert len(list((tmp_path / "c" / "kvforge" / "models" / "onnx").iterdir())) == 1
    os.utime(gguf, ns=(1, 1))  # another file at that path: exported again, beside the first
    third = run(["llm_inference", str(gguf), "--inputFile", "hi.json", "--outputFile", "out.json"], tmp_path / "c",
                tmp_path)
    assert third.returncode == 0 and f"{gguf}: exported" in third.stderr
    assert len(list((tmp_path / "c" / "kvforge" / "models" / "onnx").iterdir())) == 2


@pytest.mark.parametrize("args, says", [
    (["--inputFile", "hi.json", "--outputFile", "out.json"], "missing: a GGUF file"),
    (["x.gguf", "--engineDir", "e", "--inputFile", "hi.json", "--outputFile", "out.json"], "not both"),
    (["no/such.gguf", "--inputFile", "hi.json", "--outputFile", "out.json"], "is neither a GGUF file, an HF"),
])
def test_a_bad_model_argument_is_one_line_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    (tmp_path / "hi.json").write_text(json.dumps(HI))
    result = run(["llm_inference", *args], tmp_path / "c", tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: MODEL:") and says in lines[0], \
        result.stderr


def test_limits_come_from_the_model_and_the_machine() -> None:
    config = synthetic_model("tiny-llama").config
    config.max_position_embeddings = 32768
    options, why = models.choose_limits(config, memory=64 * 2**30)
    assert (options.max_kv_cache_capacity, options.max_input_len, options.tokens_per_page) == (8192, 6144, 16)
    assert "set by the CPU cap" in why and "32,768 positions" in why
    per_token = 2 * config.num_key_value_heads * config.head_dim * 2 * config.num_hidden_layers  # K and V, fp16
    small = 8 * 4 * per_token * 1000  # 1/8 of it holds 4 requests of 1,000 tokens
    options, why = models.choose_limits(config, memory=small)
    assert options.max_kv_cache_capacity == 992 and "1/8 of" in why  # 1,000 rounded down to 16-token pages
    with pytest.raises(KvforgeError, match="too little KV cache"):
        models.choose_limits(config, memory=8 * 4 * per_token * 20)


def test_llm_serve_takes_a_model_and_names_it_after_the_file(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    gguf = tmp_path / "tiny-chat.gguf"
    write_tiny_gguf(gguf, _tiny_hf_weights(tied=True))
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_DEBUG"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "c"), NO_COLOR="1", TERM="dumb", COLUMNS="300")
    process = subprocess.Popen([str(BIN_DIR / "llm_serve"), str(gguf), "--port", "0"], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "Application startup complete" in line:
                break
        url = next(m[1] for line in lines if (m := re.search(r"at (http://\S+)/v1 ", line)))
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as reply:
            assert [m["id"] for m in json.load(reply)["data"]] == ["tiny-chat"]
        assert any("limits: prompts up to" in line for line in lines), lines
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert process.returncode == 0, "".join(lines)[-1500:]


def test_kvforge_llm_takes_a_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kvforge.LLM(MODEL) as llm_serve MODEL: exported and built into the same cache; an engine dir, or a path that
    is no model (the runtime's own error then), is left as it is."""
    from kvforge import LLM, SamplingParams

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, _tiny_hf_weights(tied=True))
    llm = LLM(gguf, num_threads=1)
    [out] = llm.generate("hello", SamplingParams(temperature=0, max_generate_length=2))
    assert len(out.token_ids) == 2
    built = list((tmp_path / "c" / "kvforge" / "models" / "engines").iterdir())
    assert len(built) == 1 and models.model_engine(built[0]) == built[0]
    assert models.model_engine(tmp_path / "nothing") == tmp_path / "nothing"
    with pytest.raises(KvforgeError, match="is neither a GGUF file"):
        models.model_engine(tmp_path / "nothing", strict=True)

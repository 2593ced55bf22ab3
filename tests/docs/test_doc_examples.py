"""The examples in README.md and docs/**/*.md run as tests, so the docs cannot drift from the code.

Convention (what a page writer marks; the marker is an HTML comment on the line before the fence, blank lines
allowed between them):

- The blocks of one page run in page order in one temporary working directory, which stands for the root of a
  checkout after `make demo`. It holds `engines/tiny` (a tiny synthetic engine: byte-level tokenizer, maxInputLen
  2048, capacity 4096, batch 4, 16-token pages), `onnx/tiny` (its ONNX dir), an empty `adapters/` and the
  repository's `test_cases/`; no request files: a page writes the ones it uses. A block that names
  `out/engines/smollm2` or `out/onnx/smollm2` gets `make demo`'s engine or ONNX dir there (the real SmolLM2,
  built once per session), unless the block makes that path itself (`llm_export ... --outputDir PATH`,
  `llm_build ... --engineDir PATH`). Files a block writes are seen by the page's later blocks; a block selected
  on its own (`-k`) first runs the blocks above it on its page.
- ```python fences are executed, each in a fresh namespace.
  - `<!-- docs-test: server -->` before a python block: it runs while llm_serve serves `engines/tiny` as model
    `tiny`; the text `http://127.0.0.1:8000` in the block is replaced by the live server's URL.
    `<!-- docs-test: server out/engines/smollm2 -->` serves `make demo`'s engine instead, as model `smollm2`.
    The server blocks of a page share one server per engine, started by the first of them.
  - `<!-- docs-test: skip REASON -->`: not run; reported as skipped with REASON.
- ```bash, ```sh, ```shell and ```console fences must carry one of:
  - `<!-- docs-test: run -->`: executed with `bash -e` in the page's working directory, the venv's bin first on
    PATH (so `llm_inference --engineDir engines/tiny --inputFile requests.json ...` works), with a timeout
    (SHELL_TIMEOUT_S). In a console block only the `$ ` lines run (the rest is shown output).
  - `<!-- docs-test: serve -->`: a command that serves until stopped (`llm_serve ...`): started in the page's
    working directory on a free port (`--port 0` is appended), it must print uvicorn's start line within
    SERVE_TIMEOUT_S and exit 0 on SIGTERM.
  - `<!-- docs-test: needs peer -->`, `needs gpu`, `needs network`, or `skip REASON`: not run, reported as
    skipped with the reason.
  An unmarked shell block fails, naming file:line.
- ```json preceded by `<!-- docs-test: request-file -->` is parsed as an llm_inference request file;
  `<!-- docs-test: request-file NAME -->` also writes it to NAME in the page's working directory.
- Other fences (```json, ```text, ```jinja, ...) are not executed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.runtime.inputs.request_file import parse_request_file

# The tiny tokenizer is byte-level (one token per byte), so prose examples need room: 2,048-token prompts.
DOCS_BUILD = BuildOptions(max_input_len=2048, max_kv_cache_capacity=4096, max_batch_size=4, tokens_per_page=16)


@pytest.fixture(scope="session")
def docs_engine_dir(tiny_onnx_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine `engines/tiny` of every example's working directory; built once per session (defined here,
    not in a tests/docs/conftest.py, which would shadow tests/conftest.py for `from conftest import ...`)."""
    path = tmp_path_factory.mktemp("docs_engine")
    build_engine(tiny_onnx_dir, path, DOCS_BUILD)
    return path


REPO = Path(__file__).resolve().parents[2]
BIN_DIR = Path(sys.executable).parent
SHELL_TIMEOUT_S = 120
DOC_URL = "http://127.0.0.1:8000"
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# No `needs smollm2`: the blocks that need SmolLM2 run on `make demo`'s engine (the smollm2_demo_engine_dir fixture).
NEEDS = {"peer", "gpu", "network"}
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<kind>[\w-]+)(?:\s+(?P<arg>.*?))?\s*-->\s*$")
TINY = "engines/tiny"  # the tiny synthetic engine's path in every page's working directory
DEMO_PATHS = ("out/engines/smollm2", "out/onnx/smollm2")  # where `make demo` builds SmolLM2 (the Makefile's paths)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None  # "run", "server", "skip", "needs", "request-file" or an unknown word (an error)
    arg: str  # the skip reason, or what a "needs" marker needs

    @property
    def where(self) -> str:
        try:
            return f"{self.page.relative_to(REPO)}:{self.line}"
        except ValueError:
            return f"{self.page}:{self.line}"


def parse_blocks(page: Path) -> list[Block]:
    """Every fenced block of a markdown page with the docs-test marker on the nearest non-blank line above it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        ticks, indent = opening["ticks"], len(opening["indent"])
        marker, arg = None, ""
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j >= 0 and (found := _MARKER.match(lines[j])):
            marker, arg = found["kind"], found["arg"] or ""
        body: list[str] = []
        k = i + 1
        # The closing fence: the same character, at least as long (CommonMark), nothing else on the line.
        while k < len(lines) and not (lines[k].strip().startswith(ticks) and not lines[k].strip().strip(ticks[0])):
            body.append(lines[k][indent:] if lines[k][:indent].strip() == "" else lines[k])
            k += 1
        blocks.append(Block(page, i + 1, opening["lang"].lower(), "\n".join(body) + "\n", marker, arg))
        i = k + 1
    return blocks


def doc_pages() -> list[Path]:
    pages = [REPO / "README.md"] if (REPO / "README.md").exists() else []
    return pages + sorted((REPO / "docs").glob("**/*.md"))


class Skipped(Exception):
    """A block that is deliberately not run; the message is the reason."""


class ExampleFailed(Exception):
    """A block that is broken or unmarked; the message names file:line."""


def check_marker(block: Block) -> None:
    """Raise Skipped/ExampleFailed for blocks that are not to be run; return for blocks to run."""
    if block.marker == "skip":
        raise Skipped(f"{block.where}: {block.arg or 'no reason given'}")
    if block.marker == "needs":
        if block.arg not in NEEDS:
            raise ExampleFailed(f"{block.where}: unknown `needs {block.arg}` (one of {', '.join(sorted(NEEDS))})")
        raise Skipped(f"{block.where}: needs {block.arg}")
    if block.lang in SHELL_LANGS and block.marker not in ("run", "serve"):
        what = f"marker `{block.marker}`" if block.marker else "no docs-test marker"
        raise ExampleFailed(f"{block.where}: ```{block.lang} block with {what}; precede it with "
                            "<!-- docs-test: run -->, <!-- docs-test: needs peer|gpu|network --> "
                            "or <!-- docs-test: skip REASON -->")
    if block.lang == "python" and block.marker not in (None, "server", "run"):
        raise ExampleFailed(f"{block.where}: python block with unknown marker `{block.marker}`")


def make_workspace(path: Path, engine_dir: Path, onnx_dir: Path) -> Path:
    """A page's working directory: what a checkout's root holds (test_cases/) plus the tiny engine; no request files."""
    (path / "engines").mkdir(parents=True, exist_ok=True)
    (path / "onnx").mkdir(exist_ok=True)
    (path / "adapters").mkdir(exist_ok=True)
    # Copies, not links (both are small): an example may write into them (the README exports and builds its own).
    if not (path / TINY).exists():
        shutil.copytree(engine_dir, path / TINY)
    if not (path / "onnx" / "tiny").exists():
        shutil.copytree(onnx_dir, path / "onnx" / "tiny")
    if not (path / "test_cases").exists():
        (path / "test_cases").symlink_to(REPO / "test_cases", target_is_directory=True)  # tracked files, read-only
    return path


def demo_paths_to_link(block: Block) -> list[str]:
    """The `make demo` paths a block reads, so the harness links them in first; not the ones the block makes."""
    if block.marker in ("skip", "needs"):
        return []
    named = [p for p in DEMO_PATHS if re.search(rf"(?<![\w/.-]){re.escape(p)}(?![\w.-])", block.text)]
    if block.marker == "server" and block.arg in DEMO_PATHS and block.arg not in named:
        named.append(block.arg)
    made = {p for p in named
            if re.search(rf"(?:llm_export\b[^\n]*--outputDir|llm_build\b[^\n]*--engineDir)\s+{re.escape(p)}(?:\s|$)",
                         block.text)}
    return [p for p in named if p not in made]


@contextmanager
def _cwd(path: Path) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def run_python(block: Block, workdir: Path, url: str | None = None) -> None:
    source = block.text.replace(DOC_URL, url) if url else block.text
    try:
        code = compile(source, block.where, "exec")
    except SyntaxError as exc:
        raise ExampleFailed(f"{block.where}: does not compile: {exc}") from exc
    with _cwd(workdir):
        try:
            exec(code, {"__name__": "__docs_example__"})
        except Exception as exc:  # any failure of the example is the test's failure, with where it came from
            raise ExampleFailed(f"{block.where}: {type(exc).__name__}: {exc}") from exc


def shell_script(block: Block) -> str:
    """The commands of a block: all of it, or in a console block the `$ ` lines and their `\\` continuations."""
    if block.lang != "console":
        return block.text
    commands: list[str] = []
    continued = False
    for line in block.text.splitlines():
        if line.startswith("$ ") or continued:
            commands.append(line[2:] if line.startswith("$ ") and not continued else line)
            continued = line.endswith("\\")
    return "\n".join(commands) + "\n"


SERVE_TIMEOUT_S = 120


def run_server_command(block: Block, workdir: Path) -> None:
    """Start the block's command, wait for the server to be up, stop it with SIGTERM: it must exit 0."""
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_DEBUG"}
    env.update(PATH=f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}", NO_COLOR="1", TERM="dumb", COLUMNS="300")
    command = [line for line in shell_script(block).splitlines() if line.strip() and not line.startswith("#")]
    if len(command) != 1:
        raise ExampleFailed(f"{block.where}: a serve block holds one command, got {len(command)}")
    line = command[0].split(" #")[0]  # a trailing comment would swallow the appended --port
    process = subprocess.Popen(["bash", "-c", f"exec {line} --port 0"], cwd=workdir, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "Application startup complete" in line:
                started.set()
        started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        started.wait(SERVE_TIMEOUT_S)
        up = any("Application startup complete" in line for line in lines)  # not set when output merely ended
        process.send_signal(signal.SIGTERM)
        code = process.wait(SERVE_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(5)
    if not up or code != 0:
        raise ExampleFailed(f"{block.where}: the server {'exited' if not up else f'stopped with {code}'}: "
                            f"{''.join(lines)[-1500:]}")


def run_shell(block: Block, workdir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_DEBUG"}
    env.update(PATH=f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}", NO_COLOR="1", TERM="dumb")
    try:
        result = subprocess.run(["bash", "-e", "-c", shell_script(block)], cwd=workdir, env=env, text=True,
                                capture_output=True, timeout=SHELL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ExampleFailed(f"{block.where}: timed out after {SHELL_TIMEOUT_S} s") from exc
    if result.returncode:
        tail = (result.stderr or result.stdout).strip()[-1500:]
        raise ExampleFailed(f"{block.where}: exit {result.returncode}: {tail}")


def check_request_file(block: Block, workdir: Path) -> None:
    """Parse the block as a request file; with a file name after the marker, write it there for later blocks."""
    try:
        parse_request_file(json.loads(block.text), source=block.where)
    except Exception as exc:
        raise ExampleFailed(f"{block.where}: not a valid request file: {exc}") from exc
    if block.arg:
        (workdir / block.arg).write_text(block.text, encoding="utf-8")


def run_block(block: Block, workdir: Path, server_url: str | None = None) -> None:
    """Run one block by the convention; raises Skipped or ExampleFailed, returns when it passed or is not code."""
    check_marker(block)
    if block.lang == "python":
        run_python(block, workdir, server_url)
    elif block.marker == "serve":
        run_server_command(block, workdir)
    elif block.lang in SHELL_LANGS:
        run_shell(block, workdir)
    elif block.marker == "request-file":
        check_request_file(block, workdir)


ALL_BLOCKS = [b for page in doc_pages() for b in parse_blocks(page)
              if b.lang == "python" or b.lang in SHELL_LANGS or b.marker is not None]
_WORKDIRS: dict[Path, Path] = {}  # page → its working directory, shared by the page's blocks in order
_DONE: set[Block] = set()  # blocks already run in their page's working directory
# The server blocks of a page share one live server per engine (an engine load each, not one per block); a page's
# servers stop when the next page starts, and the last ones with the module.
_SERVERS: dict[tuple[Path, Path], Any] = {}
_SERVER_STACKS: dict[Path, ExitStack] = {}


@pytest.fixture(scope="module", autouse=True)
def _stop_servers() -> Iterator[None]:
    yield
    for stack in _SERVER_STACKS.values():
        stack.close()
    _SERVER_STACKS.clear()
    _SERVERS.clear()


def page_server(block: Block, engine: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The live server of `engine` for the block's page, started on first use (other pages' servers stop)."""
    from support import server_harness

    for page in [p for p in _SERVER_STACKS if p != block.page]:
        _SERVER_STACKS.pop(page).close()
        for key in [k for k in _SERVERS if k[0] == page]:
            del _SERVERS[key]
    if (block.page, engine) not in _SERVERS:
        with monkeypatch.context() as patch:
            patch.setattr(server_harness, "MODEL", engine.name)  # as llm_serve names it: the engine folder
            stack = _SERVER_STACKS.setdefault(block.page, ExitStack())
            _SERVERS[(block.page, engine)] = stack.enter_context(server_harness.live_server(engine, workdir))
    return _SERVERS[(block.page, engine)]


def run_in_page(block: Block, workdir: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run a block in its page's working directory: link the `make demo` paths it reads, serve for server blocks."""
    _DONE.add(block)
    demo = {"out/engines/smollm2": lambda: request.getfixturevalue("smollm2_demo_engine_dir"),
            "out/onnx/smollm2": lambda: request.getfixturevalue("smollm2_demo_engine_dir").parent / "onnx"}
    for path in demo_paths_to_link(block):
        if not (workdir / path).exists():
            (workdir / path).parent.mkdir(parents=True, exist_ok=True)
            (workdir / path).symlink_to(demo[path](), target_is_directory=True)
    if block.marker == "server" and block.lang == "python":
        run_block(block, workdir, page_server(block, workdir / (block.arg or TINY), workdir, monkeypatch).url)
    else:
        run_block(block, workdir)


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=lambda b: f"{b.where}-{b.lang}")
def test_doc_example(block: Block, docs_engine_dir: Path, tiny_onnx_dir: Path, request: pytest.FixtureRequest,
                     tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.page not in _WORKDIRS:
        _WORKDIRS[block.page] = make_workspace(tmp_path_factory.mktemp("docs_page"), docs_engine_dir, tiny_onnx_dir)
    workdir = _WORKDIRS[block.page]
    try:
        # Page order: a block may use what the blocks above it wrote, so those run first when not run yet.
        for earlier in [b for b in ALL_BLOCKS if b.page == block.page and b.line < block.line and b not in _DONE]:
            try:
                run_in_page(earlier, workdir, request, monkeypatch)
            except Skipped:
                pass
            except ExampleFailed as exc:
                raise ExampleFailed(f"{block.where}: an earlier block of the page failed: {exc}") from exc
        run_in_page(block, workdir, request, monkeypatch)
    except Skipped as exc:
        pytest.skip(str(exc))
    except ExampleFailed as exc:
        pytest.fail(str(exc), pytrace=False)


BROKEN_PAGE = """# A page with broken examples

```python
import kvforge
assert kvforge.__version__
```

```python
raise RuntimeError("this example is broken")
```

<!-- docs-test: run -->

```bash
llm_inference --version
```

<!-- docs-test: run -->
```bash
false
echo unreachable
```

```bash
echo this block has no marker
```

<!-- docs-test: skip needs a person at the keyboard -->
```bash
read -p "name? " name
```

<!-- docs-test: request-file -->
```json
{"requests": "not a list"}
```
"""


def test_collector_reports_broken_examples(tmp_path: Path) -> None:
    page = tmp_path / "broken.md"
    page.write_text(BROKEN_PAGE, encoding="utf-8")
    outcomes: dict[int, str] = {}
    for block in parse_blocks(page):
        try:
            run_block(block, tmp_path)
            outcomes[block.line] = "passed"
        except Skipped as exc:
            outcomes[block.line] = f"skipped: {exc}"
        except ExampleFailed as exc:
            outcomes[block.line] = f"failed: {exc}"
    assert outcomes[3] == "passed"
    assert outcomes[8].startswith("failed:") and "RuntimeError" in outcomes[8] and "broken.md:8" in outcomes[8]
    assert outcomes[14] == "passed"
    assert outcomes[19].startswith("failed:") and "exit 1" in outcomes[19]
    assert outcomes[24].startswith("failed:") and "no docs-test marker" in outcomes[24] and ":24" in outcomes[24]
    assert outcomes[29] == f"skipped: {page}:29: needs a person at the keyboard"
    assert outcomes[34].startswith("failed:") and "request file" in outcomes[34]


# Backticked tokens that name repository paths: a top-level folder, then path characters only (no spaces,
# placeholders like <name> or globs).
_PATH_ROOTS = ("kvforge/", "tests/", "experiments/", "scripts/", "test_cases/", "docs/")
_BACKTICKED = re.compile(r"`([^`\s]+)`")
_PATH_CHARS = re.compile(r"^[\w./-]+$")


def repo_paths_named(text: str) -> list[str]:
    return [t for t in _BACKTICKED.findall(text) if t.startswith(_PATH_ROOTS) and _PATH_CHARS.match(t)]


def path_exists(token: str, repo: Path = REPO) -> bool:
    """A repo path, or `folder/module.Name` naming something defined in `folder/module.py`."""
    if (repo / token.rstrip("/")).exists():
        return True
    module, _, name = token.rpartition(".")
    source = repo / f"{module}.py"
    return bool(module and name.isidentifier() and source.is_file()
                and re.search(rf"^\s*(?:class|def)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]",
                              source.read_text(encoding="utf-8"), re.MULTILINE))


@pytest.mark.parametrize("page", ["README.md", "docs/architecture.md"])
def test_named_repo_paths_exist(page: str) -> None:
    if not (REPO / page).exists():
        pytest.skip(f"{page} is not written yet")
    text = (REPO / page).read_text(encoding="utf-8")
    missing = sorted({p for p in repo_paths_named(text) if not path_exists(p)})
    assert not missing, f"{page} names paths that do not exist: {', '.join(missing)}"


def test_path_check_reads_module_names() -> None:
    assert path_exists("kvforge/runtime/context_cache/lease.py") and path_exists("kvforge/tools/export/")
    assert path_exists("kvforge/runtime/api.LLM") and not path_exists("kvforge/runtime/api.NoSuchThing")
    named = repo_paths_named("`kvforge/runtime/x.py` `<dir>/x` `out/engines` `kvforge/tools/a b`")
    assert named == ["kvforge/runtime/x.py"]


def test_demo_engine_fixture_builds_what_make_demo_builds() -> None:
    """The docs run on `smollm2_demo_engine_dir` as if on `make demo`'s engine: the same llm_build flags."""
    from conftest import DEMO_BUILD

    recipe = re.search(r"--engineDir \$\(OUT\)/engines/smollm2 \\\n\s*(.*)", (REPO / "Makefile").read_text())
    assert recipe, "the Makefile no longer builds $(OUT)/engines/smollm2"
    flags = dict(re.findall(r"--(\w+) (\S+)", recipe.group(1)))
    assert flags == {"maxInputLen": str(DEMO_BUILD.max_input_len), "maxKVCacheCapacity":
                     str(DEMO_BUILD.max_kv_cache_capacity), "maxBatchSize": str(DEMO_BUILD.max_batch_size),
                     "tokensPerPage": str(DEMO_BUILD.tokens_per_page)}


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < 250, f"README.md has {lines} lines; keep it under 250 (the details live in docs/)"


def test_demo_paths_are_linked_where_read_not_where_made(tmp_path: Path) -> None:
    def block(text: str, marker: str = "run", arg: str = "") -> Block:
        return Block(tmp_path / "p.md", 1, "bash", text, marker, arg)

    made_here = "llm_export smollm2-135m-instruct --outputDir out/onnx/smollm2\n"
    assert demo_paths_to_link(block(made_here)) == []
    built = "llm_build --onnxDir out/onnx/smollm2 --engineDir out/engines/smollm2 --maxBatchSize 4\n"
    assert demo_paths_to_link(block(built)) == ["out/onnx/smollm2"]
    assert demo_paths_to_link(block("llm_inference --engineDir out/engines/smollm2-b4 --inputFile x.json\n")) == []
    assert demo_paths_to_link(block("ls out/engines/smollm2/draft\n")) == ["out/engines/smollm2"]
    assert demo_paths_to_link(Block(tmp_path / "p.md", 1, "python", "print(1)\n", "server", "out/engines/smollm2")) \
        == ["out/engines/smollm2"]
    assert demo_paths_to_link(block("ls out/engines/smollm2\n", "skip", "a reason")) == []


def test_a_named_request_file_block_writes_the_file(tmp_path: Path) -> None:
    text = '{"max_generate_length": 4, "requests": [{"messages": [{"role": "user", "content": "Hi"}]}]}\n'
    run_block(Block(tmp_path / "p.md", 1, "json", text, "request-file", "requests.json"), tmp_path)
    assert (tmp_path / "requests.json").read_text(encoding="utf-8") == text
    run_block(Block(tmp_path / "p.md", 5, "json", text, "request-file", ""), tmp_path / "missing")  # only checked


def test_console_blocks_run_only_their_commands(tmp_path: Path) -> None:
    block = Block(tmp_path / "p.md", 1, "console", "$ echo one \\\n    two\none two\n$ test -d .\n", "run", "")
    assert shell_script(block) == "echo one \\\n    two\ntest -d .\n"
    run_block(block, tmp_path)  # the output line `one two` would fail as a command


def test_a_serve_block_that_cannot_start_fails(tmp_path: Path) -> None:
    block = Block(tmp_path / "p.md", 3, "bash", "llm_serve --engineDir engines/missing   # a comment\n", "serve", "")
    with pytest.raises(ExampleFailed, match=r"p\.md:3: the server exited: .*--engineDir"):
        run_block(block, tmp_path)

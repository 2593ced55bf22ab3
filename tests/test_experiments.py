"""experiments/ stays a set of scripts, not a library: a script never imports another script, every script sits in
a topic folder, and the commands that run them (the Makefile's bench targets, the docs) name modules that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"


def module_name(path: Path, root: Path) -> str:
    """`experiments/reuse/context_reuse.py` → `experiments.reuse.context_reuse` (`__init__` → its package)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_script(source: str) -> bool:
    """A script runs as `python -m`: it has an `if __name__ == "__main__":` block. Helpers (`_common.py`, a
    script's own helper module such as adapter_correction_engine.py) have none."""
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name)
                and node.test.left.id == "__name__"):
            return True
    return False


def imported_modules(source: str, module: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every import of a module in `known`, anywhere in `source` (lazy ones too); `from a import b`
    counts `a.b` when that is a module, relative imports are resolved against `module`'s package."""
    package = module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                if candidate in known:
                    found.append((node.lineno, candidate))
                elif base in known:
                    found.append((node.lineno, base))
    return sorted(set(found))  # one per line and module, however many names it takes


def script_imports(root: Path) -> list[str]:
    """`path:line: module imports script` for every module under root/experiments that imports a script, by its
    package name or by its bare name (the old `python experiments/x.py` style, where the folder is on sys.path)."""
    files = {module_name(path, root): path for path in sorted((root / "experiments").rglob("*.py"))}
    sources = {module: path.read_text(encoding="utf-8") for module, path in files.items()}
    scripts = {module for module, source in sources.items() if is_script(source)}
    bare = {module.rpartition(".")[2]: module for module in scripts}
    found = []
    for module, source in sorted(sources.items()):
        for line, imported in imported_modules(source, module, scripts | set(bare)):
            target = bare.get(imported, imported)
            if target in scripts and target != module:
                found.append(f"{files[module].relative_to(root)}:{line}: {module} imports script {target}")
    return found


def test_no_script_imports_another_script() -> None:
    found = script_imports(ROOT)
    assert not found, ("a script imports another script (move what they share to experiments/_common.py or the "
                       "topic folder's _common.py):\n" + "\n".join(f"  {f}" for f in found))


def test_the_check_flags_planted_script_imports(tmp_path: Path) -> None:
    main = 'if __name__ == "__main__":\n    main()\n'
    files = {
        "experiments/__init__.py": "",
        "experiments/_common.py": "def median(): ...\n",
        "experiments/spec/__init__.py": "",
        "experiments/spec/_common.py": "from experiments._common import median\n",  # ok: a helper
        "experiments/spec/a.py": "from experiments.spec._common import median\ndef main(): ...\n" + main,  # ok
        "experiments/spec/b.py": "from experiments.spec.a import main\n" + main,  # 1 by package name
        "experiments/spec/c.py": "def main():\n    from . import a\n" + main,  # 2 relative and lazy
        "experiments/spec/d.py": "import a\n" + main,  # 1 the bare name of the old flat folder
        "experiments/reuse/e.py": "from experiments.spec import b\n" + main,  # 1 across topics
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert script_imports(tmp_path) == [
        "experiments/reuse/e.py:1: experiments.reuse.e imports script experiments.spec.b",
        "experiments/spec/b.py:1: experiments.spec.b imports script experiments.spec.a",
        "experiments/spec/c.py:2: experiments.spec.c imports script experiments.spec.a",
        "experiments/spec/d.py:1: experiments.spec.d imports script experiments.spec.a",
    ]


def sys_path_edits(source: str) -> list[int]:
    """The lines that change `sys.path` (insert, append, assignment, `+=`, a slice): what an import needs must be
    importable from the repository root as it is (`experiments._common`, `tests.support`), not by a path hack."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            targets = [node.func.value]
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        targets = [t.value if isinstance(t, ast.Subscript) else t for t in targets]  # sys.path[:0] = [...]
        if any(isinstance(t, ast.Attribute) and t.attr == "path" and isinstance(t.value, ast.Name)
               and t.value.id == "sys" for t in targets):
            lines.append(node.lineno)
    return sorted(lines)


# Where the rule holds: the measurement scripts, the scripts/ tools (run as `python -m scripts.NAME`) and the tests,
# which import both as packages from the repository root (pyproject's pytest `pythonpath`).
NO_SYS_PATH_EDITS = ("experiments", "scripts", "tests")


def test_no_experiment_script_or_test_edits_sys_path() -> None:
    found = [f"{path.relative_to(ROOT)}:{line}" for folder in NO_SYS_PATH_EDITS
             for path in sorted((ROOT / folder).rglob("*.py"))
             for line in sys_path_edits(path.read_text(encoding="utf-8"))]
    assert not found, ("sys.path edited (import from the repository root instead: experiments._common, "
                       "scripts.NAME, tests' support.NAME):\n  " + "\n  ".join(found))


def test_the_check_flags_planted_sys_path_edits() -> None:
    source = ("import sys\nsys.path.insert(0, 'scripts')\nsys.path.append('x')\nsys.path = ['y']\n"
              "sys.path += ['z']\nsys.path[:0] = ['w']\npath = sys.path\nsys.modules.get('a')\n")
    assert sys_path_edits(source) == [2, 3, 4, 5, 6]


def test_every_script_sits_in_a_topic_folder() -> None:
    top = sorted(p.name for p in EXPERIMENTS.glob("*.py") if p.name not in ("__init__.py", "_common.py"))
    assert not top, f"scripts at experiments/ top level (give each a topic folder): {top}"
    for folder in (p for p in EXPERIMENTS.iterdir() if p.is_dir() and p.name not in ("data", "__pycache__")):
        assert (folder / "__init__.py").is_file(), f"{folder.relative_to(ROOT)} has no __init__.py: -m cannot run it"
        assert any(is_script(p.read_text(encoding="utf-8")) for p in folder.glob("*.py")), folder


# `python -m experiments.reuse.context_reuse` and `experiments/reuse/context_reuse.py` as commands and docs name them.
_MODULE = re.compile(r"-m (experiments(?:\.\w+)+)")
_PATH = re.compile(r"(?<![\w/])(experiments/[\w/]+\.(?:py|json|txt))")


def named_experiments(text: str) -> set[str]:
    """Each experiments module (as a file path) and file that `text` names."""
    return ({m.replace(".", "/") + ".py" for m in _MODULE.findall(text)} | set(_PATH.findall(text)))


def test_bench_targets_and_docs_name_existing_scripts() -> None:
    """The Makefile, README and docs/ (not the benchmark log or CHANGELOG: they keep the paths of their day)."""
    pages = [ROOT / "Makefile", ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = []
    for page in pages:
        if page.name == "benchmark-log.md" or not page.exists():
            continue
        missing += [f"{page.relative_to(ROOT)}: {name}" for name in sorted(named_experiments(page.read_text()))
                    if not (ROOT / name).is_file()]
    assert not missing, "named experiments that do not exist:\n" + "\n".join(f"  {m}" for m in missing)
    makefile = (ROOT / "Makefile").read_text()
    assert "experiments/reuse/context_reuse.py" in named_experiments(makefile)  # the parse reads the targets


def test_names_are_read_from_commands_and_paths() -> None:
    text = "make bench  # python -m experiments.spec.block_draft --x; see `experiments/data/quality_text.txt`."
    assert named_experiments(text) == {"experiments/spec/block_draft.py", "experiments/data/quality_text.txt"}
    assert named_experiments("python experiments/spec_decode.py") == {"experiments/spec_decode.py"}

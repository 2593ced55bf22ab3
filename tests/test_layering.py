"""Layering: kvforge's layers import downward only (README "Architecture and layering").

    0  contract     kvforge.contract.*                                   imports no other kvforge module
    1  plugins      kvforge.plugins.*, kvforge.graph.*                   layer 0 (and layer 1)
    2  components   kvforge.tools.export.*, kvforge.builder.*,           layers 0–1 and their own component;
                    kvforge.runtime.*                                    never each other (no sideways imports)
    3  front ends   every *.cli module, kvforge.tools.profile.*,         anything below
                    kvforge.tools.testcases.*, kvforge.tools.bench.*,
                    kvforge.server.*, kvforge.cli_common,
                    kvforge (the package __init__)

Nothing below layer 3 imports a front end. No module imports itself back through others: the import graph
has no cycle (a strongly connected component of two or more modules), lazy and TYPE_CHECKING edges included.
No module, no test and no experiment (experiments/) takes a private name (`_name`) from another module.
Inside the runtime, the cache core (kvforge.runtime.context_cache.*) imports only itself, kvforge.runtime.types
and layers 0–1: no ONNX Runtime, TensorRT, CUDA or runner module.

Inside the runtime, folders (and the vocabulary modules at its root) import downward only, in RUNTIME_ORDER:

    front ends     api.py, cli.py            kvforge.LLM and llm_inference
                   file_loop.py              the request-file loop they share
    engine/        the loop, scheduler, config, stop rules
    spec/          one module per speculative method
    shared_tier/, inputs/, kv_events.py
    execution/     executor, backends, KV storage
    step.py        what a step passes between parts
    sequence.py
    media_spans.py, adapters.py, sampling/
    context_cache/
    types.py, profile.py

Places on one line never import each other (no sideways imports).

Front ends reach the engine through its public interface only (`Engine.info`, `prepare`, `stats`,
`cache_profile`, `add_request`, `step`, `abort`, `profile`): a front-end module (kvforge.server.*,
kvforge.runtime.api, kvforge.runtime.cli, kvforge.runtime.file_loop, kvforge.tools.testcases.*,
kvforge.tools.bench.*) imports of the runtime only FRONT_END_MAY_IMPORT:

    kvforge.runtime.engine           the package's public names (Engine, EngineInfo, EngineRequest, EngineStats,
                                     RequestOutput, SampleResult, ...), re-exported lazily
    kvforge.runtime.engine.engine    Engine and the names it re-exports
    kvforge.runtime.engine.config    EngineConfig and its options, which every front end derives its flags from
    kvforge.runtime.inputs.*         what a request is before the engine: files, checks, templates, tokenizer
    kvforge.runtime.types, .profile, .adapters   shared vocabulary: sampling values, the profile, adapter paths
    the front ends themselves        kvforge.runtime.api, .cli, .file_loop

Anything else (the step, scheduler and row state, execution/, context_cache/, spec/, shared_tier/, sampling/,
sequence.py, step.py) is an engine part: importing it fails.

Every source lives under kvforge/ and its import path is its file path (`kvforge.runtime` is
`kvforge/runtime/`), so a new file is checked as soon as it is added. Every import
counts: module level, inside functions (lazy), under `if TYPE_CHECKING`, relative ones, and
`importlib.import_module("kvforge.…")` with a literal name.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYER_NAMES = {0: "contract", 1: "plugins/graph", 2: "export/builder/runtime", 3: "front ends"}
CACHE_CORE = "kvforge.runtime.context_cache"
CACHE_CORE_MAY_IMPORT = ("kvforge.runtime.types",)
CACHE_CORE_FORBIDDEN_THIRD_PARTY = ("onnxruntime", "tensorrt", "cuda", "polygraphy")
RUNTIME = "kvforge.runtime"
RUNTIME_FOLDERS = ("engine", "inputs", "execution", "sampling", "spec", "context_cache", "shared_tier")
# Top to bottom; a place imports only places on later lines (see the module docstring).
RUNTIME_ORDER = (("api.py", "cli.py"), ("file_loop.py",), ("engine/",), ("spec/",),
                 ("shared_tier/", "inputs/", "kv_events.py"),
                 ("execution/",), ("step.py",), ("sequence.py",), ("media_spans.py", "adapters.py", "sampling/"),
                 ("context_cache/",), ("types.py", "profile.py"))
RUNTIME_RANK = {place: rank for rank, places in enumerate(RUNTIME_ORDER) for place in places}
# Front ends and the engine's public interface (see the module docstring): exact modules, then packages.
FRONT_ENDS = ("kvforge.server", "kvforge.runtime.api", "kvforge.runtime.cli", "kvforge.runtime.file_loop",
              "kvforge.tools.testcases", "kvforge.tools.bench")
FRONT_END_MAY_IMPORT = ("kvforge.runtime", "kvforge.runtime.engine", "kvforge.runtime.engine.engine",
                        "kvforge.runtime.engine.config", "kvforge.runtime.types", "kvforge.runtime.profile",
                        "kvforge.runtime.adapters", "kvforge.runtime.api", "kvforge.runtime.cli",
                        "kvforge.runtime.file_loop")
FRONT_END_MAY_IMPORT_PACKAGES = ("kvforge.runtime.inputs",)


@dataclass(frozen=True, slots=True)
class Violation:
    path: str
    line: int
    importer: str
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} → {self.imported}: {self.rule}"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def classify(module: str) -> tuple[int, str] | None:
    """(layer, component) of a kvforge module; None for a kvforge module no layer claims (add it above)."""
    parts = module.split(".")
    if module in ("kvforge", "kvforge.cli_common") or "cli" in parts[1:] or _within(module, "kvforge.tools.profile"):
        return 3, "front end"
    if _within(module, "kvforge.server"):  # llm_serve: a front end like the CLIs
        return 3, "front end"
    if _within(module, "kvforge.tools.testcases"):  # llm_test: drives the runtime (and builds) like the CLIs
        return 3, "front end"
    if _within(module, "kvforge.tools.bench"):  # llm_bench: builds and drives engines (and peers) like the CLIs
        return 3, "front end"
    if _within(module, "kvforge.contract"):
        return 0, "contract"
    if _within(module, "kvforge.plugins"):
        return 1, "plugins"
    if _within(module, "kvforge.graph"):
        return 1, "graph"
    # kvforge.tools (the folder's __init__) belongs to the exporter: tools.profile is a front end.
    if module == "kvforge.tools" or _within(module, "kvforge.tools.export"):
        return 2, "tools.export"
    if _within(module, "kvforge.builder"):
        return 2, "builder"
    if _within(module, "kvforge.runtime"):
        return 2, "runtime"
    return None


def runtime_place(module: str) -> str | None:
    """The folder (`engine/`) or root module (`types.py`) of the runtime a module lives in; None outside it and for
    the runtime package itself."""
    if not module.startswith(RUNTIME + "."):
        return None
    head = module[len(RUNTIME) + 1:].split(".")[0]
    return head + "/" if head in RUNTIME_FOLDERS else head + ".py"


def runtime_order_violation(importer: str, imported: str) -> str | None:
    """The folder rule inside the runtime: a place imports only places below it in RUNTIME_ORDER."""
    source, target = runtime_place(importer), runtime_place(imported)
    if source is None or target is None or source == target:
        return None
    for place in (source, target):
        if place not in RUNTIME_RANK:
            return f"runtime/{place} has no place in RUNTIME_ORDER: give it one in tests/test_layering.py"
    if RUNTIME_RANK[target] <= RUNTIME_RANK[source]:
        return (f"runtime/{source} must not import runtime/{target}: runtime folders import downward only "
                "(RUNTIME_ORDER)")
    return None


def front_end_violation(importer: str, imported: str) -> str | None:
    """The engine-interface rule: a front end imports no engine part (FRONT_END_MAY_IMPORT lists what it may)."""
    if not any(_within(importer, front) for front in FRONT_ENDS) or not _within(imported, RUNTIME):
        return None
    if imported in FRONT_END_MAY_IMPORT or any(_within(imported, p) for p in FRONT_END_MAY_IMPORT_PACKAGES):
        return None
    return (f"a front end reaches the engine through its interface (kvforge.runtime.engine: Engine.info, prepare, "
            f"stats); {imported} is an engine part (tests/test_layering.py: FRONT_END_MAY_IMPORT)")


def _describe(layer_and_component: tuple[int, str]) -> str:
    layer, component = layer_and_component
    return f"layer {layer} ({component})"


def edge_violation(importer: str, imported: str) -> str | None:
    """The rule an import breaks, or None when it is allowed. Non-kvforge imports break only the cache rule."""
    if _within(importer, CACHE_CORE):
        top = imported.split(".")[0]
        if top in CACHE_CORE_FORBIDDEN_THIRD_PARTY:
            return f"the cache core ({CACHE_CORE}.*) must not import ONNX Runtime, TensorRT or CUDA"
        if _within(imported, "kvforge") and not (
            _within(imported, CACHE_CORE) or imported in CACHE_CORE_MAY_IMPORT
            or (classify(imported) or (9, ""))[0] <= 1
        ):
            return (f"the cache core ({CACHE_CORE}.*) imports only itself, kvforge.runtime.types and layers 0–1, "
                    "never a runner, the engine loop or anything else of the runtime")
    if not _within(imported, "kvforge"):
        return None
    source, target = classify(importer), classify(imported)
    for module, found in ((importer, source), (imported, target)):
        if found is None:
            return f"{module} is in no layer: give it one in tests/test_layering.py:classify"
    assert source is not None and target is not None
    if target[0] > source[0]:
        return f"{_describe(source)} must not import {_describe(target)}: layers import downward only"
    if target[0] == source[0] == 2 and target[1] != source[1]:
        return (f"{_describe(source)} must not import {_describe(target)}: export, builder and runtime "
                "share layers 0–1 and never import each other")
    return runtime_order_violation(importer, imported) or front_end_violation(importer, imported)


def imports_in(source: str, module: str, is_package: bool, known: set[str], filename: str = "<source>",
               ) -> list[tuple[int, str]]:
    """(line, imported module) for every import anywhere in `source`, relative ones resolved against `module`.

    `from a.b import c` names module `a.b.c` when that is a known module (a submodule), else `a.b`.
    """
    tree = ast.parse(source, filename=filename)
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            prefix = _from_prefix(node, package)
            for alias in node.names:
                candidate = f"{prefix}.{alias.name}"
                found.append((node.lineno, candidate if candidate in known else prefix))
        elif isinstance(node, ast.Call) and _is_import_call(node):
            found.append((node.lineno, node.args[0].value))  # type: ignore[attr-defined]
    return sorted(found)


def _from_prefix(node: ast.ImportFrom, package: str) -> str:
    """The module a `from … import` reads from, a relative one resolved against `package`."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join([*base, *([node.module] if node.module else [])])


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(source: str, module: str, is_package: bool, known: set[str], filename: str = "<source>",
                    ) -> list[tuple[int, str]]:
    """(line, `other._name`) for every private name `source` takes from another kvforge module, anywhere in it:
    `from other import _name`, or `alias._name` where an import bound `alias` (a dotted chain from it too) to a
    kvforge module. Private attributes of objects (`self._x`, `engine._y`) are the object's business, not this."""
    tree = ast.parse(source, filename=filename)
    package = module if is_package else module.rpartition(".")[0]
    bound: dict[str, str] = {}  # local name -> the kvforge module (or package) an import bound it to
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _within(alias.name, "kvforge"):  # `import kvforge.a.b` binds `kvforge`; the chain names the rest
                    bound[alias.asname or "kvforge"] = alias.name if alias.asname else "kvforge"
        elif isinstance(node, ast.ImportFrom):
            prefix = _from_prefix(node, package)
            if not _within(prefix, "kvforge"):
                continue
            for alias in node.names:
                if f"{prefix}.{alias.name}" in known:
                    bound[alias.asname or alias.name] = f"{prefix}.{alias.name}"
                if _is_private(alias.name) and prefix != module:
                    found.append((node.lineno, f"{prefix}.{alias.name}"))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in bound:
            owner = ".".join([bound[value.id], *reversed(chain)])
            if owner in known and owner != module:
                found.append((node.lineno, f"{owner}.{node.attr}"))
    return sorted(set(found))


def _is_import_call(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return (name in ("import_module", "__import__") and bool(node.args)
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str))


def check_source(source: str, module: str, path: str = "<source>", *, is_package: bool = False,
                 known: set[str] | None = None) -> list[Violation]:
    """Every layering violation in one module's source."""
    violations = []
    for line, imported in imports_in(source, module, is_package, known or set(), path):
        rule = edge_violation(module, imported)
        if rule is not None:
            violations.append(Violation(path, line, module, imported, rule))
    return violations


def source_modules(pyproject: Path) -> dict[str, Path]:
    """Every .py file under kvforge/ beside `pyproject` → its dotted module name: the import path is the file path."""
    root = pyproject.parent
    modules: dict[str, Path] = {}
    for path in sorted((root / "kvforge").rglob("*.py")):
        rel = path.relative_to(root).with_suffix("").parts
        if rel[-1] == "__init__":
            rel = rel[:-1]
        modules[".".join(rel)] = path.resolve()
    return modules


def check_repository(pyproject: Path = ROOT / "pyproject.toml") -> list[Violation]:
    modules = source_modules(pyproject)
    known = set(modules)
    violations = []
    for module, path in sorted(modules.items()):
        violations.extend(check_source(path.read_text(encoding="utf-8"), module,
                                       str(path.relative_to(pyproject.parent)),
                                       is_package=path.name == "__init__.py", known=known))
    return violations


def import_graph(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, dict[str, int]]:
    """importer → {imported kvforge module: first line} over every import `imports_in` collects (lazy and
    TYPE_CHECKING ones too: a cycle hidden behind them is still a cycle of the design)."""
    modules = source_modules(pyproject)
    known = set(modules)
    graph: dict[str, dict[str, int]] = {}
    for module, path in sorted(modules.items()):
        edges = graph.setdefault(module, {})
        for line, imported in imports_in(path.read_text(encoding="utf-8"), module, path.name == "__init__.py",
                                         known, str(path)):
            if imported in known and imported != module:
                edges.setdefault(imported, line)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.get(module, {}):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def _report_cycles(cycles: list[list[str]], graph: dict[str, dict[str, int]]) -> str:
    lines = [f"{len(cycles)} import cycle(s) (break each: move the shared part below both, or invert one edge):"]
    for cycle in cycles:
        lines.append("  " + " ↔ ".join(cycle))
        lines.extend(f"    {a}:{graph[a][b]} → {b}" for a in cycle for b in cycle if b in graph[a])
    return "\n".join(lines)


def private_imports_in_repository(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """`path:line: module takes other._name` for every private name crossing modules, the tests' and the
    measurement scripts' (experiments/) files included (one that needs a helper makes it public; nothing is
    allow-listed)."""
    modules = source_modules(pyproject)
    known = set(modules)
    files = dict(modules)
    for folder in ("tests", "experiments"):
        root = pyproject.parent / folder
        files.update({f"{folder}." + ".".join(path.relative_to(root).with_suffix("").parts): path
                      for path in sorted(root.rglob("*.py"))})
    found = []
    for module, path in sorted(files.items()):
        for line, name in private_imports(path.read_text(encoding="utf-8"), module, path.name == "__init__.py",
                                          known, str(path)):
            found.append(f"{path.relative_to(pyproject.parent)}:{line}: {module} takes {name}")
    return found


def _report(violations: list[Violation]) -> str:
    return f"{len(violations)} layering violation(s):\n" + "\n".join(f"  {v}" for v in violations)


# --- the repository ---------------------------------------------------------------------------------


def test_every_source_is_a_module_in_a_layer() -> None:
    modules = source_modules(ROOT / "pyproject.toml")
    # Spot checks that file paths name modules.
    for module, path in {"kvforge.runtime.engine.engine": "kvforge/runtime/engine/engine.py",
                         "kvforge.runtime.context_cache.manager": "kvforge/runtime/context_cache/manager.py",
                         "kvforge.builder.cli": "kvforge/builder/cli.py",
                         "kvforge.tools.export.cli": "kvforge/tools/export/cli.py",
                         "kvforge.contract.errors": "kvforge/contract/errors.py",
                         "kvforge.graph.rope": "kvforge/graph/rope.py",
                         "kvforge.plugins.reference": "kvforge/plugins/reference.py",
                         "kvforge": "kvforge/__init__.py"}.items():
        assert modules.get(module) == (ROOT / path).resolve(), module
    unclassified = sorted(m for m in modules if classify(m) is None)
    assert not unclassified, f"modules in no layer (give them one in classify): {unclassified}"


def test_layers_import_downward_only() -> None:
    violations = check_repository()
    assert not violations, _report(violations)


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = import_cycles(graph)
    assert not cycles, _report_cycles(cycles, graph)


def test_no_private_name_crosses_modules() -> None:
    found = private_imports_in_repository()
    assert not found, (f"{len(found)} private name(s) used from another module (make the name public, or move "
                       "it where both can import it):\n" + "\n".join(f"  {f}" for f in found))


MAX_MODULE_LINES = 500  # the project's rule: a module a reader takes in at one sitting (docs/architecture.md)


def oversized_modules(modules: dict[str, Path], limit: int = MAX_MODULE_LINES) -> list[str]:
    """`module (N lines)` for each package module over `limit` lines, longest first."""
    sizes = {module: len(path.read_text(encoding="utf-8").splitlines()) for module, path in modules.items()}
    return [f"{module} ({n} lines)" for module, n in sorted(sizes.items(), key=lambda item: -item[1]) if n > limit]


def test_no_package_module_is_over_500_lines() -> None:
    found = oversized_modules(source_modules(ROOT / "pyproject.toml"))
    assert not found, f"package modules over {MAX_MODULE_LINES} lines (split them by concern): " + ", ".join(found)


def test_size_check_flags_a_planted_long_module(tmp_path: Path) -> None:
    short, long = tmp_path / "short.py", tmp_path / "long.py"
    short.write_text("x = 1\n" * MAX_MODULE_LINES)
    long.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert oversized_modules({"pkg.short": short, "pkg.long": long}) == [f"pkg.long ({MAX_MODULE_LINES + 1} lines)"]


# --- the checker catches what it should (planted violations) -------------------------------------------


def _rules(source: str, module: str, **kwargs: object) -> list[tuple[int, str]]:
    known = {"kvforge.contract.errors", "kvforge.runtime.types", "kvforge.runtime.engine", "kvforge.plugins.ops"}
    return [(v.line, v.imported) for v in check_source(source, module, known=known, **kwargs)]  # type: ignore[arg-type]


def test_checker_flags_upward_sideways_and_front_end_imports() -> None:
    source = "\n".join([
        "from kvforge.contract.errors import KvforgeError",  # 1 ok: runtime → contract
        "from kvforge.plugins import ops",  # 2 ok: runtime → plugins (a submodule import)
        "from kvforge.builder.build import build_engine",  # 3 sideways
        "import kvforge.tools.export.writer",  # 4 sideways
        "def lazy():",
        "    from kvforge.cli_common import fail",  # 6 front end, lazily
        "    from kvforge import LLM",  # 7 the package __init__ is a front end
        "    import importlib; importlib.import_module('kvforge.builder.cli')",  # 8 dynamic, front end
        "from . import types",  # 9 ok: relative, kvforge.runtime.types
        "from ..builder import lora",  # 10 relative sideways: kvforge.builder
    ])
    assert _rules(source, "kvforge.runtime.engine") == [
        (3, "kvforge.builder.build"), (4, "kvforge.tools.export.writer"), (6, "kvforge.cli_common"),
        (7, "kvforge"), (8, "kvforge.builder.cli"), (10, "kvforge.builder")]


def test_checker_flags_contract_and_plugins_importing_up() -> None:
    contract = "from kvforge.contract.errors import InvalidConfig\ndef f():\n    import kvforge.plugins.reference\n"
    assert _rules(contract, "kvforge.contract.geometry") == [(3, "kvforge.plugins.reference")]
    plugins = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvforge.runtime.types import Request\n"
               "from kvforge.graph.rope import apply_rope\n")
    assert _rules(plugins, "kvforge.plugins.trt") == [(3, "kvforge.runtime.types")]
    assert _rules("from kvforge.tools.export.synthetic import synthetic_model\n", "kvforge.graph.onnx_graph") == [
        (1, "kvforge.tools.export.synthetic")]


def test_checker_allows_front_ends_everything_below() -> None:
    source = ("from kvforge.cli_common import run_app\nfrom kvforge.runtime.engine import Engine\n"
              "from kvforge.builder.build import build_engine\n"
              "from kvforge.tools.export.writer import write_onnx_dir\n")
    for module in ("kvforge.runtime.cli", "kvforge.builder.cli", "kvforge.tools.profile.report", "kvforge"):
        assert _rules(source, module, is_package=module == "kvforge") == [], module


def test_checker_keeps_front_ends_on_the_engine_interface() -> None:
    """A planted front end importing engine parts fails, line by line; the interface and the vocabulary pass."""
    source = "\n".join([
        "from kvforge.runtime.engine import Engine, EngineStats",  # 1 ok: the package's public names
        "from kvforge.runtime.engine.engine import EngineInfo",  # 2 ok
        "from kvforge.runtime.engine.config import EngineConfig",  # 3 ok
        "from kvforge.runtime.inputs.checks import parse_message",  # 4 ok
        "from kvforge.runtime.types import SamplingParams",  # 5 ok
        "from kvforge.runtime.engine.core import EngineStats",  # 6 the step
        "from kvforge.runtime.sequence import EngineRequest",  # 7 row state
        "def f():",
        "    from kvforge.runtime.context_cache.manager import ContextCacheManager",  # 9 the cache, lazily
        "    from kvforge.runtime.spec.methods import spec_method",  # 10 speculation
        "    from kvforge.runtime.execution.backend import Backend",  # 11 a runner
    ])
    known = {"kvforge.runtime.engine", "kvforge.runtime.engine.engine", "kvforge.runtime.engine.config",
             "kvforge.runtime.engine.core", "kvforge.runtime.inputs.checks", "kvforge.runtime.types",
             "kvforge.runtime.sequence", "kvforge.runtime.context_cache.manager", "kvforge.runtime.spec.methods",
             "kvforge.runtime.execution.backend"}
    for module in ("kvforge.server.app", "kvforge.runtime.api", "kvforge.runtime.cli", "kvforge.runtime.file_loop",
                   "kvforge.tools.testcases.execute", "kvforge.tools.bench.worker"):
        violations = check_source(source, module, known=known)
        assert [v.line for v in violations] == [6, 7, 9, 10, 11], module
        assert all("engine part" in v.rule for v in violations), module
    # The engine itself, and a CLI that drives no engine (llm_build's), may import them.
    for module in ("kvforge.runtime.engine.engine", "kvforge.builder.cli"):
        assert check_source(source, module, known=known) == [], module


def test_checker_keeps_the_cache_core_free_of_runners() -> None:
    source = "\n".join([
        "from kvforge.runtime.context_cache.keys import KeyExtras",  # 1 ok
        "from kvforge.runtime.types import LookupPolicy",  # 2 ok
        "from kvforge.contract.paging import pages_for",  # 3 ok
        "import onnxruntime as ort",  # 4 backend
        "def f():",
        "    from kvforge.runtime.engine import Engine",  # 6 the loop
        "    from kvforge.runtime import ort_backend",  # 7 a runner
        "    import tensorrt",  # 8 backend
    ])
    violations = check_source(source, "kvforge.runtime.context_cache.manager",
                              "kvforge/runtime/context_cache/manager.py",
                              known={"kvforge.runtime.engine", "kvforge.runtime.ort_backend"})
    assert [(v.line, v.imported) for v in violations] == [
        (4, "onnxruntime"), (6, "kvforge.runtime.engine"), (7, "kvforge.runtime.ort_backend"), (8, "tensorrt")]
    message = _report(violations)
    assert ("kvforge/runtime/context_cache/manager.py:6: kvforge.runtime.context_cache.manager → "
            "kvforge.runtime.engine: the cache core") in message
    # The same imports are fine for the rest of the runtime.
    assert _rules(source, "kvforge.runtime.engine") == []


def test_checker_keeps_the_runtime_folders_in_order() -> None:
    """Downward imports between runtime folders pass; upward and sideways ones fail, lazy ones too."""
    known = {"kvforge.runtime.engine.core", "kvforge.runtime.spec.eagle3", "kvforge.runtime.step",
             "kvforge.runtime.inputs.processor", "kvforge.runtime.shared_tier.tier", "kvforge.runtime.nowhere"}
    source = "\n".join([
        "from kvforge.runtime.step import ScheduledRow",  # 1 ok: down
        "from kvforge.runtime.context_cache.lease import Lease",  # 2 ok: down
        "def f():",
        "    from kvforge.runtime.engine.core import EngineCore",  # 4 up, lazily
        "    from kvforge.runtime.inputs.processor import InputProcessor",  # 5 ok: down from spec/
        "from kvforge.runtime.spec.eagle3 import Eagle3Proposer",  # 6 own folder
        "from kvforge.runtime.nowhere import x",  # 7 a place with no rank
    ])
    violations = check_source(source, "kvforge.runtime.spec.ngram", known=known)
    assert [(v.line, v.imported) for v in violations] == [(4, "kvforge.runtime.engine.core"),
                                                          (7, "kvforge.runtime.nowhere")]
    assert "runtime folders import downward only" in violations[0].rule
    assert "no place in RUNTIME_ORDER" in violations[1].rule
    sideways = check_source("from kvforge.runtime.shared_tier.tier import SharedTier\n",
                            "kvforge.runtime.inputs.processor", known=known)
    assert [v.imported for v in sideways] == ["kvforge.runtime.shared_tier.tier"]


def test_checker_flags_modules_in_no_layer() -> None:
    assert _rules("import kvforge.nowhere\n", "kvforge.runtime.engine") == [(1, "kvforge.nowhere")]
    assert classify("kvforge.nowhere") is None


def test_checker_reads_the_mapping_of_a_planted_tree(tmp_path: Path) -> None:
    """End to end on a throwaway tree: pyproject mapping → files → modules → violations with file:line."""
    (tmp_path / "pyproject.toml").write_text("", encoding="utf-8")
    files = {
        "kvforge/__init__.py": "from kvforge.runtime.engine import Engine\n",  # ok: the package is a front end
        "kvforge/cli_common.py": "",
        "kvforge/contract/__init__.py": "",
        "kvforge/contract/errors.py": "def f():\n    from kvforge.runtime import engine\n",  # upward, lazy
        "kvforge/runtime/__init__.py": "",
        "kvforge/runtime/engine.py": ("from kvforge.contract.errors import KvforgeError\n"
                                      "from kvforge.cli_common import fail\n"),
        "kvforge/runtime/context_cache/__init__.py": "",
        "kvforge/runtime/context_cache/manager.py": "from ..engine import Engine\n",  # relative: kvforge.runtime.engine
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert sorted(source_modules(tmp_path / "pyproject.toml")) == [
        "kvforge", "kvforge.cli_common", "kvforge.contract", "kvforge.contract.errors", "kvforge.runtime",
        "kvforge.runtime.context_cache", "kvforge.runtime.context_cache.manager", "kvforge.runtime.engine"]
    assert [str(v).split(": ")[0] for v in check_repository(tmp_path / "pyproject.toml")] == [
        "kvforge/contract/errors.py:2", "kvforge/runtime/context_cache/manager.py:1", "kvforge/runtime/engine.py:2"]


def test_cycle_check_flags_a_planted_cycle(tmp_path: Path) -> None:
    """Two modules importing each other (one lazily, one under TYPE_CHECKING) are a cycle; a third that only
    imports them is not part of it, and a tree without the back edge has none."""
    (tmp_path / "pyproject.toml").write_text("", encoding="utf-8")
    files = {
        "kvforge/__init__.py": "",
        "kvforge/runtime/__init__.py": "",
        "kvforge/runtime/a.py": "def f():\n    from kvforge.runtime import b\n",  # lazy
        "kvforge/runtime/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
        "kvforge/runtime/c.py": "from kvforge.runtime.a import f\nimport kvforge.runtime.b\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    graph = import_graph(tmp_path / "pyproject.toml")
    cycles = import_cycles(graph)
    assert cycles == [["kvforge.runtime.a", "kvforge.runtime.b"]]
    message = _report_cycles(cycles, graph)
    assert "kvforge.runtime.a ↔ kvforge.runtime.b" in message
    assert "kvforge.runtime.a:2 → kvforge.runtime.b" in message and "kvforge.runtime.b:3 → kvforge.runtime.a" in message
    (tmp_path / "kvforge/runtime/b.py").write_text("", encoding="utf-8")
    assert import_cycles(import_graph(tmp_path / "pyproject.toml")) == []


def test_private_check_flags_private_names_taken_from_other_modules() -> None:
    known = {"kvforge.runtime.request_file", "kvforge.runtime.engine", "kvforge.tools.export.gguf_source",
             "kvforge.tools.export", "kvforge.runtime"}
    source = "\n".join([
        "from __future__ import annotations",  # 1 ok
        "from kvforge.runtime.request_file import _seed, load_request_file",  # 2 a private function
        "from kvforge.tools.export import gguf_source",  # 3 ok: binds a module
        "import kvforge.tools.export.gguf_source as g",  # 4 ok
        "import kvforge.runtime.engine",  # 5 ok: binds kvforge
        "def f(engine):",
        "    from .request_file import _stop",  # 7 relative and lazy
        "    gguf_source._open_reader('x')",  # 8 through a module bound by `from … import`
        "    g._GLOBAL_NAMES",  # 9 through an alias
        "    kvforge.runtime.engine._helper()",  # 10 through a dotted chain
        "    engine._sequences, gguf_source.__name__, gguf_source.open_reader",  # 11 ok: an object's, a dunder
        "    from kvforge.runtime.engine import __all__",  # 12 ok: a dunder
    ])
    assert private_imports(source, "kvforge.runtime.api", False, known) == [
        (2, "kvforge.runtime.request_file._seed"), (7, "kvforge.runtime.request_file._stop"),
        (8, "kvforge.tools.export.gguf_source._open_reader"), (9, "kvforge.tools.export.gguf_source._GLOBAL_NAMES"),
        (10, "kvforge.runtime.engine._helper")]
    # A module's own private names are its own.
    assert private_imports("import kvforge.runtime.engine as me\nme._helper()\n", "kvforge.runtime.engine", False,
                           known) == []


def test_private_check_reads_a_planted_tree(tmp_path: Path) -> None:
    """End to end: a source module and a test file taking private names are reported with path:line."""
    (tmp_path / "pyproject.toml").write_text("", encoding="utf-8")
    files = {
        "kvforge/__init__.py": "",
        "kvforge/runtime/__init__.py": "",
        "kvforge/runtime/a.py": "def _check(): ...\ndef public(): ...\n",
        "kvforge/runtime/b.py": "from kvforge.runtime.a import public\n\nfrom kvforge.runtime.a import _check\n",
        "tests/test_a.py": "from kvforge.runtime import a\n\ndef test():\n    a._check()\n",
        "experiments/reuse/x.py": "from kvforge.runtime.a import _check as check\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert private_imports_in_repository(tmp_path / "pyproject.toml") == [
        "experiments/reuse/x.py:1: experiments.reuse.x takes kvforge.runtime.a._check",
        "kvforge/runtime/b.py:3: kvforge.runtime.b takes kvforge.runtime.a._check",
        "tests/test_a.py:4: tests.test_a takes kvforge.runtime.a._check"]

"""The suite's tiers by rule, not by list: a test is `engine`, `cli` or `torch` by what its code and its fixtures'
code name, so a new test file lands in the right tier without anyone editing a list (`make test-fast` is the
complement: `-m "not engine and not cli and not torch"`).

The rule reads code objects, not source text: the names a function loads (globals, attributes, imports inside it)
and its string constants (`importorskip("torch")`, `getfixturevalue("tiny_engine_dir")`). It follows, by name,
the helpers and classes defined under tests/ (support/ included) that a test or fixture calls, and the fixtures a
test requests, whether by argument, by `getfixturevalue` on a literal name, or through an indirect parameter.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from support.lazy_import import LazyModule

TESTS = Path(__file__).resolve().parents[1]
# Names that build or export a model, load one into an engine (a tiny one is still seconds with its build), or
# compile a kernel (the CPU kernel's library: half a minute on a clean clone).
ENGINE_NAMES = frozenset({
    "build_engine", "write_onnx_dir", "Engine", "LLM", "load_backend", "InferenceSession", "load_gguf",
    "find_smollm2_gguf", "export_eagle3", "export_block_draft", "export_gemma4_assistant", "export_mtp",
    "load_hf_dir", "kernel_status", "library_path", "compile_kernels",
})
# The heavy optional stack: importing torch alone takes seconds, and transformers/peft import it.
TORCH_NAMES = frozenset({"torch", "transformers", "peft", "accelerate"})
# Running a console script, in a process or in this one.
CLI_NAMES = frozenset({"run_cli", "run_cli_command", "run_cli_inprocess", "subprocess", "Popen", "BIN_DIR"})
CLI_FIXTURES = frozenset({"run_cli", "run_cli_inprocess"})
TIERS = ("engine", "cli", "torch")


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _module_name(value: object) -> str:
    """The module a global names: imported, or a LazyModule waiting to be (support/lazy_import.py)."""
    if isinstance(value, types.ModuleType):
        return value.__name__
    return value.lazy_module if isinstance(value, LazyModule) else ""


def _defined_in_tests(obj: object) -> bool:
    module = getattr(obj, "__module__", None) or ""
    file = getattr(sys.modules.get(module), "__file__", None)
    return file is not None and Path(file).resolve().is_relative_to(TESTS)


class Classifier:
    """Memoised walk over the functions a test reaches; `tiers(item)` → the subset of TIERS it belongs to."""

    def __init__(self, items: Iterable[pytest.Item]) -> None:
        # Every fixture any collected test can reach, by name (for names a test only spells as a string).
        self._fixtures: dict[str, list] = {}
        for item in items:
            for name, definitions in item._fixtureinfo.name2fixturedefs.items():  # no public accessor
                known = self._fixtures.setdefault(name, [])
                known.extend(d for d in definitions if d not in known)
        self._done: dict[int, set[str]] = {}

    def tiers(self, item: pytest.Item) -> set[str]:
        found: set[str] = set()
        if CLI_FIXTURES & set(item.fixturenames):
            found.add("cli")
        if item.get_closest_marker("model") is not None:  # the real SmolLM2
            found.add("engine")
        names = set(item.fixturenames)
        callspec = getattr(item, "callspec", None)
        if callspec is not None:
            names |= {v for v in callspec.params.values() if isinstance(v, str)}
        for name in names:
            found |= self._fixture(name)
        function = getattr(item, "obj", None)
        if function is not None:
            found |= self._object(getattr(function, "__func__", function))
        return found

    def _fixture(self, name: str) -> set[str]:
        found = {"cli"} if name in CLI_FIXTURES else set()
        for definition in self._fixtures.get(name, ()):
            found |= self._object(definition.func)
        return found

    def _object(self, obj: object) -> set[str]:
        key = id(obj)
        if key in self._done:
            return self._done[key]
        self._done[key] = found = set()  # a cycle (recursive helpers) ends here
        for function in self._functions(obj):
            found |= self._function(function)
        return found

    @staticmethod
    def _functions(obj: object) -> Iterable[types.FunctionType]:
        obj = getattr(obj, "__wrapped__", obj)
        if isinstance(obj, types.FunctionType):
            return [obj]
        if isinstance(obj, type):
            return [v for v in vars(obj).values() if isinstance(v, types.FunctionType)]
        return []

    def _function(self, function: types.FunctionType) -> set[str]:
        found: set[str] = set()
        namespace = function.__globals__
        for code in _codes(function.__code__):
            loaded = set(code.co_names) | set(code.co_freevars)
            strings = {c for c in code.co_consts if isinstance(c, str)}
            if loaded & ENGINE_NAMES:
                found.add("engine")
            if loaded & TORCH_NAMES or ("importorskip" in loaded and strings & TORCH_NAMES):
                found.add("torch")
            if loaded & CLI_NAMES:
                found.add("cli")
            if "getfixturevalue" in loaded:  # request.getfixturevalue("name"), a literal or a parameter
                for name in strings & self._fixtures.keys():
                    found |= self._fixture(name)
            for name in code.co_names:
                value = namespace.get(name)
                if _module_name(value).split(".")[0] in TORCH_NAMES:
                    found.add("torch")
                elif (isinstance(value, (types.FunctionType, type)) and value is not function
                      and _defined_in_tests(value)):
                    found |= self._object(value)
        return found

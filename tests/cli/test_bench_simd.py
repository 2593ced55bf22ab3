"""llm_bench's SIMD level per engine (issue 50, item 4; kvforge/tools/bench/simd.py): kvforge's kernel target beside
llama.cpp's own report, MLAS's level derived from the CPU's features and torch's capability, and a peer that is not
installed says so."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

from kvforge.tools.bench import simd


def test_mlas_level_follows_the_cpu_features() -> None:
    avx512 = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"]
    assert simd.mlas_level([*avx512, "avx512_vnni"]) == "avx512 vnni"
    assert simd.mlas_level(avx512) == "avx512"
    assert simd.mlas_level(["sse4_2", "avx", "avx2", "fma", "f16c"]) == "avx2"
    assert simd.mlas_level(["sse4_2", "avx", "avx2", "fma", "avx_vnni"]) == "avx2 vnni"
    assert simd.mlas_level(["sse4_2", "avx"]) == "sse"
    assert simd.mlas_level(["asimd", "asimddp"]) == "neon dot"


def test_llama_cpp_level_is_the_best_feature_it_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("llama_cpp")
    fake.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    fake.__version__ = "9.9"
    fake.llama_print_system_info = lambda: (b"CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | "
                                            b"FMA = 1 | AVX512 = 0 | OPENMP = 1 | ")
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    found = simd.levels(("llama.cpp",))
    assert found["llama.cpp"]["level"] == "avx2"
    assert "llama-cpp-python 9.9" in found["llama.cpp"]["source"] and "AVX512 = 0" in found["llama.cpp"]["detail"]
    assert found["kvforge"]["level"]  # ours beside it: a target, or "none (why)"


def test_a_peer_that_is_not_installed_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    real = simd.importlib.util.find_spec
    monkeypatch.setattr(simd.importlib.util, "find_spec", lambda name: None if name == "torch" else real(name))
    found = simd.levels(("torch",))
    assert found["torch"] == {"level": simd.NOT_INSTALLED, "source": "no torch module", "detail": ""}
    assert "torch not installed" in simd.describe_levels(found)


def test_a_skipped_peer_kind_is_not_installed_and_the_others_are_asked_in_a_child() -> None:
    found = simd.peer_levels({"kvforge": None, "llama.cpp": "llama-cpp-python not installed (pip ...)",
                              "transformers": None})
    assert set(found) == {"kvforge", "llama.cpp", "onnxruntime", "torch"}
    assert found["llama.cpp"] == {"level": simd.NOT_INSTALLED, "source": "llama-cpp-python not installed (pip ...)",
                                  "detail": ""}
    assert found["onnxruntime"]["level"] == simd.mlas_level(found["onnxruntime"]["detail"].split())
    assert "derived from the CPU's features" in found["onnxruntime"]["source"]
    torch_installed = simd.importlib.util.find_spec("torch") is not None
    assert (found["torch"]["level"] != simd.NOT_INSTALLED) == torch_installed
    line = simd.describe_levels(found)
    assert line.startswith("simd: kvforge ") and "llama.cpp not installed" in line and "\n" not in line
    print(line)

"""The SIMD level each engine of an llm_bench run computes with (issue 50, item 4), so a figure against a peer says
whether both ran the same class of instructions: kvforge's kernel target, llama.cpp's own report, what ONNX Runtime's
MLAS dispatches to (derived from the CPU's features: MLAS reports nothing) and torch's CPU capability.

Asked in a child process (`python -m kvforge.tools.bench.simd`, JSON on stdout) so that importing torch or llama.cpp
costs the parent nothing and a peer that crashes on import only loses its own line.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from typing import Any

from kvforge.plugins.cpu_kernel import cpu_description

NOT_INSTALLED = "not installed"
TIMEOUT_S = 120
# llama.cpp's system-info features, best first: the first one it reports as 1 is its level.
LLAMA_LEVELS = ("AVX512_BF16", "AVX512_VNNI", "AVX512", "AVX2", "AVX", "SSE3", "SVE", "NEON")


def mlas_level(simd: list[str]) -> str:
    """The kernels ONNX Runtime's MLAS dispatches to on a CPU with these /proc/cpuinfo features (its platform
    init, onnxruntime/core/mlas/lib/platform.cpp: AVX-512 (F, BW, VL, DQ) with VNNI for int8, AVX2 with FMA, else
    SSE; NEON on aarch64, with the dot product where asimddp is there)."""
    have = set(simd)
    if {"avx512f", "avx512bw", "avx512vl"} <= have:
        return "avx512" + (" vnni" if "avx512_vnni" in have else "")
    if {"avx2", "fma"} <= have:
        return "avx2" + (" vnni" if "avx_vnni" in have else "")
    if "asimd" in have:
        return "neon" + (" dot" if "asimddp" in have else "")
    return "sse"


def _llama_cpp() -> dict[str, Any]:
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    text = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    features = {name.strip(): value.strip() for name, _, value in
                (part.partition("=") for part in text.replace("CPU :", "|").split("|")) if value.strip()}
    level = next((name.lower() for name in LLAMA_LEVELS if features.get(name) == "1"), "none reported")
    return {"level": level, "source": f"llama_print_system_info (llama-cpp-python {llama_cpp.__version__})",
            "detail": " ".join(text.split())}


def _onnxruntime(simd: list[str]) -> dict[str, Any]:
    import onnxruntime

    return {"level": mlas_level(simd), "source": f"derived from the CPU's features: MLAS (onnxruntime "
                                                 f"{onnxruntime.__version__}) dispatches at run time and reports "
                                                 "nothing", "detail": " ".join(simd)}


def _torch() -> dict[str, Any]:
    import torch

    return {"level": str(torch.backends.cpu.get_cpu_capability()).lower(),
            "source": f"torch.backends.cpu.get_cpu_capability() (torch {torch.__version__})", "detail": ""}


PEERS = {"llama.cpp": "llama_cpp", "onnxruntime": "onnxruntime", "torch": "torch"}  # peer → the module it needs
# llm_bench's engine kinds → the peers whose level they run at (every kvforge engine runs on ONNX Runtime: MLAS's
# MatMulNBits where the build chose it, and the graph's other ops)
KIND_PEERS = {"kvforge": ("onnxruntime",), "llama.cpp": ("llama.cpp",), "transformers": ("torch",),
              "onnxruntime-genai": ("onnxruntime",)}


def levels(peers: tuple[str, ...] = tuple(PEERS)) -> dict[str, dict[str, Any]]:
    """In this process: kvforge's kernel target and each of `peers`' level ({"level", "source", "detail"}); a peer
    whose module is missing is {"level": "not installed"}, one whose query fails says why."""
    description = cpu_description()
    simd = [str(flag) for flag in description.get("simd") or []]  # type: ignore[union-attr]
    out: dict[str, dict[str, Any]] = {
        "kvforge": {"level": description.get("kernel_target") or f"none ({description.get('kernel_reason')})",
                    "source": "the kernel target the kvforge.cpu ops run (KVFORGE_CPU_TARGET forces one)",
                    "detail": ""}}
    for peer in peers:
        if importlib.util.find_spec(PEERS[peer]) is None:
            out[peer] = {"level": NOT_INSTALLED, "source": f"no {PEERS[peer]} module", "detail": ""}
            continue
        try:
            out[peer] = _llama_cpp() if peer == "llama.cpp" else _onnxruntime(simd) if peer == "onnxruntime" \
                else _torch()
        except Exception as exc:  # a peer's own failure is its line, never the run's
            first = str(exc).splitlines()[0] if str(exc) else ""
            out[peer] = {"level": "unknown", "source": f"{type(exc).__name__}: {first}", "detail": ""}
    return out


def peer_levels(kinds: dict[str, str | None]) -> dict[str, dict[str, Any]]:
    """For a run of engines of these kinds (kind → why it is skipped, None when it runs): kvforge's level and each
    peer's they run at, asked in a child process. A peer of a skipped kind is "not installed" with that reason, as
    the run reports it; when the child fails, the reason is each asked peer's line."""
    missing = {peer: why for kind, why in kinds.items() if why for peer in KIND_PEERS.get(kind, ())}
    asked = tuple(peer for peer in PEERS if peer not in missing and any(
        peer in KIND_PEERS.get(kind, ()) for kind in kinds))
    try:
        done = subprocess.run([sys.executable, "-m", "kvforge.tools.bench.simd", *asked], capture_output=True,
                              text=True, timeout=TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise ValueError((done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1])
        out = json.loads(done.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        out = levels(())
        out.update({peer: {"level": "unknown", "source": f"the query process failed: {exc}", "detail": ""}
                    for peer in asked})
    for peer in PEERS:
        if peer in missing:
            out[peer] = {"level": NOT_INSTALLED, "source": missing[peer], "detail": ""}
    return out


def describe_levels(found: dict[str, dict[str, Any]]) -> str:
    """One line: "simd: kvforge avx3_dl | llama.cpp avx512_bf16 | onnxruntime avx512 vnni (derived) | torch
    avx512"."""
    parts = []
    for name, entry in found.items():
        derived = " (derived from the CPU's features)" if name == "onnxruntime" and entry["level"] not in (
            NOT_INSTALLED, "unknown") else ""
        parts.append(f"{name} {entry['level']}{derived}")
    return "simd: " + " | ".join(parts)


if __name__ == "__main__":
    print(json.dumps(levels(tuple(arg for arg in sys.argv[1:] if arg in PEERS))))

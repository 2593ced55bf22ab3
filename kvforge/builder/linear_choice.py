"""Which op runs an engine's 4-bit linears on this CPU (issue 50, item 5): kvforge's MatMulBlocks or ONNX Runtime's
MatMulNBits (MLAS), chosen per CPU class from a measurement table kept here, or as `llm_build --linearKernel` says.

The class is the kernel target the kvforge library runs on the build host (Highway's choice, or KVFORGE_CPU_TARGET's):
MLAS dispatches at run time on its own, so the question per class is only which of the two is faster there. The
choice is per engine: every row of a linear (decode, prefill and verification rows alike) runs the same op, so a
verification row is computed as its decode row is.
"""

from __future__ import annotations

from dataclasses import dataclass

KVFORGE, MLAS = "kvforge", "mlas"
# The export's MatMulNBits left exactly as exported (--cpuMatmul onnx before the choice was automatic): accuracy
# level 0, whose float32 path rounds one-row and many-row calls differently, so its verification rows are not its
# decode rows bit for bit; a reference form, never auto's choice. MLAS runs them at level 4 (int8 activations),
# whose rows are exact, and the 8-bit head stays MatMulBlocks.
EXPORT_FORM = "onnx"
LINEAR_KERNELS = ("auto", KVFORGE, MLAS, EXPORT_FORM)
ALIASES = {"kernel": KVFORGE}  # --cpuMatmul's older name of kvforge
CHOICES = (*LINEAR_KERNELS, *ALIASES)

# One decode row through SmolLM2-135M's 120 4-bit linears, ms, 2 threads, on a quiet machine: MatMulBlocks forced to
# each target beside MLAS in the form an engine built with --linearKernel mlas runs: MatMulNBits at accuracy level 4
# (int8 activations: MLAS's path whose rows do not depend on the row count; tests/backends/test_linear_choice.py),
# plain (False) or with zero points and the Q4_1 correction, two MatMuls and an Add per linear (True: a GGUF Q4_1
# export, SmolLM2's). MLAS runs its own dispatch, which on this CPU is its AVX-512 VNNI code whatever target is
# forced: an AVX2 CPU's MLAS would be no faster, so the table favours MLAS there if anything.
MEASURED = ("QUIET_NAME=cpu50 /work/wt/bin/quiet python -m experiments.kernels.cpu_targets --threads 2 --repeats 30, "
            "2026-12-07 20:13 UTC, AMD EPYC (KVM, 2 cores, AVX-512 BF16/VNNI), load average "
            "0.83-1.09; docs/benchmarks.md")
MEASURED_WHERE = "cpu_targets, 2026-12-07, AMD EPYC, 2 threads; docs/benchmarks.md"  # the printed line's source
MLAS_MS = {False: 4.59, True: 6.64}  # q4_1 → ms
KVFORGE_MS = {
    "avx3_dl": 4.25,
    "avx3": 4.32,
    "avx2": 6.25,
    "sse4": 10.88,
    "scalar": 31.42,
}


@dataclass(frozen=True, slots=True)
class LinearChoice:
    """The op an engine's 4-bit linears run (KVFORGE or MLAS) and the one line that says why."""

    kernel: str
    reason: str


def canonical(choice: str) -> str | None:
    """A --linearKernel value in its own spelling (auto, kvforge, mlas, onnx), or None when it is not one."""
    return choice if choice in LINEAR_KERNELS else ALIASES.get(choice)


def choose_linear_kernel(choice: str, target: str | None, q4_1: bool = True) -> LinearChoice:
    """`choice` (a CHOICES entry; the caller checked it) resolved for the kvforge kernel target `target` that runs
    on this host (None: the library reports none), for linears in the Q4_1 form (`q4_1`) or plain. `auto` takes
    the faster op by the table; a target without figures (neon, or a new one) keeps kvforge's op, the default
    before the table."""
    wanted = canonical(choice)
    if wanted == EXPORT_FORM:
        return LinearChoice(EXPORT_FORM, "--linearKernel onnx: the export's MatMulNBits as exported (accuracy level "
                                         "0; a verification row is not bit for bit its decode row)")
    if wanted in (KVFORGE, MLAS):
        measured = choose_linear_kernel("auto", target, q4_1).kernel
        return LinearChoice(wanted, f"--linearKernel {wanted} (asked for; the measured choice for this CPU is "
                                    f"{measured})")
    ours = KVFORGE_MS.get(target or "")
    if ours is None:
        return LinearChoice(KVFORGE, f"no measurement for kernel target {target or 'none'}: kvforge's MatMulBlocks "
                                     "(the default)")
    theirs = MLAS_MS[q4_1]
    form = "MatMulNBits level 4 + Q4_1 correction" if q4_1 else "MatMulNBits level 4"
    kernel = MLAS if theirs < ours else KVFORGE
    winner = f"MLAS {form}" if kernel == MLAS else "MatMulBlocks"
    return LinearChoice(kernel, f"kernel target {target}: {winner} decodes a 4-bit row "
                                f"{max(ours, theirs) / min(ours, theirs):.2f}x faster (MatMulBlocks {ours:.2f} ms, "
                                f"MLAS {form} {theirs:.2f} ms through SmolLM2's linears; {MEASURED_WHERE})")

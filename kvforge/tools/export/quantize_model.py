"""Quantizes a loaded model's linears before its graph is built: the step that needs both the weight source's
LoadedModel and the block formats of quantize.py (which LoadedModel itself holds, so it cannot live there)."""

from __future__ import annotations

from collections.abc import Callable

from kvforge.contract.errors import KvforgeError
from kvforge.tools.export.quantize import (
    BITS,
    DEFAULT_INT4_SCHEME,
    DEFAULT_LM_HEAD_CANDIDATES,
    EMBEDDING,
    INT4_SCHEMES,
    LM_HEAD,
    BlockQuantized,
    linear_weight_names,
    quantize,
    resolve_lm_head,
)
from kvforge.tools.export.sources.base import LoadedModel


def quantize_linears(loaded: LoadedModel, quantization: str, block_size: int,
                     progress: Callable[[str], None] | None = None, lm_head: str = "auto",
                     lm_head_candidates: int = DEFAULT_LM_HEAD_CANDIDATES,
                     int4_scheme: str = DEFAULT_INT4_SCHEME) -> None:
    """Fill `loaded.quantized` for every linear: the GGUF's exact blocks where they are at least as wide as the
    request (int4 keeps Q4_0/Q4_1/Q8_0 blocks, int8 keeps Q8_0 ones), else ONNX Runtime's quantizer at the
    requested bits. Float copies of quantized linears are dropped (the embedding stays).

    The head follows `lm_head` (see resolve_lm_head): float stays a float matmul; int8/int4 become blocks of
    that width (a GGUF's own blocks when they have exactly that width) whose approximate logits choose
    `lm_head_candidates` tokens rescored against the float head, which is then kept (0: the blocks alone).

    `int4_scheme` symmetric: 4-bit blocks with zero points (a GGUF's Q4_1, ONNX Runtime's asymmetric blocks) are
    quantized again without any, at accuracy level 4 (quantize.py); a GGUF's Q4_0 and Q8_0 blocks stay exact."""
    if int4_scheme not in INT4_SCHEMES:
        raise KvforgeError(f"must be one of {', '.join(INT4_SCHEMES)}, got {int4_scheme!r}", "--int4Scheme")
    config = loaded.config
    config.quantization = quantization
    head = resolve_lm_head(quantization, lm_head)
    if lm_head_candidates < 0:
        raise KvforgeError(f"must be >= 0, got {lm_head_candidates}", "--lmHeadCandidates")
    config.lm_head = head
    config.lm_head_candidates = 0 if head == "float" else lm_head_candidates
    if quantization == "none":
        config.quant_block_size = 0
        return
    config.int4_scheme = int4_scheme
    if config.is_recurrent or config.is_hybrid:  # linear_weight_names lists llama layers only
        raise KvforgeError(f"{config.model} exports float32 weights only for now; use --quantization none",
                           "--quantization")
    config.quant_block_size = block_size
    for done, name in enumerate(linear_weight_names(config), start=1):
        bits = BITS[quantization]
        if name == LM_HEAD:
            if head == "float":
                # A head the GGUF holds as Q8_0 stays a float matmul over exactly those values: its 8-bit blocks
                # only run with int8 activations, which alone cost SmolLM2 2.2 points of top-1 agreement
                # (97.8 % vs 100 %) when nothing rescores their logits.
                continue
            bits = BITS[head]
        source = name if name in loaded.weights or name != LM_HEAD else EMBEDDING
        exact = loaded.exact_blocks.get(source)
        if exact is not None and (exact.bits < bits or (name == LM_HEAD and exact.bits != bits)):
            exact = None  # int8 asked of a 4-bit GGUF: 8-bit blocks of the dequantized weights are closer
        symmetric = bits == 4 and int4_scheme == "symmetric"
        if exact is not None and symmetric and not _is_symmetric(exact):
            exact = None  # Q4_1: its zero points and remainders are what the symmetric scheme removes
        loaded.quantized[name] = exact or quantize(loaded.weights[source], bits, block_size, symmetric)
        if source != EMBEDDING and not (name == LM_HEAD and config.lm_head_candidates):
            loaded.weights.pop(source, None)  # a rescored untied head keeps its float rows for the candidates
        if progress is not None:
            progress(f"quantized {done} linears")


def _is_symmetric(blocks: BlockQuantized) -> bool:
    """Blocks MatMulNBits runs with its implicit zero point and no correction (a GGUF's Q4_0 and Q8_0)."""
    return blocks.zero_points is None and blocks.offsets is None

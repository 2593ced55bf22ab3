"""Quantizes a loaded model's linears before its graph is built: the step that needs both the weight source's
LoadedModel and the block formats of quantize.py (which LoadedModel itself holds, so it cannot live there)."""

from __future__ import annotations

from collections.abc import Callable

from kvforge.contract.errors import KvforgeError
from kvforge.tools.export.quantize import BITS, EMBEDDING, LM_HEAD, linear_weight_names, quantize
from kvforge.tools.export.source import LoadedModel


def quantize_linears(loaded: LoadedModel, quantization: str, block_size: int,
                     progress: Callable[[str], None] | None = None) -> None:
    """Fill `loaded.quantized` for every linear: the GGUF's exact blocks where they are at least as wide as the
    request (int4 keeps Q4_0/Q4_1/Q8_0 blocks, int8 keeps Q8_0 ones), else ONNX Runtime's quantizer at the
    requested bits. Float copies of quantized linears are dropped (the embedding stays)."""
    config = loaded.config
    config.quantization = quantization
    if quantization == "none":
        config.quant_block_size = 0
        return
    if config.is_recurrent or config.is_hybrid:  # linear_weight_names lists llama layers only
        raise KvforgeError(f"{config.model} exports float32 weights only for now; use --quantization none",
                           "--quantization")
    config.quant_block_size = block_size
    bits = BITS[quantization]
    for done, name in enumerate(linear_weight_names(config), start=1):
        source = name if name in loaded.weights or name != LM_HEAD else EMBEDDING
        exact = loaded.exact_blocks.get(source)
        if exact is not None and exact.bits < bits:
            exact = None  # int8 asked of a 4-bit GGUF: 8-bit blocks of the dequantized weights are closer
        if name == LM_HEAD and exact is not None and exact.bits > bits:
            # int4 of a GGUF whose head is Q8_0: 8-bit blocks only run with int8 activations (see
            # llama_graph.ACCURACY_LEVELS), which cost SmolLM2's head alone 2.2 points of top-1 agreement
            # (97.8 % vs 100 %), and rounding them to 4 bits would be a second rounding. The head stays a
            # float MatMul over the file's exact values.
            continue
        loaded.quantized[name] = exact or quantize(loaded.weights[source], bits, block_size)
        if source != EMBEDDING:
            loaded.weights.pop(source, None)
        if progress is not None:
            progress(f"quantized {done} linears")

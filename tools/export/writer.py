"""Writes an ONNX dir (the contract llm_build reads) from a loaded model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from safetensors.numpy import save_file

from kvforge.contract.engine_dir import EMBEDDING_FILE, EMBEDDING_TENSOR
from kvforge.contract.engine_dir import ENGINE_MODEL_FILE as MODEL_FILE
from kvforge.contract.engine_dir import ENGINE_WEIGHTS_FILE as WEIGHTS_FILE
from kvforge.contract.files import check_output_dir, staged_dir, write_json
from kvforge.contract.manifest import ONNX_KIND, write_manifest
from kvforge.tools.export.families import mamba2_source
from kvforge.tools.export.families.llama_graph import build_llama_graph
from kvforge.tools.export.families.mamba2_graph import build_mamba2_graph
from kvforge.tools.export.families.qwen3_5_graph import build_qwen3_5_graph
from kvforge.tools.export.sources.base import LoadedModel


def write_onnx_dir(loaded: LoadedModel, output_dir: Path,
                   progress: Callable[[str], None] | None = None) -> Path:
    """Write into a staging dir next to `output_dir`, manifest last, and swap it in: an interrupted export
    leaves `output_dir` as it was and nothing llm_build accepts."""
    check_output_dir(output_dir, "output_dir")
    config = loaded.config
    config.validate()
    with staged_dir(output_dir, "output_dir") as staging:
        _write_files(loaded, staging, progress)
        write_manifest(staging, ONNX_KIND)
    return output_dir


def _write_files(loaded: LoadedModel, output_dir: Path, progress: Callable[[str], None] | None) -> None:
    config = loaded.config
    step = progress or (lambda _msg: None)
    if config.is_recurrent or config.is_hybrid:
        # No LoRA inputs yet: --loraTargets defaults to all, so the config says what the graph really has.
        config.lora_targets = []
    if config.is_recurrent:
        model = build_mamba2_graph(mamba2_source.geometry(config), loaded.weights)
    elif config.is_hybrid:
        model = build_qwen3_5_graph(config, loaded.weights,
                                    progress=lambda layer: step(f"layer {layer + 1}/{config.num_hidden_layers}"))
    else:
        model = build_llama_graph(config, loaded.weights,
                                  progress=lambda layer: step(f"layer {layer + 1}/{config.num_hidden_layers}"),
                                  quantized=loaded.quantized)
    step("saving model.onnx")
    onnx.save_model(model, output_dir / MODEL_FILE, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=WEIGHTS_FILE, size_threshold=1024)
    save_file({EMBEDDING_TENSOR: np.ascontiguousarray(loaded.weights["model.embed_tokens.weight"],
                                                      dtype=np.float32)},
              str(output_dir / EMBEDDING_FILE))
    write_json(output_dir / "config.json", config.to_dict())
    (output_dir / "tokenizer.json").write_text(loaded.tokenizer_json, encoding="utf-8")
    (output_dir / "tokenizer_config.json").write_text(json.dumps(loaded.tokenizer_config, indent=2) + "\n",
                                                      encoding="utf-8")

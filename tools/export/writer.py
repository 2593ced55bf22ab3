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
from kvforge.contract.model_config import write_json
from kvforge.tools.export import mamba2_source
from kvforge.tools.export.llama_graph import build_llama_graph
from kvforge.tools.export.mamba2_graph import build_mamba2_graph
from kvforge.tools.export.source import LoadedModel


def write_onnx_dir(loaded: LoadedModel, output_dir: Path,
                   progress: Callable[[str], None] | None = None) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    config = loaded.config
    config.validate()
    step = progress or (lambda _msg: None)
    if config.is_recurrent:
        model = build_mamba2_graph(mamba2_source.geometry(config), loaded.weights)
    else:
        model = build_llama_graph(config, loaded.weights,
                                  progress=lambda layer: step(f"layer {layer + 1}/{config.num_hidden_layers}"),
                                  quantized=loaded.quantized)
    step("saving model.onnx")
    for stale in (output_dir / MODEL_FILE, output_dir / WEIGHTS_FILE):
        stale.unlink(missing_ok=True)  # external data is appended to, never truncated, by onnx.save
    onnx.save_model(model, output_dir / MODEL_FILE, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=WEIGHTS_FILE, size_threshold=1024)
    save_file({EMBEDDING_TENSOR: np.ascontiguousarray(loaded.weights["model.embed_tokens.weight"],
                                                      dtype=np.float32)},
              str(output_dir / EMBEDDING_FILE))
    write_json(output_dir / "config.json", config.to_dict())
    (output_dir / "tokenizer.json").write_text(loaded.tokenizer_json, encoding="utf-8")
    (output_dir / "tokenizer_config.json").write_text(json.dumps(loaded.tokenizer_config, indent=2) + "\n",
                                                      encoding="utf-8")
    return output_dir

"""Writes an ONNX dir (the contract llm_build reads) from a loaded model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from safetensors.numpy import save_file

from kvforge.contract.engine_dir import EMBEDDING_FILE, EMBEDDING_TENSOR, PER_LAYER_EMBEDDING_FILE
from kvforge.contract.engine_dir import ENGINE_MODEL_FILE as MODEL_FILE
from kvforge.contract.engine_dir import ENGINE_WEIGHTS_FILE as WEIGHTS_FILE
from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import check_output_dir, staged_dir, write_json
from kvforge.contract.manifest import ONNX_KIND, write_manifest
from kvforge.tools.export.families import family_for
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
    family = family_for(config.model)
    if family is None:
        raise KvforgeError(f"no exporter for model {config.model!r}", "model")
    if not family.lora:
        # No LoRA inputs yet: --loraTargets defaults to all, so the config says what the graph really has.
        config.lora_targets = []
    model = family.build_graph(loaded, lambda layer: step(f"layer {layer + 1}/{config.num_hidden_layers}"))
    step("saving model.onnx")
    onnx.save_model(model, output_dir / MODEL_FILE, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=WEIGHTS_FILE, size_threshold=1024)
    save_file({EMBEDDING_TENSOR: np.ascontiguousarray(loaded.weights["model.embed_tokens.weight"],
                                                      dtype=np.float32)},
              str(output_dir / EMBEDDING_FILE))
    if config.hidden_size_per_layer_input:  # Gemma 4: looked up by token id beside the embedding, as it is
        table = loaded.weights["model.embed_tokens_per_layer.weight"][:config.vocab_size]  # ids index both tables
        save_file({EMBEDDING_TENSOR: np.ascontiguousarray(table, dtype=np.float32)},
                  str(output_dir / PER_LAYER_EMBEDDING_FILE))
    write_json(output_dir / "config.json", config.to_dict())
    (output_dir / "tokenizer.json").write_text(loaded.tokenizer_json, encoding="utf-8")
    (output_dir / "tokenizer_config.json").write_text(json.dumps(loaded.tokenizer_config, indent=2) + "\n",
                                                      encoding="utf-8")

"""What every draft exporter shares (EAGLE3, block drafts): the draft graph's contract inputs, the check that the
base returns the layers the draft reads, and the staged ONNX dir a draft is written to."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from safetensors.numpy import save_file

from kvforge.contract.engine_dir import (
    BASE_HIDDEN_INPUT,
    EMBEDDING_FILE,
    EMBEDDING_TENSOR,
    ENGINE_MODEL_FILE,
    ENGINE_WEIGHTS_FILE,
)
from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import staged_dir, write_json
from kvforge.contract.manifest import ONNX_KIND, write_manifest
from kvforge.contract.model_config import ModelConfig
from kvforge.graph.onnx_graph import FLOAT, INT32, value_info
from kvforge.graph.positions import logits_indices_input


def draft_graph_inputs(config: ModelConfig, own_input: str = "", own_width: int = 0) -> list[onnx.ValueInfoProto]:
    """The engine contract's inputs of a draft graph (its pools aside): the embeddings (the base's width for an
    assistant, whose pre-projection maps them), the base's hidden states [B, S, base width], the draft's own extra
    input `own_input` [B, S, own_width] if any, lengths, page table, RoPE table and logits positions."""
    own = [value_info(own_input, FLOAT, ["batch", "seq", own_width])] if own_input else []
    return [value_info("inputs_embeds", FLOAT, ["batch", "seq", config.embedding_width]),
            value_info(BASE_HIDDEN_INPUT, FLOAT, ["batch", "seq", config.base_model_hidden_size]), *own,
            value_info("context_lengths", INT32, ["batch"]), value_info("kvcache_start_index", INT32, ["batch"]),
            value_info("kv_page_table", INT32, ["batch", "pages_per_seq"]),
            value_info("rope_rotary_cos_sin", FLOAT, ["capacity", config.rotary_dim]), logits_indices_input()]


def check_base_layers(base: ModelConfig, draft: ModelConfig) -> None:
    """The base's ONNX dir returns exactly the hidden states the draft reads (else: which export it needs)."""
    if base.hidden_state_layers != draft.eagle_hidden_state_layers:
        layers = ",".join(map(str, draft.eagle_hidden_state_layers))
        raise KvforgeError(f"the draft reads base layers {draft.eagle_hidden_state_layers} but this base returns "
                           f"{base.hidden_state_layers or 'none'}; re-export the base with --hiddenStateLayers "
                           f"{layers}", "--baseOnnxDir")


def write_draft_dir(output_dir: Path, model: onnx.ModelProto, config: ModelConfig, embedding: np.ndarray,
                    files: dict[str, dict[str, np.ndarray]]) -> None:
    """The draft's ONNX dir, staged and swapped in whole: the graph with its weights, its embedding table, the
    method's own safetensors `files` (name -> tensors), config.json and the manifest."""
    with staged_dir(output_dir, "--outputDir") as staging:
        onnx.save_model(model, staging / ENGINE_MODEL_FILE, save_as_external_data=True,
                        all_tensors_to_one_file=True, location=ENGINE_WEIGHTS_FILE, size_threshold=1024)
        save_file({EMBEDDING_TENSOR: np.ascontiguousarray(embedding)}, str(staging / EMBEDDING_FILE))
        for name, tensors in files.items():
            save_file(tensors, str(staging / name))
        write_json(staging / "config.json", config.to_dict())
        write_manifest(staging, ONNX_KIND)

"""What every draft exporter shares (EAGLE3, block drafts, Gemma4 assistants, MTP layers): reading its inputs, the
base's tensors a draft copies (embedding, head, final norm), the draft graph's contract inputs and weight nodes, the
check that the base returns the layers the draft reads, and the staged ONNX dir a draft is written to."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper
from safetensors.numpy import save_file

from kvforge.contract.engine_dir import (
    BASE_HIDDEN_INPUT,
    DRAFT_HIDDEN_INPUT,
    EMBEDDING_FILE,
    EMBEDDING_TENSOR,
    ENGINE_MODEL_FILE,
    ENGINE_WEIGHTS_FILE,
)
from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import check_output_dir, read_json, staged_dir, write_json
from kvforge.contract.manifest import ONNX_KIND, write_manifest
from kvforge.contract.model_config import ModelConfig
from kvforge.contract.safetensors_map import map_tensor
from kvforge.graph.onnx_graph import FLOAT, INT32, GraphWriter, value_info
from kvforge.graph.positions import logits_indices_input

BASE_FIELD = "--baseOnnxDir"
BASE_HEAD_INITIALIZER = "lm_head.weight"  # the family graphs' float head, stored [H, V]
BASE_NORM_INITIALIZER = "model.norm.weight"  # their final norm, as the multiplier the graph applies


def open_draft_export(draft_dir: Path, base_onnx_dir: Path, output_dir: Path,
                      field: str) -> tuple[dict[str, Any], ModelConfig]:
    """The checks every draft export starts with, then (the checkpoint's config.json, the base's ModelConfig)."""
    if not Path(draft_dir).is_dir():
        raise KvforgeError(f"no such directory {draft_dir}", field)
    check_output_dir(output_dir, "--outputDir")
    base = ModelConfig.from_dict(read_json(Path(base_onnx_dir) / "config.json", BASE_FIELD), BASE_FIELD)
    return read_json(Path(draft_dir) / "config.json", field), base


def base_embedding(base_onnx_dir: Path) -> np.ndarray:
    """The base's token table [V, H] float32 (a draft embeds with it)."""
    return np.asarray(map_tensor(Path(base_onnx_dir) / EMBEDDING_FILE, EMBEDDING_TENSOR), dtype=np.float32)


def _base_initializer(base_onnx_dir: Path, name: str) -> np.ndarray | None:
    """A float32 initializer of the base's model.onnx (only its own external data read), or None."""
    model = onnx.load(str(Path(base_onnx_dir) / ENGINE_MODEL_FILE), load_external_data=False)
    found = next((t for t in model.graph.initializer if t.name == name), None)
    if found is None:
        return None
    if onnx.external_data_helper.uses_external_data(found):
        onnx.external_data_helper.load_external_data_for_tensor(found, str(base_onnx_dir))
    return numpy_helper.to_array(found).astype(np.float32)


def base_head(base_onnx_dir: Path, base: ModelConfig) -> np.ndarray:
    """The base's LM head [V, H] float32: its tied embedding table, or its float head initializer."""
    if base.tie_word_embeddings:
        return base_embedding(base_onnx_dir)
    found = _base_initializer(base_onnx_dir, BASE_HEAD_INITIALIZER)
    if found is None:
        raise KvforgeError("the base's LM head is not a float matrix (a quantized head); re-export the base with "
                           "--lmHead float so its draft can score with it", BASE_FIELD)
    head = found.T
    if head.shape != (base.vocab_size, base.hidden_size):
        raise KvforgeError(f"the base's {BASE_HEAD_INITIALIZER} is {list(head.shape)}, expected "
                           f"{[base.vocab_size, base.hidden_size]}", BASE_FIELD)
    return np.ascontiguousarray(head)


def base_final_norm(base_onnx_dir: Path, base: ModelConfig) -> tuple[np.ndarray, float]:
    """The base's final norm (the multiplier and eps), which turns its last layer's output into the normed hidden
    state a Gemma4 assistant or an MTP layer reads (kvforge bases return layer outputs before that norm)."""
    found = _base_initializer(base_onnx_dir, BASE_NORM_INITIALIZER)
    if found is None:
        raise KvforgeError(f"the base graph has no {BASE_NORM_INITIALIZER} initializer (a kvforge base export has "
                           "one)", BASE_FIELD)
    return found, base.rms_norm_eps


def normed_hidden_input(g: GraphWriter, norm: tuple[np.ndarray, float]) -> str:
    """The hidden state an MTP-style draft reads, from EAGLE3's two inputs (a call passes zeros for the one it does
    not use): the base's last layer output through the base's final `norm` (zeros stay zeros), plus the draft's
    own previous output."""
    weight, eps = norm
    base = g.rms_norm(BASE_HIDDEN_INPUT, g.weight("base_norm.weight", weight), eps)
    return g.add(base, DRAFT_HIDDEN_INPUT)


def weight_ops(g: GraphWriter, weights: dict[str, np.ndarray]) -> tuple[Callable[[str], str],
                                                                         Callable[[str, str], str]]:
    """A draft graph's two weight nodes: `w(name)`, weights[name] as an initializer, and `linear(x, name)`, x times
    the checkpoint's [out, in] matrix weights[name] (stored transposed)."""

    def w(name: str) -> str:
        return g.weight(name, weights[name])

    def linear(x: str, name: str) -> str:
        return g.matmul(x, g.weight(name, np.ascontiguousarray(weights[name].T)))

    return w, linear


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
                           f"{layers}", BASE_FIELD)


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

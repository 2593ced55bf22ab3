"""What both backends' builds share: loading the export's model.onnx and writing the engine dir's common files."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx

from kvforge.builder.lora import check_max_lora_rank, has_lora_inputs, strip_lora
from kvforge.contract.engine_dir import ENGINE_MODEL_FILE, BuilderConfig, copied_files, engine_role
from kvforge.contract.errors import InvalidConfig
from kvforge.contract.files import write_json
from kvforge.contract.model_config import ModelConfig


def load_model(onnx_dir: Path, config: ModelConfig, max_lora_rank: int) -> onnx.ModelProto:
    """The export's graph, its LoRA inputs stripped for a base-only engine (rank 0; `config` follows)."""
    try:
        model = onnx.load(onnx_dir / ENGINE_MODEL_FILE)
    except Exception as exc:
        raise InvalidConfig(f"cannot load {onnx_dir / ENGINE_MODEL_FILE}: {exc}", "onnx_dir") from None
    check_graph_matches_config(model, config, onnx_dir)
    check_max_lora_rank(max_lora_rank, model)
    if max_lora_rank == 0 and has_lora_inputs(model):
        model = strip_lora(model)  # a base-only engine pays nothing for the export's LoRA inputs
        config.lora_targets = []
    return model


def check_graph_matches_config(model: onnx.ModelProto, config: ModelConfig, onnx_dir: Path) -> None:
    """config.json against the graph it describes: one KV pool input per attention layer (`past_key_values_{i}`, i
    the absolute layer index), embeddings of hidden_size."""
    inputs = {vi.name: [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
              for vi in model.graph.input}
    pools = [name for name in inputs if name.startswith("past_key_values_")]
    attention_layers = config.num_attention_layers
    if sorted(pools) != sorted(f"past_key_values_{i}" for i in config.pool_layer_ids):
        raise InvalidConfig(f"{onnx_dir}/config.json says num_hidden_layers {config.num_hidden_layers} "
                            f"({attention_layers} attention) but model.onnx has {len(pools)} KV pool inputs; "
                            "re-export it with llm_export", "onnx_dir")
    embeds = inputs.get("inputs_embeds")
    if not embeds or embeds[-1] not in (None, config.embedding_width):
        raise InvalidConfig(f"model.onnx takes inputs_embeds {embeds}, config.json implies width "
                            f"{config.embedding_width}; re-export it with llm_export", "onnx_dir")


def write_engine_config(onnx_dir: Path, engine_dir: Path, config: ModelConfig, build: BuilderConfig) -> None:
    """Copy the files every engine dir holds and write config.json with its builder_config."""
    for name in copied_files(config):
        shutil.copyfile(onnx_dir / name, engine_dir / name)
    write_json(engine_dir / "config.json", {**config.to_dict(), "engine_role": engine_role(config, build.spec_base),
                                            "builder_config": build.to_dict()})

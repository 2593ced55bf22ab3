"""A Hugging Face checkpoint dir of a real model's shape with random weights, for benchmarks that cannot download.

Weights cannot be downloaded here, but speed and memory depend on shapes alone: this writes config.json +
model.safetensors in transformers' layout for a named preset, with the tokenizer files (and chat template)
of an existing export, so `llm_export DIR` takes it like a real checkpoint. Answers are noise.

    python scripts/random_checkpoint.py --preset mamba2-130m --tokenizerFrom out/onnx/smollm2 \
        --outputDir out/hf/mamba2-130m
    llm_export out/hf/mamba2-130m --outputDir out/onnx/mamba2-130m
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from kvforge.contract.model_config import ModelConfig
from kvforge.tools.export.families import mamba2 as mamba2_family
from kvforge.tools.export.families import qwen3_5 as qwen3_5_family

# state-spaces/mamba2-130m's shape (vocab cut to the borrowed tokenizer's).
PRESETS: dict[str, dict[str, Any]] = {
    "mamba2-130m": {"model_type": "mamba2", "hidden_size": 768, "num_hidden_layers": 24, "num_heads": 24,
                    "head_dim": 64, "state_size": 128, "n_groups": 1, "conv_kernel": 4, "expand": 2,
                    "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "use_bias": False,
                    "use_conv_bias": True},
    # A Qwen3.5-style hybrid of SmolLM2's width: 12 gated delta-net layers, every 4th layer full attention.
    "qwen3_5-small": {"model_type": "qwen3_5_text", "hidden_size": 768, "intermediate_size": 2048,
                      "num_hidden_layers": 16, "full_attention_interval": 4, "num_attention_heads": 8,
                      "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 32768,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                          "partial_rotary_factor": 0.25},
                      "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 64,
                      "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
                      "tie_word_embeddings": True, "hidden_act": "silu"},
}


def mamba2(preset: dict[str, Any], vocab_size: int, seed: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    hf = {**preset, "vocab_size": vocab_size, "architectures": ["Mamba2ForCausalLM"]}
    config: ModelConfig = mamba2_family.config_from_hf(hf, bos_token_id=None, eos_token_ids=[0], name="random")
    weights = mamba2_family.random_weights(config, seed)
    weights[mamba2_family.HF_EMBEDDING] = weights.pop(mamba2_family.EMBEDDING) * 0.02
    return hf, weights


def qwen3_5(preset: dict[str, Any], vocab_size: int, seed: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    hf = {**preset, "vocab_size": vocab_size, "architectures": ["Qwen3_5ForCausalLM"]}
    config: ModelConfig = qwen3_5_family.config_from_hf(hf, bos_token_id=None, eos_token_ids=[0], name="random")
    return hf, qwen3_5_family.random_weights(config, seed)  # transformers' names already


FAMILIES = {"mamba2": mamba2, "qwen3_5_text": qwen3_5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--tokenizerFrom", type=Path, required=True,
                        help="an export or HF dir whose tokenizer.json / tokenizer_config.json to copy")
    parser.add_argument("--outputDir", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = json.loads((args.tokenizerFrom / "tokenizer.json").read_text())
    vocab = max(tokenizer["model"]["vocab"].values()) + 1
    vocab = max([vocab, *(t["id"] + 1 for t in tokenizer.get("added_tokens", []))])
    preset = PRESETS[args.preset]
    hf, weights = FAMILIES[preset["model_type"]](preset, vocab, args.seed)
    tok_config = json.loads((args.tokenizerFrom / "tokenizer_config.json").read_text())
    eos = tok_config.get("eos_token")
    eos_id = next((t["id"] for t in tokenizer.get("added_tokens", []) if t["content"] == eos), 0)
    hf["eos_token_id"] = eos_id
    args.outputDir.mkdir(parents=True, exist_ok=True)
    (args.outputDir / "config.json").write_text(json.dumps(hf, indent=2))
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(args.outputDir / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(args.tokenizerFrom / name, args.outputDir / name)
    parameters = sum(v.size for v in weights.values())
    print(f"wrote {args.outputDir} ({args.preset}, vocab {vocab}, {parameters:,} parameters)")


if __name__ == "__main__":
    main()

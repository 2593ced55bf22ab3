"""PEFT adapter → the engine's LoRA layout: A as [in, r], B as [r, out] with the scaling folded into B."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import atomic_write_bytes, atomic_write_text, check_distinct, check_output_file, read_json
from kvforge.contract.lora import (
    ADAPTER_FORMAT,
    INVOCATION_FIELD,
    LORA_MODULES,
    check_invocation_tokens,
    lora_a_name,
    lora_b_name,
    lora_inputs,
    model_fingerprint,
    target_dims,
)
from kvforge.contract.model_config import ModelConfig
from kvforge.tools.export.sources.hf_common import read_safetensors_header, read_tensor  # bf16-aware, shared

FIELD = "adapter_dir"
_MODULE_TO_TARGET = {module.split(".")[-1]: target for target, module in LORA_MODULES.items()}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


def convert_peft_adapter(adapter_dir: Path, onnx_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors named like the engine inputs and metadata; every shape is checked against the model."""
    config = ModelConfig.from_dict(read_json(onnx_dir / "config.json", "onnx_dir"), f"{onnx_dir}/config.json")
    peft = read_json(adapter_dir / "adapter_config.json", FIELD)
    rank, scaling = _rank_and_scaling(peft)
    raw = _read_adapter_tensors(adapter_dir)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    graph_linears = {(layer, target) for _, _, layer, target in lora_inputs(config)}
    for name, array in raw.items():
        match = _KEY.match(name)
        if match is None:
            raise KvforgeError(f"unexpected tensor {name!r} (only q/k/v/o/gate/up/down lora_A/lora_B are supported)",
                               FIELD)
        layer, module, side = int(match[1]), match[2], match[3]
        target = _MODULE_TO_TARGET.get(module)
        if target is None:
            raise KvforgeError(f"adapter targets {module!r}, which kvforge does not adapt", FIELD)
        if layer >= config.num_hidden_layers:
            raise KvforgeError(f"adapter has layer {layer}, the model has {config.num_hidden_layers} layers; "
                               "is it for another model?", FIELD)
        if target not in config.lora_targets:
            raise KvforgeError(f"adapter targets {target} ({module}) but the ONNX dir was exported with "
                               f"--loraTargets {','.join(config.lora_targets) or 'none'}", FIELD)
        if (layer, target) not in graph_linears:  # Gemma 4's KV-shared layers have no k/v projection
            raise KvforgeError(f"adapter adapts layer {layer} {module}, which this model's layer {layer} does not have "
                               f"(it reads layer {config.kv_source_layers[layer]}'s K/V)", FIELD)
        pairs.setdefault((layer, target), {})[side] = array
    if not pairs:
        raise KvforgeError("adapter_model.safetensors holds no LoRA tensors", FIELD)
    tensors: dict[str, np.ndarray] = {}
    max_rank = 0
    for (layer, target), sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            raise KvforgeError(f"layer {layer} {target}: lora_A and lora_B must both be present", FIELD)
        in_dim, out_dim = target_dims(config, target, layer)
        a, b = sides["A"], sides["B"]  # PEFT: A [r, in], B [out, r]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_dim or b.shape[0] != out_dim or a.shape[0] != b.shape[1]:
            raise KvforgeError(f"layer {layer} {target}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit "
                               f"a [{out_dim} x {in_dim}] linear of this model; is the adapter for another model?",
                               FIELD)
        max_rank = max(max_rank, a.shape[0])
        tensors[lora_a_name(layer, target)] = np.ascontiguousarray(a.T, dtype=np.float32)
        tensors[lora_b_name(layer, target)] = np.ascontiguousarray((b * scaling).T, dtype=np.float32)
    tensors = {name: _pad_rank(array, max_rank, name) for name, array in tensors.items()}
    metadata = {"format": ADAPTER_FORMAT, "rank": str(max_rank), "model_fingerprint": model_fingerprint(config),
                "lora_alpha": str(peft.get("lora_alpha")), "scaling": repr(scaling), "configured_rank": str(rank),
                "source": str(adapter_dir)}
    invocation = peft.get(INVOCATION_FIELD)
    if invocation is not None:  # an activated LoRA: PEFT applies it from the invocation's last occurrence on
        tokens = check_invocation_tokens(invocation, config.vocab_size, str(adapter_dir), FIELD)
        metadata[INVOCATION_FIELD] = json.dumps(list(tokens))
    return tensors, metadata


def write_converted_adapter(adapter_dir: Path, onnx_dir: Path, output: Path) -> tuple[int, int]:
    check_output_file(output, "output")
    check_distinct({"output": output}, {"adapter_dir": adapter_dir, "onnx_dir": onnx_dir})
    tensors, metadata = convert_peft_adapter(adapter_dir, onnx_dir)
    atomic_write_bytes(output, save(tensors, metadata=metadata))
    return int(metadata["rank"]), len(tensors) // 2


def _pad_rank(array: np.ndarray, rank: int, name: str) -> np.ndarray:
    """PEFT's rank_pattern can give modules different ranks; zero rows/columns keep the product exact."""
    axis = 1 if name.startswith("lora_A_") else 0
    missing = rank - array.shape[axis]
    if missing == 0:
        return array
    pad = [(0, 0), (0, 0)]
    pad[axis] = (0, missing)
    return np.pad(array, pad)


def _rank_and_scaling(peft: dict) -> tuple[int, float]:
    if peft.get("peft_type", "LORA") != "LORA":
        raise KvforgeError(f"peft_type {peft.get('peft_type')!r} is not LORA", FIELD)
    if peft.get("bias", "none") != "none":
        raise KvforgeError(f"bias={peft.get('bias')!r} adapters are not supported (only bias='none')", FIELD)
    if peft.get("modules_to_save"):
        raise KvforgeError("adapters with modules_to_save are not supported", FIELD)
    if peft.get("fan_in_fan_out"):
        raise KvforgeError("fan_in_fan_out adapters are not supported (llama-family linears are not Conv1D)", FIELD)
    rank = peft.get("r")
    alpha = peft.get("lora_alpha", rank)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise KvforgeError(f"adapter_config.json r must be a positive integer, got {rank!r}", FIELD)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not np.isfinite(alpha):
        raise KvforgeError(f"adapter_config.json lora_alpha must be a finite number, got {alpha!r}", FIELD)
    if peft.get("alpha_pattern") or peft.get("rank_pattern"):
        # Per-module ranks or alphas change the scaling per module; one scaling per adapter is folded here.
        raise KvforgeError("rank_pattern/alpha_pattern adapters are not supported", FIELD)
    scaling = alpha / np.sqrt(rank) if peft.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _read_adapter_tensors(adapter_dir: Path) -> dict[str, np.ndarray]:
    path = adapter_dir / "adapter_model.safetensors"
    if not path.is_file():
        raise KvforgeError(f"missing {path}", FIELD)
    try:
        header, data_start = read_safetensors_header(path)
        return {name: read_tensor(path, name, entry, data_start).astype(np.float32)
                for name, entry in header.items() if name != "__metadata__"}
    except KvforgeError:
        raise
    except Exception as exc:
        raise KvforgeError(f"cannot read {path}: {exc}", FIELD) from None


def write_random_peft_adapter(onnx_dir: Path, output_dir: Path, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                              targets: list[str] | None = None, scale: float = 0.05,
                              invocation_tokens: list[int] | None = None) -> Path:
    """A random PEFT adapter (adapter_config.json + adapter_model.safetensors) for tests and demos."""
    config = ModelConfig.from_dict(read_json(onnx_dir / "config.json", "onnx_dir"), f"{onnx_dir}/config.json")
    targets = targets if targets is not None else config.lora_targets
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target in targets:
            if target in ("k", "v") and config.kv_source_layers and config.kv_source_layers[layer] != layer:
                continue  # a KV-shared layer has no k/v projection (PEFT adapts none there)
            in_dim, out_dim = target_dims(config, target, layer)
            prefix = f"base_model.model.model.layers.{layer}.{LORA_MODULES[target]}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, in_dim)) / np.sqrt(in_dim)).astype(
                np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (scale * rng.standard_normal((out_dim, rank))).astype(np.float32)
    if invocation_tokens is not None:
        check_invocation_tokens(invocation_tokens, config.vocab_size, str(output_dir), "invocation_tokens")
    check_distinct({"output_dir": output_dir}, {"onnx_dir": onnx_dir}, outputs_are_dirs=True)
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(output_dir / "adapter_model.safetensors", save(tensors))
    peft_config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none", "use_rslora": False,
                   "target_modules": sorted({LORA_MODULES[t].split(".")[-1] for t in targets}),
                   "task_type": "CAUSAL_LM", "fan_in_fan_out": False, "lora_dropout": 0.0}
    if invocation_tokens is not None:
        peft_config[INVOCATION_FIELD] = list(invocation_tokens)
    atomic_write_text(output_dir / "adapter_config.json", json.dumps(peft_config, indent=2) + "\n")
    return output_dir

"""The model-family registry: each family registers itself once, under its names, so the weight sources and the
writer look a family up instead of switching on model names (as llama.cpp's convert_hf_to_gguf.py registers one
class per architecture)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from kvforge.contract.model_config import ModelConfig

if TYPE_CHECKING:
    from kvforge.tools.export.sources.base import LoadedModel


def same_name(name: str) -> str | None:
    """The default rename: a checkpoint's tensor names are kvforge's."""
    return name


@dataclass(frozen=True, slots=True, eq=False)  # compared and hashed by identity: one object per family
class Family:
    """Everything the exporter knows about one family of text models."""

    # HF config.json model_type values the family reads; the first is the family's own name. ModelConfig.model is
    # one of them.
    model_types: tuple[str, ...]
    # HF config.json (hf, **common) -> ModelConfig, hf["model_type"] set: `common` holds what every family shares
    # (kv_cache_dtype, token ids, name). KeyError names a missing field, ValueError an unsupported value.
    config_from_hf: Callable[..., ModelConfig]
    # Every weight name (after checkpoint_name) a checkpoint must hold, lm_head excepted (it may be tied).
    expected_names: Callable[[ModelConfig], list[str]]
    # (loaded model, progress per layer) -> the ONNX graph of the ONNX dir's model.onnx.
    build_graph: Callable[[LoadedModel, Callable[[int], None]], onnx.ModelProto]
    # (config, seed) -> random weights under the names expected_names lists (plus lm_head when untied).
    random_weights: Callable[[ModelConfig, int], dict[str, np.ndarray]]
    # HF architectures class -> model_type, for configs that name only the class.
    architectures: Mapping[str, str] = field(default_factory=dict)
    # Synthetic model name -> ModelConfig fields ("model" included) over the tiny base geometry.
    synthetic: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # A checkpoint tensor's name -> kvforge's (None: a tensor the text model does not use).
    checkpoint_name: Callable[[str], str | None] = same_name
    lora: bool = True  # the graph takes lora_A/lora_B inputs (recurrent mixers have none yet)
    # general.architecture values of the GGUF files sources/gguf.py reads as this family (each is also the model_type
    # its metadata is mapped to, then read by config_from_hf as an HF config.json would be).
    gguf_architectures: tuple[str, ...] = ()
    # The graph takes int4/int8 blocks (`llm_export --quantization auto` keeps a GGUF's); False: float32 weights only.
    takes_blocks: bool = True

    @property
    def name(self) -> str:
        return self.model_types[0]


_BY_NAME: dict[str, Family] = {}  # model_type and architectures class -> family, in registration order


def register(family: Family) -> Family:
    """Add a family under its model types and architecture classes; a name taken twice is a bug."""
    names = (*family.model_types, *family.architectures)
    taken = [name for name in names if name in _BY_NAME]
    if taken:  # checked before any is added: a failed registration leaves the registry as it was
        raise ValueError(f"model family name {taken[0]!r} is registered twice")
    _BY_NAME.update(dict.fromkeys(names, family))
    return family


def family_for(name: str) -> Family | None:
    """The family of an HF model_type, an architectures class or a ModelConfig.model; None when none is."""
    return _BY_NAME.get(name)


def model_types() -> tuple[str, ...]:
    """Every model_type a registered family reads, in registration order."""
    return tuple(name for name, family in _BY_NAME.items() if name in family.model_types)


def model_type_of(architectures: list[str]) -> str | None:
    """The model_type of the first architectures class a family registered."""
    for architecture in architectures:
        family = _BY_NAME.get(architecture)
        if family is not None and architecture in family.architectures:
            return family.architectures[architecture]
    return None


def gguf_architectures() -> tuple[str, ...]:
    """The GGUF general.architecture values a registered family reads."""
    return tuple(dict.fromkeys(a for f in _BY_NAME.values() for a in f.gguf_architectures))


def synthetic_models() -> Mapping[str, Mapping[str, Any]]:
    """Every family's synthetic models: name -> ModelConfig fields."""
    models: dict[str, Mapping[str, Any]] = {}
    for family in dict.fromkeys(_BY_NAME.values()):
        models.update(family.synthetic)
    return MappingProxyType(models)

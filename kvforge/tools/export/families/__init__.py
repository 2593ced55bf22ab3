"""Model families: each registers itself once (registry.py) from the module that maps its checkpoints; importing
this package registers every text family, in the order `llm_export` lists them."""

from kvforge.tools.export.families import gemma3, gemma4, llama, mamba2, qwen3_5  # noqa: F401 (each registers its family)
from kvforge.tools.export.families.registry import (
    Family,
    family_for,
    gguf_architectures,
    model_type_of,
    model_types,
    register,
    synthetic_models,
)

__all__ = ["Family", "family_for", "gguf_architectures", "model_type_of", "model_types", "register", "synthetic_models"]

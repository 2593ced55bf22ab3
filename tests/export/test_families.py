"""The model-family registry (kvforge/tools/export/families/): every family registered once, and what each declares
agrees with what it builds."""

from __future__ import annotations

import pytest

from kvforge.tools.export.families import Family, family_for, model_type_of, model_types, register, synthetic_models
from kvforge.tools.export.families.llama import FAMILY as LLAMA
from kvforge.tools.export.sources.synthetic import synthetic_model


def test_every_model_type_and_architecture_finds_its_family() -> None:
    assert model_types()[:3] == ("llama", "qwen2", "qwen3")  # the order the unsupported-type error lists
    assert {"mamba2", "qwen3_5", "qwen3_5_text"} <= set(model_types())
    for name in model_types():
        family = family_for(name)
        assert family is not None and name in family.model_types
    assert model_type_of(["SomethingElse", "Qwen2ForCausalLM"]) == "qwen2"
    assert model_type_of(["Qwen3_5ForConditionalGeneration"]) == "qwen3_5"
    assert model_type_of(["MistralForCausalLM"]) is None
    assert family_for("mistral") is None


def test_a_name_registered_twice_is_refused_and_nothing_is_added() -> None:
    before = model_types()
    clash = Family(model_types=("not-yet-a-family", "qwen2"), config_from_hf=LLAMA.config_from_hf,
                   expected_names=LLAMA.expected_names, build_graph=LLAMA.build_graph,
                   random_weights=LLAMA.random_weights)
    with pytest.raises(ValueError, match="'qwen2' is registered twice"):
        register(clash)
    assert model_types() == before and family_for("not-yet-a-family") is None


@pytest.mark.parametrize("name", sorted(synthetic_models()))
def test_synthetic_weights_are_the_names_the_family_expects(name: str) -> None:
    """A family's random weights, its expected names and its ModelConfig.model agree (lm_head only when untied)."""
    loaded = synthetic_model(name)
    family = family_for(loaded.config.model)
    assert family is not None and name in family.synthetic
    expected = set(family.expected_names(loaded.config))
    if not loaded.config.tie_word_embeddings:
        expected.add("lm_head.weight")
    assert set(loaded.weights) == expected
    assert "model.embed_tokens.weight" in loaded.weights  # the runtime's embedding table, whatever the family


def test_every_draft_command_reaches_its_module_through_the_import_graph() -> None:
    """llm_export's DRAFT_FORMATS imports each draft module by a literal name, so the layering test sees the edge."""
    from test_layering import import_graph

    from kvforge.tools.export.cli import DRAFT_FORMATS

    edges = import_graph()["kvforge.tools.export.cli"]
    for load, exporter, writer in DRAFT_FORMATS.values():
        module = load()
        assert module.__name__ in edges, module.__name__
        assert callable(getattr(module, exporter)) and callable(getattr(module, writer))

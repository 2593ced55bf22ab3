"""The speculation table (kvforge/contract/speculation.py) is the one place support rows live: the registry, the
help, the docs and the checks read it, and a method's name is spelled in few source files."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.speculation import (
    DRAFT_METHODS,
    SPEC_DECODE_TYPES,
    SPEC_METHODS,
    SPEC_NONE,
    SPEC_OFF,
    SPEC_SUPPORT,
    Base,
    DraftKV,
    base_kind,
    draft_methods_on,
    spec_decode_help,
    support_table_markdown,
)
from kvforge.runtime.engine.config import EngineConfig, engine_options
from kvforge.runtime.spec.methods import HiddenStateProposer, check_spec_options, spec_method
from kvforge.runtime.spec.proposer import DraftStates
from kvforge.runtime.types import Deployment

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "commands" / "llm_inference.md"
# The package's sources; tests/, docs/ and the experiment scripts are left out.
SOURCE_DIRS = ("kvforge",)
MAX_FILES_SPELLING_A_METHOD = 3


def test_docs_show_the_table_as_generated() -> None:
    text = DOC.read_text(encoding="utf-8")
    found = re.search(r"<!-- spec-support:begin -->\n(.*?)\n<!-- spec-support:end -->", text, re.S)
    assert found is not None, "docs/commands/llm_inference.md lost its spec-support block"
    assert found.group(1) == support_table_markdown(), (
        "the support table in docs/commands/llm_inference.md differs from kvforge/contract/speculation.py: paste "
        "support_table_markdown() between the markers")


def test_every_row_has_one_registered_method() -> None:
    assert tuple(SPEC_SUPPORT) == SPEC_METHODS
    for name in SPEC_METHODS:
        assert spec_method(name).support is SPEC_SUPPORT[name]
        assert spec_method(name).name == name
    with pytest.raises(InvalidConfig) as info:
        spec_method("medusa")
    assert info.value.field == "spec_decode" and "medusa" in info.value.message


def test_rows_say_what_the_seed_matrix_says() -> None:
    # Bases: hybrid MTP is the only recurrent speculative deployment; nothing speculates on a pure recurrent base.
    assert draft_methods_on(Base.RECURRENT) == ()
    assert [name for name in DRAFT_METHODS if Base.HYBRID in SPEC_SUPPORT[name].bases] == ["mtp"]
    assert SPEC_SUPPORT["mtp"].bases == (Base.HYBRID,)  # standard MTP is refused on attention-only bases
    # Draft pools: the Gemma4 assistant reads the base's; EAGLE3, the block drafts and MTP own one.
    assert {name for name in DRAFT_METHODS if SPEC_SUPPORT[name].draft_kv is DraftKV.OWN} == \
        {"eagle3", "dflash", "dspark", "jetspec", "mtp"}
    assert SPEC_SUPPORT["gemma4_mtp"].draft_kv is DraftKV.BASE
    # The one-token future dependency: EAGLE3 and MTP replay the final matched page, the others do not.
    assert {name for name, row in SPEC_SUPPORT.items() if row.replays_final_page} == {"eagle3", "mtp"}
    # Media requests with a draft model run cold; reuse needs a batch of one (and endpoint capture) for MTP only.
    assert all(SPEC_SUPPORT[name].media_cold for name in DRAFT_METHODS)
    assert {name for name, row in SPEC_SUPPORT.items() if row.reuse_batch_of_one or row.endpoint_capture} == {"mtp"}
    assert (SPEC_NONE, *DRAFT_METHODS) == SPEC_DECODE_TYPES


def test_base_kinds_are_the_runtime_deployments() -> None:
    assert {base.value for base in Base} == {deployment.value for deployment in Deployment}
    assert base_kind(recurrent=True, hybrid=False) is Base.RECURRENT
    assert base_kind(recurrent=False, hybrid=True) is Base.HYBRID
    assert base_kind(recurrent=False, hybrid=False) is Base.ATTENTION


def test_spec_decode_help_comes_from_the_rows() -> None:
    help_text = engine_options()["spec_decode"][1].help
    assert help_text == spec_decode_help()
    for name in SPEC_METHODS:
        if name != SPEC_OFF:
            assert f"'{name}'" in help_text, name


@pytest.mark.parametrize(("changes", "field", "words"), [
    ({"spec_decode": "ngram", "spec_draft_top_k": 2}, "spec_draft_top_k", "tree drafting"),
    ({"spec_decode": "eagle3", "dflash_block_size": 4}, "dflash_block_size", "dflash or dspark"),
    ({"spec_decode": "dflash", "dspark_scheduler": "sps"}, "dspark_scheduler", "needs --specDecode dspark"),
    ({"spec_decode": "ngram"}, "spec_decode", "pure recurrent"),
])
def test_option_checks_name_the_field(changes: dict, field: str, words: str) -> None:
    base = Base.RECURRENT if field == "spec_decode" else Base.ATTENTION
    with pytest.raises(InvalidConfig) as info:
        check_spec_options(replace(EngineConfig(), **changes), base)
    assert info.value.field == field and words in info.value.message


def test_option_checks_pass_what_the_table_allows() -> None:
    assert check_spec_options(EngineConfig(), Base.RECURRENT).name == SPEC_OFF
    assert check_spec_options(replace(EngineConfig(), spec_decode="ngram"), Base.HYBRID).name == "ngram"
    tree = replace(EngineConfig(), spec_decode="eagle3", spec_draft_top_k=4)
    assert check_spec_options(tree, Base.ATTENTION).support.tree


def test_draft_states_live_and_die_with_their_request() -> None:
    states: DraftStates[int] = DraftStates()
    states.begin("a")
    states.set("a", 7)
    states.set("b", 8)
    assert states.get("a") == 7 and len(states) == 2
    states.begin("a")  # a new generation of "a" (re-admission) starts from nothing
    assert states.get("a") is None
    states.end("b")
    assert states.get("b") is None and len(states) == 0


def test_proposers_keep_their_state_per_request_and_the_lifecycle_drops_it() -> None:
    """Every proposer that drafts from a model keeps its state in DraftStates (Sequence has no draft_state) and is
    a DraftLifecycle, so the engine core begins (admission, preemption), rolls back and ends it."""
    from types import SimpleNamespace

    from kvforge.runtime.sequence import Sequence
    from kvforge.runtime.spec.block_draft import BlockDraftProposer
    from kvforge.runtime.spec.eagle3 import Eagle3Proposer
    from kvforge.runtime.spec.gemma4_mtp import Gemma4MtpProposer
    from kvforge.runtime.spec.proposer import DraftLifecycle, KeepsDraftStates

    assert "draft_state" not in Sequence.__dataclass_fields__
    for proposer in (Eagle3Proposer, BlockDraftProposer, Gemma4MtpProposer):
        assert issubclass(proposer, KeepsDraftStates)
    keeper = KeepsDraftStates()
    keeper.states = DraftStates()
    assert isinstance(keeper, DraftLifecycle)
    seq = SimpleNamespace(request_id="a")
    for drop in (keeper.begin, keeper.rollback):
        keeper.states.set("a", 1)
        drop(seq)  # type: ignore[arg-type]
        assert keeper.states.get("a") is None
    keeper.states.set("a", 1)
    keeper.end("a")
    assert len(keeper.states) == 0


def test_the_hidden_state_proposer_is_named_for_what_it_drives() -> None:
    # One class drives EAGLE3 drafts and Qwen3.5's MTP layer; its docstring says so.
    assert "MTP" in (HiddenStateProposer.__doc__ or "")


def test_a_method_name_is_spelled_in_few_source_files() -> None:
    names = "|".join(re.escape(name) for name in SPEC_METHODS if name != SPEC_OFF)
    literal = re.compile(rf"[\"']({names})[\"']")
    spelling = sorted(str(path.relative_to(ROOT)) for folder in SOURCE_DIRS
                      for path in (ROOT / folder).rglob("*.py") if literal.search(path.read_text(encoding="utf-8")))
    assert "kvforge/contract/speculation.py" in spelling
    assert len(spelling) <= MAX_FILES_SPELLING_A_METHOD, (
        f"a speculative method's name is spelled as a literal in {spelling}: import it from "
        "kvforge/contract/speculation.py")


def test_rows_name_every_field() -> None:
    """A row passes its booleans by name: positional rows (seven booleans in a row) are refused."""
    from kvforge.contract.speculation import SPEC_SUPPORT, SpecSupport, in_words

    row = SPEC_SUPPORT["eagle3"]
    with pytest.raises(TypeError):
        SpecSupport("x", "X", row.bases, True, row.draft_kv, False, False, False, False, False, False, "", "")  # type: ignore[misc]
    assert in_words(("a",)) == "a" and in_words(("a", "b", "c")) == "a, b or c"

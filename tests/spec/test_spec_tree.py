"""Tree drafting: the tree walk of verification, one masked verify call per step with the accepted path's K/V moved
into place (an oracle tree whose true branch is never the first child), EAGLE3 trees, and the settings' refusals."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from support.engine_driver import make_engine, step_audited
from support.ort_support import cpu_kernel_on
from support.sampling_checks import RUNS, first_two_tokens, second_token_ranking, total_variation

from kvforge.builder.build import build_engine
from kvforge.contract.errors import InvalidConfig
from kvforge.runtime.execution.tree_attention import tree_depths
from kvforge.runtime.sampling.rejection import accept_tokens, accept_tree
from kvforge.runtime.sampling.sampler import Sampler
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.spec.proposer import DraftTree
from kvforge.runtime.types import SamplingParams

# Speculative engines get tree inputs only on the kvforge CPU kernel (the fallback lowering has no masked attention).
needs_tree_attention = pytest.mark.skipif(not cpu_kernel_on(), reason="tree attention needs the kvforge CPU kernel, "
                                          "which does not build here or is switched off (KVFORGE_CPU_KERNEL=off)")
PROMPTS = ["abc abc abc abc abc abc abc", "the cat sat on the mat, the cat sat on the", "x" * 30, "0123456789" * 3]


def greedy(engine, length: int = 20) -> SamplingParams:
    eos = engine.engine_dir.model.eos_token_ids[0]
    return SamplingParams(temperature=0.0, num_logprobs=1, max_generate_length=length, logit_bias={eos: -100.0})


def run_all(engine, prompts: list[str], length: int = 20) -> dict[int, tuple[list[int], list[int], list[float]]]:
    ids = [engine.add_request(EngineRequest(engine.tokenizer.encode(text), greedy(engine, length)))
           for text in prompts]
    finished = step_audited(engine)
    return {i: (finished[rid].token_ids, [s[0].token_id for s in finished[rid].logprobs],
                [s[0].logprob for s in finished[rid].logprobs]) for i, rid in enumerate(ids)}


def test_the_tree_walk_follows_the_bases_choice_through_any_child() -> None:
    vocab = 8
    logits = np.zeros((7, vocab), dtype=np.float32)
    # drafts: 0:[5] 1:[3] (children of the pending token), 2:[6] under 0, 3:[4] under 1, 4:[7] under 3, 5:[1] under 1
    drafts, parents = [5, 3, 6, 4, 7, 1], [-1, -1, 0, 1, 3, 1]
    for row, best in ((0, 3), (2, 4), (4, 2)):  # after the pending token: 3; after draft 1: 4; after draft 3: 2
        logits[row, best] = 5.0
    results, path = accept_tree(Sampler(SamplingParams(temperature=0.0)), logits, drafts, parents)
    assert [r.token_id for r in results] == [3, 4, 2] and path == [1, 3]  # 2 is the base's own (no child has it)
    assert tree_depths(parents).tolist() == [1, 1, 2, 2, 3, 2]
    # A chain walks as accept_tokens does at greedy.
    chain = np.zeros((4, vocab), dtype=np.float32)
    chain[0, 2], chain[1, 5], chain[2, 1], chain[3, 7] = 1, 1, 1, 1
    tree_results, chain_path = accept_tree(Sampler(SamplingParams(temperature=0.0)), chain, [2, 5, 6], [-1, 0, 1])
    linear = accept_tokens(Sampler(SamplingParams(temperature=0.0)), chain, [2, 5, 6])
    assert [r.token_id for r in tree_results] == [r.token_id for r in linear] == [2, 5, 1] and chain_path == [0, 1]
    with pytest.raises(ValueError, match="does not come before"):
        accept_tree(Sampler(SamplingParams(temperature=0.0)), logits, drafts, [-1, 2, 0, 1, 3, 1])


class OracleTree:
    """Knows each prompt's plain continuation and proposes a tree holding it three deep, always behind a decoy
    sibling that comes first (so the accepted drafts were written one or more positions past where they belong)."""

    owns_kv = False

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.continuations = continuations
        self.vocab = vocab

    def observe(self, rows, output, sampled) -> None:
        pass

    def propose_batch(self, seqs, limits):
        proposals = []
        for seq, limit in zip(seqs, limits, strict=True):
            true = self.continuations[tuple(seq.prompt_ids)][len(seq.output_ids):len(seq.output_ids) + 3]
            tokens, parents, parent = [], [], -1
            for token in true:
                tokens += [(token + 1) % self.vocab, token]  # the decoy first, then the truth, same parent
                parents += [parent, parent]
                tokens.append((token + 2) % self.vocab)  # and a decoy child under the decoy
                parents.append(len(tokens) - 3)
                parent = len(tokens) - 2
            proposals.append(DraftTree(tokens[:limit], parents[:limit]))
        return proposals


@needs_tree_attention
@pytest.mark.parametrize("reuse", [False, True])
def test_an_oracle_tree_is_verified_in_one_call_and_changes_no_token(tiny_eagle3_engine_dir: Path,
                                                                     reuse: bool) -> None:
    plain_engine = make_engine(tiny_eagle3_engine_dir)
    plain = run_all(plain_engine, PROMPTS)
    continuations = {tuple(plain_engine.tokenizer.encode(text)): plain[i][0] for i, text in enumerate(PROMPTS)}
    # 8 pages of 16 tokens: the four requests preempt each other.
    engine = make_engine(tiny_eagle3_engine_dir, reuse=reuse, spec_decode="ngram", num_pages=8)
    engine.core.proposer = OracleTree(continuations, engine.engine_dir.model.vocab_size)
    for _ in range(2):  # the second round is warm when reuse is on
        tree = run_all(engine, PROMPTS)
        for i in plain:
            assert tree[i][:2] == plain[i][:2]
            np.testing.assert_allclose(tree[i][2], plain[i][2], atol=1e-3)  # the masked call's logits are a chain's
    spec = engine.profile()["spec_decode_generation"]
    assert spec["acceptance_length"] > 3.0, spec  # three drafts and the bonus token most steps
    assert engine.scheduler.stats.preemptions > 0


class SiblingTree:
    """Two candidates for the next token, the base's two likeliest, as siblings: rejection over several one-hot
    candidates is exercised at every step."""

    owns_kv = False

    def __init__(self, first: int, second: int) -> None:
        self.tokens = [first, second]

    def observe(self, rows, output, sampled) -> None:
        pass

    def propose_batch(self, seqs, limits):
        return [DraftTree(self.tokens[:limit], [-1, -1][:limit]) for limit in limits]


@needs_tree_attention
def test_at_temperature_one_a_tree_keeps_the_base_distribution(tiny_eagle3_engine_dir: Path) -> None:
    """As test_spec_eagle3's chain test: 600 seeded requests, the first two sampled tokens (top-3: 9 outcomes), the
    second verified against two sibling candidates; the joint histogram must match plain sampling's within a total
    variation of 0.14 (over four standard deviations of two independent 600-draw histograms)."""
    plain = first_two_tokens(make_engine(tiny_eagle3_engine_dir), 4)  # 4: room for both siblings at the second
    likeliest = second_token_ranking(plain)
    engine = make_engine(tiny_eagle3_engine_dir, spec_decode="ngram")
    engine.core.proposer = SiblingTree(likeliest[0], likeliest[1])
    spec = first_two_tokens(engine, 4)
    profile = engine.profile()["spec_decode_generation"]
    assert profile["total_draft_tokens"] >= 2 * RUNS and 0 < profile["total_accepted_tokens"] < 2 * RUNS
    distance = total_variation(plain, spec)
    assert distance < 0.14, (distance, plain, spec)


@needs_tree_attention
@pytest.mark.parametrize(("top_k", "verify"), [(2, 0), (3, 5)])
def test_eagle3_trees_change_no_token(tiny_eagle3_engine_dir: Path, top_k: int, verify: int) -> None:
    plain = run_all(make_engine(tiny_eagle3_engine_dir), PROMPTS)
    engine = make_engine(tiny_eagle3_engine_dir, reuse=True, spec_decode="eagle3", spec_draft_step=3,
                         spec_draft_top_k=top_k, spec_verify_size=verify, num_pages=8)
    for _ in range(2):
        tree = run_all(engine, PROMPTS)
        assert {i: t[:2] for i, t in tree.items()} == {i: p[:2] for i, p in plain.items()}
    spec = engine.profile()["spec_decode_generation"]
    nodes = verify - 1 if verify else top_k * 3
    # Every verify row holds the tree's best nodes: at most the budget, and more than a chain of 3.
    assert 3 * spec["total_iterations"] < spec["total_draft_tokens"] <= nodes * spec["total_iterations"]


@needs_tree_attention
def test_tree_settings_are_checked_at_initialisation(tiny_eagle3_engine_dir: Path, tmp_path: Path) -> None:
    cases = [
        ({"spec_decode": "ngram", "spec_draft_top_k": 2}, "spec_draft_top_k", "needs --specDecode eagle3"),
        ({"spec_decode": "eagle3", "spec_draft_top_k": 17}, "spec_draft_top_k", r"\[1, 16\]"),
        ({"spec_decode": "eagle3", "spec_verify_size": 8}, "spec_verify_size", "tree drafting only"),
        ({"spec_decode": "eagle3", "spec_draft_top_k": 4, "spec_verify_size": 100}, "spec_verify_size",
         "maxVerifyTreeSize 60"),
        ({"spec_decode": "eagle3", "spec_draft_top_k": 16, "spec_draft_step": 6}, "spec_draft_top_k",
         "maxDraftTreeSize 60"),
    ]
    for settings, field, needle in cases:
        with pytest.raises(InvalidConfig, match=needle) as error:
            make_engine(tiny_eagle3_engine_dir, **settings)
        assert error.value.field == field


@needs_tree_attention
def test_trees_need_engines_built_with_tree_attention(tiny_eagle3_engine_dir: Path, tmp_path: Path) -> None:
    from conftest import TINY_BUILD

    base_onnx = tiny_eagle3_engine_dir.parent / "base_onnx"
    build_engine(base_onnx, tmp_path / "engine", replace(TINY_BUILD, spec_base=True, cpu_attention="onnx"))
    draft = str(tiny_eagle3_engine_dir / "draft")
    make_engine(tmp_path / "engine", spec_decode="eagle3", spec_draft_engine_dir=draft)  # chains run on it
    with pytest.raises(InvalidConfig, match="base engine with tree attention") as error:
        make_engine(tmp_path / "engine", spec_decode="eagle3", spec_draft_engine_dir=draft, spec_draft_top_k=2)
    assert error.value.field == "spec_draft_top_k"

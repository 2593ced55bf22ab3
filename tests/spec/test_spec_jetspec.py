"""JetSpec drafts (DFlash's format, causal inside the block): the exporter reads them from their public config, the
draft graph under the causal block mask agrees with the checkpoint's forward pass rebuilt here, `--specDecode jetspec`
is lossless (reuse, preemption, abort) without replay, as a chain and as a tree of per-depth top-k, and the support
table's refusals hold."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.engine_driver import make_engine, step_audited
from support.spec_checks import assert_lossless_with_abort, recording, run_all, sampling, with_oracle

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.engine_dir import BASE_HIDDEN_INPUT, CONTEXT_TOKEN_MASK_INPUT, load_engine_dir
from kvforge.contract.errors import InvalidConfig, KvforgeError
from kvforge.contract.files import read_json, write_json
from kvforge.contract.speculation import SPEC_SUPPORT, Base, DraftKV, support_table_markdown
from kvforge.plugins.reference import apply_rope, rope_table, round_to_storage
from kvforge.runtime.execution.backend import StepInputs
from kvforge.runtime.execution.load import load_backend
from kvforge.runtime.execution.tree_attention import causal_masks, start_positions
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.spec.block_draft import jetspec_tree
from kvforge.runtime.spec.methods import spec_method
from kvforge.runtime.spec.proposer import DraftTree
from kvforge.tools.export.drafts.block_draft import (
    block_draft_kind,
    export_block_draft,
    load_weights,
    write_random_block_draft,
)
from kvforge.tools.export.drafts.common import base_head

PROMPTS = ["abc abc abc abc abc abc abc", "the cat sat on the mat, the cat sat on the", "x" * 30, "0123456789" * 3]
DOCUMENT = "a shared document: three full pages of sixteen bytes."  # 53 tokens (byte-level tokenizer)
BUILD = BuildOptions(max_input_len=64, max_kv_cache_capacity=256, max_batch_size=4, tokens_per_page=16,
                     spec_draft=True, cpu_attention="kernel")


@pytest.fixture(scope="module")
def jetspec(tiny_block_draft_engines: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The block-draft fixture's base with a random JetSpec draft (block 6): 'engine', 'hf', 'base', 'base_onnx'."""
    root = tmp_path_factory.mktemp("jetspec")
    base_onnx = tiny_block_draft_engines["base_onnx"]
    write_random_block_draft(base_onnx, root / "hf", kind="jetspec", seed=7, block_size=6)
    export_block_draft(root / "hf", base_onnx, root / "onnx")
    build_engine(root / "onnx", root / "engine", BUILD)
    return {"engine": root / "engine", "hf": root / "hf", "base": tiny_block_draft_engines["base"],
            "base_onnx": base_onnx}


def engine_for(paths: dict[str, Path], **config):
    return make_engine(paths["base"], spec_decode="jetspec", spec_draft_engine_dir=str(paths["engine"]), **config)


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * w).astype(np.float32)


def jetspec_forward(config, w: dict[str, np.ndarray], head: np.ndarray, taps: np.ndarray, block: np.ndarray,
                    causal: bool = True) -> np.ndarray:
    """The public draft's forward (hao-ai-lab/JetSpec's draft head), rebuilt from its pieces: ctx =
    hidden_norm(fc(taps)); per Qwen3 layer, queries from the block's input_layernorm, keys/values from ctx ++ the
    block (k_norm, RoPE at absolute positions, GQA); block row i sees every ctx row and block rows j <= i (all of the
    block when not `causal`, DFlash's view); SwiGLU MLP; the base's head over norm(h). Logits of every block row."""
    n, b, d = len(taps), len(block), config.head_dim
    hq, hkv, eps = config.num_attention_heads, config.num_key_value_heads, config.rms_norm_eps
    ctx = rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    table = rope_table(n + b, d, config.rope_theta)
    visible = np.ones((b, n + b), dtype=bool)
    if causal:
        visible[:, n:] = np.tril(np.ones((b, b), dtype=bool))
    h = block.astype(np.float32)
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"], eps)
        kv_in = np.concatenate([ctx, x])
        q = rms((x @ w[p + "self_attn.q_proj.weight"].T).reshape(b, hq, d), w[p + "self_attn.q_norm.weight"], eps)
        k = rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).reshape(n + b, hkv, d), w[p + "self_attn.k_norm.weight"],
                eps)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).reshape(n + b, hkv, d)
        q = apply_rope(q, table, np.arange(n, n + b))
        k = round_to_storage(apply_rope(k, table, np.arange(n + b)), config.kv_cache_dtype)
        v = round_to_storage(v, config.kv_cache_dtype)
        k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(d)
        scores = np.where(visible[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v.astype(np.float64)).reshape(b, hq * d).astype(np.float32)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T
        m = rms(h, w[p + "post_attention_layernorm.weight"], eps)
        gate = m @ w[p + "mlp.gate_proj.weight"].T
        h = h + ((gate / (1 + np.exp(-gate))) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return rms(h, w["norm.weight"], eps) @ head.T


def test_the_draft_graph_under_the_causal_mask_is_the_public_forward_pass(jetspec: dict[str, Path]) -> None:
    """A context call (the taps of 21 positions, crossing a page), then a block call with the causal mask the
    proposer passes: the block's logits are the rebuilt forward's, not DFlash's full-block view, and a block row
    does not depend on the rows after it."""
    draft = load_engine_dir(jetspec["engine"])
    model = draft.model
    assert model.spec_decode_type == "jetspec" and model.dflash_block_size == 6
    weights, _ = load_weights(jetspec["hf"], model)
    base = load_engine_dir(jetspec["base"]).model
    head = base_head(jetspec["base_onnx"], base)
    rng = np.random.default_rng(1)
    n, b, H, W = 21, 6, model.hidden_size, model.base_model_hidden_size
    taps = rng.standard_normal((n, W)).astype(np.float32)
    block = rng.standard_normal((b, H)).astype(np.float32)
    backend = load_backend(draft, 2)

    def call(start: int, embeds: np.ndarray, feats: np.ndarray, context: int) -> np.ndarray:
        m = len(embeds)
        ctx = np.zeros((1, m, 1), np.float32)
        ctx[0, :context] = 1.0
        outputs = np.array([m - 1]) if context else np.arange(m)
        return backend.forward(StepInputs(embeds[None], np.array([m], np.int32), np.array([start], np.int32),
                                          [[0, 1]], logits_indices=outputs,
                                          extra_inputs={BASE_HIDDEN_INPUT: feats[None], CONTEXT_TOKEN_MASK_INPUT: ctx},
                                          position_ids=start_positions(np.array([start]), m),
                                          attention_mask=causal_masks(1, m))).logits

    def block_logits(embeds: np.ndarray) -> np.ndarray:
        call(0, np.zeros((n, H), np.float32), taps, n)
        return call(n, embeds, np.zeros((b, W), np.float32), 0)

    logits = block_logits(block)
    expected = jetspec_forward(model, weights, head, taps, block)
    np.testing.assert_allclose(logits, expected, rtol=2e-3, atol=2e-3)
    full = jetspec_forward(model, weights, head, taps, block, causal=False)
    assert not np.allclose(full[0], expected[0], atol=1e-2)  # the masks differ where it matters
    changed = block.copy()
    changed[-1] += 1.0
    again = block_logits(changed)
    np.testing.assert_allclose(again[:-1], logits[:-1], rtol=1e-4, atol=1e-4)  # earlier rows never see the last
    assert not np.allclose(again[-1], logits[-1])


def test_the_exporter_reads_jetspec_from_its_config(jetspec: dict[str, Path], tmp_path: Path) -> None:
    """`dflash_config.causal_head` (the public checkpoints), `causal` (vLLM's spelling) or a top-level
    `jetspec_config` (Edge-LLM's) make a DFlashDraftModel a JetSpec draft; every value comes from the file."""
    hf = read_json(jetspec["hf"] / "config.json", "x")
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["dflash_config"]["causal_head"] is True
    assert block_draft_kind(jetspec["hf"]) == "jetspec"
    plain = {**hf, "dflash_config": {k: v for k, v in hf["dflash_config"].items() if k != "causal_head"}}
    variants = {
        "dflash": plain,
        "jetspec": {**plain, "dflash_config": {**plain["dflash_config"], "causal": True}},
    }
    # Edge-LLM's runtime config: its own section, whose values win over dflash_config's.
    edge = {**plain, "block_size": 16, "jetspec_config": {"target_layer_ids": [0, 1], "block_size": 4,
                                                          "mask_token_id": 3, "causal_head": True}}
    for expected, config in [*variants.items(), ("jetspec", edge)]:
        out = tmp_path / f"{expected}_{len(config)}"
        out.mkdir()
        (out / "model.safetensors").symlink_to(jetspec["hf"] / "model.safetensors")
        write_json(out / "config.json", config)
        assert block_draft_kind(out) == expected
        written = export_block_draft(out, jetspec["base_onnx"], tmp_path / f"onnx_{out.name}")
        assert written.spec_decode_type == expected
    assert (written.dflash_block_size, written.mask_token_id, written.eagle_hidden_state_layers) == (4, 3, [0, 1])


@pytest.mark.parametrize(("change", "needle"), [
    ({"hidden_size": 48}, "hidden_size 48 is not the base's"),
    ({"vocab_size": 7}, "vocab_size 7 is not the base's"),
    ({"dflash_config": {"causal_head": True, "mask_token_id": 1, "target_layer_ids": [0, 9]}}, "target_layer_ids"),
    ({"dflash_config": {"causal_head": True, "mask_token_id": 1, "target_layer_ids": [0, 1],
                        "target_hidden_size": 48}}, "target_hidden_size 48"),
    ({"jetspec_config": {"causal_head": False}}, "jetspec_config.causal_head is false"),
    ({"architectures": ["DSparkDraftModel"]}, "DSparkDraftModel sets causal_head"),
])
def test_a_config_contradicting_its_base_is_refused_in_one_line(jetspec: dict[str, Path], tmp_path: Path,
                                                                change: dict, needle: str) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors").symlink_to(jetspec["hf"] / "model.safetensors")
    write_json(out / "config.json", {**read_json(jetspec["hf"] / "config.json", "x"), **change})
    with pytest.raises(KvforgeError, match=needle) as error:
        export_block_draft(out, jetspec["base_onnx"], tmp_path / "onnx")
    assert error.value.field == "--draftDir" and "\n" not in error.value.message


@pytest.mark.parametrize("reuse", [False, True])
def test_jetspec_changes_no_token_with_plain_rows_and_under_preemption(jetspec: dict[str, Path], reuse: bool) -> None:
    plain = run_all(make_engine(jetspec["base"]), PROMPTS)
    engine = engine_for(jetspec, reuse=reuse, num_pages=6)  # four growing requests on 6 pages preempt each other
    assert run_all(engine, PROMPTS, opt_out=frozenset({1})) == plain
    assert run_all(engine, PROMPTS) == plain  # warm when reuse is on
    profile = engine.profile()
    assert profile["spec_decode_generation"]["total_draft_tokens"] > 0
    assert engine.scheduler.stats.preemptions > 0
    if reuse:
        assert profile["context_cache"]["speculative"]["pair_publications"] > 0
        assert profile["context_cache"]["speculative"]["full_page_replays"] == 0


def test_accepted_chains_are_lossless_and_keep_the_draft_coherent(jetspec: dict[str, Path]) -> None:
    """An oracle proposer (the plain answers) forces long accepts through the same verify and commit."""
    plain = run_all(make_engine(jetspec["base"]), PROMPTS, length=24)
    engine = engine_for(jetspec, reuse=True, num_pages=8)
    with_oracle(engine, PROMPTS, plain)
    assert run_all(engine, PROMPTS, length=24) == plain
    spec = engine.profile()["spec_decode_generation"]
    assert spec["total_accepted_tokens"] > 0 and spec["acceptance_length"] > 1.5


def test_a_hit_reuses_every_matched_page_without_replay_and_drafts_as_a_cold_run(jetspec: dict[str, Path]) -> None:
    question = DOCUMENT + " why?"
    cold_engine = engine_for(jetspec)
    cold_drafts = recording(cold_engine)
    cold_engine.add_request(EngineRequest(cold_engine.tokenizer.encode(question), sampling(cold_engine)), "q")
    cold = step_audited(cold_engine)["q"]
    engine = engine_for(jetspec, reuse=True)
    drafts = recording(engine)
    engine.add_request(EngineRequest(engine.tokenizer.encode(DOCUMENT + " how?"), sampling(engine)), "first")
    step_audited(engine)
    engine.add_request(EngineRequest(engine.tokenizer.encode(question), sampling(engine)), "q")
    warm = step_audited(engine)["q"]
    assert warm.token_ids == cold.token_ids
    assert drafts.proposals["q"] == cold_drafts.proposals["q"]  # the restored draft pages are the cold run's K/V
    # The chain proposes up to block - 1 = 5 guesses, each the depth's argmax.
    assert max(len(p) for p in cold_drafts.proposals["q"]) == 5
    cache = engine.profile()["context_cache"]
    assert cache["speculative"]["full_page_replays"] == 0
    assert cache["reused_tokens"] == 3 * engine.cache.tokens_per_page


@pytest.mark.parametrize(("config", "field", "needle"), [
    ({"spec_draft_top_k": 2, "spec_verify_size": 65}, "spec_verify_size", "in \\[2, "),
    ({"dspark_scheduler": "sps"}, "dspark_scheduler", "--specDecode dspark"),
    ({"dflash_block_size": 9}, "dflash_block_size", r"\[2, 6\]"),
])
def test_flags_that_do_not_apply_are_refused_naming_the_field(jetspec: dict[str, Path], config: dict, field: str,
                                                              needle: str) -> None:
    with pytest.raises(InvalidConfig, match=needle) as error:
        engine_for(jetspec, **config)
    assert error.value.field == field


def test_the_tree_grows_best_first_over_each_depths_top_k() -> None:
    """Depth 1 favours token 1 (p 0.6) over 2 (0.3); depth 2 favours 3 (0.9). Best-first with k = 2 and 4 nodes:
    the root gets 1 and 2; then 1 (log 0.6) gets 3 and the runner-up; the budget stops before 2's children."""
    probs = np.full((3, 6), 0.01)
    probs[0, [1, 2]] = [0.6, 0.3]
    probs[1, [3, 4]] = [0.9, 0.05]
    probs[2, 5] = 0.9
    logits = np.log(probs / probs.sum(-1, keepdims=True))
    tree = jetspec_tree(logits, 2, 4)
    assert (tree.token_ids, tree.parents) == ([1, 2, 3, 4], [-1, -1, 0, 0])
    # One more node: the best open node is 3 (0.6 * 0.9 = 0.54 > 0.3), whose depth-3 top candidate is 5.
    assert jetspec_tree(logits, 2, 5) == DraftTree([1, 2, 3, 4, 5], [-1, -1, 0, 0, 2])
    # Top-1 is the argmax chain; the depth bounds the tree whatever the budget.
    assert jetspec_tree(logits, 1, 10) == DraftTree([1, 3, 5], [-1, 0, 1])
    big = jetspec_tree(logits, 6, 1000)
    assert len(big.token_ids) == 6 + 36 + 216 and all(p < i for i, p in enumerate(big.parents))


@pytest.mark.parametrize("reuse", [False, True])
def test_jetspec_trees_change_no_token_under_preemption(jetspec: dict[str, Path], reuse: bool) -> None:
    """Trees of each depth's top 3 (at most 12 drafts) verified in one base call, with plain rows and preemption."""
    plain = run_all(make_engine(jetspec["base"]), PROMPTS)
    engine = engine_for(jetspec, reuse=reuse, num_pages=6, spec_draft_top_k=3, spec_verify_size=13)
    drafts = recording(engine)
    assert run_all(engine, PROMPTS, opt_out=frozenset({1})) == plain
    assert run_all(engine, PROMPTS) == plain
    trees = [p for ps in drafts.proposals.values() for p in ps if isinstance(p, DraftTree)]
    assert trees and max(len(t.token_ids) for t in trees) == 12
    assert any(t.parents.count(-1) == 3 for t in trees)  # the root's three candidates
    profile = engine.profile()
    assert profile["spec_decode_generation"]["total_draft_tokens"] > 0
    assert engine.scheduler.stats.preemptions > 0
    if reuse:
        assert profile["context_cache"]["speculative"]["full_page_replays"] == 0


def test_a_sampled_tree_commits_the_base_samples_of_a_plain_run(jetspec: dict[str, Path]) -> None:
    """At temperature 1 the walk draws the base's token at the root and at each accepted node, one draw from the
    request's seeded stream per committed token, as plain decoding does: the same seed gives the same text."""
    from kvforge.runtime.types import SamplingParams

    def run(engine) -> list[list[int]]:
        eos = engine.engine_dir.model.eos_token_ids[0]
        ids = [engine.add_request(EngineRequest(engine.tokenizer.encode(text), SamplingParams(
            temperature=1.0, seed=11 + i, max_generate_length=16, logit_bias={eos: -100.0})))
            for i, text in enumerate(PROMPTS)]
        finished = step_audited(engine)
        return [finished[rid].token_ids for rid in ids]

    engine = engine_for(jetspec, spec_draft_top_k=4, spec_verify_size=16)
    assert run(engine) == run(make_engine(jetspec["base"]))
    spec = engine.profile()["spec_decode_generation"]
    assert spec["total_accepted_tokens"] > 0  # some draws landed on a drafted child: the walk went down the tree


def test_the_support_row_and_its_base_and_draft_refusals(jetspec: dict[str, Path]) -> None:
    row = SPEC_SUPPORT["jetspec"]
    assert (row.bases, row.draft_kv, row.replays_final_page, row.block) == ((Base.ATTENTION,), DraftKV.OWN, False,
                                                                            True)
    assert "| `jetspec` | attention-only |" in support_table_markdown()
    # The tree is JetSpec's among the block drafts: DFlash and DSpark still refuse a top-k.
    with pytest.raises(InvalidConfig, match="needs --specDecode eagle3 or jetspec") as error:
        make_engine(jetspec["base"], spec_decode="dflash", spec_draft_top_k=2)
    assert error.value.field == "spec_draft_top_k"
    options = SimpleNamespace(spec_draft_engine_dir=None)
    with pytest.raises(InvalidConfig, match="JetSpec is not supported on a hybrid engine") as error:
        spec_method("jetspec").resolve_draft(options, None, Base.HYBRID)  # type: ignore[arg-type]
    assert error.value.field == "spec_decode"
    # A JetSpec draft is not a DFlash draft: the kinds never mix (the mask differs).
    with pytest.raises(InvalidConfig, match="holds a jetspec draft: use --specDecode jetspec"):
        make_engine(jetspec["base"], spec_decode="dflash", spec_draft_engine_dir=str(jetspec["engine"]))


def test_random_block_draft_writes_the_jetspec_format_from_the_cli(jetspec: dict[str, Path], tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvforge.tools.export.cli import app

    result = CliRunner().invoke(app, ["random-block-draft", "--kind", "jetspec", "--baseOnnxDir",
                                      str(jetspec["base_onnx"]), "--outputDir", str(tmp_path / "hf"), "--blockSize",
                                      "4"])
    assert result.exit_code == 0, result.output
    config = read_json(tmp_path / "hf" / "config.json", "x")
    assert config["dflash_config"]["causal_head"] is True and config["block_size"] == 4
    bad = CliRunner().invoke(app, ["random-block-draft", "--kind", "jet", "--baseOnnxDir", str(jetspec["base_onnx"]),
                                   "--outputDir", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "jetspec" in bad.output


_word = st.sampled_from(["ab", "cab ", "the ", "x", "01", " "])


@given(prompts=st.lists(st.lists(_word, min_size=1, max_size=8).map("".join), min_size=1, max_size=4),
       reuse=st.booleans(), pages=st.sampled_from([6, 8, 64]), opt_out=st.sets(st.integers(0, 3)),
       abort_at=st.integers(0, 12), length=st.integers(2, 24), block=st.sampled_from([0, 2, 4]),
       top_k=st.sampled_from([1, 2, 4]))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_property_jetspec_is_lossless_under_preemption_and_abort(
        jetspec: dict[str, Path], prompts: list[str], reuse: bool, pages: int, opt_out: set[int], abort_at: int,
        length: int, block: int, top_k: int) -> None:
    engine = engine_for(jetspec, reuse=reuse, num_pages=pages, dflash_block_size=block, spec_draft_top_k=top_k)
    assert_lossless_with_abort(engine, make_engine(jetspec["base"]), prompts, length, opt_out, abort_at)


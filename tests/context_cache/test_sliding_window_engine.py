"""The sliding-window page group end to end on tiny-gemma3 (5 sliding layers, window 32, 1 global layer): llm_build
sizes the group for the window and records each layer type's pool bytes, and the engine's greedy tokens equal the
all-full-pool engine's on every attention path (a second table bound to the sliding layers)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from support.engine_driver import make_engine

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.errors import InvalidConfig
from kvforge.contract.profile_schema import SLIDING_WINDOW_PAGES
from kvforge.runtime.context_cache.types.sliding_window import NO_PAGE, window_table
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import SamplingParams
from kvforge.server.metrics import ServerMetrics
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

pytestmark = pytest.mark.in_process  # run_cli in this process: the process is not the point here

BUILD = BuildOptions(max_input_len=256, max_kv_cache_capacity=512, max_batch_size=2, tokens_per_page=16)


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_gemma3") / "onnx"
    write_onnx_dir(synthetic_model("tiny-gemma3", kv_cache_dtype="fp32"), folder)
    return folder


@pytest.fixture(scope="module", params=["kernel", "onnx"])
def engines(request: pytest.FixtureRequest, onnx_dir: Path) -> tuple[Path, Path]:
    """(all-full-pool engine, sliding-window group engine) on one attention path."""
    if request.param == "kernel":
        request.getfixturevalue("library")  # skips where the kernel cannot be built
    root = onnx_dir.parent / f"engines-{request.param}"
    full, windowed = root / "full", root / "window"
    options = BuildOptions(**{**{f: getattr(BUILD, f) for f in BUILD.__dataclass_fields__},
                              "cpu_attention": request.param})
    build_engine(onnx_dir, full, options)
    build_engine(onnx_dir, windowed, BuildOptions(**{**{f: getattr(options, f) for f in options.__dataclass_fields__},
                                                     "sliding_window_pool": True}))
    return full, windowed


def builder_config(engine: Path) -> dict:
    return json.loads((engine / "config.json").read_text())["builder_config"]


def test_config_records_each_layer_types_pool_bytes_at_most_0_4x(engines: tuple[Path, Path]) -> None:
    full, windowed = (builder_config(e) for e in engines)
    assert full["window_pool_pages"] == 0 and full["kv_pool_bytes_sliding"] == 0
    all_global = full["kv_pool_bytes_global"]
    assert windowed["window_pool_pages"] == 2 * (-(-(32 - 1 + 32) // 16) + 1)  # 2 rows: window + a 32-token call
    total = windowed["kv_pool_bytes_global"] + windowed["kv_pool_bytes_sliding"]
    assert windowed["kv_pool_bytes_global"] == all_global // 6  # the one global layer keeps its full pool
    assert total <= 0.4 * all_global


def generate(engine_dir: Path, prompts: list[list[int]], count: int,
             reuse: bool = False) -> tuple[list[list[int]], int, int]:
    """Greedy answers of `prompts` run together (chunked prefill of 24 tokens), auditing the cache every step;
    also the most sliding-window pages any row held, and the tokens reused in all."""
    engine = make_engine(engine_dir, reuse=reuse, prefill_chunk_size=24)
    window_pages = builder_config(engine_dir)["window_pool_pages"]
    pools = [len(layer) for layer in engine.backend.kv_store.layers]
    assert pools == ([window_pages] * 5 + [512 // 16 * 2] if window_pages else [512 // 16 * 2] * 6)
    greedy = SamplingParams(max_generate_length=count, temperature=0.0,
                            logit_bias={engine.engine_dir.model.eos_token_ids[0]: -100.0})
    for ids in prompts:
        engine.add_request(EngineRequest(ids, greedy))
    answers: dict[int, list[int]] = {}
    most = reused = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                answers[out.request_id] = out.token_ids
                reused += out.cached_tokens
        engine.cache.check_invariants()
        for lease in engine.cache.leases:
            table = window_table(lease) or []
            most = max(most, sum(slot != NO_PAGE for slot in table))
    pool = engine.cache.pools[SLIDING_WINDOW_PAGES]
    kept = {slot for record in engine.cache.records.least_recent_first() for slot in
            (record.parts[SLIDING_WINDOW_PAGES].slots if SLIDING_WINDOW_PAGES in record.parts else ())}
    assert pool.num_free == pool.capacity - len(kept)  # every row gave its window back; records keep theirs
    return [answers[k] for k in sorted(answers)], most, reused


def test_greedy_tokens_equal_the_all_full_pool_engine(engines: tuple[Path, Path]) -> None:
    rng = np.random.default_rng(3)
    vocab = synthetic_model("tiny-gemma3", kv_cache_dtype="fp32").config.vocab_size
    prompts = [[int(t) for t in rng.integers(3, vocab, n)] for n in (150, 70, 9)]
    expected, _, _ = generate(engines[0], prompts, 40)
    answers, most, _ = generate(engines[1], prompts, 40)
    assert answers == expected
    assert 0 < most <= -(-(32 - 1 + 32) // 16) + 1  # never more than one call's window per row


def test_concurrent_requests_sharing_prefixes_answer_as_without_reuse(engines: tuple[Path, Path]) -> None:
    """Requests that extend each other, running at once and one after another (hits on records, waits on
    prefixes in flight, evictions from the window group), answer as the engine without reuse does."""
    rng = np.random.default_rng(11)
    base = [int(t) for t in rng.integers(3, 200, 120)]
    prompts = [base, base + [int(t) for t in rng.integers(3, 200, 20)], [int(t) for t in rng.integers(3, 200, 60)],
               base[:100] + [int(t) for t in rng.integers(3, 200, 9)], base + [7, 8, 9]]
    expected, _, _ = generate(engines[1], prompts, 12)
    answers, _, reused = generate(engines[1], prompts, 12, reuse=True)
    assert answers == expected and reused >= 2 * 112  # two of them hit the first prompt's end (120 -> 112)


def chat(engine_dir: Path, turns: int, reuse: bool) -> tuple[list[list[int]], list[int], str]:
    """A multi-turn chat (each turn's prompt extends the last with its answer and new tokens), one request at a
    time, prefill chunks of 24: each turn's greedy answer and cached tokens."""
    engine = make_engine(engine_dir, reuse=reuse, prefill_chunk_size=24)
    greedy = SamplingParams(max_generate_length=7, temperature=0.0,
                            logit_bias={engine.engine_dir.model.eos_token_ids[0]: -100.0})
    rng, history = np.random.default_rng(5), []
    answers, cached = [], []
    for _ in range(turns):
        ids = history + [int(t) for t in rng.integers(3, 200, 37)]
        engine.add_request(EngineRequest(ids, greedy))
        done = []
        while not done:
            done = [o for o in engine.step() if o.finished]
            engine.cache.check_invariants()
        answers.append(done[0].token_ids)
        cached.append(done[0].cached_tokens)
        history = ids + done[0].token_ids
    stats = replace(engine.stats(), cache=engine.cache_profile() if reuse else {})
    return answers, cached, ServerMetrics(lambda: stats).render().decode()


def test_multi_turn_chat_reuses_and_every_answer_equals_a_cold_run(engines: tuple[Path, Path]) -> None:
    """Reuse on the sliding-window engine: later turns hit the previous turn's pages and window (reused tokens >
    0), and every answer equals the cold (no reuse) run's, and the all-full-pool engine's with reuse."""
    cold, _, _ = chat(engines[1], 4, reuse=False)
    warm, cached, metrics = chat(engines[1], 4, reuse=True)
    full, _, full_metrics = chat(engines[0], 4, reuse=True)
    assert warm == cold == full
    assert cached[0] == 0 and all(n > 0 for n in cached[1:])
    # /metrics shows the group's pages and its hits (one per later turn); an engine without a group shows none.
    assert "kvforge_sliding_window_hits_total 3.0" in metrics and "kvforge_sliding_window_pages_total 10.0" in metrics
    assert "sliding_window" not in full_metrics


def test_what_reads_one_page_table_is_refused_in_one_line(engines: tuple[Path, Path]) -> None:
    with pytest.raises(InvalidConfig) as caught:
        make_engine(engines[1], spec_decode="ngram")
    assert caught.value.field == "spec_decode" and "--slidingWindowPool" in caught.value.message
    with pytest.raises(InvalidConfig) as caught:
        make_engine(engines[1], reuse=True, context_cache_partial_kv_snapshot_pool_bytes=1 << 20)
    assert caught.value.field == "context_cache_partial_kv_snapshot_pool_bytes"
    legacy = EngineRequest([5, 6, 7, 8], SamplingParams(max_generate_length=2))
    legacy.system_prompt_ids, legacy.system_prompt_key = [5, 6], ("system", "")
    with pytest.raises(InvalidConfig) as caught:
        make_engine(engines[1]).add_request(legacy)
    assert caught.value.field == "save_system_prompt_kv_cache"


def test_llm_build_prints_each_group_and_refuses_what_has_none(run_cli, onnx_dir: Path, tiny_onnx_dir: Path,
                                                               tmp_path: Path) -> None:
    built = run_cli(["llm_build", "--onnxDir", onnx_dir, "--engineDir", tmp_path / "engine", "--tokensPerPage", "16",
                     "--maxKVCacheCapacity", "512", "--maxInputLen", "256", "--maxBatchSize", "2",
                     "--cpuAttention", "onnx", "--slidingWindowPool"])
    assert built.returncode == 0, built.stderr
    printed = built.stdout + built.stderr  # the console writes to stderr
    assert "global layers: 64 pages × 1 layers" in printed and "sliding-window layers: 10 pages × 5 layers" in printed
    assert "sliding-window checkpoint: 2 pages × 5 layers = 81,920 bytes per reuse record" in printed
    more = run_cli(["llm_build", "--onnxDir", onnx_dir, "--engineDir", tmp_path / "more", "--tokensPerPage", "16",
                    "--maxKVCacheCapacity", "512", "--maxInputLen", "256", "--maxBatchSize", "2",
                    "--cpuAttention", "onnx", "--slidingWindowPool", "--slidingWindowRecords", "4"])
    assert more.returncode == 0 and builder_config(tmp_path / "more")["window_pool_pages"] == 10 + 4 * 2
    refused = run_cli(["llm_build", "--onnxDir", tiny_onnx_dir, "--engineDir", tmp_path / "llama",
                       "--slidingWindowPool"])
    assert refused.returncode == 2 and refused.stderr.startswith("error: --slidingWindowPool: ")
    assert len(refused.stderr.strip().splitlines()) == 1


def test_the_python_api_serves_it_with_reuse(engines: tuple[Path, Path]) -> None:
    """LLM's default budgets (partial-KV snapshots with reuse) leave out what such an engine refuses."""
    from kvforge.contract.engine_dir import load_engine_dir
    from kvforge.runtime.engine.engine import snapshot_budgets

    assert snapshot_budgets(load_engine_dir(engines[1]), partial_kv=True) == {}
    assert snapshot_budgets(load_engine_dir(engines[0]), partial_kv=True)


def test_answers_with_reuse_equal_transformers(tmp_path: Path) -> None:
    """A random Gemma 3 checkpoint (window 32) built with --slidingWindowPool: two chat turns well past the window,
    the second reusing the first, answer as transformers' Gemma3ForCausalLM does."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kvforge.tools.export.sources.hf import load_hf_dir
    from kvforge.tools.export.sources.synthetic import byte_level_tokenizer

    torch.manual_seed(0)  # every weight comes from the global generator
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=260, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=32,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=1,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.copy_(0.3 * torch.randn_like(param))
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    byte_level_tokenizer().save(str(tmp_path / "hf" / "tokenizer.json"))
    write_onnx_dir(load_hf_dir(tmp_path / "hf", kv_cache_dtype="fp32"), tmp_path / "onnx")
    build_engine(tmp_path / "onnx", tmp_path / "engine", BuildOptions(
        max_input_len=256, max_kv_cache_capacity=512, max_batch_size=2, tokens_per_page=16, cpu_attention="onnx",
        sliding_window_pool=True))
    rng = np.random.default_rng(9)
    first = [int(t) for t in rng.integers(3, 250, 90)]

    def reference(ids: list[int]) -> list[int]:
        return full_forward_greedy(hf, ids, 5, banned=1)

    engine = make_engine(tmp_path / "engine", reuse=True, prefill_chunk_size=24)
    greedy = SamplingParams(max_generate_length=5, temperature=0.0, logit_bias={1: -100.0})
    ids, cached = first, []
    for turn in range(2):
        engine.add_request(EngineRequest(ids, greedy))
        done = []
        while not done:
            done = [o for o in engine.step() if o.finished]
        assert done[0].token_ids == reference(ids), f"turn {turn}"
        cached.append(done[0].cached_tokens)
        ids = ids + done[0].token_ids + [int(t) for t in rng.integers(3, 250, 30)]
    assert cached[0] == 0 and cached[1] > 0


def test_a_window_group_the_graph_or_model_lacks_is_refused(engines: tuple[Path, Path], tiny_engine_dir: Path,
                                                             tmp_path: Path) -> None:
    """config.json's window_pool_pages is checked against the model (sliding layers) and the graph (pool shapes)."""
    import shutil

    from kvforge.contract.engine_dir import load_engine_dir
    from kvforge.contract.manifest import ENGINE_KIND, write_manifest

    def tampered(source: Path, name: str, pages: int) -> Path:
        target = tmp_path / name
        shutil.copytree(source, target)
        config = json.loads((target / "config.json").read_text())
        config["builder_config"]["window_pool_pages"] = pages
        (target / "config.json").write_text(json.dumps(config))
        write_manifest(target, ENGINE_KIND)
        return target

    with pytest.raises(InvalidConfig) as caught:
        load_engine_dir(tampered(tiny_engine_dir, "llama", 8))  # no sliding layers
    assert caught.value.field == "builder_config.window_pool_pages"
    with pytest.raises(Exception, match="rebuild it with llm_build"):
        make_engine(tampered(engines[1], "other", 11))  # the graph's sliding pools hold 10 pages


def test_gemma4_kv_shared_layers_read_the_window_group(tmp_path: Path) -> None:
    """Gemma 4's KV-shared layers (a sliding one reads an earlier sliding layer's pool, through the window table)
    on an engine with a window group: two turns, the second reusing the first, answer as transformers does."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from parity.test_gemma4_parity import SHARED_TYPES, hf_config, prompt, randomised

    from kvforge.tools.export.sources.hf import load_hf_dir
    from kvforge.tools.export.sources.synthetic import byte_level_tokenizer

    torch.manual_seed(0)  # the weights randomised leaves alone come from the global generator
    hf = randomised(transformers.Gemma4ForCausalLM(hf_config(
        vocab_size=320, layer_types=SHARED_TYPES, num_kv_shared_layers=2, use_double_wide_mlp=True)), seed=5)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    byte_level_tokenizer().save(str(tmp_path / "hf" / "tokenizer.json"))
    write_onnx_dir(load_hf_dir(tmp_path / "hf", kv_cache_dtype="fp32"), tmp_path / "onnx")
    build_engine(tmp_path / "onnx", tmp_path / "engine", BuildOptions(
        max_input_len=256, max_kv_cache_capacity=512, tokens_per_page=16, sliding_window_pool=True))
    engine = make_engine(tmp_path / "engine", reuse=True, prefill_chunk_size=64)
    window_pages = builder_config(tmp_path / "engine")["window_pool_pages"]
    assert [len(layer) for layer in engine.backend.kv_store.layers] == [window_pages] * 2 + [128, window_pages]
    greedy = SamplingParams(max_generate_length=5, temperature=0.0, logit_bias={hf.config.eos_token_id: -100.0})
    ids, cached = prompt(120, seed=9), []
    for turn in range(2):
        expected = full_forward_greedy(hf, ids, 5, banned=hf.config.eos_token_id)
        engine.add_request(EngineRequest(ids, greedy))
        done = []
        while not done:
            done = [o for o in engine.step() if o.finished]
        assert done[0].token_ids == expected, f"turn {turn}"
        cached.append(done[0].cached_tokens)
        ids = ids + expected + prompt(30, seed=10 + turn)
    assert cached[0] == 0 and cached[1] > 0


def full_forward_greedy(hf: object, ids: list[int], count: int, banned: int) -> list[int]:
    """transformers' greedy tokens by a whole forward pass per token (no generation cache, whose state earlier tests
    in the session can change), `banned` never chosen."""
    import torch

    tokens = list(ids)
    with torch.no_grad():
        for _ in range(count):
            logits = hf(torch.tensor([tokens])).logits[0, -1]
            logits[banned] = -float("inf")
            tokens.append(int(logits.argmax()))
    return tokens[len(ids):]

"""Recurrent engines through the engine loop, pure (tiny Mamba2) and hybrid (tiny Qwen3.5: gated delta-net and
attention layers): greedy output equals transformers', batching and chunking do not change it, exact-checkpoint
reuse (endpoint, message boundaries, intervals) never changes an answer, snapshots restore byte-exact and come
back with their records, and bad budgets fail in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.engine_driver import make_engine, run_file, top1_ids

from kvforge.builder.build import BuildOptions, build_engine
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.contract.errors import InvalidConfig
from kvforge.runtime.engine.engine import Engine, snapshot_budgets
from kvforge.runtime.engine.state import MIN_BOUNDARY_GAP
from kvforge.runtime.execution.ort import OrtBackend
from kvforge.runtime.execution.snapshots import RecurrentSnapshotStore
from kvforge.runtime.types import SamplingParams
from kvforge.tools.export.sources.synthetic import synthetic_model
from kvforge.tools.export.writer import write_onnx_dir

pytestmark = [pytest.mark.attention_path, pytest.mark.in_process]  # fallback rerun; run_cli in process

ROOT = Path(__file__).resolve().parents[2]
T = 16
SLOTS = 16


MODELS = ("tiny-mamba2", "tiny-qwen3_5")


@pytest.fixture(scope="module", params=MODELS)
def engine_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    write_onnx_dir(synthetic_model(request.param, kv_cache_dtype="fp32"), root / "onnx")
    build_engine(root / "onnx", root / "engine", BuildOptions(max_input_len=2048, max_kv_cache_capacity=2048,
                                                              max_batch_size=4, tokens_per_page=T))
    return root / "engine"


@pytest.fixture(scope="module")
def runner(engine_dir: Path) -> OrtBackend:
    return OrtBackend(load_engine_dir(engine_dir), num_threads=2)


def is_hybrid(engine_dir: Path) -> bool:
    return bool(load_engine_dir(engine_dir).model.attention_layer_ids)


def budgets(engine_dir: Path, slots: int) -> dict[str, int]:
    """Both pools a deployment needs, `slots` each (plus a remainder that buys nothing)."""
    return {field: value + 7 for field, value in snapshot_budgets(load_engine_dir(engine_dir), slots).items()}


def warm_engine(engine_dir: Path, runner: OrtBackend, slots: int = SLOTS, **config: object) -> Engine:
    return make_engine(engine_dir, runner, reuse=True, **budgets(engine_dir, slots), **config)  # type: ignore[arg-type]


def answers(responses: list[dict]) -> list[tuple[str, str, list[int]]]:
    return [(r["output_text"], r["finish_reason"], top1_ids(r)) for r in responses]


def fixture_data() -> dict:
    data = json.loads((ROOT / "test_cases" / "hybrid_context_reuse.json").read_text())
    data["max_generate_length"] = 6
    return data


def greedy(engine: Engine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    ids = [engine.add_request(engine.inputs.process_prompt(p, SamplingParams(temperature=0.0, top_k=1,
                                                                             max_generate_length=steps)))
           for p in prompts]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = list(out.token_ids)
    return [outputs[i] for i in ids]


# --- the engine loop against transformers ---------------------------------------------------------------

def test_greedy_generation_matches_transformers_batched_and_chunked(engine_dir: Path, runner: OrtBackend) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    name = load_engine_dir(engine_dir).model.name
    loaded = synthetic_model(name, kv_cache_dtype="fp32")
    if name == "tiny-mamba2":
        from parity.test_mamba2_parity import hf_twin  # the parity folder's module, by its package path

        state = {("backbone.embeddings.weight" if k == "model.embed_tokens.weight" else k): v
                 for k, v in loaded.weights.items()}
    else:
        from parity.test_qwen3_5_parity import hf_twin  # the parity folder's module, by its package path

        state = loaded.weights
    hf = hf_twin(loaded.config)
    hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=True)
    prompts = [[40, 41, 70, 100, 5, 77, 90, 12, 33, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [3, 17, 5],
               list(range(60, 100))]
    expected = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(5):
            with torch.no_grad():
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        expected.append(ids[len(prompt):])
    assert greedy(make_engine(engine_dir, runner), prompts, 5) == expected  # three rows, ragged, one call each step
    chunked = make_engine(engine_dir, runner, prefill_chunk_size=7, max_batch_size=2)
    assert greedy(chunked, prompts, 5) == expected  # states carried across chunks and between rows' calls
    assert chunked.states is not None and chunked.states.num_free == chunked.states.arrays[
        "conv_state_0"].shape[0]  # every row came back


# --- exact-checkpoint reuse is invisible -----------------------------------------------------------------

def test_fixture_matches_cold_with_exact_checkpoints(engine_dir: Path, runner: OrtBackend) -> None:
    data = fixture_data()
    cold = answers(run_file(make_engine(engine_dir, runner), data))
    warm = warm_engine(engine_dir, runner)
    responses = run_file(warm, data)
    assert answers(responses) == cold
    cached = [r["usage"]["cached_tokens"] for r in responses]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    profile = warm.profile()
    hybrid = profile["context_cache"]["hybrid"]
    assert hybrid["restores"] == sum(c > 0 for c in cached) and hybrid["snapshot_pressure_skips"] == 0
    pools = profile["context_cache"]["resource_pools"]
    assert pools["recurrent_snapshots"]["capacity"] == SLOTS and pools["recurrent_snapshots"]["free"] < SLOTS
    if not is_hybrid(engine_dir):
        assert pools["base_kv_pages"]["capacity"] == 0  # no attention layers: no pages at all
    else:
        assert pools["partial_kv_snapshots"]["free"] < SLOTS  # unaligned checkpoints keep their tail page


def test_document_shared_by_two_questions_hits_through_a_message_boundary(engine_dir: Path,
                                                                        runner: OrtBackend) -> None:
    document = "The tower was built in 1889 by Gustave Eiffel's company for the World's Fair. " * 3
    data = {"temperature": 0.0, "num_logprobs": 1, "max_generate_length": 4,
            "context_cache_commit_policy": "prefill_state_only",
            "requests": [{"messages": [{"role": "system", "content": "Answer briefly."},
                                       {"role": "user", "content": document},
                                       {"role": "assistant", "content": "Read it."},
                                       {"role": "user", "content": question}]}
                         for question in ("Who built it?", "When was it built?")]}
    cold = answers(run_file(make_engine(engine_dir, runner), data))
    boundaries = warm_engine(engine_dir, runner)
    responses = run_file(boundaries, data)
    assert answers(responses) == cold
    first = boundaries.inputs.process(_requests(data)[0])
    # The second question diverges inside the first prompt: only a boundary checkpoint can hit, the one after the
    # document's turn (the short "Read it." turn ends within MIN_BOUNDARY_GAP of it, so no checkpoint there).
    kept = [p for p in boundaries.state_manager.checkpoints.positions(first) if p < len(first.prompt_ids)]
    assert responses[1]["usage"]["cached_tokens"] == kept[-1] == first.message_boundaries[-2] > 0
    assert first.message_boundaries[-1] - first.message_boundaries[-2] < MIN_BOUNDARY_GAP
    endpoint_only = warm_engine(engine_dir, runner, snapshot_message_boundaries=False)
    assert [r["usage"]["cached_tokens"] for r in run_file(endpoint_only, data)] == [0, 0]
    # The engine's setting decides, not the request: one tokenized by a boundary engine captures only its end here.
    request = boundaries.inputs.process(_requests(data)[1])
    assert request.message_boundaries
    assert endpoint_only.state_manager.checkpoints.positions(request) == (len(request.prompt_ids),)


def test_interval_checkpoints_and_short_prompts_hit(engine_dir: Path, runner: OrtBackend) -> None:
    first, second = "Hi, Ada!", "Hi, Ada! How are you?"  # shorter than two pages
    data = {"temperature": 0.0, "num_logprobs": 1, "max_generate_length": 3, "apply_chat_template": False,
            "context_cache_commit_policy": "prefill_state_only",
            "requests": [{"messages": [{"role": "user", "content": text}]} for text in (first, second)]}
    warm = warm_engine(engine_dir, runner)
    responses = run_file(warm, data)
    assert answers(responses) == answers(run_file(make_engine(engine_dir, runner), data))
    assert [r["usage"]["cached_tokens"] for r in responses] == [0, len(first)]
    text = "abcdefghij" * 4  # 40 byte tokens; a different continuation after 25 of them
    data = {**data, "requests": [{"messages": [{"role": "user", "content": t}]} for t in (text, text[:25] + "XYZ")]}
    interval = warm_engine(engine_dir, runner, snapshot_interval_tokens=10)
    responses = run_file(interval, data)
    assert answers(responses) == answers(run_file(make_engine(engine_dir, runner), data))
    assert responses[1]["usage"]["cached_tokens"] == 20  # the last checkpoint (every 10 tokens) before the fork


def test_decode_end_checkpoint_serves_the_next_turn(engine_dir: Path, runner: OrtBackend) -> None:
    """The decode-end checkpoint (prompt + answer but the last sampled token) is exact: feeding the answer back
    hits past the prompt."""
    warm = warm_engine(engine_dir, runner)
    base = {"temperature": 0.0, "num_logprobs": 1, "max_generate_length": 5, "apply_chat_template": False,
            "logit_bias": {str(t): 40.0 for t in warm.tokenizer.encode("abcdefghij")}}  # ASCII: re-tokenizes alike
    prompt = "Once upon a time, "
    first = run_file(warm, {**base, "requests": [{"messages": [{"role": "user", "content": prompt}]}]})[0]
    follow = {**base, "requests": [{"messages": [{"role": "user", "content": prompt + first["output_text"] + "!"}]}]}
    second = run_file(warm, follow)[0]
    assert second["usage"]["cached_tokens"] == len(prompt) + 4
    assert answers([second]) == answers(run_file(make_engine(engine_dir, runner), follow))


def test_a_recompute_after_preemption_checkpoints_the_prompt_state(engine_dir: Path,
                                                                    runner: OrtBackend) -> None:
    """A preempted sequence whose checkpoints were evicted recomputes prompt + output; the scheduler must end a
    call at the prompt's end so the prompt's checkpoint holds the state after the prompt alone."""
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 200, size=37)]
    sampling = SamplingParams(temperature=0.0, top_k=1, max_generate_length=8, num_logprobs=1,
                              cache_generated_tokens=False)
    warm = warm_engine(engine_dir, runner)
    request_id = warm.add_request(warm.inputs.process_prompt(prompt, sampling))
    for _ in range(4):  # the prompt, then three tokens
        warm.step()
    warm.scheduler.preempt(warm.core.sequences[request_id])
    warm.cache._evict([r.record_id for r in warm.cache.records.least_recent_first()])  # nothing to restore
    while warm.has_unfinished():
        warm.step()
    assert warm.scheduler.stats.preemptions == 1
    extended = prompt + [5, 6, 7]
    outputs = greedy(warm, [extended], 5)
    assert warm.profile()["prefill"]["reused_tokens"] == len(prompt)  # the recompute's prompt checkpoint
    assert outputs == greedy(make_engine(engine_dir, runner), [extended], 5)


# --- snapshots: byte-exact, freed with their records, pressure skipped -------------------------------------

def test_snapshot_restore_is_byte_exact(engine_dir: Path, runner: OrtBackend) -> None:
    states = runner.states
    assert states is not None
    row, other = states.allocate(), states.allocate()
    rng = np.random.default_rng(0)
    for array in states.arrays.values():
        array[row] = rng.standard_normal(array.shape[1:]).astype(np.float32)
    store = RecurrentSnapshotStore(states, 2)
    store.capture(row, 1)
    before = [a.copy() for a in states.read(row)]
    for array in states.arrays.values():
        array[row] = 0.0
    store.restore(1, other)
    for restored, original in zip(states.read(other), before, strict=True):
        assert restored.tobytes() == original.tobytes()
    states.free(row)
    states.free(other)


def test_one_slot_budget_evicts_and_counts_pressure_never_errors(engine_dir: Path, runner: OrtBackend) -> None:
    data = fixture_data()
    cold = answers(run_file(make_engine(engine_dir, runner), data))
    tight = warm_engine(engine_dir, runner, slots=1)
    assert answers(run_file(tight, data)) == cold
    pools = tight.profile()["context_cache"]["resource_pools"]["recurrent_snapshots"]
    assert pools == {"free": 0, "capacity": 1}  # the newest checkpoint holds the one slot
    reclaimed = tight.profile()["context_cache"]["reclaimed_resources"]["recurrent_snapshots"]
    assert reclaimed > 0


# --- bad budgets and flags ---------------------------------------------------------------------------------

RECURRENT = "context_cache_recurrent_snapshot_pool_bytes"
PARTIAL = "context_cache_partial_kv_snapshot_pool_bytes"
BAD_BUDGETS = {  # per deployment: (config, field named, words in the message)
    "pure": [({"reuse": True}, RECURRENT, "at least one slot"),
             ({"reuse": True, RECURRENT: 100}, RECURRENT, "hold no recurrent snapshot slot"),
             ({RECURRENT: 10**7}, RECURRENT, "requires context reuse"),
             ({"reuse": True, RECURRENT: 10**7, PARTIAL: 10**7}, PARTIAL, "no attention layers"),
             ({"reuse": True, RECURRENT: 10**7, "snapshot_interval_tokens": -1}, "snapshot_interval_tokens", ">= 0")],
    "hybrid": [({"reuse": True, PARTIAL: 10**7}, RECURRENT, "at least one slot"),
               ({"reuse": True, RECURRENT: 10**7}, PARTIAL, "at least one slot"),
               ({"reuse": True, RECURRENT: 10**7, PARTIAL: 100}, PARTIAL, "hold no partial-KV snapshot slot"),
               ({PARTIAL: 10**7}, PARTIAL, "requires context reuse"),
               ({"snapshot_interval_tokens": 8}, "snapshot_interval_tokens", "need a recurrent snapshot pool")],
}


def test_bad_budgets_fail_naming_the_field(engine_dir: Path, runner: OrtBackend) -> None:
    for config, field, words in BAD_BUDGETS["hybrid" if is_hybrid(engine_dir) else "pure"]:
        with pytest.raises(InvalidConfig) as info:
            make_engine(engine_dir, runner, **dict(config))
        assert info.value.field == field and words in info.value.message, (config, info.value.message)


def test_cli_runs_a_recurrent_engine_and_refuses_budget_flags_without_reuse(run_cli, engine_dir: Path,
                                                                           tmp_path: Path) -> None:
    from support.cli_checks import assert_one_line_error

    from kvforge.cli_common import ENGINE_FLAGS

    request = tmp_path / "in.json"
    request.write_text(json.dumps({"max_generate_length": 3, "temperature": 0, "requests": [
        {"messages": [{"role": "user", "content": "hi there"}]}, {"messages": [{"role": "user", "content": "hi"}]}]}))
    flags = [f"{ENGINE_FLAGS[field]}={value}" for field, value in budgets(engine_dir, 4).items()]
    ok = run_cli(["llm_inference", "--engineDir", engine_dir, "--inputFile", request, "--outputFile",
                  tmp_path / "out.json", "--enableContextReuse", *flags, "--snapshotIntervalTokens", "8"])
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads((tmp_path / "out.json").read_text())["responses"]) == 2
    missing = run_cli(["llm_inference", "--engineDir", engine_dir, "--inputFile", request, "--outputFile",
                       tmp_path / "out2.json", "--enableContextReuse", *flags[1:]])
    assert_one_line_error(missing, "--contextCacheRecurrentSnapshotPoolBytes", "at least one slot")
    no_reuse = run_cli(["llm_inference", "--engineDir", engine_dir, "--inputFile", request, "--outputFile",
                        tmp_path / "out3.json", "--contextCacheRecurrentSnapshotPoolBytes", "1000000"])
    assert_one_line_error(no_reuse, "--contextCacheRecurrentSnapshotPoolBytes", "requires --enableContextReuse")


def _requests(data: dict) -> list:
    from kvforge.runtime.inputs.request_file import parse_request_file

    return parse_request_file(data).requests

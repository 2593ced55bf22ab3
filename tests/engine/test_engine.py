"""The engine loop on a synthetic engine: preemption, abort, in-flight prefix sharing, static vs continuous,
and a property test of the scheduler against each request run alone."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.engine_driver import assert_idle, lora_model_with_adapters, make_engine, run_file, top1_ids

from kvforge.builder.build import BuildOptions
from kvforge.contract.engine_dir import load_engine_dir
from kvforge.contract.errors import PoolTooSmall
from kvforge.contract.geometry import partial_kv_bytes_per_slot
from kvforge.runtime.engine.engine import Engine
from kvforge.runtime.engine.output import RequestOutput
from kvforge.runtime.execution.executor import PADDING_SLACK_TOKENS, group_by_width
from kvforge.runtime.execution.ort import OrtBackend
from kvforge.runtime.file_loop import Scheduling
from kvforge.runtime.sequence import EngineRequest, Status
from kvforge.runtime.types import SamplingParams

pytestmark = pytest.mark.attention_path  # assertions that depend on the attention lowering: run again on the fallback

ROOT = Path(__file__).resolve().parents[2]
T = 16
GREEDY = SamplingParams(temperature=0.0, num_logprobs=1)


@dataclass(frozen=True, slots=True)
class Setup:
    engine_dir: Path  # LoRA-capable, long inputs: max_input_len 3072, capacity 3200, batch 4
    adapters: dict[str, Path]
    runner: OrtBackend  # for engines under test
    cold_runner: OrtBackend  # for cold references (never interleaved with a warm cache's pages)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("engine")
    _, adapters = lora_model_with_adapters(
        root, BuildOptions(max_input_len=3072, max_kv_cache_capacity=3200, max_batch_size=4, tokens_per_page=T,
                           max_lora_rank=8), "fp16", (("a", 1, 4), ("b", 2, 8)))
    engine = load_engine_dir(root / "engine")
    return Setup(root / "engine", adapters, OrtBackend(engine, num_threads=2),
                 OrtBackend(engine, num_threads=2))


def request(engine: Engine, text: str, max_generate_length: int = 8, **fields: object) -> EngineRequest:
    sampling = SamplingParams(temperature=0.0, num_logprobs=1, max_generate_length=max_generate_length,
                              logit_bias={engine.engine_dir.model.eos_token_ids[0]: -100.0})  # exact lengths
    adapter = engine.loras.get(fields.pop("lora_name", None))  # type: ignore[arg-type]
    return EngineRequest(engine.tokenizer.encode(text), sampling, adapter, **fields)  # type: ignore[arg-type]


def step_until_done(engine: Engine) -> dict[str, RequestOutput]:
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.cache.check_invariants()
    return finished


def answer(output: RequestOutput) -> tuple[list[int], list[int]]:
    """Greedy tokens and top-1 logprob ids: what reuse, batching and preemption must never change."""
    return output.token_ids, [s.top_logprobs[0][0] for s in output.samples]


def alone(setup: Setup, text: str, max_generate_length: int, lora_name: str | None = None) -> tuple:
    cold = make_engine(setup.engine_dir, setup.cold_runner)
    if lora_name:
        cold.load_adapters({lora_name: str(setup.adapters[lora_name])})
    request_id = cold.add_request(request(cold, text, max_generate_length, lora_name=lora_name))
    return answer(step_until_done(cold)[request_id])


DOCUMENT = "".join(f"Section {i}: the tide turbines at pier {i % 7} delivered {i * 13 % 97} kilowatts. "
                   for i in range(20))[:1000]


# --- preemption and abort -----------------------------------------------------------------------------

def test_preempted_request_finishes_with_the_same_answer(setup: Setup) -> None:
    engine = make_engine(setup.engine_dir, setup.runner, reuse=True, num_pages=75)  # 1,200 tokens: three growing
    # requests cannot all fit
    texts = [f"request {i} " + "abcdefgh" * 20 for i in range(3)]  # ~170 tokens each, 11 pages
    ids = [engine.add_request(request(engine, t, max_generate_length=400)) for t in texts]
    preempted_seen = False
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.cache.check_invariants()
        for seq in engine.scheduler.waiting:
            if seq.num_preemptions:  # just preempted: holds nothing, nothing of its output is findable
                preempted_seen = True
                assert seq.lease is None and seq.status is Status.WAITING and seq.num_computed_tokens == 0
                generated_keys = {r.terminal_key for r in engine.cache.records.least_recent_first()
                                  if len(r.token_ids) > len(seq.prompt_ids)}
                assert not any(len(r.token_ids) > len(seq.prompt_ids) and
                               list(r.token_ids[:len(seq.prompt_ids)]) == seq.prompt_ids
                               for r in engine.cache.records.least_recent_first()), generated_keys
    assert preempted_seen and engine.scheduler.stats.preemptions > 0
    assert any(finished[i].timing.preemptions for i in ids)
    for request_id, text in zip(ids, texts, strict=True):
        assert answer(finished[request_id]) == alone(setup, text, 400)
    assert_idle(engine)


def test_abort_releases_pages_and_publishes_nothing(setup: Setup) -> None:
    engine = make_engine(setup.engine_dir, setup.runner, reuse=True, prefill_chunk_size=64)
    mid_prefill = engine.add_request(request(engine, DOCUMENT))
    engine.step()  # 64 of ~1000 prompt tokens computed: 4 pages indexed in flight
    assert len(engine.cache.index) == 4
    assert engine.abort(mid_prefill) and not engine.abort(mid_prefill)
    assert len(engine.cache.records) == 0 and len(engine.cache.index) == 0
    assert_idle(engine)
    assert engine.cache.pages.num_free == engine.cache.pages.capacity

    decoding = engine.add_request(request(engine, "short prompt, long answer " * 2, max_generate_length=100))
    while not engine.cache.records:  # the prompt is published when its prefill completes
        engine.step()
    for _ in range(40):
        engine.step()
    prompt_records = len(engine.cache.records)
    engine.abort(decoding)  # mid-decode: its generated tokens are never published
    assert len(engine.cache.records) == prompt_records == 1
    [record] = engine.cache.records.least_recent_first()
    assert len(record.token_ids) <= len(engine.tokenizer.encode("short prompt, long answer " * 2))
    assert_idle(engine)
    assert engine.step() == []


def test_request_that_cannot_fit_alone_is_refused_before_it_runs(setup: Setup) -> None:
    engine = make_engine(setup.engine_dir, setup.runner, num_pages=8, context_cache_max_records=0)  # 128 tokens
    big = request(engine, "x" * 100, max_generate_length=50)
    with pytest.raises(PoolTooSmall) as info:
        engine.add_request(big)
    need = -(-(len(big.prompt_ids) + 49) // T)  # K/V for the prompt and all but the last generated token
    assert info.value.field == "max_kv_pool_pages" and f"needs {need} pages" in info.value.message
    assert not engine.has_unfinished()
    engine.add_request(request(engine, "x" * 100, max_generate_length=20))  # 119 tokens of K/V: fits
    step_until_done(engine)
    assert_idle(engine)


# --- in-flight prefix sharing -------------------------------------------------------------------------

def test_simultaneous_requests_compute_a_shared_prefix_once(setup: Setup) -> None:
    questions = [" Which pier delivered most?", " How many sections are there?"]
    computed = {}
    outputs = {}
    for reuse in (True, False):
        engine = make_engine(setup.engine_dir, setup.runner, reuse=reuse, prefill_chunk_size=256)
        ids = [engine.add_request(request(engine, DOCUMENT + q, 4)) for q in questions]
        finished = step_until_done(engine)
        outputs[reuse] = [answer(finished[i]) for i in ids]
        computed[reuse] = engine.profile()["prefill"]["computed_tokens"]
        if reuse:
            lengths = [len(engine.tokenizer.encode(DOCUMENT + q)) for q in questions]
            shared_pages = len(engine.tokenizer.encode(DOCUMENT)) // T
            assert [finished[i].cached_tokens for i in ids] == [0, shared_pages * T]
            assert computed[True] == sum(lengths) - shared_pages * T  # the document was computed once
            assert engine.scheduler.stats.inflight_prefix_waits > 0
        assert_idle(engine)
    assert computed[False] > computed[True] + 900
    assert outputs[True] == outputs[False]


def test_request_arriving_mid_prefill_hits_the_finished_chunks(setup: Setup) -> None:
    engine = make_engine(setup.engine_dir, setup.runner, reuse=True, prefill_chunk_size=128)
    first = engine.add_request(request(engine, DOCUMENT + " First question?", 4))
    engine.step()
    engine.step()  # 256 tokens (16 pages) of the document are done
    divergent = DOCUMENT[:200] + " and now something else entirely"  # shares ~12 pages, then differs
    late = engine.add_request(request(engine, DOCUMENT + " Second question?", 4))
    other = engine.add_request(request(engine, divergent, 4))
    finished = step_until_done(engine)
    assert finished[other].cached_tokens == len(engine.tokenizer.encode(DOCUMENT[:200])) // T * T
    assert finished[late].cached_tokens == len(engine.tokenizer.encode(DOCUMENT)) // T * T
    assert answer(finished[late]) == alone(setup, DOCUMENT + " Second question?", 4)
    assert answer(finished[first]) == alone(setup, DOCUMENT + " First question?", 4)
    assert_idle(engine)


# --- static vs continuous on every shipped test case --------------------------------------------------

# Media files (vlm_*, audio_*) need an encoder engine: tests/test_multimodal.py and test_audio.py run them.
@pytest.mark.parametrize("case", sorted(p.name for p in (ROOT / "test_cases").glob("*.json")
                                        if not p.name.startswith(("vlm_", "audio_"))))
def test_continuous_and_static_give_identical_outputs(setup: Setup, case: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    lora_dir = setup.adapters["a"].parent / "case_adapters"
    lora_dir.mkdir(exist_ok=True)
    for name, source in (("summarizer", "a"), ("classifier", "b")):
        (lora_dir / f"{name}.safetensors").write_bytes(setup.adapters[source].read_bytes())
    monkeypatch.setenv("KVFORGE_LORA_DIR", str(lora_dir))
    data = json.loads((ROOT / "test_cases" / case).read_text())
    data.update(max_generate_length=min(data.get("max_generate_length", 8), 8), num_logprobs=1)
    results = {}
    for scheduling in Scheduling:
        engine = make_engine(setup.engine_dir, setup.runner, reuse=True)
        results[scheduling] = run_file(engine, data, scheduling, base_dir=ROOT / "test_cases")
    for static, continuous in zip(results[Scheduling.STATIC], results[Scheduling.CONTINUOUS], strict=True):
        assert (static["output_text"], static["finish_reason"], top1_ids(static)) == \
               (continuous["output_text"], continuous["finish_reason"], top1_ids(continuous))
        assert static["batch_idx"] == continuous["batch_idx"]


# --- property: random arrivals, prefixes, salts, adapters, aborts, small pools ------------------------

PREFIXES = ["", DOCUMENT[:90], DOCUMENT[300:420], "abcdefgh" * 6]
arrival = st.fixed_dictionaries({
    "prefix": st.sampled_from(PREFIXES),
    "suffix": st.text(alphabet="xyz ?!", min_size=1, max_size=10),
    "salt": st.sampled_from([None, "a"]),
    "lora_name": st.sampled_from([None, None, "a", "b"]),
    "max_generate_length": st.integers(1, 60),
    "arrives_at": st.integers(0, 12),
    "abort_at": st.one_of(st.none(), st.none(), st.integers(0, 20)),
    "extends": st.one_of(st.none(), st.integers(0, 5)),  # an earlier arrival's text + this suffix (a chat turn)
})
REFERENCES: dict[tuple, tuple] = {}
SEEN = {"preemptions": 0, "waits": 0, "restores": 0, "snapshot_evictions": 0}


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# One explicit example reaches preemption, an in-flight wait and a snapshot restore whatever the generated examples
# do (they change with this function's source text).
@example(arrivals=[{"prefix": PREFIXES[1], "suffix": "x?", "salt": None, "lora_name": None, "max_generate_length": 60,
                    "arrives_at": 0, "abort_at": None, "extends": None} for _ in range(3)]
         + [{"prefix": PREFIXES[1], "suffix": " y", "salt": None, "lora_name": None, "max_generate_length": 60,
             "arrives_at": 1, "abort_at": None, "extends": None},
            {"prefix": "", "suffix": "z!", "salt": None, "lora_name": None, "max_generate_length": 20,
             "arrives_at": 12, "abort_at": None, "extends": 0}],
         pool_pages=36, reuse=True, chunk=48, max_records=1024, snapshot_slots=8)
@given(arrivals=st.lists(arrival, min_size=1, max_size=7), pool_pages=st.sampled_from([36, 44, 75]),
       reuse=st.sampled_from([True, True, False]), chunk=st.sampled_from([16, 48, 512]),
       max_records=st.sampled_from([0, 2, 1024]), snapshot_slots=st.sampled_from([0, 1, 2, 8]))
def test_scheduler_matches_each_request_alone(setup: Setup, arrivals: list[dict], pool_pages: int, reuse: bool,
                                             chunk: int, max_records: int, snapshot_slots: int) -> None:
    # Partial-KV snapshots (reuse only): tight budgets make captures evict each other's records.
    snapshot_slots = snapshot_slots if reuse else 0
    engine = make_engine(setup.engine_dir, setup.runner, reuse=reuse, prefill_chunk_size=chunk,
                         context_cache_max_records=max_records, num_pages=pool_pages,
                         context_cache_partial_kv_snapshot_pool_bytes=snapshot_slots * partial_slot_bytes(setup))
    engine.load_adapters({name: str(path) for name, path in setup.adapters.items()})
    # Prompts up to ~490 tokens growing by up to 60 in a pool of 36-75 pages (576-1,200 tokens): four rows
    # do not fit, so requests wait for pages and running rows preempt each other.
    texts: list[str] = []
    for i, a in enumerate(arrivals):
        earlier = a["extends"] if a["extends"] is not None and a["extends"] < i else None
        texts.append((a["prefix"] * 4)[:480] + a["suffix"] if earlier is None else texts[earlier] + a["suffix"])
    ids: dict[int, str] = {}
    finished: dict[str, RequestOutput] = {}
    aborted: set[str] = set()
    step = 0
    while len(ids) < len(arrivals) or engine.has_unfinished():
        for i, a in enumerate(arrivals):
            if a["arrives_at"] == step:
                ids[i] = engine.add_request(request(engine, texts[i], a["max_generate_length"],
                                                    lora_name=a["lora_name"], cache_salt=a["salt"]))
            if a["abort_at"] == step and i in ids and ids[i] not in finished and engine.abort(ids[i]):
                aborted.add(ids[i])
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.cache.check_invariants()
        step += 1
    for i, a in enumerate(arrivals):
        if ids[i] in aborted:
            assert ids[i] not in finished
            continue
        key = (texts[i], a["max_generate_length"], a["lora_name"])
        if key not in REFERENCES:
            REFERENCES[key] = alone(setup, texts[i], a["max_generate_length"], a["lora_name"])
        assert answer(finished[ids[i]]) == REFERENCES[key], (i, a)
    assert_idle(engine)
    SEEN["preemptions"] += engine.scheduler.stats.preemptions
    SEEN["waits"] += engine.scheduler.stats.inflight_prefix_waits
    if reuse:
        hybrid = engine.cache.profile()["hybrid"]
        SEEN["restores"] += hybrid["restores"]
        SEEN["snapshot_evictions"] += engine.cache.metrics.reclaimed["partial_kv_snapshots"]


def partial_slot_bytes(setup: Setup) -> int:
    model, build = (engine := load_engine_dir(setup.engine_dir)).model, engine.build
    return partial_kv_bytes_per_slot(model.num_hidden_layers, model.num_key_value_heads, model.head_dim,
                                     build.tokens_per_page, model.kv_cache_dtype)


@pytest.mark.engine  # reads SEEN, which the engine test above fills: the tier rule cannot see that
def test_property_examples_exercised_preemption_and_waiting() -> None:
    """Guards the property test's strategy: it must keep reaching preemption, in-flight waits, snapshot
    restores and snapshot slots reclaimed by eviction."""
    if not SEEN["preemptions"] and not SEEN["waits"]:
        pytest.skip("run together with test_scheduler_matches_each_request_alone (it fills the counters)")
    assert all(SEEN.values()), SEEN


@given(st.lists(st.integers(1, 600), min_size=1, max_size=8))
def test_calls_group_rows_of_similar_width(lengths: list[int]) -> None:
    groups = group_by_width(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        real = sum(lengths[i] for i in group)
        padding = len(group) * max(lengths[i] for i in group) - real
        assert padding <= max(real // 4, PADDING_SLACK_TOKENS)
    assert group_by_width([512, 1, 1, 1]) == [[0], [1, 2, 3]]  # a prefill chunk never pads decode rows to 512

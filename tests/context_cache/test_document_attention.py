"""`--documentRepair attention` (issue 53): a first pass over the question with the documents restored, the CPU
kernel's attention mass per document, the budget spent on the documents the question reads, then a second pass.
Budget 1 gives `full`'s (a cold run's) tokens, budget 0 `first-page`'s; the mass is normalised; the chosen document
is the one the mass ranks first; approximate K/V stays unfindable; bad options are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.cli_checks import assert_one_line_error
from support.engine_driver import document_prompt, run_alone

from kvforge.contract.engine_dir import ATTENTION_ONNX_OPS
from kvforge.contract.errors import InvalidConfig
from kvforge.plugins import cpu_kernel
from kvforge.plugins.attention_mass import check_attention_mass
from kvforge.runtime.context_cache.keys import KeyExtras, page_keys
from kvforge.runtime.context_cache.types.document_chunks import DocumentChunks
from kvforge.runtime.context_cache.types.document_repair import check_budget, document_shares, spend_budget
from kvforge.runtime.engine.engine import Engine, EngineConfig, EngineRequest
from kvforge.runtime.types import SamplingParams

T = 16  # the tiny engine's page
GREEDY = SamplingParams(temperature=0, max_generate_length=6)
DOC_A = list(range(40, 64))  # 24 tokens: a page and 8
DOC_B = list(range(70, 92))  # 22 tokens: a page and 6
QUESTION = [9, 10, 11, 12, 13]


def prompt(system: list[int], docs: list[list[int]], question: list[int] = QUESTION) -> EngineRequest:
    return document_prompt(system, docs, question, GREEDY)


FIRST = prompt([1, 2, 3, 4, 5], [DOC_A, DOC_B])
SECOND = prompt([1, 2, 3, 4, 6, 7, 8], [DOC_B, DOC_A], [12, 13, 14, 15, 16, 17])


class RecordingMeter:
    """Delegates to the kernel's meter and keeps every reading (the engine's pass reads each watch once)."""

    def __init__(self, meter: Any) -> None:
        self.meter, self.readings, self.watched = meter, [], []

    def watch(self, page: int, page_index: int, query_from: int, positions: int) -> Any:
        self.watched.append(query_from)
        return self.meter.watch(page, page_index, query_from, positions)

    def read(self, watch: Any) -> Any:
        reading = self.meter.read(watch)
        self.readings.append(reading)
        return reading


def documents_type(engine: Engine) -> DocumentChunks:
    [kind] = [kind for kind in engine.cache.types if isinstance(kind, DocumentChunks)]
    return kind


def counters(engine: Engine) -> dict[str, int]:
    return engine.profile()["context_cache"]["documents"]


@pytest.fixture
def kernel_engine_dir(tiny_engine_dir: Path) -> Path:
    """The tiny engine, when this run attends with the CPU kernel; the attention policy needs it (else skipped with
    the reason: the refusal is tested below)."""
    _, reason = cpu_kernel.kernel_status()
    if reason:
        pytest.skip(f"--documentRepair attention needs the CPU kernel: {reason}")
    return tiny_engine_dir


def engine_with(engine_dir: Path, repair: str, budget: float = 0.25, **kwargs: Any) -> Engine:
    return Engine(engine_dir, EngineConfig(num_threads=1, document_reuse=True, document_repair=repair,
                                           document_repair_budget=budget), **kwargs)


def warm(engine: Engine) -> None:
    run_alone(engine, FIRST)  # stores both documents (FIRST computes them for itself)


@pytest.fixture(scope="module")
def cold(tiny_engine_dir: Path) -> list[int]:
    return run_alone(Engine(tiny_engine_dir, EngineConfig(num_threads=1)), SECOND).token_ids


def test_budget_one_gives_full_repairs_tokens(kernel_engine_dir: Path, cold: list[int]) -> None:
    full = engine_with(kernel_engine_dir, "full")
    warm(full)
    assert run_alone(full, SECOND).token_ids == cold
    engine = engine_with(kernel_engine_dir, "attention", budget=1.0)
    warm(engine)
    output = run_alone(engine, SECOND)
    assert output.token_ids == cold
    assert output.cached_tokens == 0  # every restored token was taken back
    counts = counters(engine)
    assert counts["attention_passes"] == 2  # FIRST restored its documents too (its own standalone prefills')
    assert counts["documents_seen"] == 4 and counts["document_hits"] == 4
    assert counts["attention_repaired_tokens"] == 2 * (len(DOC_A) + len(DOC_B) - 2 * T)


def test_budget_zero_is_first_page(kernel_engine_dir: Path) -> None:
    first_page = engine_with(kernel_engine_dir, "first-page")
    warm(first_page)
    want = run_alone(first_page, SECOND)
    engine = engine_with(kernel_engine_dir, "attention", budget=0.0)
    warm(engine)
    got = run_alone(engine, SECOND)
    assert (got.token_ids, got.cached_tokens) == (want.token_ids, want.cached_tokens)
    assert counters(engine)["attention_passes"] == 2 and counters(engine)["attention_repaired_tokens"] == 0


def test_the_mass_is_normalised_and_chooses_the_document_it_ranks_first(kernel_engine_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_with(kernel_engine_dir, "attention", budget=0.1)
    warm(engine)
    kind = documents_type(engine)
    kind.meter = meter = RecordingMeter(kind.meter)
    chosen: list[tuple[int, ...]] = []
    real = DocumentChunks.repair_pass

    def recording(self: DocumentChunks, lease: Any, computed: int) -> tuple[int, int]:
        resume, stop = real(self, lease, computed)
        if resume < computed:  # the pass ended and chose: the lease's repairs now
            chosen.append(tuple(hit.repair for hit in lease.parts[self.name].hits))
        return resume, stop

    monkeypatch.setattr(DocumentChunks, "repair_pass", recording)
    before = counters(engine)
    output = run_alone(engine, SECOND)
    [question_from], [reading] = meter.watched, meter.readings
    model = engine.engine_dir.model
    rows = len(SECOND.prompt_ids) - 1 - question_from  # the question's rows but the last token (the second pass's)
    assert rows == 5
    assert reading.rows == model.num_hidden_layers * model.num_attention_heads * rows
    assert reading.mass.sum() == pytest.approx(reading.rows, rel=1e-4)  # each softmax adds 1
    assert not reading.mass[len(SECOND.prompt_ids) - 1:].any()  # causal: nothing at or past the last token
    spans = [(span.start, span.length) for span in SECOND.documents]
    shares = document_shares(reading.mass, spans)
    ranked = int(np.argmax(shares))
    # 10 % of 46 document tokens: 4 more tokens of the top document, right after its first page; the other keeps
    # its first page.
    extra = 4
    assert counters(engine)["attention_repaired_tokens"] - before["attention_repaired_tokens"] == extra
    assert chosen == [tuple(T + extra if i == ranked else T for i in range(len(spans)))]
    assert output.cached_tokens == len(DOC_A) + len(DOC_B) - 2 * T - extra


def test_the_budget_goes_to_the_documents_with_the_most_mass() -> None:
    """The choice alone: shares rank the documents; the budget extends repairs in that order, contiguously."""
    spans = [(10, 20, 16), (30, 18, 16), (48, 34, 16)]
    mass = np.zeros(90, dtype=np.float32)
    mass[30:48] = 3.0  # the second document draws the most attention, then the third
    mass[60:62] = 1.0
    shares = document_shares(mass, [(s, n) for s, n, _ in spans])
    assert shares == [0.0, 54.0, 2.0]
    assert spend_budget(spans, shares, 0.0) == [16, 16, 16]
    assert spend_budget(spans, shares, 0.05) == [16, 18, 17]  # 3 tokens: the second's 2 left, then one of the third
    assert spend_budget(spans, shares, 1.0) == [20, 18, 34]


def test_approximate_kv_is_never_found_under_exact_keys(kernel_engine_dir: Path) -> None:
    engine = engine_with(kernel_engine_dir, "attention", budget=0.5)
    warm(engine)
    run_alone(engine, SECOND)
    keys = page_keys(SECOND.prompt_ids, T, KeyExtras(), parent=engine.cache.chain_root)
    # Pages wholly before the first restored token (the first document's first page is recomputed in context) are
    # exact and findable; none from there on, whatever the second pass recomputed.
    first_restored = SECOND.documents[0].start + T
    assert [engine.cache.index.contains(key) for key in keys] == [page < first_restored // T
                                                                   for page in range(len(keys))]


def test_a_tight_pool_preempts_and_budget_one_still_answers_as_cold(kernel_engine_dir: Path) -> None:
    """Both requests at once in 8 pages: preempted sequences drop their watch (released with their lease) and
    start a new pass when readmitted; nothing stays armed."""
    long = SamplingParams(temperature=0, max_generate_length=30)
    requests = [EngineRequest(r.prompt_ids, long, documents=r.documents) for r in (FIRST, SECOND)]
    reference = Engine(kernel_engine_dir, EngineConfig(num_threads=1))
    cold_tokens = [run_alone(reference, request).token_ids for request in requests]
    engine = engine_with(kernel_engine_dir, "attention", budget=1.0, num_pages=8)
    meter = documents_type(engine).meter
    ids = [engine.add_request(request) for request in requests]
    finals: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.token_ids
        engine.cache.check_invariants()
    assert engine.scheduler.stats.preemptions > 0
    assert [finals[i] for i in ids] == cold_tokens
    assert not meter._watches  # type: ignore[union-attr]  # every watch was read or dropped


@pytest.mark.parametrize("budget", [-0.1, 1.5, "half", True])
def test_a_bad_budget_is_refused(tiny_engine_dir: Path, budget: object) -> None:
    with pytest.raises(InvalidConfig) as info:
        check_budget(budget)
    assert info.value.field == "document_repair_budget"
    with pytest.raises(InvalidConfig):
        Engine(tiny_engine_dir, EngineConfig(num_threads=1, document_reuse=True, document_repair="attention",
                                             document_repair_budget=budget))  # type: ignore[arg-type]


def test_llm_inference_refuses_a_bad_budget_in_one_line(run_cli, tiny_engine_dir: Path, tmp_path: Path) -> None:
    input_file, output_file = tmp_path / "in.json", tmp_path / "out.json"
    input_file.write_text(json.dumps({"apply_chat_template": False, "max_generate_length": 2,
                                      "requests": [{"messages": [{"role": "user", "content": "hi"}]}]}))
    proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", input_file, "--outputFile",
                    output_file, "--documentReuse", "--documentRepair", "attention", "--documentRepairBudget", "2"])
    assert_one_line_error(proc, "--documentRepairBudget", "[0, 1]")
    assert not output_file.exists()


def test_without_the_kernel_attention_is_refused_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decided: a refusal at engine start, not a silent fallback to first-page (the user asked for the kernel's
    reading); both ways the kernel can be missing."""
    with pytest.raises(InvalidConfig) as info:
        check_attention_mass(ATTENTION_ONNX_OPS, False)
    assert info.value.field == "document_repair" and "first-page" in info.value.message
    monkeypatch.setenv(cpu_kernel.SWITCH_ENV, "off")
    with pytest.raises(InvalidConfig, match="KVFORGE_CPU_KERNEL=off") as info:
        check_attention_mass("kvforge-cpu-kernel", True)
    assert info.value.field == "document_repair"


def test_llm_inference_without_the_kernel_refuses_attention_at_start(run_cli, tiny_engine_dir: Path,
                                                                      tmp_path: Path) -> None:
    """The refusal at engine start, in one line naming the flag: in the KVFORGE_CPU_KERNEL=off run (make test runs
    the engine tests both ways), where the tiny engine attends with plain ONNX ops."""
    _, reason = cpu_kernel.kernel_status()
    if not reason:
        pytest.skip("this run attends with the CPU kernel; the refusal runs with KVFORGE_CPU_KERNEL=off")
    input_file, output_file = tmp_path / "in.json", tmp_path / "out.json"
    input_file.write_text(json.dumps({"apply_chat_template": False, "max_generate_length": 2,
                                      "requests": [{"messages": [{"role": "user", "content": "hi"}]}]}))
    proc = run_cli(["llm_inference", "--engineDir", tiny_engine_dir, "--inputFile", input_file, "--outputFile",
                    output_file, "--documentReuse", "--documentRepair", "attention"])
    assert_one_line_error(proc, "--documentRepair", "first-page")
    assert not output_file.exists()

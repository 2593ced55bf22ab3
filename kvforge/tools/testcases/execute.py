"""Runs one test file on a fresh Engine through the engine loop (kvforge/runtime/file_loop.py), then checks it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvforge.contract.errors import KvforgeError
from kvforge.runtime.engine.engine import Engine, EngineConfig, Runner, snapshot_budgets
from kvforge.runtime.file_loop import Scheduling, prepare_requests, run_request_file
from kvforge.tools.export.sources.synthetic import SYNTHETIC_MODELS
from kvforge.tools.testcases.checks import FAILED, PASSED, SKIPPED, CheckOptions, CheckResult, Scorer, check_file
from kvforge.tools.testcases.declared import CaseSpec

ENGINE_DEFAULTS = EngineConfig()  # what llm_test does not set follows the engine options' declaration


@dataclass(frozen=True, slots=True)
class RunSettings:
    engine_dir: Path
    num_threads: int = ENGINE_DEFAULTS.num_threads
    # On for every file (ctxreuse, --enableContextReuse); a file may also ask for it.
    reuse: bool = ENGINE_DEFAULTS.enable_context_reuse
    scheduling: Scheduling = Scheduling.STATIC
    rouge: str = "auto"
    thresholds: tuple[float, float] = (0.25, 0.20)
    lengths_overridden: bool = False
    multimodal_engine_dir: Path | None = None  # files with image or audio items run only when one is given
    # Budget for files declaring _checks.partial_kv_snapshots (ccpkvsb); 0 = snapshot_budgets' default slots.
    partial_kv_snapshot_pool_bytes: int = 0
    # Recurrent and hybrid engines with reuse (ccrsb); 0 = snapshot_budgets' default slots. Attention-only engines
    # ignore it.
    recurrent_snapshot_pool_bytes: int = 0
    document_reuse: bool = ENGINE_DEFAULTS.document_reuse  # --documentReuse for every file (issue 37)
    document_repair: str = ENGINE_DEFAULTS.document_repair


@dataclass(slots=True)
class FileResult:
    case: CaseSpec
    reuse: bool
    checks: list[CheckResult] = field(default_factory=list)
    responses: list[dict[str, Any]] = field(default_factory=list)
    profile: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # one line: the file could not run on this engine
    timing_s: dict[str, float] = field(default_factory=dict)  # engine (load + tokenize), run (engine loop), checks

    @property
    def status(self) -> str:
        return "error" if self.error else FAILED if self.count(FAILED) else PASSED

    def count(self, status: str) -> int:
        return sum(c.status == status for c in self.checks)

    @property
    def ttft_ms(self) -> float | None:
        values = [r["timing"]["ttft_ms"] for r in self.responses if r.get("timing")]
        return sum(values) / len(values) if values else None

    @property
    def reused_tokens(self) -> int | None:
        return self.profile.get("prefill", {}).get("reused_tokens")


class CaseRunner:
    """One Engine per file (a fresh cache, like the seed's one process per file) over one shared model runner."""

    def __init__(self, settings: RunSettings, flags: Mapping[str, str], scorer: Scorer | None = None) -> None:
        self.settings = settings
        self.flags = flags
        self.scorer = scorer
        self._runner: Runner | None = None

    def run(self, case: CaseSpec) -> FileResult:
        reuse = self.settings.reuse or case.context_reuse or case.partial_kv_snapshots
        result = FileResult(case, reuse)
        media = [(r.index, m.media[0].kind) for r in case.requests.requests for m in r.messages if m.media]
        if media and self.settings.multimodal_engine_dir is None:
            index, kind = media[0]
            result.checks = [CheckResult("media", SKIPPED, f"request {index} has {kind} items: this file needs a "
                                                           "multimodal engine (--multimodalEngineDir)")]
            return result
        try:
            self._run(case, result)
        except KvforgeError as exc:
            result.error = f"{case.name}: {exc.with_flag_names(self.flags)}"
        return result

    def _run(self, case: CaseSpec, result: FileResult) -> None:
        started = time.perf_counter()
        multimodal = self.settings.multimodal_engine_dir
        engine = Engine(self.settings.engine_dir, EngineConfig(
            num_threads=self.settings.num_threads, enable_context_reuse=result.reuse,
            multimodal_engine_dir=str(multimodal) if multimodal else None,
            document_reuse=self.settings.document_reuse, document_repair=self.settings.document_repair,
            **self._snapshot_budgets(case, result.reuse)), backend=self._runner)
        self._runner = engine.runner  # fresh caches, one model: Engines may share a runner one after another
        prepared = prepare_requests(engine, case.requests, case.path.resolve().parent)
        loaded = time.perf_counter()
        result.responses = run_request_file(engine, case.requests, prepared, self.settings.scheduling)
        result.profile = engine.profile()
        ran = time.perf_counter()
        result.checks = check_file(case, result.responses, result.profile, self._options(engine, result.reuse))
        result.timing_s = {"engine": loaded - started, "run": ran - loaded, "checks": time.perf_counter() - ran}

    def _snapshot_budgets(self, case: CaseSpec, reuse: bool) -> dict[str, int]:
        """EngineConfig's snapshot budgets for this file. Attention-only engines: partial-KV snapshots only for files
        that ask for them (the other files' counters are page-granular). Recurrent and hybrid engines reuse exact
        checkpoints only, so with reuse on they always get both pools they need."""
        from kvforge.contract.engine_dir import load_engine_dir

        if not reuse:
            return {}
        budgets = snapshot_budgets(load_engine_dir(self.settings.engine_dir), partial_kv=case.partial_kv_snapshots)
        given = {"context_cache_partial_kv_snapshot_pool_bytes": self.settings.partial_kv_snapshot_pool_bytes,
                 "context_cache_recurrent_snapshot_pool_bytes": self.settings.recurrent_snapshot_pool_bytes}
        return {field: given[field] or value for field, value in budgets.items()}

    def _options(self, engine: Engine, reuse: bool) -> CheckOptions:
        info = engine.info
        model, build = info.model, info.build
        facts = {"model": model.name, "tokens_per_page": build.tokens_per_page, "kv_cache_dtype": model.kv_cache_dtype,
                 "max_batch_size": build.max_batch_size, "max_kv_pool_pages": build.max_kv_pool_pages,
                 "scheduling": self.settings.scheduling.value, "deployment": info.deployment.value}
        return CheckOptions(reuse=reuse, facts=facts, synthetic=model.name in SYNTHETIC_MODELS,
                            rouge=self.settings.rouge, thresholds=self.settings.thresholds,
                            lengths_overridden=self.settings.lengths_overridden, scorer=self.scorer)


def summary_counts(results: list[FileResult]) -> dict[str, int]:
    return {"files": len(results), "passed": sum(r.count(PASSED) for r in results),
            "failed": sum(r.count(FAILED) for r in results), "skipped": sum(r.count(SKIPPED) for r in results),
            "errors": sum(bool(r.error) for r in results)}

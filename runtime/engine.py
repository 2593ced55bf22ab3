"""The engine loop every front end drives: add_request, step (schedule → run → postprocess), abort.

`llm_inference`, the Python API (`kvforge.LLM`), the benchmarks and the tests all call `step()` until
their requests finish; none of them re-implements batching, paging or reuse.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvforge.contract.engine_dir import EMBEDDING_FILE, EMBEDDING_TENSOR, EngineDir, load_engine_dir
from kvforge.contract.errors import InvalidConfig, PoolTooSmall
from kvforge.contract.geometry import snapshot_slots
from kvforge.contract.model_config import ModelConfig
from kvforge.contract.paging import pages_for
from kvforge.contract.safetensors_map import map_tensor
from kvforge.runtime.backends import load_runner
from kvforge.runtime.context_cache.lease import Lease
from kvforge.runtime.context_cache.manager import DEFAULT_MAX_RECORDS, ContextCacheManager
from kvforge.runtime.inputs import InputProcessor, check_prompt_length
from kvforge.runtime.lora import LoraRegistry, lora_input_shapes
from kvforge.runtime.model_runner import ModelRunner
from kvforge.runtime.multimodal.encoder_cache import DEFAULT_ENCODER_CACHE_BUDGET_BYTES
from kvforge.runtime.output import OutputProcessor, RequestOutput
from kvforge.runtime.profile import GENERATION_STAGE, PREFILL_STAGE, Profiler
from kvforge.runtime.runner import EngineRunner
from kvforge.runtime.sampling import Sampler
from kvforge.runtime.scheduler import Scheduler, SchedulerOutput
from kvforge.runtime.sequence import EngineRequest, FinishReason, Sequence, Status
from kvforge.runtime.snapshots import PartialKVSnapshotStore, RecurrentSnapshotStore
from kvforge.runtime.system_prompt_cache import SystemPromptCache
from kvforge.runtime.types import CommitPolicy, Deployment

# Long prompts prefill faster in chunks on the CPU: the masked score matrix grows with the square of the
# call's length. bench/prefill_chunks.py measured a 1,536-token SmolLM2 prefill 1.36x faster at 512
# (1.43x at 256, which would split more of the short prompts that gain nothing).
DEFAULT_PREFILL_CHUNK_TOKENS = 512
# Message-boundary checkpoints closer than this to the previous one are skipped: bench/recurrent_reuse.py measured
# a chat turn on Mamba2-130m at 2x the TTFT when the boundary 5 tokens past its restored checkpoint split the call.
MIN_BOUNDARY_GAP = 32


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Run-time settings (the build fixed the rest). 0 means "the engine's own limit" for the sizes."""

    num_threads: int = 0
    enable_context_reuse: bool = False
    context_cache_max_records: int = DEFAULT_MAX_RECORDS
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK_TOKENS  # 0 = a whole prompt per call
    max_num_tokens: int = 0  # per-step token budget; 0 = maxInputLen
    max_batch_size: int = 0  # rows per step; 0 = the engine's maxBatchSize
    multimodal_engine_dir: str | None = None  # a visual engine dir (llm_build of an encoder ONNX dir)
    encoder_cache_budget_bytes: int = DEFAULT_ENCODER_CACHE_BUDGET_BYTES  # 0 disables; on even without reuse
    # Bytes for partial-KV snapshots (one K+V page per attention layer each): records whose length is not
    # page-aligned keep their tail page, so a prompt extending one reuses up to its exact last token. 0 = off.
    context_cache_partial_kv_snapshot_pool_bytes: int = 0
    # Bytes for recurrent snapshots (every recurrent layer's state and conv state at one exact token count):
    # what recurrent and hybrid engines reuse; required (>= one slot) for them when reuse is on.
    context_cache_recurrent_snapshot_pool_bytes: int = 0
    # Recurrent/hybrid engines capture a checkpoint where an earlier chat message ends (so a shared system
    # prompt or document hits although the next request diverges inside the first one's prompt) and, with an
    # interval, every that many prompt tokens; besides the prompt's and the generation's end, always captured.
    snapshot_message_boundaries: bool = True
    snapshot_interval_tokens: int = 0  # 0 = no periodic checkpoints


class Engine:
    def __init__(self, engine_dir: Path | str, config: EngineConfig = EngineConfig(),
                 runner: EngineRunner | None = None, profiler: Profiler | None = None) -> None:
        self.config = config
        self.engine: EngineDir = load_engine_dir(Path(engine_dir))
        build = self.engine.build
        budget = _resolve_limits(config, build.max_input_len, build.max_batch_size)
        self.deployment = deployment_of(self.engine.model)
        partial_slots = _partial_kv_snapshot_slots(config, self.engine, self.deployment)
        recurrent_slots = _recurrent_snapshot_slots(config, self.engine, self.deployment)
        # A pure recurrent engine keeps no pages (its geometry's page count only sizes nothing).
        num_pages = 0 if self.deployment is Deployment.PURE_RECURRENT else build.max_kv_pool_pages
        self.cache = ContextCacheManager(num_pages, build.tokens_per_page,
                                         enabled=config.enable_context_reuse,
                                         max_records=config.context_cache_max_records,
                                         partial_kv_snapshot_slots=partial_slots,
                                         recurrent_snapshot_slots=recurrent_slots,
                                         deployment=self.deployment)
        from kvforge.runtime.tokenizer import ChatTokenizer  # after the cheap checks: loading it takes a moment

        self.tokenizer = ChatTokenizer(self.engine.path)
        self.loras = LoraRegistry(self.engine)
        self.inputs = InputProcessor(self.tokenizer, self.loras, build.max_input_len, config.enable_context_reuse,
                                     self.engine.model.vocab_size)
        self.inputs.message_boundaries = bool(recurrent_slots) and config.snapshot_message_boundaries
        embedding = map_tensor(self.engine.file(EMBEDDING_FILE), EMBEDDING_TENSOR)  # rows paged in as looked up
        self.runner = runner or load_runner(self.engine, config.num_threads, embedding)
        self.snapshots = PartialKVSnapshotStore(self.runner.pool, partial_slots) if partial_slots else None
        if self.snapshots is not None:
            self.cache.capture_partial = self.snapshots.capture
        self.states = self.runner.states
        if (self.states is None) != (self.deployment is Deployment.VANILLA):
            raise InvalidConfig(f"config.json says {self.deployment.name.lower()} layers but the engine's graph "
                                f"{'has no' if self.states is None else 'has'} recurrent states; rebuild it with "
                                "llm_build", "engine_dir")
        self._state_rows: dict[Lease, int] = {}  # running sequences' recurrent state rows, by lease
        self.recurrent_snapshots = RecurrentSnapshotStore(self.states, recurrent_slots) \
            if self.states is not None and recurrent_slots else None
        if self.recurrent_snapshots is not None:
            self.cache.capture_recurrent = self._capture_recurrent
        self.model_runner = ModelRunner(self.runner, embedding, lora_input_shapes(self.engine),
                                        self._state_rows if self.states is not None else None)
        self.outputs = OutputProcessor(self.tokenizer, frozenset(self.engine.model.eos_token_ids),
                                       build.max_kv_cache_capacity)
        self.system_prompts = SystemPromptCache(self.runner.pool)
        # A row computes at most maxInputLen tokens per call (a recompute after preemption can be longer).
        chunk = min(config.prefill_chunk_size or build.max_input_len, build.max_input_len)
        self.scheduler = Scheduler(self.cache, max_batch_size=budget[1], max_num_tokens=budget[0],
                                   prefill_chunk_tokens=chunk,
                                   on_admit=self._on_admit, on_release=self._on_release)
        self.profiler = profiler or Profiler()
        self.multimodal = self._load_multimodal(config)
        self._sequences: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()

    def _load_multimodal(self, config: EngineConfig):  # -> MultimodalProcessor | None
        if not config.multimodal_engine_dir:
            if config.encoder_cache_budget_bytes < 0:
                raise InvalidConfig(f"must be >= 0, got {config.encoder_cache_budget_bytes}",
                                    "encoder_cache_budget_bytes")
            return None
        from kvforge.runtime.multimodal.encoder_cache import EncoderCache  # Pillow and the encoder only when asked
        from kvforge.runtime.multimodal.encoders import load_encoder
        from kvforge.runtime.multimodal.processor import MultimodalProcessor

        cache = EncoderCache(config.encoder_cache_budget_bytes)
        encoder = load_encoder(Path(config.multimodal_engine_dir), config.num_threads)
        processor = MultimodalProcessor(encoder, cache, self.tokenizer, self.profiler, self.engine.model.hidden_size)
        self.tokenizer.media_markers = {encoder.kind: encoder.marker}
        self.inputs.multimodal = processor
        return processor

    # --- front-end calls ----------------------------------------------------------------------------

    def load_adapters(self, available_lora_weights: dict[str, str], base_dir: Path | None = None) -> None:
        """Load named adapters; each is identified by its weights' digest, not its name."""
        self.loras.load(available_lora_weights, base_dir)
        self.model_runner.forget_adapters()

    def add_request(self, request: EngineRequest, request_id: str | None = None) -> str:
        """Queue a request; it runs from the next step on. Returns its id."""
        check_prompt_length(len(request.prompt_ids), self.engine.build.max_input_len, "prompt")
        # K/V is held for the prompt and every generated token but the last, up to the capacity.
        need = min(len(request.prompt_ids) + request.sampling.max_generate_length - 1,
                   self.engine.build.max_kv_cache_capacity)
        if not self.cache.fits_alone(need):
            raise PoolTooSmall(f"the KV pool cannot hold this request even alone: it needs "
                               f"{pages_for(need, self.cache.tokens_per_page)} pages and the pool has "
                               f"{self.cache.pages.capacity}; rebuild with a larger --maxKVPoolPages",
                               "max_kv_pool_pages")
        if request.system_prompt_key is not None and self.states is not None:
            raise InvalidConfig("the legacy system-prompt cache keeps K/V only, which cannot restore a recurrent "
                                "model's state; use --enableContextReuse (exact checkpoints)",
                                "save_system_prompt_kv_cache")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._sequences:
            raise InvalidConfig(f"request id {request_id!r} is already in flight", "request_id")
        seq = Sequence(request_id, request, Sampler(request.sampling), arrival=next(self._arrivals))
        self._sequences[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def _checkpoints(self, request: EngineRequest, start: int = 0) -> tuple[int, ...]:
        """Prompt positions after `start` (the reuse point) where this request's recurrent state is captured.

        The prompt's end always: a recompute after preemption (prompt + output in one go) must stop there, or the
        prompt's checkpoint would hold the state after some generated tokens. Every --snapshotIntervalTokens
        multiple. Message boundaries at least MIN_BOUNDARY_GAP tokens after the previous kept one (the reuse
        point first): each one ends an engine call early and copies the state, which a boundary a few tokens past
        the restored checkpoint (the last answer's end marker in a chat) would pay for nothing.
        """
        if self.recurrent_snapshots is None:
            return ()
        end = len(request.prompt_ids)
        positions = {end}
        if self.config.snapshot_message_boundaries:
            last = start
            for boundary in request.message_boundaries:
                if boundary - last >= MIN_BOUNDARY_GAP:
                    positions.add(boundary)
                    last = boundary
        if self.config.snapshot_interval_tokens:
            positions.update(range(self.config.snapshot_interval_tokens, end, self.config.snapshot_interval_tokens))
        return tuple(sorted(p for p in positions if start < p <= end))

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its pages are released and nothing of it is published. False if unknown."""
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = FinishReason.ABORTED
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule → run one engine call → sample, stop, publish and release. Returns the rows' outputs."""
        batch = self.scheduler.schedule()
        if not batch.rows:
            if self.scheduler.has_unfinished():
                raise AssertionError("nothing schedulable while requests wait (a scheduler bug)")
            return []
        started = time.perf_counter()
        for row in batch.rows:
            if row.seq.first_scheduled_time is None:
                row.seq.first_scheduled_time = started
        stage = PREFILL_STAGE if batch.has_prefill else GENERATION_STAGE
        with self.profiler.stage(stage):
            logits = self.model_runner.run(batch.rows)
        return self._postprocess(batch, logits)

    # --- postprocess --------------------------------------------------------------------------------

    def _postprocess(self, batch: SchedulerOutput, logits: np.ndarray) -> list[RequestOutput]:
        admitted = {id(seq) for seq in batch.admitted}
        # Tokens a sequence starts with at admission were served from a cache (pages or the legacy copy).
        reused = sum(row.seq.num_computed_tokens for row in batch.rows if id(row.seq) in admitted)
        if batch.has_prefill or admitted:
            self.profiler.add_prefill(reused_tokens=reused,
                                      computed_tokens=sum(r.num_new_tokens for r in batch.rows if r.is_prefill))
        if not batch.has_prefill:
            self.profiler.add_generation(len(batch.rows))
        outputs = []
        for row, row_logits in zip(batch.rows, logits, strict=True):
            seq = row.seq
            before = seq.num_computed_tokens
            seq.num_computed_tokens += row.num_new_tokens
            prompt_len = len(seq.prompt_ids)
            if before < prompt_len:
                self.cache.index_computed(seq.lease, seq.prompt_ids, seq.num_computed_tokens)
                if seq.num_computed_tokens >= prompt_len:  # the prompt is in the pool: publish it (both policies)
                    # A recurrent state is the prompt's only when the call ended exactly there (a checkpoint).
                    if self.states is None or seq.num_computed_tokens == prompt_len:
                        self.cache.publish(seq.lease, seq.prompt_ids)
                    self._save_system_prompt(seq)
                elif seq.num_computed_tokens in seq.checkpoints:  # the scheduler ended the chunk here for this
                    self.cache.publish(seq.lease, seq.prompt_ids[:seq.num_computed_tokens], boundary=True)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # more prompt chunks to go before the next token
            self.outputs.accept(seq, seq.sampler.sample(row_logits))
            if seq.finish_reason is not None:
                self._finish(seq)
            outputs.append(self.outputs.output(seq, seq.output_ids[-1:]))
        return outputs

    def _finish(self, seq: Sequence) -> None:
        seq.finish_time = time.perf_counter()
        if seq.request.sampling.commit_policy is CommitPolicy.INCLUDING_GENERATED_TOKENS and seq.lease is not None:
            self.cache.publish(seq.lease, seq.resident_token_ids())  # only sequences that finished normally
        self.scheduler.finish(seq)
        self._sequences.pop(seq.request_id, None)
        self.profiler.add_adapter_request(seq.adapter_label, seq.reused_tokens)

    # --- restores at admission: partial-KV snapshots, the legacy system-prompt cache -------------------

    def _on_admit(self, seq: Sequence) -> None:
        lease = seq.lease
        assert lease is not None
        seq.checkpoints = self._checkpoints(seq.request, seq.num_computed_tokens)
        if self.states is not None:
            row = self._state_rows[lease] = self.states.allocate()  # zeroed: the state before any token
            if lease.restore_recurrent_slot is not None:
                assert self.recurrent_snapshots is not None, "a checkpoint hit without a recurrent snapshot store"
                self.recurrent_snapshots.restore(lease.restore_recurrent_slot, row)
        if lease.restore_slot is not None:
            assert self.snapshots is not None, "a snapshot hit without a snapshot store"
            # Copy-on-partial-reuse: the snapshot goes into the sequence's own page, which it then extends.
            self.snapshots.restore(lease.restore_slot, lease.page_ids[lease.reuse_tokens // self.cache.tokens_per_page])
        if lease.restore_slot is not None or lease.restore_recurrent_slot is not None:
            self.cache.finish_restore(lease)
        self._restore_system_prompt(seq)

    def _on_release(self, lease: Lease) -> None:
        """A sequence finished or was preempted: its state row goes back (a preempted one restarts from a checkpoint
        or from zero, like its pages)."""
        row = self._state_rows.pop(lease, None)
        if row is not None:
            assert self.states is not None
            self.states.free(row)

    def _capture_recurrent(self, lease: Lease, slot: int) -> None:
        assert self.recurrent_snapshots is not None
        self.recurrent_snapshots.capture(self._state_rows[lease], slot)

    def _restore_system_prompt(self, seq: Sequence) -> None:
        key = seq.request.system_prompt_key
        if key is None or seq.num_computed_tokens or seq.lease is None:
            return
        restored = self.system_prompts.restore(key, seq.prompt_ids, seq.lease.page_ids)
        if restored:
            seq.num_computed_tokens = restored
            if seq.num_preemptions == 0:
                seq.reused_tokens = restored

    def _save_system_prompt(self, seq: Sequence) -> None:
        key = seq.request.system_prompt_key
        if key is not None and not seq.reused_tokens and seq.lease is not None:
            self.system_prompts.save(key, seq.request.system_prompt_ids, seq.prompt_ids, seq.lease.page_ids)

    # --- reporting ----------------------------------------------------------------------------------

    @property
    def kv_pool_bytes(self) -> int:
        return int(self.runner.pool.nbytes)

    def profile(self) -> dict:
        """The profile JSON object: stages and token counters, the cache block (reuse on) and the scheduler's."""
        self.profiler.note_peak_memory(self.kv_pool_bytes)
        data = self.profiler.to_dict(self.cache.profile() if self.cache.enabled else None,
                                     scheduler=self.scheduler.stats.to_dict())
        # Which path attention took (kvforge's CPU kernel or the pure-ONNX fallback): speed depends on it.
        data["engine"] = {"backend": self.engine.build.backend, "attention": self.engine.build.attention}
        return {**data, **self.multimodal.profile()} if self.multimodal else data


def snapshot_budgets(engine: EngineDir, slots: int, partial_kv: bool = False) -> dict[str, int]:
    """EngineConfig's snapshot budgets for `slots` slots of each pool this engine needs with reuse on: recurrent and
    hybrid engines both of theirs; an attention-only engine partial-KV snapshots only when asked (`partial_kv`)."""
    build = engine.build
    budgets = {}
    if build.recurrent_snapshot_bytes_per_slot:
        budgets["context_cache_recurrent_snapshot_pool_bytes"] = slots * build.recurrent_snapshot_bytes_per_slot
    if build.partial_kv_snapshot_bytes_per_slot and (partial_kv or build.recurrent_snapshot_bytes_per_slot):
        budgets["context_cache_partial_kv_snapshot_pool_bytes"] = slots * build.partial_kv_snapshot_bytes_per_slot
    return budgets


def deployment_of(model: ModelConfig) -> Deployment:
    """Attention layers only, recurrent layers only, or both (what the cache may reuse follows from it)."""
    attention = len(model.attention_layer_ids)
    if attention == model.num_hidden_layers:
        return Deployment.VANILLA
    return Deployment.PURE_RECURRENT if attention == 0 else Deployment.HYBRID


def _partial_kv_snapshot_slots(config: EngineConfig, engine: EngineDir, deployment: Deployment) -> int:
    """Slots the partial-KV snapshot budget holds; a budget that holds none, or without reuse, is an error, and
    a hybrid engine with reuse needs one slot at least (its checkpoints' tail pages)."""
    budget, field = config.context_cache_partial_kv_snapshot_pool_bytes, "context_cache_partial_kv_snapshot_pool_bytes"
    if budget and deployment is Deployment.PURE_RECURRENT:
        raise InvalidConfig("this engine has no attention layers, so no partial pages to snapshot; use 0", field)
    per_slot = engine.build.partial_kv_snapshot_bytes_per_slot
    slots = _snapshot_budget(config, budget, field, per_slot, "partial-KV snapshot slot (a K+V page per attention "
                             "layer)")
    if config.enable_context_reuse and deployment is Deployment.HYBRID and slots == 0:
        raise InvalidConfig(f"a hybrid engine reuses exact checkpoints, whose partial tail page needs a partial-KV "
                            f"snapshot: give at least one slot ({per_slot} bytes)", field)
    return slots


def _recurrent_snapshot_slots(config: EngineConfig, engine: EngineDir, deployment: Deployment) -> int:
    """Slots the recurrent snapshot budget holds; required (>= 1) for recurrent and hybrid engines with reuse."""
    budget, field = config.context_cache_recurrent_snapshot_pool_bytes, "context_cache_recurrent_snapshot_pool_bytes"
    if budget and deployment is Deployment.VANILLA:
        raise InvalidConfig("this engine has attention layers only, so no recurrent state to snapshot; use 0", field)
    per_slot = engine.build.recurrent_snapshot_bytes_per_slot
    slots = _snapshot_budget(config, budget, field, per_slot, "recurrent snapshot slot (every recurrent layer's "
                             "state and conv state)")
    if config.enable_context_reuse and deployment is not Deployment.VANILLA and slots == 0:
        raise InvalidConfig(f"a {deployment.name.lower().replace('_', ' ')} engine reuses exact checkpoints only, "
                            f"which need recurrent snapshots: give at least one slot ({per_slot} bytes)", field)
    if config.snapshot_interval_tokens < 0:
        raise InvalidConfig(f"must be >= 0 (0 = off), got {config.snapshot_interval_tokens}",
                            "snapshot_interval_tokens")
    if config.snapshot_interval_tokens and not slots:
        raise InvalidConfig("periodic checkpoints need a recurrent snapshot pool (and --enableContextReuse)",
                            "snapshot_interval_tokens")
    return slots


def _snapshot_budget(config: EngineConfig, budget: int, field: str, per_slot: int, what: str) -> int:
    if budget < 0:
        raise InvalidConfig(f"must be >= 0, got {budget}", field)
    if budget == 0:
        return 0
    if not config.enable_context_reuse:
        raise InvalidConfig("a snapshot pool budget requires context reuse (enable_context_reuse)", field)
    slots = snapshot_slots(budget, per_slot)
    if slots == 0:
        raise InvalidConfig(f"{budget} bytes hold no {what}: one slot takes {per_slot} bytes on this engine", field)
    return slots


def _resolve_limits(config: EngineConfig, max_input_len: int, engine_batch: int) -> tuple[int, int]:
    """(token budget per step, rows per step), checked against the engine's build limits."""
    if config.num_threads < 0:
        raise InvalidConfig(f"must be >= 0, got {config.num_threads}", "num_threads")
    if config.prefill_chunk_size < 0:
        raise InvalidConfig(f"must be >= 0, got {config.prefill_chunk_size}", "prefill_chunk_size")
    if config.max_num_tokens < 0:
        raise InvalidConfig(f"must be >= 0 (0 = maxInputLen), got {config.max_num_tokens}", "max_num_tokens")
    if not 0 <= config.max_batch_size <= engine_batch:
        raise InvalidConfig(f"must be in [0, the engine's maxBatchSize {engine_batch}], got {config.max_batch_size}",
                            "max_batch_size")
    return config.max_num_tokens or max_input_len, config.max_batch_size or engine_batch


__all__ = ["Engine", "EngineConfig", "EngineRequest", "RequestOutput", "Status"]

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
from kvforge.contract.geometry import partial_kv_bytes_per_slot, snapshot_slots
from kvforge.contract.paging import pages_for
from kvforge.contract.safetensors_map import map_tensor
from kvforge.runtime.backends import load_runner
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
from kvforge.runtime.snapshots import PartialKVSnapshotStore
from kvforge.runtime.system_prompt_cache import SystemPromptCache
from kvforge.runtime.types import CommitPolicy

# Long prompts prefill faster in chunks on the CPU: the masked score matrix grows with the square of the
# call's length. bench/prefill_chunks.py measured a 1,536-token SmolLM2 prefill 1.36x faster at 512
# (1.43x at 256, which would split more of the short prompts that gain nothing).
DEFAULT_PREFILL_CHUNK_TOKENS = 512


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


class Engine:
    def __init__(self, engine_dir: Path | str, config: EngineConfig = EngineConfig(),
                 runner: EngineRunner | None = None, profiler: Profiler | None = None) -> None:
        self.config = config
        self.engine: EngineDir = load_engine_dir(Path(engine_dir))
        build = self.engine.build
        budget = _resolve_limits(config, build.max_input_len, build.max_batch_size)
        partial_slots = _partial_kv_snapshot_slots(config, self.engine)
        self.cache = ContextCacheManager(build.max_kv_pool_pages, build.tokens_per_page,
                                         enabled=config.enable_context_reuse,
                                         max_records=config.context_cache_max_records,
                                         partial_kv_snapshot_slots=partial_slots)
        from kvforge.runtime.tokenizer import ChatTokenizer  # after the cheap checks: loading it takes a moment

        self.tokenizer = ChatTokenizer(self.engine.path)
        self.loras = LoraRegistry(self.engine)
        self.inputs = InputProcessor(self.tokenizer, self.loras, build.max_input_len, config.enable_context_reuse,
                                     self.engine.model.vocab_size)
        embedding = map_tensor(self.engine.file(EMBEDDING_FILE), EMBEDDING_TENSOR)  # rows paged in as looked up
        self.runner = runner or load_runner(self.engine, config.num_threads, embedding)
        self.snapshots = PartialKVSnapshotStore(self.runner.pool, partial_slots) if partial_slots else None
        if self.snapshots is not None:
            self.cache.capture_partial = self.snapshots.capture
        self.model_runner = ModelRunner(self.runner, embedding, lora_input_shapes(self.engine))
        self.outputs = OutputProcessor(self.tokenizer, frozenset(self.engine.model.eos_token_ids),
                                       build.max_kv_cache_capacity)
        self.system_prompts = SystemPromptCache(self.runner.pool)
        # A row computes at most maxInputLen tokens per call (a recompute after preemption can be longer).
        chunk = min(config.prefill_chunk_size or build.max_input_len, build.max_input_len)
        self.scheduler = Scheduler(self.cache, max_batch_size=budget[1], max_num_tokens=budget[0],
                                   prefill_chunk_tokens=chunk,
                                   on_admit=self._on_admit)
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
        from kvforge.runtime.multimodal.processor import MultimodalProcessor
        from kvforge.runtime.multimodal.visual import load_encoder

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
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._sequences:
            raise InvalidConfig(f"request id {request_id!r} is already in flight", "request_id")
        seq = Sequence(request_id, request, Sampler(request.sampling), arrival=next(self._arrivals))
        self._sequences[request_id] = seq
        self.scheduler.add(seq)
        return request_id

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
                    self.cache.publish(seq.lease, seq.prompt_ids)
                    self._save_system_prompt(seq)
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
        if lease is not None and lease.restore_slot is not None:
            assert self.snapshots is not None, "a snapshot hit without a snapshot store"
            # Copy-on-partial-reuse: the snapshot goes into the sequence's own page, which it then extends.
            self.snapshots.restore(lease.restore_slot, lease.page_ids[lease.reuse_tokens // self.cache.tokens_per_page])
            self.cache.finish_restore(lease)
        self._restore_system_prompt(seq)

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
        return {**data, **self.multimodal.profile()} if self.multimodal else data


def _partial_kv_snapshot_slots(config: EngineConfig, engine: EngineDir) -> int:
    """Slots the partial-KV snapshot budget holds; a budget that holds none, or without reuse, is an error."""
    budget, field = config.context_cache_partial_kv_snapshot_pool_bytes, "context_cache_partial_kv_snapshot_pool_bytes"
    if budget < 0:
        raise InvalidConfig(f"must be >= 0, got {budget}", field)
    if budget == 0:
        return 0
    if not config.enable_context_reuse:
        raise InvalidConfig("a snapshot pool budget requires context reuse (enable_context_reuse)", field)
    model, build = engine.model, engine.build
    per_slot = partial_kv_bytes_per_slot(model.num_hidden_layers, model.num_key_value_heads, model.head_dim,
                                         build.tokens_per_page, model.kv_cache_dtype)
    slots = snapshot_slots(budget, per_slot)
    if slots == 0:
        raise InvalidConfig(f"{budget} bytes hold no partial-KV snapshot slot: one slot (a K+V page per attention "
                            f"layer) takes {per_slot} bytes on this engine", field)
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

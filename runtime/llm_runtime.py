"""Runs request batches on an engine: tokenize, acquire pages (reusing cached prefixes), prefill, decode."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

from kvforge.contract.engine_dir import EMBEDDING_FILE, EMBEDDING_TENSOR, EngineDir, load_engine_dir
from kvforge.contract.errors import KvforgeError
from kvforge.runtime.context_cache.keys import KeyExtras
from kvforge.runtime.context_cache.manager import (
    DEFAULT_MAX_RECORDS,
    INCLUDING_GENERATED_TOKENS,
    USE_CACHE,
    Admission,
    ContextCacheManager,
    Lease,
)
from kvforge.runtime.lora import LoraAdapter, LoraRegistry, lora_input_shapes, stack_adapters
from kvforge.runtime.ort_runner import OrtEngineRunner
from kvforge.runtime.profile import GENERATION_STAGE, PREFILL_STAGE, Profiler
from kvforge.runtime.requests import Request, RequestFile
from kvforge.runtime.runner import EngineRunner, StepInputs
from kvforge.runtime.sampling import Sampler, SampleResult
from kvforge.runtime.system_prompt_cache import SystemPromptCache
from kvforge.runtime.tokenizer import ChatTokenizer
from kvforge.runtime.trt_runner import TrtEngineRunner

# Long prompts prefill faster in chunks on the CPU: the masked score matrix grows with the square of the
# call's length. bench/prefill_chunks.py measured a 1,536-token SmolLM2 prefill 1.36x faster at 512
# (1.43x at 256, which would split more of the short prompts that gain nothing).
DEFAULT_PREFILL_CHUNK_TOKENS = 512
FINISH_EOS = "end-of-sequence"
FINISH_LENGTH = "max-length"
FINISH_STOP = "stop-words"


@dataclass(frozen=True, slots=True)
class CachePolicies:
    """The request file's top-level policies; warmup runs use lookup `bypass`."""

    lookup: str = USE_CACHE
    commit: str = INCLUDING_GENERATED_TOKENS


@dataclass(slots=True)
class PreparedRequest:
    request: Request
    formatted_prompt: str
    prompt_ids: list[int]
    adapter: LoraAdapter | None = None
    system_prompt: str = ""
    system_ids: list[int] = field(default_factory=list)

    @property
    def adapter_label(self) -> str:
        return self.adapter.name if self.adapter else "base"


@dataclass(slots=True)
class Sequence:
    """One request in flight: its tokens, its lease on the pool and what it has generated."""

    prepared: PreparedRequest
    sampler: Sampler
    lease: Lease | None = None
    num_cached_tokens: int = 0  # tokens whose K/V are in the pool
    reused_tokens: int = 0  # of those, tokens served from a cache instead of computed
    output_ids: list[int] = field(default_factory=list)
    samples: list[SampleResult] = field(default_factory=list)
    output_text: str = ""
    finish_reason: str | None = None

    @property
    def request(self) -> Request:
        return self.prepared.request

    @property
    def prompt_ids(self) -> list[int]:
        return self.prepared.prompt_ids

    @property
    def page_ids(self) -> list[int]:
        assert self.lease is not None
        return self.lease.page_ids

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def resident_tokens(self) -> list[int]:
        """Tokens whose K/V the pool holds: the prompt and every generated token but the last sampled."""
        return (self.prompt_ids + self.output_ids)[:self.num_cached_tokens]


class LLMRuntime:
    def __init__(self, engine_dir: Path, num_threads: int = 0, runner: EngineRunner | None = None, *,
                 enable_context_reuse: bool = False, context_cache_max_records: int = DEFAULT_MAX_RECORDS,
                 prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS) -> None:
        if prefill_chunk_tokens < 0:
            raise KvforgeError(f"must be >= 0, got {prefill_chunk_tokens}", "--prefillChunkSize")
        self.prefill_chunk_tokens = prefill_chunk_tokens  # 0 = the whole prompt in one call
        self.engine: EngineDir = load_engine_dir(engine_dir)
        build = self.engine.build
        self.cache = ContextCacheManager(build.max_kv_pool_pages, build.tokens_per_page, enabled=enable_context_reuse,
                                         max_records=context_cache_max_records)
        self.tokenizer = ChatTokenizer(engine_dir)
        self.embedding = load_file(str(self.engine.file(EMBEDDING_FILE)))[EMBEDDING_TENSOR]
        self.runner: EngineRunner = runner or (TrtEngineRunner(self.engine) if build.backend == "tensorrt"
                                               else OrtEngineRunner(self.engine, num_threads))
        self.system_prompts = SystemPromptCache()
        self.loras = LoraRegistry(self.engine)
        self._lora_shapes = lora_input_shapes(self.engine)
        self._lora_stack: dict[str, np.ndarray] | None = None
        self._lora_stack_key: tuple[int, ...] = ()
        self.eos_ids = frozenset(self.engine.model.eos_token_ids)

    @property
    def tokens_per_page(self) -> int:
        return self.engine.build.tokens_per_page

    def load_adapters(self, available_lora_weights: dict[str, str], base_dir: Path | None = None) -> None:
        """Load a request file's adapters; each is identified by its weights' digest, not its name."""
        self.loras.load(available_lora_weights, base_dir)
        self._lora_stack_key = ()  # ids of replaced adapters may be reused by new objects

    def prepare(self, request: Request, enable_thinking: bool = False) -> PreparedRequest:
        """Tokenize and check a request against the engine limits before anything runs.

        The whole prompt must fit maxInputLen even when a cached prefix would shorten the computed part,
        so whether a request is accepted never depends on what the cache holds.
        """
        text = self.tokenizer.format(request, enable_thinking)
        ids = self.tokenizer.encode(text)
        where = f"requests[{request.index}].messages"
        if not ids:
            raise KvforgeError("the prompt is empty after tokenization", where)
        limit = self.engine.build.max_input_len
        if len(ids) > limit:
            raise KvforgeError(f"prompt has {len(ids)} tokens, more than the engine's maxInputLen {limit}; "
                               "rebuild with a larger --maxInputLen or shorten the prompt", where)
        prepared = PreparedRequest(request, text, ids, self.loras.get(request.lora_name))
        if request.save_system_prompt_kv_cache:
            if self.cache.enabled:
                raise KvforgeError("the legacy system-prompt cache cannot be combined with --enableContextReuse "
                                   "(which already reuses system prompts)",
                                   f"requests[{request.index}].save_system_prompt_kv_cache")
            prepared.system_prompt = self.tokenizer.format_system_prompt(request)
            prepared.system_ids = self.tokenizer.encode(prepared.system_prompt) if prepared.system_prompt else []
        return prepared

    def check_batch_size(self, request_file: RequestFile) -> None:
        limit = self.engine.build.max_batch_size
        if request_file.batch_size > limit:
            raise KvforgeError(f"{request_file.batch_size} exceeds the engine's maxBatchSize {limit}", "batch_size")

    def generate(self, batch: list[PreparedRequest], batch_idx: int, profiler: Profiler,
                 policies: CachePolicies = CachePolicies()) -> list[dict[str, Any]]:
        sequences = [Sequence(p, Sampler(p.request.sampling)) for p in batch]
        try:
            for seq in sequences:
                adapter = seq.prepared.adapter
                extras = KeyExtras(adapter.digest if adapter else b"", seq.request.cache_salt)
                seq.lease = self.cache.acquire(Admission(seq.prompt_ids, extras, policies.lookup))
                seq.num_cached_tokens = seq.reused_tokens = seq.lease.reuse_tokens
                self._restore_system_prompt(seq)
            started = time.perf_counter()
            prefill_ms = self._prefill(sequences, profiler)
            ttft_ms = (time.perf_counter() - started) * 1e3
            decode_started = time.perf_counter()
            self._decode(sequences, profiler)
            decode_ms = (time.perf_counter() - decode_started) * 1e3
            if policies.commit == INCLUDING_GENERATED_TOKENS:
                for seq in sequences:  # every sequence here finished normally (errors raise before this)
                    self.cache.publish(seq.lease, seq.resident_tokens())
        finally:
            for seq in sequences:
                if seq.lease is not None:
                    self.cache.release(seq.lease)
        profiler.add_generation(sum(max(len(s.output_ids) - 1, 0) for s in sequences))
        for seq in sequences:
            profiler.add_adapter_request(seq.prepared.adapter_label, seq.reused_tokens)
        return [self._response(seq, batch_idx, ttft_ms, prefill_ms, decode_ms) for seq in sequences]

    # --- engine calls -------------------------------------------------------------------------------

    def _run(self, rows: list[Sequence], new_ids: list[list[int]], stage: str, profiler: Profiler) -> np.ndarray:
        """One engine call for all rows, whatever their adapters (LoRA inputs are per row)."""
        for seq, ids in zip(rows, new_ids, strict=True):
            self.cache.grow(seq.lease, seq.num_cached_tokens + len(ids))
        width = max(len(ids) for ids in new_ids)
        embeds = np.zeros((len(rows), width, self.embedding.shape[1]), dtype=np.float32)
        for row, ids in enumerate(new_ids):
            embeds[row, :len(ids)] = self.embedding[ids]
        step = StepInputs(embeds, np.array([len(ids) for ids in new_ids], dtype=np.int32),
                          np.array([s.num_cached_tokens for s in rows], dtype=np.int32),
                          [s.page_ids for s in rows], self._lora_inputs(rows))
        with profiler.stage(stage):
            logits = self.runner.forward(step)
        for seq, ids in zip(rows, new_ids, strict=True):
            seq.num_cached_tokens += len(ids)
        return logits

    def _lora_inputs(self, rows: list[Sequence]) -> dict[str, np.ndarray] | None:
        """Stacked per-row adapters, rebuilt only when the batch's adapter composition changes."""
        adapters = [s.prepared.adapter for s in rows]
        if all(a is None for a in adapters):
            return None
        key = tuple(id(a) for a in adapters)
        if self._lora_stack_key != key:
            self._lora_stack = stack_adapters(adapters, self._lora_shapes)
            self._lora_stack_key = key
        return self._lora_stack

    def _prefill(self, sequences: list[Sequence], profiler: Profiler) -> float:
        """Prefill from each row's reuse point in chunks of at most prefill_chunk_tokens per row, then
        publish the prompt's full pages. A chunk attends to the pages earlier chunks wrote, exactly as a
        reused prefix is attended to, so chunking changes the cost, not the math."""
        started = time.perf_counter()
        computed = sum(len(s.prompt_ids) - s.num_cached_tokens for s in sequences)
        chunk = self.prefill_chunk_tokens or self.engine.build.max_input_len
        last_logits: dict[int, np.ndarray] = {}
        while pending := [i for i, s in enumerate(sequences) if s.num_cached_tokens < len(s.prompt_ids)]:
            rows = [sequences[i] for i in pending]
            chunks = [s.prompt_ids[s.num_cached_tokens:s.num_cached_tokens + chunk] for s in rows]
            for i, row_logits in zip(pending, self._run(rows, chunks, PREFILL_STAGE, profiler), strict=True):
                last_logits[i] = row_logits  # the row's final chunk leaves its prompt's last-token logits
        profiler.add_prefill(reused_tokens=sum(s.reused_tokens for s in sequences), computed_tokens=computed)
        for i, seq in enumerate(sequences):
            row = last_logits[i]
            self.cache.publish(seq.lease, seq.prompt_ids)  # both commit policies publish the prefill state
            self._save_system_prompt(seq)
            self._accept(seq, seq.sampler.sample(row))
        return (time.perf_counter() - started) * 1e3

    def _decode(self, sequences: list[Sequence], profiler: Profiler) -> None:
        capacity = self.engine.build.max_kv_cache_capacity
        while True:
            active = [s for s in sequences if not s.is_finished]
            for seq in active:
                if seq.num_cached_tokens >= capacity:  # no room to feed the last sampled token
                    seq.finish_reason = FINISH_LENGTH
            active = [s for s in active if not s.is_finished]
            if not active:
                return
            logits = self._run(active, [[s.output_ids[-1]] for s in active], GENERATION_STAGE, profiler)
            for seq, row in zip(active, logits, strict=True):
                self._accept(seq, seq.sampler.sample(row))

    def _accept(self, seq: Sequence, sample: SampleResult) -> None:
        seq.samples.append(sample)
        seq.output_ids.append(sample.token_id)
        if sample.token_id in self.eos_ids:
            seq.finish_reason = FINISH_EOS
            return
        stops = seq.request.sampling.stop
        if stops:
            text = self.tokenizer.decode(seq.output_ids)
            hits = [i for i in (text.find(s) for s in stops) if i >= 0]
            if hits:
                seq.output_text = text[:min(hits)]
                seq.finish_reason = FINISH_STOP
                return
        if len(seq.output_ids) >= seq.request.sampling.max_generate_length:
            seq.finish_reason = FINISH_LENGTH

    # --- legacy system-prompt cache -----------------------------------------------------------------

    def _system_key(self, seq: Sequence) -> tuple[str, str]:
        # The adapter's digest, not its name (the seed keys on the name): a reloaded adapter cannot hit.
        adapter = seq.prepared.adapter
        return seq.prepared.system_prompt, adapter.digest.hex() if adapter else ""

    def _restore_system_prompt(self, seq: Sequence) -> None:
        if not seq.prepared.system_ids:
            return
        restored = self.system_prompts.restore(self._system_key(seq), seq.prompt_ids, self.runner.pool,
                                               seq.page_ids)
        if restored:
            seq.num_cached_tokens = seq.reused_tokens = restored

    def _save_system_prompt(self, seq: Sequence) -> None:
        if seq.prepared.system_ids and not seq.reused_tokens:
            self.system_prompts.save(self._system_key(seq), seq.prepared.system_ids, seq.prompt_ids,
                                     self.runner.pool, seq.page_ids)

    # --- output -------------------------------------------------------------------------------------

    def _response(self, seq: Sequence, batch_idx: int, ttft_ms: float, prefill_ms: float,
                  decode_ms: float) -> dict[str, Any]:
        if seq.finish_reason != FINISH_STOP:
            seq.output_text = self.tokenizer.decode(seq.output_ids)
        response: dict[str, Any] = {
            "output_text": seq.output_text,
            "request_idx": seq.request.index,
            "batch_idx": batch_idx,
            "finish_reason": seq.finish_reason,
            "formatted_complete_request": seq.prepared.formatted_prompt,
            "usage": {"prompt_tokens": len(seq.prompt_ids), "completion_tokens": len(seq.output_ids),
                      "cached_tokens": seq.reused_tokens},
            "timing": {"ttft_ms": round(ttft_ms, 3), "prefill_ms": round(prefill_ms, 3),
                       "decode_ms": round(decode_ms, 3)},
        }
        if seq.request.sampling.num_logprobs > 0:
            response["logprobs"] = [[self._logprob_entry(token_id, logprob) for token_id, logprob in s.top_logprobs]
                                    for s in seq.samples]
        return response

    def _logprob_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.tokenizer.token_text(token_id)
        return {"token_id": token_id, "token": text, "bytes": list(text.encode("utf-8")),
                "logprob": round(logprob, 6)}

"""The engine loop every front end drives: add_request, step (schedule → run → postprocess), abort.

`llm_inference`, the Python API (`kvforge.LLM`), the benchmarks and the tests all call `step()` until
their requests finish; none of them re-implements batching, paging or reuse.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvforge.contract.engine_dir import (
    ATTENTION_CPU_KERNEL,
    EMBEDDING_FILE,
    EMBEDDING_TENSOR,
    PER_LAYER_EMBEDDING_FILE,
    BuilderConfig,
    EngineDir,
    load_engine_dir,
)
from kvforge.contract.errors import InvalidConfig, KvforgeError, PoolTooSmall
from kvforge.contract.model_config import ModelConfig
from kvforge.contract.paging import pages_for
from kvforge.contract.profile_schema import ADAPTER_CORRECTIONS, DOCUMENT_KV_PAGES
from kvforge.contract.rope import rope_table
from kvforge.contract.safetensors_map import map_tensor
from kvforge.contract.window_pool import window_call_tokens
from kvforge.plugins.attention_mass import check_attention_mass
from kvforge.plugins.cpu_kernel import cpu_description
from kvforge.runtime.adapters import LoraRegistry, lora_input_shapes, mark_corrected
from kvforge.runtime.context_cache.manager import ContextCacheManager
from kvforge.runtime.context_cache.types.document_chunks import REPAIR_ATTENTION
from kvforge.runtime.context_cache.types.document_repair import ATTENTION_METER
from kvforge.runtime.engine.config import (  # noqa: F401 - EngineConfig and the budget helper are re-exported
    EngineConfig,
    ResolvedConfig,
    deployment_of,
    resolve_engine_config,
    snapshot_budgets,
)
from kvforge.runtime.engine.core import EngineCore, EngineStats
from kvforge.runtime.engine.output import OutputProcessor, RequestOutput
from kvforge.runtime.engine.scheduler import Scheduler, SchedulerStats
from kvforge.runtime.engine.state import StateManager
from kvforge.runtime.execution.backend import Backend
from kvforge.runtime.execution.corrections import AdapterCorrector, check_correction_engine, load_attention_norms
from kvforge.runtime.execution.executor import ModelExecutor
from kvforge.runtime.execution.key_rotation import layer_rotations
from kvforge.runtime.execution.kv_store import DocumentKVStore, KVStore
from kvforge.runtime.execution.load import load_backend
from kvforge.runtime.execution.ort import set_ort_logging  # noqa: F401 - re-exported for llm_inference's --debug
from kvforge.runtime.execution.snapshots import PartialKVSnapshotStore, RecurrentSnapshotStore
from kvforge.runtime.execution.system_prompt_cache import SystemPromptCache
from kvforge.runtime.inputs.processor import InputProcessor, check_prompt_length
from kvforge.runtime.inputs.segments import SEGMENTS_OFF
from kvforge.runtime.kv_events import KvEventPublisher, listeners
from kvforge.runtime.profile import Profiler
from kvforge.runtime.sampling.grammar import CompiledGrammar, GrammarCompiler
from kvforge.runtime.sampling.sampler import Sampler, SampleResult
from kvforge.runtime.sequence import EngineRequest, Sequence, Status
from kvforge.runtime.shared_tier.secret import tier_secret
from kvforge.runtime.shared_tier.stores import open_store
from kvforge.runtime.shared_tier.tier import SharedTier
from kvforge.runtime.spec.methods import ProposerParts
from kvforge.runtime.spec.proposer import Proposer
from kvforge.runtime.types import CommitPolicy, Deployment, Request, SamplingParams

if TYPE_CHECKING:
    from kvforge.runtime.inputs.tokenizer import ChatTokenizer

TIER_CONNECT_WAIT_S = 2.0  # Mooncake's client set-up takes ~0.1-0.5 s here; Redis a round trip
Runner = Backend  # what llm_test hands from one Engine to the next of the same dir (Engine.runner)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What a front end may know of an engine: its model and build (contract data), the limits it runs under, the
    loaded adapters, whether reuse is on, and the tokenizer (for rendering text). Copied at the call."""

    model: ModelConfig
    build: BuilderConfig
    deployment: Deployment
    max_batch_size: int  # rows one step runs (EngineConfig's, or the build's maxBatchSize)
    reuse_enabled: bool
    spec_decode: str
    adapters: tuple[str, ...]  # loaded adapter names, sorted
    tokenizer: ChatTokenizer
    partial_kv_snapshot_slots: int = 0  # reuse to the exact token when > 0 (else by whole pages)

    @property
    def max_input_len(self) -> int:
        return self.build.max_input_len

    @property
    def max_kv_cache_capacity(self) -> int:
        return self.build.max_kv_cache_capacity

    @property
    def attention(self) -> str:
        """Which path attention takes (kvforge's CPU kernel or the pure-ONNX fallback)."""
        return self.build.attention


class Engine:
    def __init__(self, engine_dir: Path | str, config: EngineConfig = EngineConfig(),
                 backend: Backend | None = None, profiler: Profiler | None = None, *,
                 num_pages: int | None = None) -> None:
        """Build every part from the engine dir and `config`, each with its collaborators as arguments (nothing is
        completed afterwards). `backend`: one to reuse instead of loading one; `profiler`: the server's;
        `num_pages`: run on fewer KV pages than the build allocated (tests force waiting and eviction with it)."""
        self.config = config
        self.engine_dir: EngineDir = load_engine_dir(Path(engine_dir))
        build = self.engine_dir.build
        resolved = resolve_engine_config(config, self.engine_dir, num_pages=num_pages)
        self.deployment = resolved.deployment
        from kvforge.runtime.inputs.tokenizer import ChatTokenizer  # after the cheap checks: loading it takes a moment

        self.profiler = profiler or Profiler()
        embedding = map_tensor(self.engine_dir.file(EMBEDDING_FILE), EMBEDDING_TENSOR)  # rows paged in as looked up
        drafting = resolved.draft is not None  # a draft session alternates with the base on the same cores
        self.backend = backend or load_backend(self.engine_dir, config.num_threads, embedding, shares_cores=drafting)
        self.states = self.backend.states
        if (self.states is None) != (self.deployment is Deployment.VANILLA):
            raise InvalidConfig(f"config.json says {self.deployment.name.lower()} layers but the engine's graph "
                                f"{'has no' if self.states is None else 'has'} recurrent states; rebuild it with "
                                "llm_build", "engine_dir")
        partial, recurrent = resolved.partial_kv_snapshot_slots, resolved.recurrent_snapshot_slots
        self.partial_store = PartialKVSnapshotStore(self.backend.kv_store, partial) if partial else None
        self.recurrent_store = RecurrentSnapshotStore(self.states, recurrent) \
            if self.states is not None and recurrent else None
        self.system_prompts = SystemPromptCache(self.backend.kv_store)
        self.state_manager = StateManager(tokens_per_page=build.tokens_per_page, states=self.states,
                                          partial=self.partial_store, recurrent=self.recurrent_store,
                                          system_prompts=self.system_prompts, checkpoints=resolved.checkpoints)
        self.tier = self._shared_tier(config, resolved)
        self.kv_events = self._kv_events(config, build.tokens_per_page)
        spec = resolved.spec
        assert spec is not None  # resolve_engine_config always names the method
        self.spec = spec
        self.corrector = self._corrector(config)
        self.cache = ContextCacheManager(resolved.num_pages, build.tokens_per_page,
                                         enabled=config.enable_context_reuse,
                                         max_records=config.context_cache_max_records,
                                         partial_kv_snapshot_slots=partial, recurrent_snapshot_slots=recurrent,
                                         deployment=self.deployment, copier=self.state_manager,
                                         copiers=self._copiers(config, resolved),
                                         chain_root=resolved.chain_root, events=listeners(self.tier, self.kv_events),
                                         draft_pages=spec.draft_pages(resolved.draft),
                                         draft_replays=resolved.draft is None or spec.support.replays_final_page,
                                         **self._document_options(config),
                                         **self._correction_options(config, resolved.num_pages),
                                         **_window_group(self.engine_dir))
        encoder = _load_encoder(config)
        self.tokenizer = ChatTokenizer(self.engine_dir.path,
                                       media_markers={encoder.kind: encoder.marker} if encoder is not None else {})
        self.multimodal = _multimodal_processor(encoder, config, self.tokenizer, self.profiler,
                                                self.engine_dir.model.hidden_size)
        # response_format and forced-tool grammars compile here, on a worker of their own (cached by schema)
        self.grammars = GrammarCompiler(self.tokenizer.tokenizer, self.engine_dir.model.eos_token_ids)
        self.loras = LoraRegistry(self.engine_dir)
        self.inputs = InputProcessor(self.tokenizer, self.loras, build.max_input_len, config.enable_context_reuse,
                                     self.engine_dir.model.vocab_size, multimodal=self.multimodal,
                                     message_boundaries=resolved.checkpoints.enabled
                                     and config.snapshot_message_boundaries,
                                     segment_min_tokens=config.document_segment_min_tokens
                                     if config.document_segments != SEGMENTS_OFF else 0)
        try:
            drafter = spec.build(ProposerParts(config, self.engine_dir, resolved.draft, self.backend.kv_store.layers,
                                               self.cache, self.profiler, self.states is not None))
        except KvforgeError as exc:  # the draft's graph and weights are --specDraftEngineDir's, not --engineDir's
            if resolved.draft is None or exc.field != "engine_dir" and not str(exc.field).startswith(
                    str(resolved.draft.path)):
                raise
            raise InvalidConfig(f"the draft engine at {resolved.draft.path}: {exc.message}",
                                "spec_draft_engine_dir") from None
        self.profiler.spec_strategy_section = spec.profile_section
        self.proposer: Proposer | None = drafter.proposer if drafter else None
        self.draft_backend: Backend | None = drafter.backend if drafter else None
        model = self.engine_dir.model
        per_layer = map_tensor(self.engine_dir.file(PER_LAYER_EMBEDDING_FILE), EMBEDDING_TENSOR) \
            if model.hidden_size_per_layer_input else None  # Gemma 4's second table, looked up as the first
        self.executor = ModelExecutor(self.backend, embedding, lora_input_shapes(self.engine_dir),
                                      self.state_manager.rows if self.states is not None else None,
                                      all_hidden=self.proposer is not None and self.proposer.owns_kv,
                                      per_layer=per_layer, media_row=model.pad_token_id or 0,
                                      corrector=self.corrector, page_tables=self.cache.page_tables)
        self.outputs = OutputProcessor(self.tokenizer, frozenset(self.engine_dir.model.eos_token_ids),
                                       build.max_kv_cache_capacity)
        self.scheduler = Scheduler(self.cache, self.state_manager, self.outputs, max_batch_size=resolved.max_batch_size,
                                   max_num_tokens=resolved.max_num_tokens,
                                   prefill_chunk_tokens=resolved.prefill_chunk_tokens,
                                   max_seq_tokens=build.max_kv_cache_capacity, loader=self.tier)
        self.core = EngineCore(self.scheduler, self.executor, self.outputs, self.profiler, self.proposer)
        if self.tier is not None:  # connected in the background while the rest loaded; a dead store costs this once
            self.tier.wait_connected(TIER_CONNECT_WAIT_S)
        self._ids = itertools.count()
        self._arrivals = itertools.count()

    # --- front-end calls: every front end reaches the engine through these (tests/test_layering.py) ----------

    @property
    def info(self) -> EngineInfo:
        """The model, build, limits, adapters and switches a front end reads (llm_serve, kvforge.LLM, llm_test)."""
        return EngineInfo(self.engine_dir.model, self.engine_dir.build, self.deployment,
                          self.scheduler.max_batch_size, self.cache.enabled, self.config.spec_decode,
                          tuple(sorted(self.loras.adapters)), self.tokenizer,
                          self.cache.partial_snapshots.capacity if self.cache.enabled else 0)

    @property
    def runner(self) -> Runner:
        """The loaded model runner: an Engine of the same dir built next may take it (`backend=`) instead of loading
        its weights again (llm_test builds one Engine per file, one after another)."""
        return self.backend

    def prepare(self, request: Request | str | Seq[int], sampling: SamplingParams | None = None, *,
                lora_name: str | None = None, cache_salt: str | None = None, enable_thinking: bool = False,
                where: str | None = None, base_dir: Path | None = None) -> EngineRequest:
        """A request checked against this engine's limits, ready for `add_request`: a chat `Request` (the request
        file's; `where` prefixes its errors' field names, `base_dir` resolves its media paths) through the chat
        template, or a raw prompt (text tokenized without a template, or token ids; errors name "prompt") with its
        `sampling`, adapter and salt. Safe beside a running step (the server prepares on other threads)."""
        if isinstance(request, Request):
            return self.inputs.process(request, enable_thinking, where=where, base_dir=base_dir)
        return self.inputs.process_prompt(request, sampling or SamplingParams(), lora_name, cache_salt)

    def prompt_text(self, request: Request, enable_thinking: bool = False) -> str:
        """The formatted prompt as outputs show it (`formatted_complete_request`)."""
        return self.inputs.prompt_text(request, enable_thinking)

    def load_adapters(self, available_lora_weights: dict[str, str], base_dir: Path | None = None) -> None:
        """Load named adapters; each is identified by its weights' digest, not its name."""
        self.loras.load(available_lora_weights, base_dir)
        if self.corrector is not None:  # the option names adapters of this set: refused here if it lacks one
            self.corrector.register(mark_corrected(self.loras, self.config.lora_corrections))
        self.executor.forget_adapters()

    def add_request(self, request: EngineRequest, request_id: str | None = None) -> str:
        """Queue a request; it runs from the next step on. Returns its id."""
        check_prompt_length(len(request.prompt_ids), self.engine_dir.build.max_input_len, "prompt")
        # K/V is held for the prompt and every generated token but the last, up to the capacity.
        need = min(len(request.prompt_ids) + request.sampling.max_generate_length - 1,
                   self.engine_dir.build.max_kv_cache_capacity)
        if not self.cache.fits_alone(need):
            raise PoolTooSmall(f"the KV pool cannot hold this request even alone: it needs "
                               f"{pages_for(need, self.cache.tokens_per_page)} pages and the pool has "
                               f"{self.cache.pages.capacity}; rebuild with a larger --maxKVPoolPages",
                               "max_kv_pool_pages")
        if request.system_prompt_key is not None and self.states is not None:
            raise InvalidConfig("the legacy system-prompt cache keeps K/V only, which cannot restore a recurrent "
                                "model's state; use --enableContextReuse (exact checkpoints)",
                                "save_system_prompt_kv_cache")
        if request.system_prompt_key is not None and self.engine_dir.build.window_pool_pages:
            raise InvalidConfig("the legacy system-prompt cache copies every layer through one page table, which an "
                                "engine built with --slidingWindowPool does not have", "save_system_prompt_kv_cache")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.core.sequences:
            raise InvalidConfig(f"request id {request_id!r} is already in flight", "request_id")
        constraint = None
        if request.sampling.response_format is not None:  # compiled beforehand (llm_serve) or here, once per schema
            grammar = request.grammar or self.grammars.compile(request.sampling.response_format)
            constraint = grammar.constraint()
        sampler = Sampler(request.sampling, constraint, request.prompt_ids)  # the prompt: repetition_penalty's
        seq = Sequence(request_id, request, sampler, arrival=next(self._arrivals))
        if self.proposer is not None and request.sampling.speculative:
            self._apply_support_rows(seq)
        self.core.add(seq)
        return request_id

    def _apply_support_rows(self, seq: Sequence) -> None:
        """The speculation table's per-request rows: media requests decode undrafted (a method with a draft runs
        them cold: no lookup, no publication; counted), a draft with its own K/V pages beside the base, and a
        method whose reuse needs a batch of one gets it only so."""
        request, support = seq.request, self.spec.support
        if request.media:
            seq.request = replace(request, sampling=replace(request.sampling, speculative=False,
                                                            reuse_context=request.sampling.reuse_context
                                                            and not support.media_cold))
            if support.media_cold:
                self.profiler.add_media_cold_request()
            return
        assert self.proposer is not None
        if self.proposer.owns_kv:
            seq.drafts_with_kv = True
        if support.reuse_batch_of_one and self.cache.enabled and request.sampling.reuse_context:
            seq.request = self._single_row_reuse(request)

    def _single_row_reuse(self, request: EngineRequest) -> EngineRequest:
        """The support matrix's hybrid MTP row: reuse needs a batch of one (a larger batch bypasses it, counted)
        and publishes the prefill endpoint only (`prefill_state_only`; a request asking for more is counted)."""
        sampling = request.sampling
        if self.scheduler.max_batch_size > 1:
            self.profiler.add_reuse_bypass()
            return replace(request, sampling=replace(sampling, reuse_context=False))
        if sampling.commit_policy is not CommitPolicy.PREFILL_STATE_ONLY:
            self.profiler.add_prefill_only()
            return replace(request, sampling=replace(sampling, cache_generated_tokens=False))
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its pages are released and nothing of it is published. False if unknown."""
        return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def flush(self) -> bool:
        """Wait (bounded) until what the shared tier queued is written; True without a tier or once it is."""
        return self.tier is None or self.tier.flush()

    def close(self) -> None:
        """Let the shared tier finish saving what was committed (bounded), then release its connections. The
        engine itself holds nothing that outlives the process; without a tier this does nothing."""
        self.grammars.close()
        if self.tier is not None:
            self.tier.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def step(self) -> list[RequestOutput]:
        """Schedule → run one engine call → sample → update (commit, stop, publish, release); the rows' outputs."""
        return self.core.step()

    # --- reporting ----------------------------------------------------------------------------------

    @property
    def kv_pool_bytes(self) -> int:
        return int(self.backend.kv_store.nbytes)

    def reset_counters(self) -> None:
        """Start the profile's stages and counters and the scheduler's counters from zero (benchmark phases)."""
        self.profiler.reset()
        self.scheduler.stats = SchedulerStats()

    def stats(self) -> EngineStats:
        """Queue depths, pool occupancy and counters at this moment (cheap: no walk over cache records), for servers
        and benchmarks; `cache_profile()` is the cache's block when a front end exports it."""
        scheduler, pages, profiler = self.scheduler, self.cache.pages, self.profiler
        return EngineStats(waiting=len(scheduler.waiting), running=len(scheduler.running),
                           loading=len(scheduler.loading), pool_free=pages.num_free, pool_capacity=pages.capacity,
                           prefill_reused_tokens=profiler.prefill_reused_tokens,
                           prefill_computed_tokens=profiler.prefill_computed_tokens,
                           generated_tokens=profiler.generated_tokens,
                           spec_draft_tokens=profiler.spec_draft_tokens,
                           spec_accepted_tokens=profiler.spec_accepted_tokens, scheduler=scheduler.stats.to_dict(),
                           adapter_base_pages=profiler.adapter_base_pages,
                           adapter_corrected_pages=profiler.adapter_corrected_pages,
                           encoder_cache=self.multimodal.cache.to_dict() if self.multimodal is not None else {})

    def profile(self) -> dict:
        """The profile JSON object: stages and token counters, the cache block (reuse on) and the scheduler's."""
        self.profiler.note_peak_memory(self.kv_pool_bytes)
        data = self.profiler.to_dict(self.cache_profile() or None, scheduler=self.scheduler.stats.to_dict())
        # Which path attention took (kvforge's CPU kernel or the pure-ONNX fallback): speed depends on it.
        data["engine"] = {"backend": self.engine_dir.build.backend, "attention": self.engine_dir.build.attention}
        build = self.engine_dir.build
        if build.backend == "onnxruntime":  # the CPU, its SIMD features and the kernel target that ran
            data["engine"]["cpu"] = cpu_description(with_kernel=build.attention == ATTENTION_CPU_KERNEL)
        return {**data, **self.multimodal.profile()} if self.multimodal else data

    def cache_profile(self) -> dict:
        """The profile's context_cache block (empty with reuse off), with the shared tier's counters under
        `shared_tier` when there is one. Built on each call (it walks the records): only when a front end asks."""
        if not self.cache.enabled:
            return {}
        block = self.cache.profile()
        if self.tier is not None:
            block["shared_tier"] = self.tier.profile()
        return block

    def _copiers(self, config: EngineConfig, resolved: ResolvedConfig) -> dict[str, object]:
        """What moves each cache type's bytes besides the snapshots (the state manager's, `copier`): the document
        store (issue 37) and the corrected adapters' engine side (issue 39), when those types are on."""
        copiers: dict[str, object] = {}
        if config.document_reuse:
            model = self.engine_dir.model  # each pool layer's keys move by its own RoPE (issue 53: Gemma)
            copiers[DOCUMENT_KV_PAGES] = DocumentKVStore(self.backend.kv_store, resolved.num_pages,
                                                         layer_rotations(model), model.kv_cache_dtype)
            if config.document_repair == REPAIR_ATTENTION:  # the kernel's mass output, or a one-line refusal
                build = self.engine_dir.build
                copiers[ATTENTION_METER] = check_attention_mass(build.attention, build.kernel_kv_write)
        if self.corrector is not None:
            copiers[ADAPTER_CORRECTIONS] = self.corrector
        return copiers

    @staticmethod
    def _document_options(config: EngineConfig) -> dict:
        """The document type's options (issue 37): its switch and repair policy."""
        return {"document_reuse": True, "document_repair": config.document_repair,
                "document_repair_budget": config.document_repair_budget} if config.document_reuse else {}

    def _correction_options(self, config: EngineConfig, num_pages: int) -> dict:
        """The adapter_corrections type's budget (0: the type's default), bounded by what the pool can use."""
        if self.corrector is None:
            return {}
        if config.lora_correction_pages < 0:
            raise InvalidConfig(f"must be >= 0, got {config.lora_correction_pages}", "lora_correction_pages")
        # One slot per corrected adapter and base page: more can never be filled, and the pool's bookkeeping is
        # allocated up front (10^12 slots ended in a MemoryError).
        adapters = len(config.lora_corrections)
        if config.lora_correction_pages > num_pages * adapters:
            raise InvalidConfig(f"must be at most the KV pool's {num_pages} pages x {adapters} corrected adapters = "
                                f"{num_pages * adapters} (one slot per adapter and base page; 0 = that), got "
                                f"{config.lora_correction_pages}", "lora_correction_pages")
        return {"adapter_correction_pages": config.lora_correction_pages} if config.lora_correction_pages else {}

    def _corrector(self, config: EngineConfig) -> AdapterCorrector | None:
        """Corrected adapters' engine side (issue 39), only when `lora_corrections` names some; refused in one line
        on an engine the correction cannot serve."""
        if not config.lora_corrections:  # its support row's refusals (reuse, engines, speculation) came first
            return None
        repeated = sorted({name for name in config.lora_corrections if config.lora_corrections.count(name) > 1})
        if repeated:
            raise InvalidConfig(f"names adapter {repeated[0][:60]!r} more than once", "lora_corrections")
        check_correction_engine(self.engine_dir, self.deployment)
        if not isinstance(self.backend.kv_store, KVStore):
            raise InvalidConfig("corrected adapters need the onnxruntime backend's host KV pool", "lora_corrections")
        model, build = self.engine_dir.model, self.engine_dir.build
        norms, eps = load_attention_norms(self.engine_dir)
        return AdapterCorrector(self.backend.kv_store, rope_table(build.max_kv_cache_capacity, model.rotary_dim,
                                                                  model.rope_theta),
                                model.kv_cache_dtype, model.num_key_value_heads, model.head_dim, norms, eps,
                                tuple(config.lora_corrections))

    def _kv_events(self, config: EngineConfig, tokens_per_page: int) -> KvEventPublisher | None:
        """The KV event publisher (--kvEventsEndpoint); LoRA names are looked up when an event is built, so adapters
        loaded later are named."""
        if not (config.kv_events_endpoint and config.enable_context_reuse):
            return None

        def lora_name(digest: bytes) -> str | None:
            return next((name for name, a in self.loras.adapters.items() if a.digest == digest), None)

        return KvEventPublisher(config.kv_events_endpoint, tokens_per_page=tokens_per_page,
                                topic=config.kv_events_topic, lora_name=lora_name)

    def _shared_tier(self, config: EngineConfig, resolved: ResolvedConfig) -> SharedTier | None:
        """The tier below the pool (--sharedCache), reading and writing this engine's pool, rows and snapshots."""
        if not (config.shared_cache and config.enable_context_reuse):
            return None
        store = open_store(config.shared_cache, config.shared_cache_timeout_ms / 1e3)
        return SharedTier(store, root=resolved.chain_root, tokens_per_page=self.engine_dir.build.tokens_per_page,
                          kv=self.backend.kv_store if resolved.num_pages else None, states=self.states,
                          state_rows=self.state_manager.rows, partial=self.partial_store,
                          recurrent=self.recurrent_store, timeout_s=config.shared_cache_timeout_ms / 1e3,
                          secret=tier_secret(config.shared_cache_secret, encrypt=config.shared_cache_encrypt,
                                             read_secrets=config.shared_cache_read_secrets))


def _load_encoder(config: EngineConfig):  # -> VisualEncoder | AudioEncoder | None
    if not config.multimodal_engine_dir:
        return None
    from kvforge.runtime.inputs.multimodal.encoders import load_encoder  # Pillow and the encoder only when asked

    return load_encoder(Path(config.multimodal_engine_dir), config.num_threads)


def _multimodal_processor(encoder, config: EngineConfig, tokenizer, profiler: Profiler,
                          hidden_size: int):  # -> MultimodalProcessor | None
    if encoder is None:
        return None
    from kvforge.runtime.inputs.multimodal.encoder_cache import EncoderCache
    from kvforge.runtime.inputs.multimodal.processor import MultimodalProcessor

    return MultimodalProcessor(encoder, EncoderCache(config.encoder_cache_budget_bytes), tokenizer, profiler,
                               hidden_size)


__all__ = ["CompiledGrammar", "Engine", "EngineConfig", "EngineInfo", "EngineRequest", "EngineStats", "RequestOutput",
           "Runner", "SampleResult", "Status", "deployment_of", "set_ort_logging", "snapshot_budgets"]


def _window_group(engine: EngineDir) -> dict[str, int]:
    """The sliding-window page group's options for the cache (none on an engine built without one)."""
    if not engine.build.window_pool_pages:
        return {}
    return {"sliding_window": engine.model.sliding_window, "sliding_window_pages": engine.build.window_pool_pages,
            "sliding_window_call_tokens": window_call_tokens(engine.model.sliding_window, engine.build.tokens_per_page,
                                                             engine.build.max_input_len)}

"""The profile JSON's section, stage and counter names, spelled once so its writer and llm_profile agree."""

# Names follow TensorRT Edge-LLM's profile (examples/utils/profileFormatter.cpp, tensorrt-edge-llm.md §2.4) so
# scripts written for that tool read kvforge profiles unchanged. Field names inside the prefill, generation and
# stages entries are spelled where they are written (kvforge/runtime/profile.py) and read
# (kvforge/tools/profile/report.py).

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

# ------------------------------------------------------------------------------------------------ stages

# `stages[].stage_id` of the engine calls; the prefill and generation sections take their times from these.
PREFILL_STAGE = "llm_prefill"
GENERATION_STAGE = "llm_generation"
SPEC_DRAFT_PROPOSAL_STAGE = "spec_decode_draft_proposal"  # TensorRT Edge-LLM's stage id for drafting
SPEC_BASE_VERIFICATION_STAGE = "spec_decode_base_verification"  # engine calls of steps that verify drafts
SPEC_DRAFT_ACCEPT_STAGE = "spec_decode_draft_accept"  # acceptance (greedy match or rejection sampling)
BLOCK_DIFFUSION_DENOISE_STAGE = "block_diffusion_denoise"  # a block draft's one call over a block of masks
# kvforge only: each engine call's wall time outside ONNX Runtime (the runner's Python: inputs, binding, outputs)
ENGINE_CALL_PYTHON_STAGE = "engine_call_python"

# ------------------------------------------------------------------------------------------ top-level sections

PREFILL = "prefill"
CONTEXT_CACHE = "context_cache"
GENERATION = "generation"
SCHEDULER = "scheduler"
PER_ADAPTER = "per_adapter"  # kvforge only; llm_profile also finds it inside context_cache
# per_adapter[name] counter: whole base pages (no adapter identity) an adapter's requests reused
ADAPTER_BASE_PAGES = "base_pages_reused"
# per_adapter[name] counter: whole base pages a corrected adapter's requests started from (copied, then corrected)
ADAPTER_CORRECTED_PAGES = "corrected_pages"
STAGES = "stages"
KVFORGE_SECTIONS = (PREFILL, CONTEXT_CACHE, GENERATION, SCHEDULER, PER_ADAPTER, STAGES)

# Written only by TensorRT Edge-LLM (speculative decoding, multimodal encoders, Omni talker); llm_profile reads them.
EAGLE_GENERATION = "eagle_generation"
MTP_GENERATION = "mtp_generation"
SPEC_DECODE_GENERATION = "spec_decode_generation"
MULTIMODAL = "multimodal"
TALKER = "talker"
EDGE_LLM_SECTIONS = (EAGLE_GENERATION, MTP_GENERATION, SPEC_DECODE_GENERATION, MULTIMODAL, TALKER)

SECTIONS = KVFORGE_SECTIONS + EDGE_LLM_SECTIONS

# Top-level memory figures, each written twice: `<figure>_bytes` and `<figure>_mb` (MiB).
PEAK_CPU_MEMORY = "peak_cpu_memory"
KV_POOL = "kv_pool"  # kvforge only: the KV pool the runtime allocated
PEAK_GPU_MEMORY = "peak_gpu_memory"  # TensorRT Edge-LLM on a discrete GPU
PEAK_UNIFIED_MEMORY = "peak_unified_memory"  # TensorRT Edge-LLM on an integrated GPU
MEMORY_FIGURES = (PEAK_CPU_MEMORY, KV_POOL, PEAK_GPU_MEMORY, PEAK_UNIFIED_MEMORY)


def bytes_key(figure: str) -> str:
    """`peak_cpu_memory` → `peak_cpu_memory_bytes`."""
    return f"{figure}_bytes"


def mb_key(figure: str) -> str:
    """`peak_cpu_memory` → `peak_cpu_memory_mb`."""
    return f"{figure}_mb"


MEMORY_KEYS = frozenset(key(figure) for figure in MEMORY_FIGURES for key in (bytes_key, mb_key))
TOP_LEVEL_KEYS = frozenset(SECTIONS) | MEMORY_KEYS

# ------------------------------------------------------------------------------------------------ context_cache
# Counters are cumulative over the process, warmup included. Keys are listed in the order they are written.

ADMITTED_SEQUENCES = "admitted_sequences"
HIT_SEQUENCES = "hit_sequences"  # matched > 0
MEDIA_AWARE_SEQUENCES = "media_aware_sequences"
LOOKUP_BYPASS_SEQUENCES = "lookup_bypass_sequences"  # bypass policy or forced cold
FORCED_COLD_SEQUENCES = "forced_cold_sequences"
SEQUENCE_COUNTERS = (ADMITTED_SEQUENCES, HIT_SEQUENCES, MEDIA_AWARE_SEQUENCES, LOOKUP_BYPASS_SEQUENCES,
                     FORCED_COLD_SEQUENCES)

MATCHED_TOKENS = "matched_tokens"
REUSED_TOKENS = "reused_tokens"
TOKEN_COUNTERS = (MATCHED_TOKENS, REUSED_TOKENS)

# `plans`: admitted sequences that looked the cache up, by the kind of reuse plan they got.
PLANS = "plans"
PLAN_STANDARD = "standard"
PLAN_NO_REUSABLE_PREFIX = "no_reusable_prefix"
PLAN_FULL_INPUT_REWIND = "full_input_rewind"
PLAN_KINDS = (PLAN_STANDARD, PLAN_NO_REUSABLE_PREFIX, PLAN_FULL_INPUT_REWIND)

PUBLICATIONS = "publications"
PUBLICATION_ATTEMPTS = "attempts"
PUBLICATIONS_COMMITTED = "committed"
PUBLICATIONS_EXISTING = "existing"
SUCCESSFUL_ENDPOINTS = "successful_endpoints"  # committed + existing
PUBLICATION_KEYS = (PUBLICATION_ATTEMPTS, PUBLICATIONS_COMMITTED, PUBLICATIONS_EXISTING, SUCCESSFUL_ENDPOINTS)

# `hybrid` counts snapshot restores (a request's checkpoint copied in: recurrent and/or partial-KV, one per request),
# captures skipped for want of a slot, and captures (each waits for the engine call that wrote the state).
# `speculative` stays all zero until speculative decoding lands: it exists so that scripts written for
# TensorRT Edge-LLM find the keys.
HYBRID = "hybrid"
HYBRID_RESTORES = "restores"
SNAPSHOT_PRESSURE_SKIPS = "snapshot_pressure_skips"
CAPTURE_SYNCHRONIZATIONS = "capture_synchronizations"
HYBRID_KEYS = (HYBRID_RESTORES, SNAPSHOT_PRESSURE_SKIPS, CAPTURE_SYNCHRONIZATIONS)

SPECULATIVE = "speculative"
FULL_PAGE_REPLAYS = "full_page_replays"
PAIR_PUBLICATIONS = "pair_publications"
SPECULATIVE_KEYS = (FULL_PAGE_REPLAYS, PAIR_PUBLICATIONS)
SPECULATIVE_BLOCK: Mapping[str, int] = MappingProxyType(dict.fromkeys(SPECULATIVE_KEYS, 0))

# `documents` counts document reuse (issue 37, --documentReuse): document spans admitted requests carried, how many
# were restored from a stored form, the tokens restored (reused) and recomputed in place (repaired), the pages' worth
# of stored K/V rotated into requests, and the standalone prefills that produced stored forms. All zero without it.
DOCUMENTS = "documents"
DOCUMENTS_SEEN = "documents_seen"
DOCUMENT_HITS = "document_hits"
DOCUMENT_REUSED_TOKENS = "reused_tokens"
DOCUMENT_REPAIRED_TOKENS = "repaired_tokens"
DOCUMENT_ROTATED_PAGES = "rotated_pages"
DOCUMENTS_PRODUCED = "documents_produced"
# `--documentRepair attention` (issue 53): question passes whose attention mass was read, and the tokens they chose
DOCUMENT_ATTENTION_PASSES = "attention_passes"
DOCUMENT_ATTENTION_REPAIRED_TOKENS = "attention_repaired_tokens"
# Document parts that could not be reused, by reason (issue 53): shorter than 16 tokens, tokens not told apart from
# their neighbours' (a tokenizer that cannot encode the parts on their own), or refused (the template moved it, a
# media prompt, under an activated LoRA, holding the prompt's last token, longer than the document pool).
SKIP_TOO_SHORT, SKIP_EDGE_MERGE, SKIP_REFUSED = "too_short", "edge_merge", "refused"
SKIP_REASONS = (SKIP_TOO_SHORT, SKIP_EDGE_MERGE, SKIP_REFUSED)
DOCUMENTS_SKIPPED = {reason: f"skipped_{reason}" for reason in SKIP_REASONS}
DOCUMENT_KEYS = (DOCUMENTS_SEEN, DOCUMENT_HITS, DOCUMENT_REUSED_TOKENS, DOCUMENT_REPAIRED_TOKENS,
                 DOCUMENT_ROTATED_PAGES, DOCUMENTS_PRODUCED, *DOCUMENTS_SKIPPED.values(), DOCUMENT_ATTENTION_PASSES,
                 DOCUMENT_ATTENTION_REPAIRED_TOKENS)

# Sliding-window checkpoints (engines built with --slidingWindowPool): hits that took a record's window pages, and
# records published without one (the lease had freed part of it).
SLIDING_WINDOW = "sliding_window"
WINDOW_HITS = "hits"
WINDOW_SKIPS = "skips"

# `adapter_corrections` counts corrected adapters (lora_corrections, issue 39): base pages copied and corrected for
# their requests, factor slots written, and pages published without factors because the pool was full. All zero
# without the option.
CORRECTION_STORED_PAGES = "stored_pages"
CORRECTION_SKIPPED_PAGES = "skipped_pages"
CORRECTION_KEYS = (ADAPTER_CORRECTED_PAGES, CORRECTION_STORED_PAGES, CORRECTION_SKIPPED_PAGES)

PLANNING_NANOSECONDS = "planning_nanoseconds"

RECORDS = "records"
RECORDS_CURRENT = "current"
RECORDS_EVICTED = "evicted"
RECORD_KEYS = (RECORDS_CURRENT, RECORDS_EVICTED)

# `resource_pools` ({pool: {free, capacity}}) and `reclaimed_resources` ({pool: slots freed by eviction}) list
# TensorRT Edge-LLM's four pools. kvforge has base KV pages (capacity 0 on a pure recurrent deployment),
# recurrent snapshots (hybrid and pure recurrent deployments) and partial-KV snapshots (capacity 0 without a
# budget); draft pages are written empty (free 0, capacity 0) until speculative decoding lands.
RESOURCE_POOLS = "resource_pools"
RECLAIMED_RESOURCES = "reclaimed_resources"
BASE_KV_PAGES = "base_kv_pages"
DRAFT_KV_PAGES = "draft_kv_pages"
RECURRENT_SNAPSHOTS = "recurrent_snapshots"
PARTIAL_KV_SNAPSHOTS = "partial_kv_snapshots"
DOCUMENT_KV_PAGES = "document_kv_pages"  # kvforge only: stored documents' pages (capacity 0 without document reuse)
SLIDING_WINDOW_PAGES = "sliding_window_pages"  # the sliding layers' own pages (engines built with --slidingWindowPool)
# kvforge only: corrected adapters' factors, one slot per (adapter, base page) (capacity 0 without lora_corrections)
ADAPTER_CORRECTIONS = "adapter_corrections"
POOL_KEYS = (BASE_KV_PAGES, DRAFT_KV_PAGES, RECURRENT_SNAPSHOTS, PARTIAL_KV_SNAPSHOTS, DOCUMENT_KV_PAGES,
             SLIDING_WINDOW_PAGES, ADAPTER_CORRECTIONS)
POOL_FREE = "free"
POOL_CAPACITY = "capacity"
EMPTY_POOL: Mapping[str, int] = MappingProxyType({POOL_FREE: 0, POOL_CAPACITY: 0})

# ------------------------------------------------------------------------------------------------ scheduler
# The engine loop's scheduler, over the whole process.

SCHEDULER_STEPS = "steps"
SCHEDULER_MIXED_STEPS = "mixed_steps"
SCHEDULER_PREEMPTIONS = "preemptions"
SCHEDULER_MAX_RUNNING = "max_running"  # most sequences running at once
SCHEDULER_INFLIGHT_PREFIX_WAITS = "inflight_prefix_waits"
SCHEDULER_KEYS = (SCHEDULER_STEPS, SCHEDULER_MIXED_STEPS, SCHEDULER_PREEMPTIONS, SCHEDULER_MAX_RUNNING,
                  SCHEDULER_INFLIGHT_PREFIX_WAITS)

"""Run-time engine settings (each declared once, with its CLI flag and help) and their one check against a build.

`resolve_engine_config` turns an `EngineConfig` and an engine dir into every size the engine's parts are built
with, or raises `InvalidConfig` naming the setting; nothing is allocated before it has answered.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvforge.contract.engine_dir import EngineDir
from kvforge.contract.errors import InvalidConfig
from kvforge.contract.files import read_json
from kvforge.contract.formats import MANIFEST_FILE
from kvforge.contract.geometry import snapshot_slots
from kvforge.contract.memory import available_memory_bytes, check_fits_memory
from kvforge.contract.model_config import ModelConfig
from kvforge.contract.speculation import BLOCK_DRAFTS, DRAFT_METHODS, TREE_METHODS, in_words, spec_decode_help
from kvforge.contract.window_pool import window_call_tokens
from kvforge.runtime.context_cache.keys import EngineFingerprint, chain_root
from kvforge.runtime.context_cache.manager import DEFAULT_MAX_RECORDS
from kvforge.runtime.context_cache.registry import support_rows
from kvforge.runtime.context_cache.support import check_support
from kvforge.runtime.context_cache.types.document_chunks import (  # noqa: F401 - REPAIR_POLICIES is re-exported
    DEFAULT_REPAIR,
    REPAIR_POLICIES,
)
from kvforge.runtime.context_cache.types.document_repair import DEFAULT_REPAIR_BUDGET, check_budget
from kvforge.runtime.engine.state import CheckpointPolicy
from kvforge.runtime.execution.key_rotation import layer_rotations
from kvforge.runtime.execution.kv_store import ROTATION_CHECK_TOLERANCE, rotation_error
from kvforge.runtime.inputs.multimodal.encoder_cache import DEFAULT_ENCODER_CACHE_BUDGET_BYTES
from kvforge.runtime.inputs.segments import DEFAULT_SEGMENT_MIN_TOKENS, SEGMENTS_OFF, check_segment_options
from kvforge.runtime.shared_tier.secret import READ_SECRETS_ENV, SECRET_ENV, check_secret
from kvforge.runtime.shared_tier.store import check_store_url
from kvforge.runtime.spec.methods import (  # noqa: F401 - the draft sizes are re-exported for the front ends
    DEFAULT_SPEC_DRAFT_TOKENS,
    MAX_SPEC_DRAFT_TOKENS,
    MAX_SPEC_DRAFT_TOP_K,
    SCHEDULER_OFF,
    SPEC_OFF,
    Base,
    DraftKV,
    SpecMethod,
    check_spec_options,
)
from kvforge.runtime.spec.ngram import DEFAULT_MAX_N, DEFAULT_MIN_N
from kvforge.runtime.types import Deployment

# Long prompts prefill faster in chunks on the CPU: the masked score matrix grows with the square of the
# call's length. experiments/engine/prefill_chunks.py measured a 1,536-token SmolLM2 prefill 1.36x faster at 512
# (1.43x at 256, which would split more of the short prompts that gain nothing).
DEFAULT_PREFILL_CHUNK_TOKENS = 512
# The default: one store round trip on a LAN is ~1 ms; a batch of 8 MiB of pages takes ~15 ms on Redis here.
DEFAULT_SHARED_CACHE_TIMEOUT_MS = 50.0
MAX_SHARED_CACHE_TIMEOUT_MS = 60_000.0  # one store call; a minute is already far past making a request cold


@dataclass(frozen=True, slots=True)
class EngineOption:
    """How front ends offer one EngineConfig field: llm_inference and llm_serve derive their typer options from it,
    ENGINE_FLAGS its flag for error messages, and kvforge.LLM takes the field name as a keyword."""

    flag: str | None  # the CLI flag (camelCase, the spelling users know); None: kvforge.LLM only, no CLI flag
    help: str
    off_flag: str | None = None  # a bool that is on by default: the flag that turns it off
    path: bool = False  # CLIs take a path; the engine gets it as a str
    requires_reuse: bool = False  # a non-zero value is refused without --enableContextReuse (before loading)


OPTION = "kvforge.engine_option"  # the key of an EngineConfig field's metadata that holds its EngineOption


def _option(default: Any, flag: str | None, help: str, **kwargs: Any) -> Any:
    return field(default=default, metadata={OPTION: EngineOption(flag, help, **kwargs)})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Run-time settings (the build fixed the rest). 0 means "the engine's own limit" for the sizes.

    Each field is declared once, with its default, CLI flag and help (`EngineOption`); every front end derives
    its options from here (`engine_options`)."""

    num_threads: int = _option(0, "--numThreads", "CPU threads for the engine; 0 = onnxruntime default.")
    enable_context_reuse: bool = _option(
        False, "--enableContextReuse", "Reuse KV pages of repeated prefixes (documents, earlier turns, generated "
        "continuations) across requests and batches.")
    context_cache_max_records: int = _option(
        DEFAULT_MAX_RECORDS, "--contextCacheMaxRecords", "Max retained cache records (0 = publish then evict at "
        "once).")
    prefill_chunk_size: int = _option(
        DEFAULT_PREFILL_CHUNK_TOKENS, "--prefillChunkSize", "Max prompt tokens per row in one prefill call; longer "
        "prompts run in chunks (faster on the CPU). 0 = one call per prompt.")
    max_num_tokens: int = _option(
        0, "--maxNumTokens", "Token budget of one engine step (prefill chunks + decode rows); 0 = the engine's "
        "maxInputLen.")
    # Rows per step; 0 = the engine's maxBatchSize. Not a CLI flag: errors about it name llm_build's --maxBatchSize.
    max_batch_size: int = _option(0, None, "Rows per engine step; 0 = the engine's maxBatchSize.")
    multimodal_engine_dir: str | None = _option(
        None, "--multimodalEngineDir", "Encoder engine dir (llm_build of llm_export's OUTPUTDIR/visual or "
        "OUTPUTDIR/audio): requests may then hold image or audio items.", path=True)
    encoder_cache_budget_bytes: int = _option(  # on even without reuse
        DEFAULT_ENCODER_CACHE_BUDGET_BYTES, "--encoderCacheBudgetBytes", "Bytes of encoder outputs kept by media "
        "digest (LRU), so a repeated image or audio skips the encoder; 0 disables. Independent of "
        "--enableContextReuse.")
    # Bytes for partial-KV snapshots (one K+V page per attention layer each): records whose length is not
    # page-aligned keep their tail page, so a prompt extending one reuses up to its exact last token. 0 = off.
    context_cache_partial_kv_snapshot_pool_bytes: int = _option(
        0, "--contextCachePartialKVSnapshotPoolBytes", "Bytes for partial-KV snapshots (llm_build prints the bytes "
        "per slot): records whose length is not page-aligned keep their tail page, so later prompts extending them "
        "reuse up to the exact token. Needs --enableContextReuse; 0 = off (reuse stops at the last whole page). "
        "Hybrid engines with reuse need at least one slot.", requires_reuse=True)
    # Bytes for recurrent snapshots (every recurrent layer's state and conv state at one exact token count):
    # what recurrent and hybrid engines reuse; required (>= one slot) for them when reuse is on.
    context_cache_recurrent_snapshot_pool_bytes: int = _option(
        0, "--contextCacheRecurrentSnapshotPoolBytes", "Bytes for recurrent snapshots (llm_build prints the bytes "
        "per slot): exact checkpoints of a recurrent or hybrid model's state, the only thing such models can reuse. "
        "Needs --enableContextReuse; required (at least one slot) for recurrent and hybrid engines with reuse.",
        requires_reuse=True)
    # Recurrent/hybrid engines capture a checkpoint where an earlier chat message ends (so a shared system
    # prompt or document hits although the next request diverges inside the first one's prompt) and, with an
    # interval, every that many prompt tokens; besides the prompt's and the generation's end, always captured.
    snapshot_message_boundaries: bool = _option(
        True, "--snapshotMessageBoundaries", "Recurrent/hybrid engines: also capture a checkpoint where each "
        "earlier chat message ends, so a shared system prompt or document hits although requests diverge after it "
        "(default on).", off_flag="--noSnapshotMessageBoundaries")
    snapshot_interval_tokens: int = _option(
        0, "--snapshotIntervalTokens", "Recurrent/hybrid engines: also capture a checkpoint every N prompt tokens "
        "(within the snapshot budget; least recently used checkpoints are evicted). 0 = off.", requires_reuse=True)
    # A second cache tier below the pool, shared by every process serving this engine (kvforge/runtime/shared_tier).
    shared_cache: str | None = _option(
        None, "--sharedCache", "A KV tier shared by every process serving this engine: redis://HOST:PORT/DB "
        "(Redis or Valkey) or mooncake://MASTER_HOST:PORT (Mooncake Store). Pages and checkpoints missing locally "
        "are loaded from it before computing; committed ones are saved to it in the background. A slow or dead "
        "store only makes requests compute cold. Needs --enableContextReuse.", requires_reuse=True)
    shared_cache_timeout_ms: float = _option(
        DEFAULT_SHARED_CACHE_TIMEOUT_MS, "--sharedCacheTimeoutMs", "With --sharedCache: how long one store call "
        "of a load may take before the request stops waiting and computes what it lacks (the store is then left "
        "alone for a back-off of 1 s, doubling up to 30 s).")
    # The tier secret authenticates every value (a keyed MAC); never in a repr, a message or the profile.
    shared_cache_secret: str | None = field(default=None, repr=False, metadata={OPTION: EngineOption(
        "--sharedCacheSecret", "With --sharedCache: a secret every process sharing the tier is given; values are "
        f"then authenticated (a forged or altered value is a miss). Prefer the {SECRET_ENV} environment variable "
        "(a flag shows in the process list). At least 16 bytes. See docs/shared-tier.md.")})
    # Rotation: secrets values are also read with (never written with); a value one of them opens is not replaced.
    shared_cache_read_secrets: tuple[str, ...] = field(default=(), repr=False, metadata={OPTION: EngineOption(
        "--sharedCacheReadSecret", "With --sharedCacheSecret: another secret values are also read with (repeatable; "
        f"or {READ_SECRETS_ENV}, comma-separated), never written with: rotate by adding the new secret here on "
        "every process, then making it the --sharedCacheSecret, then dropping the old one. See docs/shared-tier.md.")})
    shared_cache_encrypt: bool = _option(
        False, "--sharedCacheEncrypt", "With --sharedCache and a tier secret: also encrypt values (AES-GCM), so the "
        "store holds no prompt tokens or K/V in clear. Needs the cryptography package (kvforge[tier]).")
    # KV events for cache-aware routers (issue 54, kvforge/runtime/kv_events.py, docs/scale-out.md).
    kv_events_endpoint: str | None = _option(
        None, "--kvEventsEndpoint", "Publish vLLM-format KV events (BlockStored/BlockRemoved/AllBlocksCleared) for "
        "the pages the context cache stores and evicts on a ZMQ PUB socket bound here, e.g. tcp://127.0.0.1:5557, "
        "for routers that index exact pages (vllm-router kv_aware, llm-d, Dynamo). Events carry every tenant's "
        "prompt tokens: bind it where only the operator's router can connect. Needs pyzmq and msgspec "
        "(kvforge[cluster]).", requires_reuse=True)
    kv_events_topic: str = _option(
        "", "--kvEventsTopic", "With --kvEventsEndpoint: the topic frame of every message (default: empty, which "
        "every subscriber receives).")
    # Position-independent reuse of {"type": "document"} items (issue 37, docs/document-reuse.md).
    document_reuse: bool = _option(
        False, "--documentReuse", "Reuse a document item's K/V wherever it appears in a prompt (behind another "
        "system prompt, in another order): each document is computed once alone and restored with its keys "
        "re-rotated. Implies --enableContextReuse. Approximate unless --documentRepair full; attention-only "
        "engines, no draft model.")
    document_repair: str = _option(
        DEFAULT_REPAIR, "--documentRepair", f"With --documentReuse, what each reused document recomputes: "
        f"{REPAIR_POLICIES[0]}, {REPAIR_POLICIES[1]} (default), {REPAIR_POLICIES[2]} (+ the document nearest the "
        f"question), {REPAIR_POLICIES[3]} (= cold) or {REPAIR_POLICIES[4]} (+ what the question reads most).")
    document_repair_budget: float = _option(DEFAULT_REPAIR_BUDGET, "--documentRepairBudget", "With "
        "--documentRepair attention: the share (0-1) of document tokens to redo.")
    document_segments: str = _option(SEGMENTS_OFF, "--documentSegments", "With --documentReuse: 'paragraphs' makes "
        "each block of system or user text between blank lines a document (RAG clients' plain-text passages); 'off'.")
    document_segment_min_tokens: int = _option(DEFAULT_SEGMENT_MIN_TOKENS, "--documentSegmentMinTokens", "With "
        "--documentSegments paragraphs: the fewest tokens a block needs to be a document (instructions are shorter).")
    # Corrected adapters (issue 39, docs/lora.md): approximate, so off unless named.
    lora_corrections: tuple[str, ...] = _option(
        (), "--loraCorrection", "An ordinary adapter (repeatable, by name) whose requests start from the base model's "
        "cached pages plus a low-rank K/V correction instead of a full prefill. Approximate: it changes answers. "
        "Needs --enableContextReuse and an engine exported with --hiddenStateLayers 0..L-2 (llama).",
        requires_reuse=True)
    lora_correction_pages: int = _option(
        0, "--loraCorrectionPages", "With --loraCorrection: factor slots (one per corrected adapter and base page); "
        "when full, new pages are cached without factors. 0 = the KV pool's pages times the corrected adapters.")
    spec_decode: str = _option(SPEC_OFF, "--specDecode", spec_decode_help())  # one sentence per support row
    dflash_block_size: int = _option(
        0, "--dflashBlockSize", f"With --specDecode {in_words(BLOCK_DRAFTS)}: positions one block call drafts over "
        "(the pending token and blockSize - 1 masks, so up to blockSize - 1 proposed tokens). 0 (default) = the block "
        "the draft was trained on; smaller blocks verify fewer tokens. --specDraftStep does not apply to block drafts.")
    dspark_scheduler: str = _option(
        SCHEDULER_OFF, "--dsparkScheduler", "With --specDecode dspark: how many of the block's guesses to verify, "
        "from its acceptance predictor: 'off' (default) all; 'threshold' while the running product of the scores "
        "is at least --dsparkConfidenceThreshold; 'sps' the length with the most expected tokens per unit of verify "
        "cost.")
    dspark_confidence_threshold: float = _option(
        0.0, "--dsparkConfidenceThreshold", "With --dsparkScheduler threshold: the lowest running acceptance "
        "probability still proposed, in [0, 1].")
    dspark_min_proposal_len: int = _option(
        1, "--dsparkMinProposalLen", "With --specDecode dspark: propose at least this many tokens (default 1).")
    dspark_max_proposal_len: int = _option(
        0, "--dsparkMaxProposalLen", "With --specDecode dspark: propose at most this many tokens (0 = the block).")
    spec_draft_engine_dir: str | None = _option(
        None, "--specDraftEngineDir", f"With --specDecode {in_words(DRAFT_METHODS)}: the draft's engine dir "
        "(default ENGINEDIR/draft).",
        path=True)
    spec_draft_step: int = _option(
        DEFAULT_SPEC_DRAFT_TOKENS, "--specDraftStep", "With --specDecode: tokens proposed per step for each decoding "
        "request (the verify call computes this many more positions); with --specDraftTopK > 1, the tree's depth.")
    spec_draft_top_k: int = _option(
        1, "--specDraftTopK", f"With --specDecode {in_words(TREE_METHODS)}: candidates per drafting step. 1 (default) "
        "drafts "
        "a chain; k > 1 drafts a tree (each step expands the k best nodes into their k best children) and the base "
        "verifies its best --specVerifySize - 1 nodes in one masked call (jetspec: best-first over each depth's top k "
        "from one block call). Needs engines built with --specBase/--specDraft on the kvforge CPU kernel.")
    spec_verify_size: int = _option(
        0, "--specVerifySize", "With --specDraftTopK > 1: positions one verify row computes (the pending token and "
        "the tree's nodes). 0 = min(specDraftTopK x specDraftStep + 1, the base's maxVerifyTreeSize).")
    spec_prompt_lookup_min: int = _option(
        DEFAULT_MIN_N, "--specPromptLookupMin", "With --specDecode ngram: the shortest n-gram that may match.")
    spec_prompt_lookup_max: int = _option(
        DEFAULT_MAX_N, "--specPromptLookupMax", "With --specDecode ngram: the longest n-gram tried first.")

    def __post_init__(self) -> None:
        if self.document_reuse and not self.enable_context_reuse:  # documents are a kind of context reuse
            object.__setattr__(self, "enable_context_reuse", True)


# Snapshot slots a front end sizes each pool with when it sizes them for the user (llm_test, llm_bench): enough
# for every checkpoint of llm_bench's six-turn chat session and every endpoint of an llm_test file, so neither
# measures or counts under snapshot pressure.
DEFAULT_SNAPSHOT_SLOTS = 64


def engine_options() -> dict[str, tuple[Any, EngineOption]]:
    """EngineConfig's field name → (default, EngineOption), in declaration order."""
    return {f.name: (f.default, f.metadata[OPTION]) for f in fields(EngineConfig)}


def engine_flags() -> dict[str, str]:
    """Field name → CLI flag, for the fields a CLI offers (error messages name the flag, not the field)."""
    return {name: option.flag for name, (_, option) in engine_options().items() if option.flag}


# The --help panel (typer's rich_help_panel) each CLI flag of EngineConfig is listed under; fields not named here
# (the engine basics: threads, chunking, encoders) stay in the command's own "Options" panel.
ENGINE_OPTION_PANELS: dict[str, tuple[str, ...]] = {
    "Context reuse": ("enable_context_reuse", "context_cache_max_records",
                      "context_cache_partial_kv_snapshot_pool_bytes", "context_cache_recurrent_snapshot_pool_bytes",
                      "snapshot_message_boundaries", "snapshot_interval_tokens"),
    "Shared KV tier": ("shared_cache", "shared_cache_timeout_ms", "shared_cache_secret", "shared_cache_encrypt"),
    "Routers (KV events)": ("kv_events_endpoint", "kv_events_topic"),
    "Documents and adapter corrections": ("document_reuse", "document_repair", "document_repair_budget",
                                          "document_segments", "document_segment_min_tokens", "lora_corrections",
                                          "lora_correction_pages"),
    "Speculative decoding": ("spec_decode", "dflash_block_size", "dspark_scheduler", "dspark_confidence_threshold",
                             "dspark_min_proposal_len", "dspark_max_proposal_len", "spec_draft_engine_dir",
                             "spec_draft_step", "spec_draft_top_k", "spec_verify_size", "spec_prompt_lookup_min",
                             "spec_prompt_lookup_max"),
}


def engine_option_panel(name: str) -> str | None:
    """The --help panel EngineConfig field `name`'s flag is listed under (None: the command's "Options")."""
    return next((panel for panel, names in ENGINE_OPTION_PANELS.items() if name in names), None)


def make_engine_config(options: Mapping[str, Any]) -> EngineConfig:
    """An EngineConfig from front-end values keyed by field name (a path option may be a Path); a name that is no
    field is a TypeError, as for any keyword argument."""
    declared = engine_options()
    unknown = sorted(set(options) - set(declared))
    if unknown:
        raise TypeError(f"unexpected engine option(s) {', '.join(map(repr, unknown))}: expected some of "
                        f"{', '.join(declared)}")
    values = {name: (str(value) if value else None) if declared[name][1].path else
              tuple(value) if isinstance(value, list) else value  # a repeatable flag's list
              for name, value in options.items()}
    return EngineConfig(**values)


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """Every size the engine's parts are built with, checked against the build."""

    deployment: Deployment
    max_num_tokens: int  # per-step token budget
    max_batch_size: int  # rows per step
    prefill_chunk_tokens: int  # at most maxInputLen (a recompute after preemption can be longer)
    num_pages: int  # KV pages the cache manages (0 on a pure recurrent engine)
    partial_kv_snapshot_slots: int
    recurrent_snapshot_slots: int
    checkpoints: CheckpointPolicy
    chain_root: bytes  # the engine fingerprint's root of every page key
    draft: EngineDir | None = None  # the draft's engine dir (a method with one, see the speculation table)
    spec: SpecMethod | None = None  # the --specDecode method, which builds the proposer


def resolve_engine_config(config: EngineConfig, engine: EngineDir, *, num_pages: int | None = None) -> ResolvedConfig:
    """Check `config` against `engine`'s build and size every part. `num_pages` runs on fewer pages than the build
    allocated (tests force waiting, eviction and preemption with it)."""
    build = engine.build
    deployment = deployment_of(engine.model)
    budget, rows = _resolve_limits(config, build.max_input_len, build.max_batch_size)
    base = Base(deployment.value)
    method = check_spec_options(config, base)
    timeout_ms = config.shared_cache_timeout_ms  # nan and inf pass `> 0`; a tier that never connects says nothing
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int | float) or not math.isfinite(timeout_ms) \
            or not 0 < timeout_ms <= MAX_SHARED_CACHE_TIMEOUT_MS:
        raise InvalidConfig(f"must be a finite number of milliseconds > 0 and <= {MAX_SHARED_CACHE_TIMEOUT_MS:g}, "
                            f"got {timeout_ms!r}", "shared_cache_timeout_ms")
    if config.shared_cache:
        if not config.enable_context_reuse:
            raise InvalidConfig("a shared tier is a second level of context reuse: it needs enable_context_reuse",
                                "shared_cache")
        check_store_url(config.shared_cache, config.shared_cache_timeout_ms / 1e3)
        check_secret(config.shared_cache_secret, encrypt=config.shared_cache_encrypt,
                     read_secrets=config.shared_cache_read_secrets)
    if config.encoder_cache_budget_bytes < 0:
        raise InvalidConfig(f"must be >= 0, got {config.encoder_cache_budget_bytes}", "encoder_cache_budget_bytes")
    # Before the snapshot budgets: a recurrent engine's missing budget is not what stops document reuse there. The
    # cache types' support rows refuse what each one turned on cannot run with (engines, speculation, a
    # sliding-window group, a shared tier, reuse off: context_cache/support.py).
    check_support(support_rows(), config, build, deployment)
    _check_document_reuse(config, engine)
    partial = _partial_kv_snapshot_slots(config, engine, deployment)
    recurrent = _recurrent_snapshot_slots(config, engine, deployment)
    pages = build.max_kv_pool_pages if num_pages is None else num_pages
    if not 0 <= pages <= build.max_kv_pool_pages:
        raise InvalidConfig(f"must be in [0, the engine's maxKVPoolPages {build.max_kv_pool_pages}], got {pages}",
                            "max_kv_pool_pages")
    # A pure recurrent engine keeps no pages (its geometry's page count sizes nothing).
    pages = 0 if deployment is Deployment.PURE_RECURRENT else pages
    chunk = min(config.prefill_chunk_size or build.max_input_len, build.max_input_len)
    if build.window_pool_pages:  # the group is sized for calls of at most this many tokens per row
        chunk = min(chunk, window_call_tokens(engine.model.sliding_window, build.tokens_per_page, build.max_input_len))
    checkpoints = CheckpointPolicy(bool(recurrent), config.snapshot_message_boundaries,
                                   config.snapshot_interval_tokens)
    if method.support.endpoint_capture and recurrent:
        # The support matrix's hybrid MTP row: endpoint-only capture (a prompt's end, never mid-prompt).
        if config.snapshot_interval_tokens:
            raise InvalidConfig(f"hybrid {method.support.label} with reuse captures checkpoints at prompt ends only "
                                "(the support matrix's endpoint-only capture); use 0", "snapshot_interval_tokens")
        checkpoints = CheckpointPolicy(True, message_boundaries=False, interval_tokens=0)
    draft = method.resolve_draft(config, engine, base)
    # A draft with its own K/V on a recurrent base keeps a draft tail (at most a page of the base's hidden states)
    # beside each recurrent snapshot, so the recurrent budget's slots bound them.
    tails = recurrent * build.tokens_per_page * engine.model.hidden_size * 4 \
        if draft and method.support.draft_kv is DraftKV.OWN and deployment is not Deployment.VANILLA else 0
    _check_memory(config, engine, draft, tails)
    return ResolvedConfig(deployment, budget, rows, chunk, pages, partial, recurrent, checkpoints,
                          chain_root(engine_fingerprint(engine)), draft, method)


def _check_document_reuse(config: EngineConfig, engine: EngineDir) -> None:
    """The refusals of document reuse (issue 37) its support row cannot express, before anything is loaded: a
    repair policy it knows, and layer rotations that move keys exactly (checked numerically against the reference,
    so a rope variant the rotation cannot reproduce is refused)."""
    if config.document_repair not in REPAIR_POLICIES:
        raise InvalidConfig(f"must be one of {', '.join(REPAIR_POLICIES)}, got {config.document_repair!r}",
                            "document_repair")
    check_segment_options(config.document_segments, config.document_segment_min_tokens, config.document_reuse)
    check_budget(config.document_repair_budget)
    if not config.document_reuse:
        return
    # Each pool layer's keys move by its own RoPE (Gemma's layer types: their bases, linear scaling, proportional
    # and wider heads; key_rotation.py), each checked like the table of a plain engine.
    rotations = layer_rotations(engine.model)
    error = rotation_error(rotations, min(engine.build.max_kv_cache_capacity, 4096))
    if not error <= ROTATION_CHECK_TOLERANCE:
        raise InvalidConfig(f"this engine's rotary embedding cannot be moved by re-rotating keys (a check was off by "
                            f"{error:.3g}); document reuse is refused", "document_reuse")


def _check_memory(config: EngineConfig, engine: EngineDir, draft: EngineDir | None, draft_tail_bytes: int = 0) -> None:
    """Everything this engine holds in host memory against what the machine has available now, before any of it
    is allocated: a budget beyond it would end in a MemoryError, or in the kernel killing the run as pages fill.
    The flag named is the snapshot budget when that alone is the excess, else the pool (rebuild it smaller)."""
    needs = {"KV pool": engine.kv_pool_bytes + engine.rope_bytes, "weights": engine.weight_bytes,
             "partial-KV snapshots": config.context_cache_partial_kv_snapshot_pool_bytes,
             "recurrent snapshots": config.context_cache_recurrent_snapshot_pool_bytes + draft_tail_bytes,
             "draft": draft.kv_pool_bytes + draft.rope_bytes + draft.weight_bytes if draft else 0}
    have = available_memory_bytes()
    if have is None or sum(needs.values()) <= have:
        return
    snapshots = {"context_cache_partial_kv_snapshot_pool_bytes": needs["partial-KV snapshots"],
                 "context_cache_recurrent_snapshot_pool_bytes": needs["recurrent snapshots"]}
    largest = max(snapshots, key=lambda name: snapshots[name])
    if sum(needs.values()) - snapshots[largest] <= have:
        check_fits_memory(needs, have, "available", largest, "give a smaller budget")
    check_fits_memory(needs, have, "available", "max_kv_pool_pages",
                      "rebuild the engine with a smaller --maxKVPoolPages, or free memory")


def engine_fingerprint(engine: EngineDir) -> EngineFingerprint:
    """What roots this engine's page keys: a digest of every file its manifest lists (weights, graph, config,
    tokenizer), its KV dtype, page size and layer layout. Two engines share cache keys only if all agree, so pages
    in a tier shared between processes are never read by an engine with other weights or layout. The manifest was
    verified when the dir was loaded, and its digests are cheap (sampled for large files), so no weight is re-read."""
    files = read_json(engine.path / MANIFEST_FILE, "engine_dir").get("files", {})
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(files):
        digest.update(f"{len(name)}:{name}={files[name].get('digest')}\n".encode())
    model = engine.model
    layout = (f"layers={model.num_hidden_layers};attention={list(model.attention_layer_ids)};"
              f"kv_heads={model.num_key_value_heads};head_dim={model.head_dim}")
    return EngineFingerprint(digest.hexdigest(), model.kv_cache_dtype, engine.build.tokens_per_page, layout)


def snapshot_budgets(engine: EngineDir, slots: int = DEFAULT_SNAPSHOT_SLOTS,
                     partial_kv: bool = False) -> dict[str, int]:
    """EngineConfig's snapshot budgets for `slots` slots of each pool this engine needs with reuse on: recurrent and
    hybrid engines both of theirs; an attention-only engine partial-KV snapshots only when asked (`partial_kv`)."""
    build = engine.build
    budgets = {}
    if build.recurrent_snapshot_bytes_per_slot:
        budgets["context_cache_recurrent_snapshot_pool_bytes"] = slots * build.recurrent_snapshot_bytes_per_slot
    # A sliding-window group engine keeps no partial-KV snapshots (its reuse is by window checkpoints).
    if build.partial_kv_snapshot_bytes_per_slot and (partial_kv or build.recurrent_snapshot_bytes_per_slot) \
            and not build.window_pool_pages:
        budgets["context_cache_partial_kv_snapshot_pool_bytes"] = slots * build.partial_kv_snapshot_bytes_per_slot
    return budgets


def deployment_of(model: ModelConfig) -> Deployment:
    """Attention layers only, recurrent layers only, or both (what the cache may reuse follows from it)."""
    attention = len(model.attention_layer_ids)
    if attention == model.num_hidden_layers or (attention and not model.recurrent_layer_ids):  # Gemma 4 KV sharing
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

"""One `SpecMethod` per speculative method: its option checks, the draft it loads, what it needs from the cache and
its proposer. The engine asks this registry (`spec_method(name)`) instead of switching on model flags; the support
rows themselves are data in kvforge.contract.speculation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvforge.contract.engine_dir import (
    D2T_FILE,
    D2T_TENSOR,
    DRAFT_ENGINE_SUBDIR,
    DSPARK_HEADS_FILE,
    EMBEDDING_FILE,
    EMBEDDING_TENSOR,
    MAX_TREE_SIZE,
    EngineDir,
    load_engine_dir,
)
from kvforge.contract.errors import InvalidConfig
from kvforge.contract.model_config import MAX_BLOCK_SIZE
from kvforge.contract.profile_schema import MTP_GENERATION
from kvforge.contract.safetensors_map import map_tensor
from kvforge.contract.speculation import (  # noqa: F401 - the names are re-exported for the runtime's readers
    DEFAULT_SPEC_DRAFT_TOKENS,
    DRAFT_METHODS,
    DSPARK_SCHEDULERS,
    MAX_SPEC_DRAFT_TOKENS,
    MAX_SPEC_DRAFT_TOP_K,
    METHOD_NAMES,
    SCHEDULER_OFF,
    SCHEDULER_SPS,
    SCHEDULER_THRESHOLD,
    SPEC_DFLASH,
    SPEC_DSPARK,
    SPEC_EAGLE3,
    SPEC_GEMMA4_MTP,
    SPEC_JETSPEC,
    SPEC_METHODS,
    SPEC_MTP,
    SPEC_NGRAM,
    SPEC_OFF,
    SPEC_SUPPORT,
    Base,
    DraftKV,
    SpecSupport,
)
from kvforge.runtime.execution.load import load_backend
from kvforge.runtime.spec.block_draft import BlockDraftProposer, DsparkHeads
from kvforge.runtime.spec.eagle3 import Eagle3Proposer
from kvforge.runtime.spec.gemma4_mtp import Gemma4MtpProposer
from kvforge.runtime.spec.ngram import NgramProposer

# The proposer EAGLE3 drafts and Qwen3.5's MTP layer (MtpMethod) share: a one-layer draft over the base's hidden
# states. Its module keeps the EAGLE3 name; this one says what it drives.
HiddenStateProposer = Eagle3Proposer

if TYPE_CHECKING:
    from kvforge.runtime.context_cache.manager import ContextCacheManager
    from kvforge.runtime.execution.backend import Backend
    from kvforge.runtime.profile import Profiler
    from kvforge.runtime.spec.proposer import Proposer


class SpecOptions(Protocol):
    """The run-time settings a method reads (EngineConfig's fields; spec/ sits below engine/, so it names them)."""

    spec_decode: str
    num_threads: int
    spec_draft_engine_dir: str | None
    spec_draft_step: int
    spec_draft_top_k: int
    spec_verify_size: int
    spec_prompt_lookup_min: int
    spec_prompt_lookup_max: int
    dflash_block_size: int
    dspark_scheduler: str
    dspark_confidence_threshold: float
    dspark_min_proposal_len: int
    dspark_max_proposal_len: int


@dataclass(frozen=True, slots=True)
class ProposerParts:
    """What a method's proposer is built from: the engine's parts it reads or drafts beside."""

    options: SpecOptions
    base: EngineDir
    draft: EngineDir | None  # what `resolve_draft` returned
    base_kv_layers: list[np.ndarray]  # the base's pools, one per attention layer (an assistant reads them in place)
    cache: ContextCacheManager
    profiler: Profiler
    recurrent: bool  # the base carries recurrent state: a rejected verify row rolls back


@dataclass(frozen=True, slots=True)
class Drafter:
    """A built proposer and the draft session it runs on (None for prompt lookup)."""

    proposer: Proposer
    backend: Backend | None


class SpecMethod:
    """A method's behaviour; its support row (`support`) is the data every layer shares."""

    def __init__(self, support: SpecSupport) -> None:
        self.support = support

    @property
    def name(self) -> str:
        return self.support.name

    # The profile section its counters are reported under (None: spec_decode_generation).
    profile_section: str | None = None

    def check_options(self, options: SpecOptions) -> None:
        """This method's own settings, before anything is loaded (the shared ranges are checked already)."""
        if options.spec_draft_top_k > 1 and not self.support.tree:
            trees = " or ".join(name for name, row in SPEC_SUPPORT.items() if row.tree)
            raise InvalidConfig(f"tree drafting (a top-k above 1) needs --specDecode {trees} (prompt lookup drafts one "
                                "chain)", "spec_draft_top_k")

    def resolve_draft(self, options: SpecOptions, engine: EngineDir, base: Base) -> EngineDir | None:
        """The draft engine dir, checked against its base; None for a method without one."""
        if options.spec_draft_engine_dir:
            raise InvalidConfig(f"a draft engine dir is read with --specDecode {_draft_method_list()} only",
                                "spec_draft_engine_dir")
        return None

    def draft_pages(self, draft: EngineDir | None) -> int:
        """Pages of the draft's own pool the cache manages (0: no pool of its own)."""
        return draft.build.max_kv_pool_pages if draft is not None and self.support.draft_kv is DraftKV.OWN else 0

    def build(self, parts: ProposerParts) -> Drafter | None:
        """The proposer, or None when the method drafts nothing."""
        return None


class NgramMethod(SpecMethod):
    def build(self, parts: ProposerParts) -> Drafter | None:
        options = parts.options
        return Drafter(NgramProposer(options.spec_draft_step, options.spec_prompt_lookup_min,
                                     options.spec_prompt_lookup_max), None)


class DraftModelMethod(SpecMethod):
    """A method with a draft engine dir: the draft checks every such method shares."""

    def resolve_draft(self, options: SpecOptions, engine: EngineDir, base: Base) -> EngineDir | None:
        self._check_base(base)
        method = self.support.label
        if engine.model.sliding_window and not self.support.sliding_window_bases:  # the support matrix's column
            raise InvalidConfig(f"{method} is not supported on a base with sliding-window layers yet (the support "
                                "matrix runs gemma4_mtp and ngram there)", "spec_decode")
        if not engine.build.spec_base:
            raise InvalidConfig("this engine was not built as a speculative base; rebuild it with llm_build --specBase "
                                "(from an export with --hiddenStateLayers)", "spec_decode")
        path = Path(options.spec_draft_engine_dir) if options.spec_draft_engine_dir \
            else engine.path / DRAFT_ENGINE_SUBDIR
        if not path.is_dir():
            raise InvalidConfig(f"no draft engine at {path}; build one with llm_build --specDraft --engineDir {path}",
                                "spec_draft_engine_dir")
        try:
            draft = load_engine_dir(path)
        except InvalidConfig as exc:
            raise InvalidConfig(f"the draft engine at {path}: {exc.message}", "spec_draft_engine_dir") from None
        model, build = draft.model, draft.build
        if not build.spec_draft or model.spec_decode_type != self.name:
            article = "an" if method[0] in "AEIOU" else "a"
            hint = f"it holds a {model.spec_decode_type} draft: use --specDecode {model.spec_decode_type}" \
                if build.spec_draft else "build one with llm_build --specDraft"
            raise InvalidConfig(f"{path} is not {article} {method} draft engine; {hint}", "spec_draft_engine_dir")
        if build.backend != "onnxruntime":
            raise InvalidConfig(f"{method} drafts run on onnxruntime only for now; rebuild the draft with --backend "
                                "onnxruntime", "spec_draft_engine_dir")
        self._check_draft_build(draft)
        _check_fits_base(draft, engine, path)
        if options.spec_draft_top_k > 1:
            check_tree(options, engine, draft)
        return draft

    def _check_draft_build(self, draft: EngineDir) -> None:
        """What this method needs of how its draft was built, beyond what every draft needs."""

    def _check_base(self, base: Base) -> None:
        if base not in self.support.bases:
            raise InvalidConfig(f"{self.support.label} is not supported on a {base.value} engine (the support matrix "
                                "rejects hybrid EAGLE3, DFlash, JetSpec and DSpark: only hybrid MTP runs on a "
                                "recurrent base)", "spec_decode")

    def _draft_session(self, parts: ProposerParts, shared: dict[int, np.ndarray] | None = None,
                       ) -> tuple[Backend, np.ndarray]:
        """The draft's session (alternating with the base on the same cores) and its embedding table."""
        assert parts.draft is not None
        table = map_tensor(parts.draft.file(EMBEDDING_FILE), EMBEDDING_TENSOR)
        backend = load_backend(parts.draft, parts.options.num_threads, table, shares_cores=True, shared_pools=shared)
        return backend, table


class Eagle3Method(DraftModelMethod):
    """EAGLE3, and the MTP layer (EAGLE3's contract over the base's whole vocabulary): `MtpMethod`."""

    def build(self, parts: ProposerParts) -> Drafter | None:
        assert parts.draft is not None
        draft, options = parts.draft, parts.options
        backend, table = self._draft_session(parts)
        d2t = self._d2t(parts)
        verify_nodes = verify_size(options, parts.base) - 1
        proposer = HiddenStateProposer(backend, table, d2t, options.spec_draft_step,
                                  draft.model.base_model_hidden_size, top_k=options.spec_draft_top_k,
                                  verify_nodes=verify_nodes, rolls_back=parts.recurrent,
                                  keep_hidden=parts.cache.tokens_per_page if parts.recurrent else 0)
        return Drafter(proposer, backend)

    def _d2t(self, parts: ProposerParts) -> np.ndarray:
        assert parts.draft is not None
        return np.asarray(map_tensor(parts.draft.file(D2T_FILE), D2T_TENSOR), dtype=np.int64)


class MtpMethod(Eagle3Method):
    """Standard MTP: a Qwen3.5 checkpoint's MTP layer on its hybrid base, driven by the EAGLE3 proposer."""

    profile_section = MTP_GENERATION

    def _check_base(self, base: Base) -> None:
        if base not in self.support.bases:
            raise InvalidConfig("standard MTP needs a hybrid attention/recurrent base (the support matrix rejects it "
                                f"on an {'attention-only' if base is Base.ATTENTION else 'pure recurrent'} base); a "
                                "Gemma4 assistant runs with --specDecode gemma4_mtp", "spec_decode")

    def _d2t(self, parts: ProposerParts) -> np.ndarray:
        assert parts.draft is not None
        return np.zeros(parts.draft.model.vocab_size, dtype=np.int64)  # the identity map: the whole vocabulary


class BlockDraftMethod(DraftModelMethod):
    """DFlash, DSpark and JetSpec: a whole block per call; DSpark adds its heads and scheduler, JetSpec drafts with a
    causal mask inside the block."""

    def _check_draft_build(self, draft: EngineDir) -> None:
        if not draft.build.tree_attention:
            raise InvalidConfig(f"the {self.support.label} draft at {draft.path} was built without masked attention "
                                "(its block's mask is an input); rebuild it with llm_build --specDraft "
                                "--cpuAttention kernel", "spec_draft_engine_dir")

    def resolve_draft(self, options: SpecOptions, engine: EngineDir, base: Base) -> EngineDir | None:
        draft = super().resolve_draft(options, engine, base)
        assert draft is not None
        block = block_size(options, draft)
        if block > engine.build.max_input_len:
            raise InvalidConfig(f"a block of {block} exceeds the base's maxInputLen {engine.build.max_input_len}",
                                "dflash_block_size")
        return draft

    def build(self, parts: ProposerParts) -> Drafter | None:
        assert parts.draft is not None
        draft, options = parts.draft, parts.options
        backend, table = self._draft_session(parts)
        heads = None
        if self.name == SPEC_DSPARK:
            tensors = {name: np.asarray(map_tensor(draft.file(DSPARK_HEADS_FILE), name), dtype=np.float32)
                       for name in ("markov_w1", "markov_w2", "accept_weight", "accept_bias")}
            heads = DsparkHeads(tensors["markov_w1"], tensors["markov_w2"], tensors["accept_weight"],
                                float(tensors["accept_bias"][0]), options.dspark_scheduler,
                                options.dspark_confidence_threshold, options.dspark_min_proposal_len,
                                options.dspark_max_proposal_len)
        block = block_size(options, draft)
        # JetSpec's tree: --specVerifySize counts the pending token; by default every depth's top-k (within the base).
        nodes = options.spec_verify_size or min(options.spec_draft_top_k * (block - 1) + 1,
                                                parts.base.build.max_verify_tree_size)
        proposer = BlockDraftProposer(backend, table, block, draft.model.mask_token_id,
                                      draft.model.base_model_hidden_size, parts.profiler, heads,
                                      causal=self.name == SPEC_JETSPEC, top_k=options.spec_draft_top_k,
                                      verify_nodes=nodes - 1)
        return Drafter(proposer, backend)


class Gemma4MtpMethod(DraftModelMethod):
    """A Gemma4 assistant: attends over the base's own pools, bound as they are (no draft pool)."""

    profile_section = MTP_GENERATION

    def build(self, parts: ProposerParts) -> Drafter | None:
        shared = dict(zip(parts.base.model.attention_layer_ids, parts.base_kv_layers, strict=True))
        backend, table = self._draft_session(parts, shared)
        return Drafter(Gemma4MtpProposer(backend, table, parts.options.spec_draft_step), backend)


_REGISTRY: dict[str, SpecMethod] = {
    SPEC_OFF: SpecMethod(SPEC_SUPPORT[SPEC_OFF]),
    SPEC_NGRAM: NgramMethod(SPEC_SUPPORT[SPEC_NGRAM]),
    SPEC_EAGLE3: Eagle3Method(SPEC_SUPPORT[SPEC_EAGLE3]),
    SPEC_DFLASH: BlockDraftMethod(SPEC_SUPPORT[SPEC_DFLASH]),
    SPEC_DSPARK: BlockDraftMethod(SPEC_SUPPORT[SPEC_DSPARK]),
    SPEC_JETSPEC: BlockDraftMethod(SPEC_SUPPORT[SPEC_JETSPEC]),
    SPEC_GEMMA4_MTP: Gemma4MtpMethod(SPEC_SUPPORT[SPEC_GEMMA4_MTP]),
    SPEC_MTP: MtpMethod(SPEC_SUPPORT[SPEC_MTP]),
}
assert set(_REGISTRY) == set(SPEC_METHODS), "every row of the support table has one SpecMethod"


def spec_method(name: str) -> SpecMethod:
    """The registered method of a --specDecode value; InvalidConfig naming spec_decode for an unknown one."""
    method = _REGISTRY.get(name)
    if method is None:
        raise InvalidConfig(f"must be one of {', '.join(SPEC_METHODS)}, got {name!r}", "spec_decode")
    return method


def check_spec_options(options: SpecOptions, base: Base) -> SpecMethod:
    """Every speculative setting against its range and the chosen method (nothing loaded yet); the method."""
    method = spec_method(options.spec_decode)
    if not 1 <= options.spec_draft_step <= MAX_SPEC_DRAFT_TOKENS:
        raise InvalidConfig(f"must be in [1, {MAX_SPEC_DRAFT_TOKENS}], got {options.spec_draft_step}",
                            "spec_draft_step")
    if not 1 <= options.spec_draft_top_k <= MAX_SPEC_DRAFT_TOP_K:
        raise InvalidConfig(f"must be in [1, {MAX_SPEC_DRAFT_TOP_K}], got {options.spec_draft_top_k}",
                            "spec_draft_top_k")
    _check_block_options(options)
    method.check_options(options)
    if options.spec_verify_size and (options.spec_draft_top_k == 1
                                     or not 2 <= options.spec_verify_size <= MAX_TREE_SIZE):
        raise InvalidConfig(f"sizes tree drafting only (--specDraftTopK > 1), in [2, {MAX_TREE_SIZE}]; got "
                            f"{options.spec_verify_size}", "spec_verify_size")
    if not 1 <= options.spec_prompt_lookup_min <= options.spec_prompt_lookup_max:
        raise InvalidConfig(f"must be in [1, specPromptLookupMax {options.spec_prompt_lookup_max}], got "
                            f"{options.spec_prompt_lookup_min}", "spec_prompt_lookup_min")
    if base is Base.RECURRENT and base not in method.support.bases:
        # The seed's support matrix: speculation on a pure recurrent base is rejected.
        raise InvalidConfig("speculative decoding is not supported on a pure recurrent engine (no attention "
                            "layers to verify drafts against cheaply; the support matrix rejects it)", "spec_decode")
    return method


def block_size(options: SpecOptions, draft: EngineDir) -> int:
    """A block draft's block: --dflashBlockSize, or the one it was trained on (never longer)."""
    trained = draft.model.dflash_block_size
    if options.dflash_block_size and not 2 <= options.dflash_block_size <= trained:
        raise InvalidConfig(f"must be in [2, {trained}] (the block this draft was trained on), got "
                            f"{options.dflash_block_size}", "dflash_block_size")
    return options.dflash_block_size or trained


def verify_size(options: SpecOptions, engine: EngineDir) -> int:
    """Positions one tree verify row computes (--specVerifySize, or its default)."""
    if options.spec_verify_size:
        return options.spec_verify_size
    return min(options.spec_draft_top_k * options.spec_draft_step + 1, engine.build.max_verify_tree_size)


def check_tree(options: SpecOptions, engine: EngineDir, draft: EngineDir) -> None:
    """Tree drafting: both engines take tree masks, and a round's nodes fit the sizes they were built for."""
    for role, dir_ in (("base", engine), ("draft", draft)):
        if not dir_.build.tree_attention:
            flag = "--specBase" if role == "base" else "--specDraft"
            raise InvalidConfig(f"tree drafting needs a {role} engine with tree attention; rebuild it with llm_build "
                                f"{flag} on the kvforge CPU kernel (--cpuAttention kernel), or use --specDraftTopK 1",
                                "spec_draft_top_k")
    size = verify_size(options, engine)
    if not 2 <= size <= engine.build.max_verify_tree_size:
        raise InvalidConfig(f"must be in [2, the base's maxVerifyTreeSize {engine.build.max_verify_tree_size}], got "
                            f"{size}", "spec_verify_size")
    rows = options.spec_draft_top_k * (options.spec_draft_step - 1)
    if rows > draft.build.max_draft_tree_size and not draft.model.is_block_draft:  # a block call drafts one block
        raise InvalidConfig(f"specDraftTopK x (specDraftStep - 1) = {rows} draft positions per step exceed the "
                            f"draft's maxDraftTreeSize {draft.build.max_draft_tree_size}; lower them or rebuild the "
                            "draft", "spec_draft_top_k")


def _check_fits_base(draft: EngineDir, engine: EngineDir, path: Path) -> None:
    """The draft's geometry against its base's: the hidden states it reads, its vocabulary, pages and sizes."""
    model, build, base = draft.model, draft.build, engine.model
    checks = [
        (model.eagle_hidden_state_layers == base.hidden_state_layers,
         f"the draft reads base layers {model.eagle_hidden_state_layers}, the base returns {base.hidden_state_layers}"),
        (model.base_model_hidden_size == len(base.hidden_state_layers) * base.hidden_size,
         f"the draft takes base hidden states {model.base_model_hidden_size} wide, the base's are "
         f"{len(base.hidden_state_layers) * base.hidden_size}"),
        (model.vocab_size == base.vocab_size, f"vocab_size {model.vocab_size} vs the base's {base.vocab_size}"),
        (build.tokens_per_page == engine.build.tokens_per_page,
         f"tokensPerPage {build.tokens_per_page} vs the base's {engine.build.tokens_per_page}"),
        # An assistant reads the base's pools: their element type and layers are in its graph.
        (not model.reads_base_kv or (model.kv_cache_dtype == base.kv_cache_dtype and
                                     set(model.kv_shared_layers) <= set(base.attention_layer_ids)),
         f"it reads layers {model.kv_shared_layers} stored as {model.kv_cache_dtype}, the base has attention layers "
         f"{base.attention_layer_ids} stored as {base.kv_cache_dtype}"),
        (build.max_kv_cache_capacity >= engine.build.max_kv_cache_capacity,
         f"maxKVCacheCapacity {build.max_kv_cache_capacity} below the base's {engine.build.max_kv_cache_capacity}"),
        (build.max_input_len >= engine.build.max_input_len,
         f"maxInputLen {build.max_input_len} below the base's {engine.build.max_input_len}"),
    ]
    for ok, message in checks:
        if not ok:
            raise InvalidConfig(f"the draft at {path} does not fit this base: {message}; rebuild it",
                                "spec_draft_engine_dir")


def _check_block_options(options: SpecOptions) -> None:
    """The block-draft flags: in range, and given only with a method that reads them."""
    if options.dflash_block_size and not SPEC_SUPPORT[options.spec_decode].block:
        raise InvalidConfig("sizes a block draft's block: needs --specDecode dflash or dspark or jetspec",
                            "dflash_block_size")
    if options.dflash_block_size < 0:
        raise InvalidConfig(f"must be >= 0, got {options.dflash_block_size}", "dflash_block_size")
    if options.dspark_scheduler not in DSPARK_SCHEDULERS:
        raise InvalidConfig(f"must be one of {', '.join(DSPARK_SCHEDULERS)}, got {options.dspark_scheduler!r}",
                            "dspark_scheduler")
    if not 0.0 <= options.dspark_confidence_threshold <= 1.0:
        raise InvalidConfig(f"must be in [0, 1], got {options.dspark_confidence_threshold}",
                            "dspark_confidence_threshold")
    if not 1 <= options.dspark_min_proposal_len <= MAX_BLOCK_SIZE:
        raise InvalidConfig(f"must be in [1, {MAX_BLOCK_SIZE}], got {options.dspark_min_proposal_len}",
                            "dspark_min_proposal_len")
    if options.dspark_max_proposal_len and not options.dspark_min_proposal_len <= options.dspark_max_proposal_len \
            <= MAX_BLOCK_SIZE:
        raise InvalidConfig(f"must be 0 or in [dsparkMinProposalLen {options.dspark_min_proposal_len}, "
                            f"{MAX_BLOCK_SIZE}], got {options.dspark_max_proposal_len}", "dspark_max_proposal_len")
    dspark_set = [name for name, changed in (
        ("dspark_scheduler", options.dspark_scheduler != SCHEDULER_OFF),
        ("dspark_confidence_threshold", options.dspark_confidence_threshold != 0.0),
        ("dspark_min_proposal_len", options.dspark_min_proposal_len != 1),
        ("dspark_max_proposal_len", options.dspark_max_proposal_len != 0)) if changed]
    if dspark_set and options.spec_decode != SPEC_DSPARK:
        raise InvalidConfig("is a DSpark scheduler setting: it needs --specDecode dspark", dspark_set[0])


def _draft_method_list() -> str:
    """The methods whose draft dir a user picks, in words (standard MTP is left out, as its messages say)."""
    names = [name for name in DRAFT_METHODS if name != SPEC_MTP]
    return f"{', '.join(names[:-1])} or {names[-1]}"

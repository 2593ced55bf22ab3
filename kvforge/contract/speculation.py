"""The speculative methods and the support matrix's rows for each, as data: the CLI, API, server, builder, exporter
and docs read this one table instead of each spelling the rules again."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# The --specDecode values. A method's name is spelled here only; every other module imports these constants.
SPEC_OFF, SPEC_NGRAM, SPEC_EAGLE3, SPEC_DFLASH, SPEC_DSPARK = "off", "ngram", "eagle3", "dflash", "dspark"
SPEC_GEMMA4_MTP, SPEC_MTP = "gemma4_mtp", "mtp"
SPEC_JETSPEC = "jetspec"
# config.json's spec_decode_type of a model that is no draft (a draft's is its method's name).
SPEC_NONE = "none"
DEFAULT_SPEC_DRAFT_TOKENS = 6  # TensorRT Edge-LLM's --specDraftStep default; experiments/spec/spec_decode.py tries more
MAX_SPEC_DRAFT_TOKENS = 32  # --specDraftStep's bound
MAX_SPEC_DRAFT_TOP_K = 16  # --specDraftTopK's bound


class Base(str, Enum):
    """A base engine's layers, named as runtime.types.Deployment's values (the support matrix's first column)."""

    ATTENTION = "vanilla"  # attention layers only
    HYBRID = "hybrid"  # attention and recurrent layers
    RECURRENT = "pure_recurrent"  # recurrent layers only


class DraftKV(str, Enum):
    """Where a method's draft keeps its K/V: what the cache must hold for it."""

    NONE = "none"  # no draft model (off, prompt lookup)
    OWN = "own pool"  # an independent draft page pool, paged and reused beside the base's pages
    BASE = "reads base"  # a read-only assistant attending over the base's own pools (no draft pages)


@dataclass(frozen=True, slots=True, kw_only=True)  # rows spell every field by name
class SpecSupport:
    """One method's row of the support matrix (the seed's "Support Matrix" and DESIGN.md "Speculative decoding")."""

    name: str  # the --specDecode value (and, for a draft, its config.json spec_decode_type)
    label: str  # how messages name it
    bases: tuple[Base, ...]  # the base engines it runs on; any other is refused before loading
    draft_dir: bool  # reads a draft engine dir (ENGINEDIR/draft or --specDraftEngineDir)
    draft_kv: DraftKV
    replays_final_page: bool  # the draft's K/V at p depends on token p + 1: a reuse hit replays its last page
    tree: bool  # --specDraftTopK > 1 (tree drafting) is accepted
    block: bool  # a block draft: --dflashBlockSize applies
    media_cold: bool  # a speculative request with image or audio runs cold (else it only decodes undrafted)
    reuse_batch_of_one: bool  # reuse needs a batch of one (a larger batch bypasses it, counted)
    endpoint_capture: bool  # with reuse: checkpoints at prompt ends only, prefill_state_only publication
    reuse: str  # what context reuse keeps for its requests, in words
    help: str  # the --specDecode help's sentence for it
    # Runs on a base with sliding-window layers (Gemma 3/4), whose engine verifies chains without tree inputs.
    sliding_window_bases: bool = False

    @property
    def tier(self) -> str:
        """What the shared tier serves its requests (the tier holds no draft K/V)."""
        if self.draft_kv is DraftKV.OWN:
            return "nothing: a row with draft K/V computes cold"
        return "base pages and snapshots"


_ALL = (Base.ATTENTION, Base.HYBRID, Base.RECURRENT)
_SAME = "as without speculation"

SPEC_SUPPORT: dict[str, SpecSupport] = {row.name: row for row in (
    SpecSupport(name=SPEC_OFF, label="plain decoding", bases=_ALL, draft_dir=False, draft_kv=DraftKV.NONE,
                replays_final_page=False, tree=False, block=False, media_cold=False, reuse_batch_of_one=False,
                endpoint_capture=False, reuse=_SAME, help="no drafts", sliding_window_bases=True),
    SpecSupport(name=SPEC_NGRAM, label="prompt lookup", bases=(Base.ATTENTION, Base.HYBRID), draft_dir=False,
                draft_kv=DraftKV.NONE, replays_final_page=False, tree=False, block=False, media_cold=False,
                reuse_batch_of_one=False, endpoint_capture=False, reuse=_SAME,
                help="'ngram' drafts by prompt lookup (the tokens that followed the last few tokens where they "
                "occurred earlier in the prompt or output; no draft model)", sliding_window_bases=True),
    SpecSupport(name=SPEC_EAGLE3, label="EAGLE3", bases=(Base.ATTENTION,), draft_dir=True, draft_kv=DraftKV.OWN,
                replays_final_page=True, tree=True, block=False, media_cold=True, reuse_batch_of_one=False,
                endpoint_capture=False,
                reuse="base and draft pages; a hit replays the final matched page (the one-token future dependency)",
                help="'eagle3' drafts with the engine's EAGLE3 draft (ENGINEDIR/draft, or --specDraftEngineDir; "
                "built with llm_build --specDraft)"),
    SpecSupport(name=SPEC_DFLASH, label="DFlash", bases=(Base.ATTENTION,), draft_dir=True, draft_kv=DraftKV.OWN,
                replays_final_page=False, tree=False, block=True, media_cold=True, reuse_batch_of_one=False,
                endpoint_capture=False, reuse="base and draft pages; no replay",
                help="'dflash' drafts a whole block per call with a block draft there"),
    SpecSupport(name=SPEC_DSPARK, label="DSpark", bases=(Base.ATTENTION,), draft_dir=True, draft_kv=DraftKV.OWN,
                replays_final_page=False, tree=False, block=True, media_cold=True, reuse_batch_of_one=False,
                endpoint_capture=False, reuse="base and draft pages; no replay",
                help="'dspark' drafts a block as 'dflash' does, verifying as many guesses as its scheduler says"),
    # A DFlash-format draft trained with a causal in-block mask (dflash_config.causal_head): row j sees rows <= j.
    SpecSupport(name=SPEC_JETSPEC, label="JetSpec", bases=(Base.ATTENTION,), draft_dir=True, draft_kv=DraftKV.OWN,
                replays_final_page=False, tree=True, block=True, media_cold=True, reuse_batch_of_one=False,
                endpoint_capture=False, reuse="base and draft pages; no replay",
                help="'jetspec' drafts a block as 'dflash' does with a JetSpec draft (causal inside the block), as a "
                "chain or, with --specDraftTopK above 1, a tree of each depth's top-k"),
    SpecSupport(name=SPEC_GEMMA4_MTP, label="Gemma4 MTP", bases=(Base.ATTENTION,), draft_dir=True,
                draft_kv=DraftKV.BASE, replays_final_page=False, tree=False, block=False, media_cold=True,
                reuse_batch_of_one=False, endpoint_capture=False,
                reuse="base pages only (the assistant reads them; no draft pool, no replay)",
                help="'gemma4_mtp' drafts with a Gemma4 assistant that reads the base's own K/V (no draft pool; "
                "over a llama-style or a Gemma 4 base)", sliding_window_bases=True),
    SpecSupport(name=SPEC_MTP, label="MTP", bases=(Base.HYBRID,), draft_dir=True, draft_kv=DraftKV.OWN,
                replays_final_page=True, tree=False, block=False, media_cold=True, reuse_batch_of_one=True,
                endpoint_capture=True, reuse="both snapshot pools; a restore rebuilds the successor boundary",
                help="'mtp' drafts with a Qwen3.5 checkpoint's MTP layer on its hybrid base (llm_export mtp; "
                "refused on attention-only bases)"),
)}
SPEC_METHODS = tuple(SPEC_SUPPORT)
# Methods with a draft engine dir; a draft's config.json spec_decode_type is one of them or SPEC_NONE.
DRAFT_METHODS = tuple(name for name, row in SPEC_SUPPORT.items() if row.draft_dir)
SPEC_DECODE_TYPES = (SPEC_NONE, *DRAFT_METHODS)
BLOCK_DRAFTS = tuple(name for name, row in SPEC_SUPPORT.items() if row.block)
TREE_METHODS = tuple(name for name, row in SPEC_SUPPORT.items() if row.tree)  # --specDraftTopK > 1 accepted
METHOD_NAMES = {name: row.label for name, row in SPEC_SUPPORT.items() if row.draft_dir}

BASE_WORDS = {Base.ATTENTION: "attention-only", Base.HYBRID: "hybrid", Base.RECURRENT: "pure recurrent"}


def base_kind(recurrent: bool, hybrid: bool) -> Base:
    """A model's base row from its ModelConfig's is_recurrent / is_hybrid."""
    return Base.RECURRENT if recurrent else Base.HYBRID if hybrid else Base.ATTENTION


def draft_methods_on(base: Base) -> tuple[str, ...]:
    """The methods with a draft that the support matrix runs on `base` (none: a speculative base is refused)."""
    return tuple(name for name in DRAFT_METHODS if base in SPEC_SUPPORT[name].bases)


def support(method: str) -> SpecSupport:
    """The row of a --specDecode value; KeyError for an unknown one (callers check the name first)."""
    return SPEC_SUPPORT[method]


def bases_of(method: str) -> str:
    """The bases a method runs on, in words ("attention-only or hybrid")."""
    return " or ".join(BASE_WORDS[base] for base in SPEC_SUPPORT[method].bases)


def in_words(methods: tuple[str, ...], joint: str = "or") -> str:
    """`("a", "b", "c")` → "a, b or c": how help texts and messages list a table column's methods."""
    return methods[0] if len(methods) == 1 else f"{', '.join(methods[:-1])} {joint} {methods[-1]}"


def spec_decode_help() -> str:
    """--specDecode's help, one sentence per method from the table."""
    sentences = "; ".join(row.help for row in SPEC_SUPPORT.values() if row.name != SPEC_OFF)
    return (f"Speculative decoding: {sentences}; the engine verifies the drafts in one call per step; 'off' "
            "(default). Outputs are unchanged; a request opts out with disable_spec_decode.")


def support_table_markdown() -> str:
    """The support matrix as a Markdown table (docs/commands/llm_inference.md embeds it; a docs test compares)."""
    lines = ["| `--specDecode` | bases | sliding-window base | draft dir | draft K/V | replays final page | tree | "
             "media request | reuse | batch with reuse | shared tier serves |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in SPEC_SUPPORT.values():
        media = "runs cold, undrafted" if row.media_cold else "undrafted"
        reuse = row.reuse + ("; endpoint-only capture, prefill_state_only publication" if row.endpoint_capture else "")
        cells = [f"`{row.name}`", ", ".join(BASE_WORDS[b] for b in row.bases), _yes(row.sliding_window_bases),
                 _yes(row.draft_dir), row.draft_kv.value,
                 _yes(row.replays_final_page), _yes(row.tree), media, reuse,
                 "one row" if row.reuse_batch_of_one else "any", row.tier]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


# DSpark's proposal-length schedulers (TensorRT Edge-LLM's --dsparkScheduler values;
# kvforge/runtime/spec/block_draft.py).
SCHEDULER_OFF, SCHEDULER_THRESHOLD, SCHEDULER_SPS = "off", "threshold", "sps"
DSPARK_SCHEDULERS = (SCHEDULER_OFF, SCHEDULER_THRESHOLD, SCHEDULER_SPS)

"""What each cache type runs with, as data: one support row per type (as kvforge/contract/speculation.py's
SpecSupport is one per speculative method), registered with the type. The engine's refusals of a combination are
read off the rows (`refusal`), and the docs render them as one matrix (`support_table_markdown`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

from kvforge.contract.errors import InvalidConfig
from kvforge.contract.speculation import SPEC_METHODS, SPEC_OFF, SPEC_SUPPORT
from kvforge.runtime.types import Deployment

# The message for what an engine built with a sliding-window page group does not serve yet (it reads or keeps K/V
# through the global page table alone).
NOT_ON_WINDOW_GROUP = "is not served on an engine built with --slidingWindowPool yet (rebuild without it)"
DEPLOYMENT_WORDS = {Deployment.VANILLA: "attention-only", Deployment.HYBRID: "hybrid",
                    Deployment.PURE_RECURRENT: "pure recurrent"}
# --specDecode values by what they need of a cache type.
ALL_METHODS = SPEC_METHODS
WITHOUT_DRAFT_MODEL = tuple(name for name in SPEC_METHODS if not SPEC_SUPPORT[name].draft_dir)
PLAIN_DECODING = (SPEC_OFF,)


class Tier(str, Enum):
    """What a shared tier (--sharedCache) does with a type's state."""

    SAVED = "saved and loaded"
    NOT_SAVED = "not saved (computed again)"
    REFUSED = "refused"


class ReuseOff(str, Enum):
    """What the type does with context reuse off (enable_context_reuse false)."""

    RUNS = "runs"
    IMPLIES = "turns reuse on"
    REFUSED = "refused"
    UNUSED = "not built"


@dataclass(frozen=True, slots=True)
class CacheSupport:
    """One cache type's row: where it runs and with what, and the one-line refusal of each column it refuses."""

    label: str  # how the docs name it
    option: str  # the setting that turns it on (its refusals name it); "" = on whenever the deployment has it
    deployments: tuple[Deployment, ...]  # the engines it runs on
    spec_methods: tuple[str, ...]  # the --specDecode values it runs with
    window_group: bool  # served on an engine built with --slidingWindowPool
    tier: Tier
    reuse_off: ReuseOff
    # The one-line refusals by column: "reuse", "deployment" ({deployment}: the engine's, in words), "spec"
    # ({method}), "window", "tier". A column without a message is informational here: where it matters, another
    # check refuses it first (the engine config's budgets, the speculation table).
    refusals: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    spec_field: str = ""  # the setting a speculation refusal names ("": `option`)
    # Whether the type is on for an engine config and its build (None: `option`'s value is the switch).
    on: Callable[[Any, Any], bool] | None = None
    note: str = ""  # what the matrix adds in words (a check the row cannot express)

    def is_on(self, config: Any, build: Any) -> bool:
        if self.on is not None:
            return self.on(config, build)
        return bool(self.option) and bool(getattr(config, self.option, False))


def refusal(row: CacheSupport, *, deployment: Deployment, spec_decode: str, reuse: bool, window_group: bool,
            shared_cache: bool) -> InvalidConfig | None:
    """The row's refusal of this combination, in the order reuse, deployment, speculation, window group, tier, or
    None when the type runs with it (or leaves the refusal to another check: no message)."""
    messages = row.refusals
    if not reuse and row.reuse_off is ReuseOff.REFUSED and "reuse" in messages:
        return InvalidConfig(messages["reuse"], row.option)
    if deployment not in row.deployments and "deployment" in messages:
        return InvalidConfig(messages["deployment"].format(deployment=DEPLOYMENT_WORDS[deployment]), row.option)
    if spec_decode not in row.spec_methods and "spec" in messages:
        return InvalidConfig(messages["spec"].format(method=spec_decode), row.spec_field or row.option)
    if window_group and not row.window_group and "window" in messages:
        return InvalidConfig(messages["window"], row.option)
    if shared_cache and row.tier is Tier.REFUSED and "tier" in messages:
        return InvalidConfig(messages["tier"], "shared_cache")
    return None


def check_support(rows: Iterable[CacheSupport], config: Any, build: Any, deployment: Deployment) -> None:
    """Raise the first refusal of the types `config` turns on for this engine (their rows, in registration order)."""
    for row in rows:
        if row.is_on(config, build):
            found = refusal(row, deployment=deployment, spec_decode=config.spec_decode,
                            reuse=config.enable_context_reuse, window_group=bool(build.window_pool_pages),
                            shared_cache=bool(config.shared_cache))
            if found is not None:
                raise found


def support_table_markdown(rows: Iterable[CacheSupport]) -> str:
    """The types' rows as one Markdown table (docs/context-reuse.md embeds it; a docs test compares)."""
    lines = ["| cache type | turned on by | engines | `--specDecode` | sliding-window group | shared tier | "
             "reuse off | note |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        methods = "any" if row.spec_methods == ALL_METHODS else ", ".join(f"`{m}`" for m in row.spec_methods)
        cells = [row.label, f"`{row.option}`" if row.option else "the engine",
                 ", ".join(DEPLOYMENT_WORDS[d] for d in row.deployments), methods,
                 "yes" if row.window_group else "refused", row.tier.value, row.reuse_off.value, row.note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

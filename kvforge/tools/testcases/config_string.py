"""Config strings of the seed's test harness (`mxsl1024-mxbs1-ctxreuse-llm_context_reuse`) resolved to flags."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from kvforge.contract.engine_dir import BuilderConfig
from kvforge.contract.errors import KvforgeError

CONFIG_FLAG = "--config"
REUSE_TOKEN = "ctxreuse"
SNAPSHOT_TOKENS = ("ccrsb", "ccpkvsb")
_NUMBERED = re.compile(r"([a-z]+)([0-9]+)")
_TEST_CASE = re.compile(r"\w+")


@dataclass(frozen=True, slots=True)
class Token:
    """A `<name><integer>` token: the setting it fills and the flag the seed's harness passes for it."""

    name: str
    setting: str  # BuildOptions field for build tokens; a run setting otherwise
    flag: str
    minimum: int
    build: bool


TOKENS = {t.name: t for t in (
    Token("mxsl", "max_kv_cache_capacity", "--maxKVCacheCapacity", 1, True),
    Token("mxbs", "max_batch_size", "--maxBatchSize", 1, True),
    Token("mxil", "max_input_len", "--maxInputLen", 1, True),
    Token("mxkvp", "max_kv_pool_pages", "--maxKVPoolPages", 0, True),
    Token("mxlr", "max_lora_rank", "--maxLoraRank", 0, True),
    Token("tpp", "tokens_per_page", "--tokensPerPage", 1, True),  # kvforge's own: the seed's pages are 128 tokens
    Token("bs", "batch_size", "--batchSize", 1, False),
    Token("ccrsb", "recurrent_snapshot_pool_bytes", "--contextCacheRecurrentSnapshotPoolBytes", 1, False),
    Token("ccpkvsb", "partial_kv_snapshot_pool_bytes", "--contextCachePartialKVSnapshotPoolBytes", 1, False),
)}
KNOWN = ", ".join([*(f"{name}<N>" for name in TOKENS), REUSE_TOKEN])


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """What a config string asks for: token values in string order, reuse, and the test case it names."""

    text: str = ""
    values: dict[str, int] = field(default_factory=dict)  # token name -> value
    context_reuse: bool = False
    test_case: str | None = None

    def build_options(self) -> dict[str, int]:
        """BuildOptions fields the string sets (the others keep llm_build's defaults)."""
        return {TOKENS[n].setting: v for n, v in self.values.items() if TOKENS[n].build}

    def build_args(self) -> list[str]:
        return [f"{TOKENS[n].flag}={v}" for n, v in self.values.items() if TOKENS[n].build]

    def inference_args(self) -> list[str]:
        run = [f"{TOKENS[n].flag}={v}" for n, v in self.values.items() if not TOKENS[n].build]
        return (["--enableContextReuse"] if self.context_reuse else []) + run

    @property
    def batch_size(self) -> int | None:
        return self.values.get("bs")

    @property
    def partial_kv_snapshot_pool_bytes(self) -> int:
        return self.values.get("ccpkvsb", 0)

    @property
    def recurrent_snapshot_pool_bytes(self) -> int:
        return self.values.get("ccrsb", 0)

    def notes(self) -> list[str]:
        notes = []
        if "ccrsb" in self.values:
            notes.append(f"ccrsb{self.values['ccrsb']}: recurrent snapshot budget of recurrent and hybrid engines "
                         "(ignored on attention-only engines)")
        if "ccpkvsb" in self.values:
            notes.append(f"ccpkvsb{self.values['ccpkvsb']}: partial-KV snapshot budget of the files that declare "
                         "_checks.partial_kv_snapshots (the others keep page-granular reuse and their counters)")
        return notes

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.text, "llm_build": self.build_args(), "llm_inference": self.inference_args(),
                "test_case": self.test_case, "notes": self.notes()}


def parse_config(text: str) -> ResolvedConfig:
    """Resolve a config string; unknown tokens are refused (only the last token may name a test case)."""
    parts = text.split("-") if text else []
    values: dict[str, int] = {}
    seen: set[str] = set()
    test_case = None
    for i, part in enumerate(parts):
        numbered = _NUMBERED.fullmatch(part)
        token = TOKENS.get(numbered.group(1)) if numbered else None
        name = token.name if token is not None else part
        if name in seen:
            _fail(f"{name} is given twice in {text!r}")
        seen.add(name)
        if token is not None and numbered is not None:
            values[token.name] = _number(token, numbered.group(2))
        elif part == REUSE_TOKEN:
            continue
        elif i == len(parts) - 1 and _TEST_CASE.fullmatch(part):
            test_case = part
        else:
            _fail(f"unknown token {part!r} in {text!r} (known: {KNOWN}; the last token may name a test case; "
                  "the model comes from --onnxDir/--engineDir, so no <model>-<precision> prefix)")
    if REUSE_TOKEN not in seen and any(name in values for name in SNAPSHOT_TOKENS):
        _fail("snapshot pool budgets require ctxreuse")
    return ResolvedConfig(text, values, REUSE_TOKEN in seen, test_case)


def named_test_case(config: ResolvedConfig, test_cases_dir: Path) -> Path | None:
    """The file the trailing token names, as the seed's harness finds it: <test cases dir>/<name>.json."""
    if config.test_case is None:
        return None
    path = test_cases_dir / f"{config.test_case}.json"
    if not path.is_file():
        _fail(f"the last token {config.test_case!r} is neither a known token ({KNOWN}) nor a test case: "
              f"{path} does not exist (see --testCasesDir)")
    return path


def check_engine(config: ResolvedConfig, build: BuilderConfig, engine_dir: Path) -> None:
    """With --engineDir the build tokens describe the engine: refuse a string that contradicts it."""
    for name, value in config.values.items():
        token = TOKENS[name]
        if not token.build:
            continue
        actual = getattr(build, token.setting)
        wanted = build.full_batch_pages if name == "mxkvp" and value == 0 else value
        if actual != wanted:
            _fail(f"{name}{value} asks for {token.flag.lstrip('-')} {wanted} but the engine in {engine_dir} was built "
                  f"with {actual}; build one with --onnxDir, or drop the token")


def _number(token: Token, digits: str) -> int:
    value = int(digits)
    if value < token.minimum:
        _fail(f"{token.name}{digits}: {token.flag} must be {'positive' if token.minimum else '>= 0'}, got {value}")
    return value


def _fail(message: str) -> NoReturn:
    raise KvforgeError(message, CONFIG_FLAG)

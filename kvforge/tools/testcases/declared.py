"""What a test file declares beside its requests: references, identities, reuse and expected profile counters."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvforge.contract.errors import KvforgeError
from kvforge.contract.profile_schema import SECTIONS
from kvforge.contract.validation import check_int, describe, fail, get_bool, json_kind
from kvforge.runtime.inputs.request_file import RequestFile, load_request_file

CHECKS_KEY = "_checks"
EXPECTED_PREFIX = "expected_"  # expected_context_cache, expected_prefill, ... : one per profile section
CHECK_KEYS = ("context_reuse", "partial_kv_snapshots", "identical", "engine_specific")
# What an engine_specific block's `when` may name (see `run_facts` in runner.py).
FACTS = ("model", "tokens_per_page", "kv_cache_dtype", "max_batch_size", "max_kv_pool_pages", "scheduling")
# The seed's harness checks this file by name: 3 responses, 0 and 2 identical, reused tokens > 0 (reuse on).
SEED_REUSE_FILE = "llm_context_reuse.json"


@dataclass(frozen=True, slots=True)
class Expectations:
    """Profile counters to assert exactly, per section (`context_cache`, `prefill`, ...); `when` limits the engines."""

    sections: dict[str, dict[str, Any]]
    when: dict[str, Any] = field(default_factory=dict)
    label: str = ""  # "" for the file's top level, else "engine_specific[i]" (its check's name)


@dataclass(slots=True)
class CaseSpec:
    path: Path
    requests: RequestFile
    references: dict[int, str]  # request index -> reference answer
    identical: list[tuple[int, int]]
    context_reuse: bool  # the file asks for reuse (and for prefill.reused_tokens > 0)
    partial_kv_snapshots: bool  # the file asks for partial-KV snapshots too (token-exact reuse; implies reuse)
    seed_rule: bool  # no _checks: the seed's implicit rule applies to llm_context_reuse.json when reuse is on
    expectations: list[Expectations]

    @property
    def name(self) -> str:
        return self.path.name


def load_case(path: Path) -> CaseSpec:
    """Read a request file and what it declares; every problem is one line naming the file and the JSON path."""
    try:
        requests = load_request_file(path)
        data = json.loads(path.read_text(encoding="utf-8-sig"))
        return _declared(path, data, requests)
    except KvforgeError as exc:
        where = "" if exc.field in (None, "inputFile") else f"{exc.field}: "
        raise KvforgeError(f"{where}{exc.message}", str(path)) from None


def _declared(path: Path, data: dict[str, Any], requests: RequestFile) -> CaseSpec:
    checks = data.get(CHECKS_KEY, {})
    if not isinstance(checks, dict):
        fail(CHECKS_KEY, f"must be an object, got {json_kind(checks)}")
    for key in checks:
        if key not in CHECK_KEYS:
            fail(f"{CHECKS_KEY}.{key}", f"unknown check (known: {', '.join(CHECK_KEYS)})")
    count = len(requests.requests)
    identical = [_pair(p, f"{CHECKS_KEY}.identical[{i}]", count) for i, p in enumerate(_list(checks, "identical"))]
    for a, b in identical:
        for index in (a, b):
            if requests.requests[index].sampling.num_logprobs < 1:
                fail(f"requests[{index}].num_logprobs", "must be >= 1: an identity compares top-1 logprob ids")
    blocks = [_block(b, i) for i, b in enumerate(_list(checks, "engine_specific"))]
    return CaseSpec(path=path, requests=requests, references=_references(requests), identical=identical,
                    context_reuse=get_bool(checks, "context_reuse", CHECKS_KEY, False),
                    partial_kv_snapshots=get_bool(checks, "partial_kv_snapshots", CHECKS_KEY, False),
                    seed_rule=CHECKS_KEY not in data and path.name == SEED_REUSE_FILE,
                    expectations=[Expectations(_sections(data, "")), *blocks])


def _references(requests: RequestFile) -> dict[int, str]:
    references = {}
    for request in requests.requests:
        if "reference" in request.extra:
            value = request.extra["reference"]
            if not isinstance(value, str) or not value.strip():
                fail(f"requests[{request.index}].reference", f"must be a non-empty string, got {describe(value)}")
            references[request.index] = value
    return references


def _list(checks: dict[str, Any], key: str) -> list[Any]:
    value = checks.get(key, [])
    if not isinstance(value, list):
        fail(f"{CHECKS_KEY}.{key}", f"must be an array, got {json_kind(value)}")
    return value


def _pair(value: Any, where: str, count: int) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        fail(where, f"must be a pair of request indices like [0, 2], got {describe(value)}")
    a, b = (check_int(v, where, 0, count - 1) for v in value)
    if a == b:
        fail(where, "must name two different requests")
    return a, b


def _block(value: Any, index: int) -> Expectations:
    label = f"engine_specific[{index}]"
    where = f"{CHECKS_KEY}.{label}"
    if not isinstance(value, dict):
        fail(where, f"must be an object with `when` and expected_* keys, got {json_kind(value)}")
    when = value.get("when")
    if not isinstance(when, dict) or not when:
        fail(f"{where}.when", f"must be a non-empty object of run facts ({', '.join(FACTS)})")
    for key in when:
        if key not in FACTS:
            fail(f"{where}.when.{key}", f"unknown fact (known: {', '.join(FACTS)})")
    for key in value:
        if key != "when" and not key.startswith(EXPECTED_PREFIX):
            fail(f"{where}.{key}", "unknown key (expected `when` and expected_<profile section> keys)")
    sections = _sections(value, where)
    if not sections:
        fail(where, "declares no expected_<profile section> counters")
    return Expectations(sections, dict(when), label)


def _sections(obj: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    sections = {}
    for key, value in obj.items():
        if not key.startswith(EXPECTED_PREFIX):
            continue
        section = key[len(EXPECTED_PREFIX):]
        path = f"{where}.{key}" if where else key
        if section not in SECTIONS:
            fail(path, f"names no profile section (known: {', '.join(SECTIONS)})")
        if not isinstance(value, dict) or not value:
            fail(path, f"must be a non-empty object of counters, got {describe(value)}")
        sections[section] = value
    return sections


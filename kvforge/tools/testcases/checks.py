"""The checks llm_test runs on one file's responses and profile; every result carries a one-line reason."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvforge.contract.errors import KvforgeError
from kvforge.tools.testcases.declared import CaseSpec, Expectations

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
SEED_ROUGE_THRESHOLDS = (0.25, 0.20)  # ROUGE-1, ROUGE-L: the seed harness's thresholds for every ROUGE test case
ROUGE_MODES = ("auto", "on", "off")
Scorer = Callable[[str, str], tuple[float, float]]  # (reference, output) -> (ROUGE-1 F, ROUGE-L F)


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    status: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class CheckOptions:
    """How this run checks files: ROUGE mode and thresholds, reuse, and the facts engine_specific blocks match."""

    reuse: bool
    facts: dict[str, Any]
    synthetic: bool = False
    rouge: str = "auto"
    thresholds: tuple[float, float] = SEED_ROUGE_THRESHOLDS
    lengths_overridden: bool = False
    scorer: Scorer | None = field(default=None, compare=False)


def rouge_scorer() -> Scorer:
    """ROUGE-1/ROUGE-L F-measures from Google's rouge-score, as the seed's harness computes them."""
    try:
        from rouge_score import rouge_scorer as rouge
    except ImportError:
        raise KvforgeError("ROUGE checks need the rouge-score package (pip install rouge-score), "
                           "or skip them with --rouge off", "--rouge") from None
    scorer = rouge.RougeScorer(["rouge1", "rougeL"])

    def score(reference: str, output: str) -> tuple[float, float]:
        scores = scorer.score(reference, output)
        return scores["rouge1"].fmeasure, scores["rougeL"].fmeasure

    return score


def check_file(case: CaseSpec, responses: list[dict[str, Any]], profile: dict[str, Any],
               options: CheckOptions) -> list[CheckResult]:
    """Every check the file declares (and the seed's implicit rule), in a stable order."""
    results = _rouge_checks(case, responses, options)
    results += [identity_check(responses, a, b) for a, b in case.identical]
    if case.seed_rule:
        results += _seed_rule(responses, profile, options.reuse)
    elif case.context_reuse:
        results.append(reuse_check(profile))
    for block in case.expectations:
        results += _expectation_checks(block, profile, options)
    return results


def rouge_check(index: int, reference: str, output: str, thresholds: tuple[float, float],
                scorer: Scorer) -> CheckResult:
    rouge1, rouge_l = scorer(reference, output)
    low1, low_l = thresholds
    name = f"rouge[{index}]"
    if rouge1 >= low1 and rouge_l >= low_l:
        return CheckResult(name, PASSED, f"ROUGE-1 {rouge1:.3f}, ROUGE-L {rouge_l:.3f}")
    return CheckResult(name, FAILED, f"ROUGE-1 {rouge1:.3f} (min {low1}), ROUGE-L {rouge_l:.3f} (min {low_l}): "
                                     f"output {_short(output)} vs reference {_short(reference)}")


def identity_check(responses: list[dict[str, Any]], a: int, b: int) -> CheckResult:
    """Text, finish reason and per-step top-1 logprob ids of responses a and b must be equal."""
    name = f"identical[{a},{b}]"
    first, second = responses[a], responses[b]
    if first["output_text"] != second["output_text"]:
        return CheckResult(name, FAILED, f"output_text differs: {_short(first['output_text'])} vs "
                                         f"{_short(second['output_text'])}")
    if first["finish_reason"] != second["finish_reason"]:
        return CheckResult(name, FAILED,
                           f"finish_reason differs: {first['finish_reason']} vs {second['finish_reason']}")
    if not first.get("logprobs") or not second.get("logprobs"):
        return CheckResult(name, FAILED, "no logprobs to compare: the requests need num_logprobs >= 1")
    ids_a, ids_b = _top1(first), _top1(second)
    if ids_a != ids_b:
        pairs = zip(ids_a, ids_b, strict=False)  # a shorter list differs where it ends
        step = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(ids_a), len(ids_b)))
        return CheckResult(name, FAILED, f"top-1 logprob ids differ at step {step}: "
                                         f"{ids_a[step:step + 3]} vs {ids_b[step:step + 3]}")
    return CheckResult(name, PASSED, f"{len(ids_a)} tokens identical")


def reuse_check(profile: dict[str, Any]) -> CheckResult:
    reused = profile.get("prefill", {}).get("reused_tokens", 0)
    if isinstance(reused, int) and reused > 0:
        return CheckResult("reused_tokens>0", PASSED, f"prefill.reused_tokens {reused}")
    return CheckResult("reused_tokens>0", FAILED, f"prefill.reused_tokens is {reused}: no prompt token came from the "
                                                  "cache")


def counter_mismatches(expected: dict[str, Any], actual: Any, path: str) -> list[str]:
    """`path.key expected X, got Y` for every expected key (nested objects compared key by key)."""
    found = []
    for key, want in expected.items():
        where = f"{path}.{key}"
        if not isinstance(actual, dict) or key not in actual:
            found.append(f"{where} missing from the profile")
        elif isinstance(want, dict):
            found += counter_mismatches(want, actual[key], where)
        elif actual[key] != want:
            found.append(f"{where} expected {json.dumps(want)}, got {json.dumps(actual[key])}")
    return found


def _rouge_checks(case: CaseSpec, responses: list[dict[str, Any]], options: CheckOptions) -> list[CheckResult]:
    skip = ("--rouge off" if options.rouge == "off" else
            "synthetic engine (random weights) cannot match a reference; --rouge on forces the check"
            if options.rouge == "auto" and options.synthetic else "")
    if skip or not case.references:
        return [CheckResult(f"rouge[{i}]", SKIPPED, skip) for i in case.references]
    scorer = options.scorer or rouge_scorer()
    return [rouge_check(i, ref, responses[i]["output_text"], options.thresholds, scorer)
            for i, ref in case.references.items()]


def _seed_rule(responses: list[dict[str, Any]], profile: dict[str, Any], reuse: bool) -> list[CheckResult]:
    if not reuse:
        return [CheckResult("seed_rule", SKIPPED, "the seed's llm_context_reuse rule applies with reuse on "
                                                  "(ctxreuse or --enableContextReuse)")]
    if len(responses) != 3:
        return [CheckResult("responses==3", FAILED, f"the seed's rule needs exactly 3 responses, got {len(responses)}")]
    return [identity_check(responses, 0, 2), reuse_check(profile)]


def _expectation_checks(block: Expectations, profile: dict[str, Any], options: CheckOptions) -> list[CheckResult]:
    """The file's top-level counters: one check per profile section; an engine_specific block: one check."""
    if not block.label:
        deployment = options.facts.get("deployment", "vanilla")
        if deployment != "vanilla":  # recurrent state is reused at exact checkpoints, not by pages
            return [CheckResult(f"expected_{section}", SKIPPED, "the file's top-level counters describe page reuse "
                                f"on attention-only engines; this engine is {deployment} (exact checkpoints; "
                                "engine_specific blocks may cover it)") for section in block.sections]
        return [_counters_result(f"expected_{section}", {section: expected}, profile, options.reuse)
                for section, expected in block.sections.items()]
    skip = _not_applicable(block, options)
    if skip:
        return [CheckResult(block.label, SKIPPED, skip)]
    return [_counters_result(block.label, block.sections, profile, options.reuse)]


def _counters_result(name: str, sections: dict[str, dict[str, Any]], profile: dict[str, Any],
                     reuse: bool) -> CheckResult:
    wrong = []
    for section, expected in sections.items():
        if section in profile:
            wrong += counter_mismatches(expected, profile[section], section)
        else:
            off = " (context reuse is off for this run)" if section == "context_cache" and not reuse else ""
            wrong.append(f"the profile has no {section} block{off}")
    if wrong:
        more = f" (+{len(wrong) - 3} more)" if len(wrong) > 3 else ""
        return CheckResult(name, FAILED, "; ".join(wrong[:3]) + more)
    return CheckResult(name, PASSED, f"{sum(_count_leaves(e) for e in sections.values())} counters equal")


def _not_applicable(block: Expectations, options: CheckOptions) -> str:
    if not block.when:
        return ""
    if options.lengths_overridden:
        return "--maxGenerateLength overrides the lengths these counters were measured with"
    differs = [k for k, v in block.when.items() if not _same(v, options.facts.get(k))]
    if not differs:
        return ""
    return (f"for {', '.join(f'{k}={block.when[k]}' for k in differs)}; "
            f"this run: {', '.join(f'{k}={options.facts.get(k)}' for k in differs)}")


def _same(expected: Any, actual: Any) -> bool:
    if isinstance(expected, str) and isinstance(actual, str):
        return expected.casefold() == actual.casefold()
    return expected == actual


def _count_leaves(expected: dict[str, Any]) -> int:
    return sum(_count_leaves(v) if isinstance(v, dict) else 1 for v in expected.values())


def _top1(response: dict[str, Any]) -> list[int]:
    return [step[0]["token_id"] for step in response.get("logprobs") or [] if step]


def _short(text: str, limit: int = 60) -> str:
    """A quoted one-line excerpt (newlines escaped) for a reason."""
    return json.dumps(text if len(text) <= limit else text[:limit] + "…", ensure_ascii=False)

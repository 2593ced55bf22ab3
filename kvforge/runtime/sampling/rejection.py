"""Verification of drafted tokens: which of a row's drafts the base accepts, keeping its output distribution."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvforge.runtime.sampling.sampler import Sampler, SampleResult


def accept_tokens(sampler: Sampler, logits: np.ndarray, draft_ids: Sequence[int]) -> list[SampleResult]:
    """The tokens a row commits this step: `logits` [1 + k, V] holds the logits after its last pending token and
    after each of its k draft tokens. Drafts are accepted in order while they pass; the first that fails is
    replaced by the base's own token, and if all pass one more (bonus) token is sampled. So 1..k+1 results.

    Greedy: a draft passes when it is the argmax (the output equals decoding without drafts, token for token).
    Sampling: the drafter gave no distribution, so its proposal is one-hot and rejection sampling accepts draft d
    with probability p(d) and otherwise draws from p with d removed, renormalized: every committed token is then
    distributed exactly as the base model's (p = `Sampler.probs`, after bias, temperature, top-k and top-p).
    """
    if logits.ndim != 2 or logits.shape[0] != len(draft_ids) + 1:
        raise ValueError(f"expected [{len(draft_ids) + 1}, V] logits for {len(draft_ids)} drafts, got {logits.shape}")
    results: list[SampleResult] = []
    for position, draft in enumerate(draft_ids):
        row = logits[position]
        if sampler.params.is_greedy:
            result = sampler.sample(row)
            results.append(result)
            if result.token_id != draft:
                return results
            continue
        probs = sampler.probs(row)
        if sampler.rng.random() < probs[draft]:
            results.append(sampler.scored(row, draft))
            continue
        probs[draft] = 0.0  # p(d) < 1 here, so some other token keeps mass
        results.append(sampler.scored(row, sampler.draw_from(probs)))
        return results
    results.append(sampler.sample(logits[len(draft_ids)]))
    return results


def accept_tree(sampler: Sampler, logits: np.ndarray, draft_ids: Sequence[int],
                parents: Sequence[int]) -> tuple[list[SampleResult], list[int]]:
    """The tokens a tree row commits, and the drafts on its accepted path (indices into `draft_ids`, root first).

    `logits` [1 + n, V]: after the pending token (row 0), then after each draft (row i + 1); `parents[i]` is draft i's
    parent draft (-1: the pending token). From the root, the base picks its token exactly as it would without drafts
    (`Sampler.sample`: the argmax, or a draw from the row's distribution); a child carrying that token is accepted
    and the walk goes on from it, otherwise the token is the last one committed. Each committed token is therefore
    the base's own choice given the path so far: greedy output is unchanged and at temperature > 0 every token is
    distributed as the base model's (the drafts are one-hot proposals, so this is multi-candidate rejection sampling
    with deterministic proposals). A chain (parents -1, 0, 1, ...) commits what `accept_tokens` would at greedy."""
    if logits.ndim != 2 or logits.shape[0] != len(draft_ids) + 1 or len(parents) != len(draft_ids):
        raise ValueError(f"expected [{len(draft_ids) + 1}, V] logits and one parent per draft, got {logits.shape} "
                         f"and {len(parents)} parents")
    children: dict[int, dict[int, int]] = {}
    for index, (token, parent) in enumerate(zip(draft_ids, parents, strict=True)):
        if not -1 <= parent < index:
            raise ValueError(f"draft {index}'s parent {parent} does not come before it")
        children.setdefault(parent, {}).setdefault(int(token), index)  # a repeated sibling token: the first wins
    results: list[SampleResult] = []
    path: list[int] = []
    node = -1
    while True:
        result = sampler.sample(logits[node + 1])
        results.append(result)
        node = children.get(node, {}).get(result.token_id, -2)
        if node == -2:
            return results, path
        path.append(node)

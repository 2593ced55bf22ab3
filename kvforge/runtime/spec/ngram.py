"""Prompt-lookup drafting: the tokens that followed the earliest earlier occurrence of the sequence's last n tokens.

No weights, no draft KV and no replay: the proposal is copied from the sequence's own prompt and output, so it pays
where the answer quotes its input (document questions, summaries, code edits) and costs nothing when no n-gram
repeats (no proposal, a plain decode row). The longest n in [min_n, max_n] that matches wins, as in vLLM's `ngram`
method; the search is one vectorized comparison per n over the token history (tens of microseconds for 2,000
tokens), so a step never waits on it.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

DEFAULT_MIN_N = 2
DEFAULT_MAX_N = 4


class NgramProposer:
    __slots__ = ("min_n", "max_n", "num_tokens")
    owns_kv = False

    def observe(self, rows: list, output: object, sampled: list) -> None:
        pass  # the proposal reads the tokens alone

    def propose_batch(self, seqs: list, limits: list[int]) -> list[list[int]]:
        return [self.propose(seq.all_token_ids(), limit) for seq, limit in zip(seqs, limits, strict=True)]

    def __init__(self, num_tokens: int, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        count = min(self.num_tokens, limit)
        if count <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows that end before the last token: the suffix itself never matches, and a match leaves at
            # least one token after it to propose.
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[0]) + n
                return tokens[start:start + count].tolist()
        return []

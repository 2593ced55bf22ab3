"""EAGLE3 drafting: a one-layer draft engine with its own KV pool, fed the base's hidden states, proposing greedily.

Token layout of one sequence (C = tokens whose base K/V is committed, t_C the pending token):

    position p:       0      1     ...   C-1    | C      C+1   ...  C+k-2
    draft input:      t_1    t_2   ...   t_C    | d_1    d_2   ...  d_{k-1}     (the token *after* p)
    hidden input:     base h_0 ...      base h_{C-1} | draft's own output at p-1
    draft K/V:        coherent (lease.draft_computed_tokens = C) | scratch, rewritten next round
    draft output:     ...                 d_1   | d_2    d_3   ...  d_k

`observe` runs after each base call, before the commit publishes anything: the draft consumes the positions the
base just committed (prompt chunks, verify rows' accepted tokens), with their hidden states from that call, so the
draft K/V always covers exactly the base's committed positions and a publication can carry a coherent draft path.
Its last output is the first proposal d_1. `propose_batch` then runs k - 1 single-position calls for every
decoding sequence at once. Drafts are greedy (argmax over the reduced vocabulary, mapped by d2t); the base's
verification (greedy match, or rejection sampling against a one-hot proposal at temperature > 0) keeps outputs
lossless whatever the draft proposes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvforge.contract.engine_dir import BASE_HIDDEN_INPUT, DRAFT_HIDDEN_INPUT
from kvforge.runtime.backend import Backend, StepInputs
from kvforge.runtime.context_cache.manager import ContextCacheManager
from kvforge.runtime.model_executor import BatchOutput
from kvforge.runtime.sampling import SampleResult
from kvforge.runtime.scheduler import ScheduledRow
from kvforge.runtime.sequence import Sequence


@dataclass(slots=True)
class DraftState:
    """What the drafter knows at a sequence's end: its first proposal and the draft's hidden state that made it."""

    position: int  # the sequence's committed tokens C when this was computed
    first_token: int  # d_1, a base vocabulary id
    hidden: np.ndarray  # [H]: the draft layer's output at position C - 1


class Eagle3Proposer:
    owns_kv = True

    def __init__(self, backend: Backend, embedding: np.ndarray, d2t: np.ndarray, cache: ContextCacheManager,
                 num_tokens: int, base_hidden_width: int) -> None:
        """`backend`: the draft engine's runner (its own KV pool); `embedding`: the draft's token table; `d2t`: draft
        id -> base id offsets; `cache`: the coordinator whose draft pool the leases' draft pages come from."""
        self.backend = backend
        self.embedding = embedding
        self.draft_to_base = np.arange(len(d2t), dtype=np.int64) + d2t
        self.cache = cache
        self.num_tokens = num_tokens
        self.base_width = base_hidden_width
        self.hidden_size = embedding.shape[1]

    # --- after each base call -------------------------------------------------------------------------

    def observe(self, rows: list[ScheduledRow], output: BatchOutput, sampled: list[list[SampleResult]]) -> None:
        jobs = []
        for i, (row, samples) in enumerate(zip(rows, sampled, strict=True)):
            seq, lease = row.seq, row.seq.lease
            if not seq.drafts_with_kv or lease is None or lease.draft_page_ids is None:
                continue
            start = seq.num_computed_tokens  # the commit has not moved it yet
            if lease.draft_computed_tokens != start:
                raise AssertionError("the draft K/V lags the base's committed positions")
            end = start + row.num_new_tokens + max(len(samples) - 1, 0)  # base positions committed by this step
            if end <= start or output.hidden_states is None or output.hidden_states[i] is None:
                continue
            following = seq.all_token_ids() + [s.token_id for s in samples]  # token p + 1 for every position p
            jobs.append((seq, start, following[start + 1:end + 1], output.hidden_states[i][:end - start]))
        if not jobs:
            return
        logits, hidden = self._run([(seq, start, ids, base, None) for seq, start, ids, base in jobs])
        for (seq, start, ids, _), row_logits, row_hidden in zip(jobs, logits, hidden, strict=True):
            assert seq.lease is not None
            end = start + len(ids)
            seq.lease.draft_computed_tokens = end
            seq.draft_state = DraftState(end, self._token(row_logits), row_hidden)

    # --- before the next step -------------------------------------------------------------------------

    def propose_batch(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in seqs]
        live: list[tuple[int, Sequence, DraftState]] = []
        for i, (seq, limit) in enumerate(zip(seqs, limits, strict=True)):
            state = seq.draft_state
            if not isinstance(state, DraftState) or state.position != seq.num_computed_tokens or limit <= 0 \
                    or seq.lease is None or seq.lease.draft_page_ids is None:
                continue
            proposals[i].append(state.first_token)
            count = min(self.num_tokens, limit)
            # The draft writes scratch K/V at positions C .. C + count - 2; no pages, no more drafts (never preempts).
            if count > 1 and self.cache.try_grow_draft(seq.lease, state.position + count - 1):
                live.append((i, seq, state))
        hidden = {i: state.hidden for i, _, state in live}
        for step in range(1, self.num_tokens):
            live = [(i, seq, state) for i, seq, state in live if len(proposals[i]) < min(self.num_tokens, limits[i])]
            if not live:
                break
            jobs = [(seq, state.position + step - 1, [proposals[i][-1]], None, hidden[i]) for i, seq, state in live]
            logits, outs = self._run(jobs)
            for (i, _, _), row_logits, row_hidden in zip(live, logits, outs, strict=True):
                proposals[i].append(self._token(row_logits))
                hidden[i] = row_hidden
        return proposals

    # --- the draft engine call ------------------------------------------------------------------------

    def _run(self, jobs: list[tuple[Sequence, int, list[int], np.ndarray | None, np.ndarray | None]]
             ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """One draft call over ragged rows (sequence, first position, the tokens fed there, base hidden states
        [n, base width] or None, the draft's own hidden state [H] or None): logits and hidden at each row's last."""
        width = max(len(ids) for _, _, ids, _, _ in jobs)
        batch = len(jobs)
        embeds = np.zeros((batch, width, self.hidden_size), dtype=np.float32)
        base = np.zeros((batch, width, self.base_width), dtype=np.float32)
        own = np.zeros((batch, width, self.hidden_size), dtype=np.float32)
        for b, (_, _, ids, base_hidden, draft_hidden) in enumerate(jobs):
            embeds[b, :len(ids)] = self.embedding[ids]
            if base_hidden is not None:
                base[b, :len(ids)] = base_hidden
            if draft_hidden is not None:
                own[b, 0] = draft_hidden
        lengths = np.array([len(ids) for _, _, ids, _, _ in jobs], dtype=np.int32)
        step = StepInputs(embeds, lengths, np.array([start for _, start, _, _, _ in jobs], dtype=np.int32),
                          [seq.lease.draft_page_ids for seq, _, _, _, _ in jobs],  # type: ignore[union-attr,misc]
                          logits_indices=np.arange(batch, dtype=np.int64) * width + lengths - 1,
                          extra_inputs={BASE_HIDDEN_INPUT: base, DRAFT_HIDDEN_INPUT: own})
        out = self.backend.forward(step)
        assert out.hidden_states is not None, "an EAGLE3 draft returns its layer's output"
        return list(out.logits), list(out.hidden_states)

    def _token(self, draft_logits: np.ndarray) -> int:
        return int(self.draft_to_base[int(np.argmax(draft_logits))])

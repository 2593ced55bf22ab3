"""Gemma4-style MTP drafting: an assistant whose attention reads the base's own KV pages proposes a chain, one token
per call, from the base's last hidden state; it owns no K/V, so a reuse hit needs nothing but the base's pages.

Token layout of one sequence (C = tokens whose base K/V is committed, t_C the pending token):

    position p:       0 ... C-1                  | C
    base K/V:         in the base's pages        | (computed by the verify call)
    round step j:     the assistant's query at C sees base K/V [0, C) only
    step 0 input:     embed(t_C), h_{C-1}        -> d_1, s_1
    step j input:     embed(d_j), s_j            -> d_{j+1}, s_{j+1}

h_{C-1} is the base's last-layer output at the position whose logits gave t_C (`observe` keeps it after every base
call; the graph applies the base's final norm to it); s_j is the assistant's projected state. The graph takes them
through EAGLE3's two hidden inputs, zeros in the one a call does not use. The query stays at position C
through the round (transformers' candidate generator does the same), and no step writes K/V, so rejected guesses
leave nothing to roll back. Verification is the engine's, so outputs are lossless whatever the guesses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvforge.contract.engine_dir import BASE_HIDDEN_INPUT, DRAFT_HIDDEN_INPUT
from kvforge.runtime.execution.backend import Backend, StepInputs
from kvforge.runtime.sampling.sampler import SampleResult
from kvforge.runtime.sequence import Sequence
from kvforge.runtime.spec.proposer import DraftStates, DraftTree, KeepsDraftStates
from kvforge.runtime.step import BatchOutput, ScheduledRow


@dataclass(slots=True)
class AssistantState:
    """The base's last-layer output at `position - 1`: what the round drafting after position `position` reads."""

    position: int
    hidden: np.ndarray  # [backbone width]


class Gemma4MtpProposer(KeepsDraftStates[AssistantState]):
    owns_kv = False

    def __init__(self, backend: Backend, embedding: np.ndarray, max_draft_tokens: int) -> None:
        """`backend`: the assistant's runner, bound to the base's pools; `embedding`: the base's token table."""
        self.states: DraftStates[AssistantState] = DraftStates()  # what each request's next proposal starts from
        self.backend = backend
        self.embedding = embedding
        self.max_draft_tokens = max_draft_tokens

    def observe(self, rows: list[ScheduledRow], output: BatchOutput, sampled: list[list[SampleResult]]) -> None:
        if output.hidden_states is None:
            return
        for i, (row, samples) in enumerate(zip(rows, sampled, strict=True)):
            hidden = output.hidden_states[i]
            if not samples or hidden is None or not row.seq.request.sampling.speculative:
                continue
            # Row i's logits positions are its pending token, then its drafts; the last committed token's
            # successor came from position len(samples) - 1 among them.
            position = row.seq.num_computed_tokens + row.num_new_tokens + len(samples) - 1
            self.states.set(row.seq.request_id,
                            AssistantState(position, np.array(hidden[len(samples) - 1], dtype=np.float32)))

    def propose_batch(self, seqs: list[Sequence], limits: list[int]) -> list[list[int] | DraftTree]:
        proposals: list[list[int] | DraftTree] = [[] for _ in seqs]
        owners, tokens, hidden, limit_of = [], [], [], []
        for i, (seq, limit) in enumerate(zip(seqs, limits, strict=True)):
            state = self.states.get(seq.request_id)
            if not isinstance(state, AssistantState) or seq.lease is None or limit <= 0 or \
                    state.position != seq.num_computed_tokens:
                continue
            owners.append(i)
            tokens.append(seq.all_token_ids()[state.position])
            hidden.append(state.hidden)
            limit_of.append(min(limit, self.max_draft_tokens))
        if not owners:
            return proposals
        base = np.stack(hidden)  # the first step's input; the later steps read the assistant's own states
        states, zeros = np.zeros_like(base), np.zeros_like(base)
        ids = np.asarray(tokens, dtype=np.int64)
        for step in range(max(limit_of)):
            active = [k for k, limit in enumerate(limit_of) if limit > step]
            seqs_now = [seqs[owners[k]] for k in active]
            starts = np.array([seq.num_computed_tokens for seq in seqs_now], dtype=np.int32)
            out = self.backend.forward(StepInputs(
                self.embedding[ids[active]][:, None, :], np.ones(len(active), dtype=np.int32), starts,
                [seq.lease.page_ids for seq in seqs_now],  # type: ignore[union-attr]
                extra_inputs={BASE_HIDDEN_INPUT: (base if step == 0 else zeros)[active][:, None, :],
                              DRAFT_HIDDEN_INPUT: states[active][:, None, :]}))
            assert out.hidden_states is not None, "an assistant returns its projected state"
            guesses = np.argmax(out.logits, axis=-1)
            for row, k in enumerate(active):
                ids[k] = guesses[row]
                states[k] = out.hidden_states[row]
                proposals[owners[k]].append(int(guesses[row]))  # type: ignore[union-attr]
        return proposals

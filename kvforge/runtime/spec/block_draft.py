"""Block drafting (DFlash, DSpark, JetSpec): one draft call guesses a whole block from the base's hidden states.

Token layout of one sequence (C = tokens whose base K/V is committed, t_C the pending token, b = block size):

    position p:     0 ... C-1                         | C      C+1    ...  C+b-1
    draft input:    context feature of base h_p       | t_C    MASK   ...  MASK       (the block)
    draft K/V:      coherent (draft part's computed)  | scratch: rewritten by the next call's context
    draft output:                                     |        d_1    ...  d_{b-1}    (guesses for C+1 .. C+b-1)

`observe` runs after each base call, before the commit: the positions the base just committed get their context
K/V (a function of the base's hidden state at that position alone, so a draft page is as content-addressed as the
base page beside it and a reuse hit needs no replay). `propose_batch` then runs one call over every decoding
sequence's block; the block sees all the context and all of itself (DFlash, DSpark) or, for JetSpec, whose drafts
were trained so, block row j sees rows <= j only (the mask input is causal there). DFlash and JetSpec take each
position's argmax (JetSpec's as a chain: the depth-j argmax). With --specDraftTopK K > 1, JetSpec grows a token tree
from the one call's per-depth logits as its public loop does (`jetspec_tree`): best-first on the cumulative
log-probability, a popped node gets the next depth's top K as children, until the node budget (--specVerifySize
less the pending token). Every child of a depth carries the same candidates: the draft saw mask tokens, not the
path. The engine verifies the tree in one base call under the ancestor mask and keeps the longest path the base
agrees with (greedy, or its own draws with sampling: every committed token is the base's choice given the path). DSpark
walks the block left to right adding its previous-token bias (`markov_w2 @ markov_w1[previous]`) before each argmax,
and its acceptance predictor scores each guess; the scheduler proposes the prefix worth verifying:

- `off`: the whole block (at most the sequence's room);
- `threshold`: while the running product of the scores stays at or above --dsparkConfidenceThreshold;
- `sps`: the length L maximising (1 + expected accepted tokens) / cost(L), the expected count being the sum of the
  running products, cost(0) = 1 decode step and cost(L) = 1 + VERIFY_CALL_COST + VERIFY_TOKEN_COST x L: a verify
  call is dearer than a decode step before its first extra token (a GEMM instead of a GEMV over every weight), and
  each extra token adds a little (experiments/spec/block_draft.py measured both on SmolLM2, two cores).

Both bounded by --dsparkMinProposalLen / --dsparkMaxProposalLen. Verification is the engine's: greedy match, or
rejection sampling against a one-hot proposal, so outputs are lossless whatever the draft guesses.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from kvforge.contract.engine_dir import BASE_HIDDEN_INPUT, CONTEXT_TOKEN_MASK_INPUT
from kvforge.contract.profile_schema import BLOCK_DIFFUSION_DENOISE_STAGE
from kvforge.contract.speculation import SCHEDULER_OFF, SCHEDULER_SPS, SCHEDULER_THRESHOLD
from kvforge.runtime.context_cache.types.draft_paths import draft_of
from kvforge.runtime.execution.backend import Backend, StepInputs
from kvforge.runtime.execution.tree_attention import causal_masks, start_positions
from kvforge.runtime.profile import Profiler
from kvforge.runtime.sampling.sampler import SampleResult
from kvforge.runtime.sequence import Sequence
from kvforge.runtime.spec.proposer import DraftStates, DraftTree, KeepsDraftStates, committed_spans
from kvforge.runtime.step import BatchOutput, ScheduledRow

# In decode steps, SmolLM2 on two cores (experiments/spec/block_draft.py, 2026-12-03): a verify call of 7 tokens cost
# 2.6-2.7 steps and one of 16 tokens 3.8-3.9, so about 0.9 for the call and 0.13 per verified token.
VERIFY_CALL_COST = 0.9
VERIFY_TOKEN_COST = 0.13


@dataclass(slots=True)
class BlockState:
    """The draft's K/V covers positions [0, position) of the sequence."""

    position: int


@dataclass(slots=True, frozen=True)
class DsparkHeads:
    """DSpark's runtime heads (dspark_heads.safetensors) and how its proposals are scheduled."""

    markov_w1: np.ndarray  # [V, r]
    markov_w2: np.ndarray  # [V, r]
    accept_weight: np.ndarray  # [H + r]
    accept_bias: float
    scheduler: str = SCHEDULER_OFF
    threshold: float = 0.0
    min_len: int = 1
    max_len: int = 0  # 0 = the block


@dataclass(slots=True)
class _Call:
    seq: Sequence
    start: int
    embeds: np.ndarray  # [n, H] (zeros at context positions)
    features: np.ndarray  # [n, base width] (zeros in the block)
    context: int  # the first `context` entries are context positions
    outputs: list[int]


class BlockDraftProposer(KeepsDraftStates[BlockState]):
    owns_kv = True

    def __init__(self, backend: Backend, embedding: np.ndarray, block_size: int,
                 mask_token_id: int, base_hidden_width: int, profiler: Profiler,
                 dspark: DsparkHeads | None = None, causal: bool = False, top_k: int = 1,
                 verify_nodes: int = 0) -> None:
        """`backend`: the draft engine's runner (its own KV pool: each lease's draft part, `draft_of`, grown through
        it); `embedding`: the base's token table; `block_size`: positions one block call drafts over (the pending
        token and block_size - 1 masks); `causal`: the block sees itself causally (JetSpec); `top_k` > 1: a tree of
        at most `verify_nodes` drafts (JetSpec)."""
        self.states: DraftStates[BlockState] = DraftStates()  # what each request's next proposal starts from
        self.backend = backend
        self.embedding = embedding
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.base_width = base_hidden_width
        self.hidden_size = embedding.shape[1]
        self.profiler = profiler
        self.dspark = dspark
        self.causal = causal
        self.top_k = top_k
        self.verify_nodes = verify_nodes

    # --- after each base call -------------------------------------------------------------------------

    def observe(self, rows: list[ScheduledRow], output: BatchOutput, sampled: list[list[SampleResult]]) -> None:
        calls = []
        for i, seq, start, end in committed_spans(rows, output, sampled):
            assert output.hidden_states is not None
            n = end - start
            calls.append(_Call(seq, start, np.zeros((n, self.hidden_size), np.float32),
                               output.hidden_states[i][:n], n, [n - 1]))
        if not calls:
            return
        self._run(calls)
        for call in calls:
            draft = draft_of(call.seq.lease)
            assert draft is not None
            end = call.start + call.context
            draft.computed = end
            self.states.set(call.seq.request_id, BlockState(end))

    # --- before the next step -------------------------------------------------------------------------

    def propose_batch(self, seqs: list[Sequence], limits: list[int]) -> list[list[int] | DraftTree]:
        proposals: list[list[int] | DraftTree] = [[] for _ in seqs]
        calls, owners, pending, budgets = [], [], [], []
        for i, (seq, limit) in enumerate(zip(seqs, limits, strict=True)):
            state, draft = self.states.get(seq.request_id), draft_of(seq.lease)
            if not isinstance(state, BlockState) or draft is None or limit <= 0:
                continue
            start = seq.num_computed_tokens
            if state.position != start or draft.computed != start:
                continue
            width = min(self.block_size, limit + 1)
            # The block's scratch K/V at C .. C + width - 1; no pages, no proposal (drafting never preempts).
            if not draft.grow(start + width):
                continue
            token = seq.all_token_ids()[start]
            ids = [token] + [self.mask_token_id] * (width - 1)
            calls.append(_Call(seq, start, self.embedding[ids], np.zeros((width, self.base_width), np.float32), 0,
                               list(range(1, width))))
            owners.append(i)
            pending.append(token)
            budgets.append(min(self.verify_nodes, limit))
        if not calls:
            return proposals
        with self.profiler.stage(BLOCK_DIFFUSION_DENOISE_STAGE):
            logits, hidden = self._run(calls)
        for i, token, budget, row_logits, row_hidden in zip(owners, pending, budgets, logits, hidden, strict=True):
            if self.dspark is not None:
                proposals[i] = self._dspark(token, row_logits, row_hidden)
            elif self.top_k > 1:
                proposals[i] = jetspec_tree(row_logits, self.top_k, budget)
            else:
                proposals[i] = [int(t) for t in np.argmax(row_logits, axis=-1)]
        return proposals

    def _dspark(self, pending: int, logits: np.ndarray, hidden: np.ndarray) -> list[int]:
        """The semi-autoregressive walk over the block, then the scheduled prefix."""
        heads = self.dspark
        assert heads is not None
        tokens: list[int] = []
        scores: list[float] = []
        previous = pending
        for position_logits, position_hidden in zip(logits, hidden, strict=True):
            latent = heads.markov_w1[previous]
            token = int(np.argmax(position_logits + heads.markov_w2 @ latent))
            z = float(heads.accept_weight @ np.concatenate([position_hidden, latent]) + heads.accept_bias)
            scores.append(1.0 / (1.0 + np.exp(-z)))
            tokens.append(token)
            previous = token
        return tokens[:schedule(np.asarray(scores), heads)]

    # --- the draft engine call ------------------------------------------------------------------------

    def _run(self, calls: list[_Call]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """One draft call over ragged rows (context positions, then block positions): per row, logits [m, V] and
        the normed last layer [m, H] at its `outputs` entries. The block sees all of itself (causally for JetSpec);
        context rows, whose queries nothing reads, see causally."""
        width = max(len(call.embeds) for call in calls)
        batch = len(calls)
        embeds = np.zeros((batch, width, self.hidden_size), dtype=np.float32)
        features = np.zeros((batch, width, self.base_width), dtype=np.float32)
        context = np.zeros((batch, width, 1), dtype=np.float32)
        starts = np.array([call.start for call in calls], dtype=np.int32)
        mask = causal_masks(batch, width)
        picks, counts = [], []
        for b, call in enumerate(calls):
            n = len(call.embeds)
            embeds[b, :n] = call.embeds
            features[b, :n] = call.features
            context[b, :call.context] = 1.0
            if not self.causal:  # causal_masks already gives JetSpec's view: block row j sees rows <= j
                mask[b, call.context:n, :n] = True
            picks.append(b * width + np.asarray(call.outputs, dtype=np.int64))
            counts.append(len(call.outputs))
        step = StepInputs(embeds, np.array([len(call.embeds) for call in calls], dtype=np.int32), starts,
                          [draft_of(call.seq.lease).page_ids for call in calls],  # type: ignore[union-attr]
                          logits_indices=np.concatenate(picks),
                          extra_inputs={BASE_HIDDEN_INPUT: features, CONTEXT_TOKEN_MASK_INPUT: context},
                          position_ids=start_positions(starts, width), attention_mask=mask)
        out = self.backend.forward(step)
        assert out.hidden_states is not None, "a block draft returns its normed last layer"
        bounds = np.cumsum([0] + counts)
        return ([out.logits[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)],
                [out.hidden_states[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)])


def schedule(scores: np.ndarray, heads: DsparkHeads) -> int:
    """How many of the block's guesses to propose, from their acceptance scores (see the module docstring)."""
    longest = len(scores) if not heads.max_len else min(heads.max_len, len(scores))
    shortest = min(heads.min_len, longest)
    survival = np.cumprod(scores[:longest])
    if heads.scheduler == SCHEDULER_THRESHOLD:
        below = np.flatnonzero(survival < heads.threshold)
        length = int(below[0]) if len(below) else longest
    elif heads.scheduler == SCHEDULER_SPS:
        lengths = np.arange(longest + 1)
        expected = np.concatenate([[0.0], np.cumsum(survival)])
        cost = 1.0 + np.where(lengths > 0, VERIFY_CALL_COST, 0.0) + VERIFY_TOKEN_COST * lengths
        length = int(np.argmax((1.0 + expected) / cost))
    else:
        length = longest
    return max(length, shortest)


def jetspec_tree(logits: np.ndarray, top_k: int, budget: int) -> DraftTree:
    """JetSpec's tree from one block call's logits [depths, V] (row d guesses depth d + 1): best-first on cumulative
    log-probability from the pending token (score 0); a popped node at depth d gains depth d + 1's top `top_k`
    tokens, best first, as children, until `budget` drafts. Parents come before their children."""
    log_probs = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(axis=-1, keepdims=True))
    k = min(top_k, logits.shape[-1])
    ranked = np.argsort(-log_probs, axis=-1, kind="stable")[:, :k]  # ties: the lower token id first
    tokens: list[int] = []
    parents: list[int] = []
    heap: list[tuple[float, int, int, int]] = [(0.0, -1, -1, 0)]  # (-score, node index, node, its depth)
    while heap and len(tokens) < budget:
        negative, _, node, depth = heapq.heappop(heap)
        if depth >= len(logits):
            continue
        for token in ranked[depth][:budget - len(tokens)]:
            tokens.append(int(token))
            parents.append(node)
            child = len(tokens) - 1
            heapq.heappush(heap, (negative - float(log_probs[depth, token]), child, child, depth + 1))
    return DraftTree(tokens, parents)

"""EAGLE3 drafting: a one-layer draft engine with its own KV pool, fed the base's hidden states, proposing greedily.

Token layout of one sequence (C = tokens whose base K/V is committed, t_C the pending token):

    position p:       0      1     ...   C-1    | C      C+1   ...  C+k-2
    draft input:      t_1    t_2   ...   t_C    | d_1    d_2   ...  d_{k-1}     (the token *after* p)
    hidden input:     base h_0 ...      base h_{C-1} | draft's own output at p-1
    draft K/V:        coherent (draft_of(lease).computed = C)    | scratch, rewritten next round
    draft output:     ...                 d_1   | d_2    d_3   ...  d_k

`observe` runs after each base call, before the commit publishes anything: the draft consumes the positions the
base just committed (prompt chunks, verify rows' accepted tokens), with their hidden states from that call, so the
draft K/V always covers exactly the base's committed positions and a publication can carry a coherent draft path.
Its last output is the first proposal d_1. `propose_batch` then runs k - 1 single-position calls for every
decoding sequence at once. Drafts are greedy (argmax over the reduced vocabulary, mapped by d2t); the base's
verification (greedy match, or rejection sampling against a one-hot proposal at temperature > 0) keeps outputs
lossless whatever the draft proposes.

Tree drafting (top_k > 1, EAGLE-2's dynamic tree): the root's top-k tokens are the first frontier; each round
expands every frontier node into its top-k children, scored by the sum of the draft's log-probabilities along the
path, and keeps the best k children as the next frontier, for k - 1 rounds. A round recomputes every frontier node
drawn so far as one masked row (position C - 1 + depth, each node seeing its ancestors): the kernel's mask covers
only the new tokens of a call, and a few dozen positions of a one-layer draft cost about one call's weight reads.
The best `verify_nodes` nodes by score form the proposal; a child never outscores its parent, so they are a tree.

Qwen3.5's MTP layer keeps this contract (its K/V at p also read token p + 1), so this drafter runs it on a hybrid
base too, over the whole vocabulary (d2t zeros), with `rolls_back` (the base's recurrent rollback commits nothing
for a rejected row until its kept tokens are recomputed) and `keep_hidden` (the last page of base hidden states,
which a checkpoint stores so that a hit can replay the draft's tail).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvforge.contract.engine_dir import BASE_HIDDEN_INPUT, DRAFT_HIDDEN_INPUT
from kvforge.runtime.context_cache.types.draft_paths import DraftLease, draft_of
from kvforge.runtime.execution.backend import Backend, StepInputs
from kvforge.runtime.execution.tree_attention import ancestor_mask, causal_masks, start_positions
from kvforge.runtime.sampling.sampler import SampleResult, log_softmax, top_ids
from kvforge.runtime.sequence import Sequence
from kvforge.runtime.spec.proposer import DraftStates, DraftTree, KeepsDraftStates, committed_spans
from kvforge.runtime.step import BatchOutput, ScheduledRow


@dataclass(slots=True)
class DraftState:
    """What the drafter knows at a sequence's end: its first proposal and the draft's hidden state that made it."""

    position: int  # the sequence's committed tokens C when this was computed
    first_token: int  # d_1, a base vocabulary id
    hidden: np.ndarray  # [H]: the draft layer's output at position C - 1
    # Tree drafting: the top-k candidates for d_1 (base ids) and their draft log-probabilities, best first.
    top_ids: np.ndarray | None = None
    top_scores: np.ndarray | None = None


@dataclass(slots=True)
class DraftCall:
    """One row of a draft engine call: `ids` fed at positions start.. (or at `positions`), with the base's hidden
    states [n, base width] or the draft's own previous outputs [n, H] (zeros where None), an optional tree mask
    [n, n], and the row's entries whose logits and hidden states come back (`outputs`; default: the last)."""

    seq: Sequence
    start: int
    ids: list[int]
    base_hidden: np.ndarray | None = None
    own_hidden: np.ndarray | None = None
    positions: list[int] | None = None
    mask: np.ndarray | None = None
    outputs: list[int] | None = None


@dataclass(slots=True)
class _Tree:
    """A tree being drafted for one sequence: nodes in creation order (parents first)."""

    state: DraftState
    limit: int  # most nodes proposed
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]
    frontier: list[int]
    drawn: list[int]  # nodes recomputed in each round's row (every frontier so far), in order
    hidden: dict[int, np.ndarray]  # node -> the draft's output at it (its children's hidden input)


class Eagle3Proposer(KeepsDraftStates[DraftState]):
    """Drafts with a one-layer draft fed the base's hidden states: an EAGLE3 draft, and also Qwen3.5's MTP layer
    (EAGLE3's contract over the whole vocabulary; kvforge/runtime/spec/methods.py names it HiddenStateProposer)."""

    owns_kv = True

    def __init__(self, backend: Backend, embedding: np.ndarray, d2t: np.ndarray, num_tokens: int,
                 base_hidden_width: int, top_k: int = 1, verify_nodes: int = 0, rolls_back: bool = False,
                 keep_hidden: int = 0) -> None:
        """`backend`: the draft engine's runner (its own KV pool); `embedding`: the draft's token table; `d2t`: draft
        id -> base id offsets (the draft pages are each lease's draft part, `draft_of`, grown through it);
        `num_tokens`: drafting steps (a chain's length, a tree's depth); `top_k` > 1 drafts trees of at most
        `verify_nodes` nodes (the draft engine then needs tree attention); `rolls_back`: the base is hybrid (an MTP
        layer's), so rejected verify rows commit nothing until their kept tokens are recomputed (committed_spans);
        `keep_hidden`: base hidden states each lease keeps while it prefills its prompt (its last positions, for the
        draft tail of the checkpoint at the prompt's end)."""
        self.states: DraftStates[DraftState] = DraftStates()  # what each request's next proposal starts from
        self.backend = backend
        self.embedding = embedding
        self.draft_to_base = np.arange(len(d2t), dtype=np.int64) + d2t
        self.num_tokens = num_tokens
        self.base_width = base_hidden_width
        self.hidden_size = embedding.shape[1]
        self.top_k = top_k
        self.verify_nodes = verify_nodes or num_tokens
        self.rolls_back = rolls_back
        self.keep_hidden = keep_hidden

    # --- after each base call -------------------------------------------------------------------------

    def observe(self, rows: list[ScheduledRow], output: BatchOutput, sampled: list[list[SampleResult]]) -> None:
        jobs = []
        for i, seq, start, end in committed_spans(rows, output, sampled, self.rolls_back):
            draft = draft_of(seq.lease)
            assert output.hidden_states is not None and draft is not None
            following = seq.all_token_ids() + [s.token_id for s in sampled[i]]  # token p + 1 for every position p
            base = output.hidden_states[i][:end - start]
            first = draft.computed
            if first < start:  # a checkpoint restore: the draft replays its tail from the record's hidden states
                offset = draft.hidden_start
                base = np.concatenate([draft.hidden[first - offset:start - offset], base])  # type: ignore[index]
            if self.keep_hidden and start < len(seq.prompt_ids):
                draft.keep_hidden(first, base, self.keep_hidden)  # the lease's last base hidden states
            else:  # checkpoints are prompt ends (hybrid MTP captures endpoints only): past it, nothing reads them
                draft.hidden = None
            jobs.append((seq, first, following[first + 1:end + 1], base))
        if not jobs:
            return
        logits, hidden = self._run([DraftCall(seq, start, ids, base) for seq, start, ids, base in jobs])
        for (seq, start, ids, _), row_logits, row_hidden in zip(jobs, logits, hidden, strict=True):
            draft = draft_of(seq.lease)
            assert draft is not None
            end = start + len(ids)
            draft.computed = end
            state = DraftState(end, self._token(row_logits[0]), row_hidden[0])
            if self.top_k > 1:
                state.top_ids, state.top_scores = self._top(row_logits[0])
            self.states.set(seq.request_id, state)

    @staticmethod
    def _draft(seq: Sequence) -> DraftLease:
        draft = draft_of(seq.lease)
        assert draft is not None, "a drafting sequence's lease has a draft part"
        return draft

    # --- before the next step -------------------------------------------------------------------------

    def propose_batch(self, seqs: list[Sequence], limits: list[int]) -> list[list[int] | DraftTree]:
        proposals: list[list[int] | DraftTree] = [[] for _ in seqs]
        chains: list[list[int]] = [[] for _ in seqs]
        live: list[tuple[int, Sequence, DraftState]] = []
        trees: dict[int, _Tree] = {}
        for i, (seq, limit) in enumerate(zip(seqs, limits, strict=True)):
            state = self.states.get(seq.request_id)
            if not isinstance(state, DraftState) or state.position != seq.num_computed_tokens or limit <= 0 \
                    or draft_of(seq.lease) is None:
                continue
            if self.top_k > 1 and state.top_ids is not None:
                trees[i] = self._root(state, min(self.verify_nodes, limit))
                continue
            proposals[i] = chains[i]
            chains[i].append(state.first_token)
            count = min(self.num_tokens, limit)
            # The draft writes scratch K/V at positions C .. C + count - 2; no pages, no more drafts (never preempts).
            if count > 1 and self._draft(seq).grow(state.position + count - 1):
                live.append((i, seq, state))
        hidden = {i: state.hidden for i, _, state in live}
        for step in range(1, self.num_tokens):
            live = [(i, seq, state) for i, seq, state in live if len(chains[i]) < min(self.num_tokens, limits[i])]
            if not live:
                break
            jobs = [DraftCall(seq, state.position + step - 1, [chains[i][-1]], own_hidden=hidden[i][None])
                    for i, seq, state in live]
            logits, outs = self._run(jobs)
            for (i, _, _), row_logits, row_hidden in zip(live, logits, outs, strict=True):
                chains[i].append(self._token(row_logits[0]))
                hidden[i] = row_hidden[0]
        if trees:
            self._grow_trees({i: (seqs[i], tree) for i, tree in trees.items()})
            for i, tree in trees.items():
                proposals[i] = self._selected(tree)
        return proposals

    # --- tree drafting --------------------------------------------------------------------------------

    def _root(self, state: DraftState, limit: int) -> _Tree:
        assert state.top_ids is not None and state.top_scores is not None
        count = min(self.top_k, limit)
        ids, scores = state.top_ids[:count].tolist(), state.top_scores[:count].tolist()
        return _Tree(state, limit, ids, [-1] * count, [1] * count, scores, list(range(count)), [], {})

    def _grow_trees(self, trees: dict[int, tuple[Sequence, _Tree]]) -> None:
        """k - 1 rounds; a sequence whose draft pool cannot hold the rounds' rows keeps its root's candidates."""
        rows_needed = self.top_k * (self.num_tokens - 1)
        live = {i: (seq, tree) for i, (seq, tree) in trees.items() if self.num_tokens > 1 and tree.limit > len(
            tree.tokens) and self._draft(seq).grow(tree.state.position + rows_needed)}
        for _ in range(1, self.num_tokens):
            live = {i: item for i, item in live.items() if item[1].frontier}
            if not live:
                return
            calls = []
            for seq, tree in live.values():
                tree.drawn += tree.frontier
                index = {node: at for at, node in enumerate(tree.drawn)}
                mask = ancestor_mask([index[tree.parents[n]] if tree.parents[n] >= 0 else -1 for n in tree.drawn])
                own = np.stack([tree.hidden[tree.parents[n]] if tree.parents[n] >= 0 else tree.state.hidden
                                for n in tree.drawn])
                calls.append(DraftCall(seq, tree.state.position, [tree.tokens[n] for n in tree.drawn],
                                       own_hidden=own, positions=[tree.state.position - 1 + tree.depths[n]
                                                                  for n in tree.drawn],
                                       mask=mask, outputs=[index[n] for n in tree.frontier]))
            logits, hidden = self._run(calls)
            for (_, tree), row_logits, row_hidden in zip(live.values(), logits, hidden, strict=True):
                self._expand(tree, row_logits, row_hidden)

    def _expand(self, tree: _Tree, logits: np.ndarray, hidden: np.ndarray) -> None:
        """Each frontier node's top-k children join the tree; the best k of them are the next frontier."""
        children: list[int] = []
        for node, node_logits, node_hidden in zip(tree.frontier, logits, hidden, strict=True):
            tree.hidden[node] = node_hidden
            ids, scores = self._top(node_logits)
            for token, score in zip(ids.tolist(), scores.tolist(), strict=True):
                children.append(len(tree.tokens))
                tree.tokens.append(token)
                tree.parents.append(node)
                tree.depths.append(tree.depths[node] + 1)
                tree.scores.append(tree.scores[node] + score)
        children.sort(key=lambda n: (-tree.scores[n], n))
        tree.frontier = sorted(children[:self.top_k])

    def _selected(self, tree: _Tree) -> DraftTree:
        """The best `limit` nodes (a parent never scores below its child and was created first, so this is a tree),
        renumbered in creation order."""
        best = sorted(range(len(tree.tokens)), key=lambda n: (-tree.scores[n], tree.depths[n], n))[:tree.limit]
        kept = sorted(best)
        index = {node: at for at, node in enumerate(kept)}
        return DraftTree([tree.tokens[n] for n in kept],
                         [index[tree.parents[n]] if tree.parents[n] >= 0 else -1 for n in kept])

    def _top(self, draft_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The top-k draft tokens as base ids, best first (ties to the lower id), with their log-probabilities."""
        logprobs = log_softmax(draft_logits)
        ids = top_ids(logprobs, self.top_k)
        return self.draft_to_base[ids], logprobs[ids]

    # --- the draft engine call ------------------------------------------------------------------------

    def _run(self, calls: list[DraftCall]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """One draft call over ragged rows: per row, logits [m, draft vocab] and hidden states [m, H] at its
        `outputs` entries."""
        width = max(len(call.ids) for call in calls)
        batch = len(calls)
        embeds = np.zeros((batch, width, self.hidden_size), dtype=np.float32)
        base = np.zeros((batch, width, self.base_width), dtype=np.float32)
        own = np.zeros((batch, width, self.hidden_size), dtype=np.float32)
        starts = np.array([call.start for call in calls], dtype=np.int32)
        positions = mask = None
        if any(call.mask is not None for call in calls):
            positions, mask = start_positions(starts, width), causal_masks(batch, width)
        picks, counts = [], []
        for b, call in enumerate(calls):
            n = len(call.ids)
            embeds[b, :n] = self.embedding[call.ids]
            if call.base_hidden is not None:
                base[b, :n] = call.base_hidden
            if call.own_hidden is not None:
                own[b, :len(call.own_hidden)] = call.own_hidden
            if call.mask is not None:
                assert positions is not None and mask is not None and call.positions is not None
                positions[b, :n] = call.positions
                mask[b, :n, :n] = call.mask
            outputs = call.outputs if call.outputs is not None else [n - 1]
            picks.append(b * width + np.asarray(outputs, dtype=np.int64))
            counts.append(len(outputs))
        step = StepInputs(embeds, np.array([len(call.ids) for call in calls], dtype=np.int32), starts,
                          [self._draft(call.seq).page_ids for call in calls],
                          logits_indices=np.concatenate(picks),
                          extra_inputs={BASE_HIDDEN_INPUT: base, DRAFT_HIDDEN_INPUT: own},
                          position_ids=positions, attention_mask=mask)
        out = self.backend.forward(step)
        assert out.hidden_states is not None, "an EAGLE3 draft returns its layer's output"
        bounds = np.cumsum([0] + counts)
        return ([out.logits[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)],
                [out.hidden_states[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)])

    def _token(self, draft_logits: np.ndarray) -> int:
        return int(self.draft_to_base[int(np.argmax(draft_logits))])

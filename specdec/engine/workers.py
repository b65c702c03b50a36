"""The draft worker (proposes k tokens) and the target worker (verifies them in one pass), pure torch.

Both run batches of calls over a ``ModelRunner``; the gRPC services wrap exactly these classes and
the offline ``LLM`` calls them directly.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from specdec.errors import ConfigError, InvalidRequestError, SequencePreemptedError, SpecDecError
from specdec.proposal import MAX_NUM_SPECULATIVE_TOKENS, Proposal, VerifyResult
from kernels.dispatch import resolve
from specdec.rejection import RaggedBatch, race_scores
from specdec.rejection import accept as accept_batch  # by the resolved backend (a name the negative controls swap)
from specdec.calls import UNFINISHED, ProposeCall, VerifyCall, until_finished
from specdec.features import FeatureChunk
from specdec.engine.kv_manager import CachedSequence
from specdec.engine.lean_linear import INVARIANT_TILE_ROWS
from specdec.engine.runner import ModelRunner
from specdec.engine.scoring import RowLogits, materialize
from specdec.engine.tree_drafting import grow_trees
from specdec.token_mask import apply_token_bitmask
from specdec.sampling import SamplingParams, apply_penalties, penalty_context, process_logits, sample, token_logprobs
from specdec.seeding import DEFAULT_SEEDED_SAMPLING, check_seeded_sampling, race_noise
from specdec.config import TreeShape
from specdec.trees import check_parents, fit_trees, levels, path_to, walk


logger = logging.getLogger(__name__)
_NOTED: set[str] = set()


def _note_once(message: str) -> None:
    """Log a fact about how calls are served once per process (not per round)."""
    if message not in _NOTED:
        _NOTED.add(message)
        logger.info(message)


def _per_call(calls, prepare):
    """Run ``prepare`` per call; collect (index, prepared) or the call's own domain error."""
    results: list = [None] * len(calls)
    prepared = []
    seen: set[str] = set()
    for i, call in enumerate(calls):
        try:
            if call.sequence_id in seen:
                raise InvalidRequestError(f"sequence {call.sequence_id!r} appears twice in one batch", param="sequence_id")
            seen.add(call.sequence_id)
            prepared.append((i, *prepare(call)))
        except SpecDecError as exc:
            results[i] = exc
    return results, prepared


class DraftWorker:
    """Proposes k tokens per sequence by k autoregressive steps of the draft model, batched across
    sequences (each step is one forward pass over every sequence still drafting)."""

    def __init__(self, runner: ModelRunner, draft_sample_method: str = "greedy", top_n: int | None = None,
                 tli: Any = None, tree: TreeShape | None = None):
        check_draft_sample_method(draft_sample_method)
        self.runner = runner
        self.draft_sample_method = draft_sample_method
        # Token-Level Intersection (specdec.tli.TLIAdapter) when the draft's vocabulary differs:
        # it reads re-tokenized text, drafts intersection tokens only, and proposes target ids.
        self.tli = tli
        # Probabilistic drafting samples from the renormalised top-N of q, so q travels sparsely;
        # still lossless: the target's rejection step only needs the q that was sampled from.
        self.top_n = top_n
        # token trees (specdec.engine.tree_drafting): greedy drafting proposes a tree of top-k candidates instead
        # of a chain (a TLI draft's only over the vocabularies' intersection, each node mapped to its target id: text
        # proposals retokenize a path, so they stay chains; tree passes need the lean forward)
        node_ids = tli is None or tli.proposals == "intersection"
        self.tree = tree if node_ids and runner.supports_trees else None
        if tree is not None and self.tree is None:
            logger.warning("draft: token trees are off, proposals are chains: %s", "a TLI draft's text proposals are "
                           "chains (tli_proposals \"intersection\" drafts trees)" if not node_ids else
                           "the draft runs transformers' forward (trees need the lean forward)")

    def propose(self, sequence_id: str, token_ids: list[int], num_speculative_tokens: int, params: SamplingParams) -> Proposal:
        result = until_finished(self.propose_batch, ProposeCall(sequence_id, token_ids, num_speculative_tokens, params))
        if isinstance(result, BaseException):
            raise result
        return result

    def propose_batch(self, calls: list[ProposeCall]) -> list[Proposal | SpecDecError]:
        runner = self.runner
        with runner.lock:

            def prepare(call: ProposeCall):
                method = call.draft_sample_method or self.draft_sample_method
                check_draft_sample_method(method)
                seq = runner.get_or_create(call.sequence_id, call.params.seed, call.params.priority)
                seq.begin_round(len(call.token_ids))
                history = self.tli.draft_history(seq.state, call.token_ids) if self.tli else call.token_ids
                k = call.num_speculative_tokens
                if self.tli is not None:
                    # The re-tokenized text may be empty (a prompt of special tokens only) or reach past
                    # the draft's own context: draft fewer tokens, or none (the target decodes alone).
                    room = runner.max_model_len - len(history) + 1 if history else 0
                    if room < k:
                        call = replace(call, num_speculative_tokens=max(room, 0))
                    if call.num_speculative_tokens == 0:
                        return call, seq, [], False
                elif len(history) + k - 1 > runner.max_model_len:  # k steps feed history + k - 1 tokens
                    raise InvalidRequestError(
                        f"{len(history)} tokens + {k} draft tokens exceed max_model_len={runner.max_model_len}",
                        param="max_model_len")
                new = runner.sync(seq, history)
                runner.check_append(seq, new)
                return call, seq, new, method == "probabilistic" and not call.params.greedy

            results, rows = _per_call(calls, prepare)
            for r in rows:
                if r[1].num_speculative_tokens == 0:  # nothing to draft (k=0, or no room left)
                    results[r[0]] = Proposal([])
            rows = [r for r in rows if r[1].num_speculative_tokens > 0]
            if not rows:
                return results
            logits = runner.forward_batch([r[2] for r in rows], [r[3] for r in rows], [1] * len(rows),
                                          chunkable=[True] * len(rows))
            tli = self.tli
            drafts: list[list[int]] = [[] for _ in rows]  # draft-model ids (fed back to the draft)
            qs: list[list[torch.Tensor]] = [[] for _ in rows]
            active = list(range(len(rows)))
            if self.tree is not None:  # greedy drafting grows trees: those rows leave the chains' steps
                grown = [j for j, lg in enumerate(logits) if isinstance(lg, torch.Tensor) and not rows[j][4]]
                if grown:
                    trees = grow_trees(runner, [rows[j][1] for j in grown], [rows[j][2] for j in grown],
                                       [logits[j] for j in grown], self.tree, runner.lm.eos_token_ids,
                                       restrict=tli.restrict if tli is not None else None)
                    for j, proposal in zip(grown, trees):  # (TLI: each node's draft id as its target id)
                        results[rows[j][0]] = proposal if tli is None else Proposal(
                            [tli.to_target(t) for t in proposal.draft_token_ids], parents=proposal.parents,
                            node_probs=proposal.node_probs)
                    logits = [lg for j, lg in enumerate(logits) if j not in grown]
                    active = [j for j in active if j not in grown]
                    for j in active:  # a chain row the trees' passes preempted proposes nothing (resent next round)
                        if runner.sequences.get(rows[j][2].sequence_id) is not rows[j][2]:
                            logits[active.index(j)] = SequencePreemptedError(
                                f"draft: sequence {rows[j][2].sequence_id!r} was preempted")
            # rows the KV pool preempted (they propose what they drafted so far) or whose prompt is prefilled
            # in chunks (UNFINISHED: the batcher runs them again)
            stopped: dict[int, Any] = {}
            while active:
                for j, row_logits in zip(active, logits):
                    if not isinstance(row_logits, torch.Tensor):
                        stopped[j] = row_logits
                        continue
                    _, call, seq, _, probabilistic = rows[j]
                    last = row_logits[-1]  # [vocab]
                    if tli is not None and not tli.text_proposals(not probabilistic):
                        last = tli.restrict(last)
                    if tli is None and call.params.has_penalties:  # as the target will process this position
                        last = apply_penalties(last, call.params, penalty_context(
                            call.params, call.token_ids, runner.lm.eos_token_ids, after=drafts[j]))
                    if probabilistic:
                        q = truncate_top_n(process_logits(last, call.params), self.top_n)  # [vocab]
                        q_target = q if tli is None else tli.q_to_target(q)
                        if call.params.couples:  # the race the target runs, over q (specdec.seeding)
                            winner = race_winner(q_target, call.params.seed, len(call.token_ids) + len(drafts[j]))
                            drafts[j].append(winner if tli is None else tli.to_draft(winner))
                        else:
                            drafts[j].append(int(sample(q, seq.generator)))
                        qs[j].append(q_target)
                    else:
                        drafts[j].append(int(last.argmax()))
                active = [j for j in active if len(drafts[j]) < rows[j][1].num_speculative_tokens and j not in stopped]
                if active:  # the last draft token is not fed: the next round's sync feeds it if kept
                    logits = runner.forward_batch([rows[j][2] for j in active], [[drafts[j][-1]] for j in active],
                                                  [1] * len(active))
            for j, (i, call, _seq, _new, probabilistic) in enumerate(rows):
                if j not in stopped and results[i] is not None:  # a tree (above)
                    continue
                if stopped.get(j) is UNFINISHED:
                    results[i] = UNFINISHED
                    continue
                if tli is None:
                    proposed = drafts[j]
                elif tli.text_proposals(not probabilistic):
                    # k draft tokens' text: as many target tokens as it makes (bounded)
                    proposed = tli.text_to_target(drafts[j], min(2 * call.num_speculative_tokens,
                                                                 MAX_NUM_SPECULATIVE_TOKENS))
                else:
                    proposed = [tli.to_target(t) for t in drafts[j]]
                results[i] = Proposal(proposed, torch.stack(qs[j]) if qs[j] else None)
        return results

    def release(self, sequence_id: str) -> None:
        with self.runner.lock:
            self.runner.release(sequence_id)


class TargetWorker:
    """Scores each sequence's drafts and bonus position in ONE forward pass (one pass for the whole
    batch of sequences), accepts the whole batch in one ``accept_batch`` call (Triton or torch, see
    ``kernels.dispatch``; one host transfer of the results), and rolls each rejected tail back by
    moving its cache pointer."""

    def __init__(self, runner: ModelRunner, kernels: str | None = None,
                 seeded_sampling: str = DEFAULT_SEEDED_SAMPLING, tree_tile_rows: int = 0):
        """``tree_tile_rows``: the rows a verify pass costs by (``specdec.trees.fit_trees`` cuts a batch's trees
        so they fill no more of them than chains would); 0: by device (see ``tile_rows_of``), < 0: never cut."""
        self.runner = runner
        self.tree_tile_rows = tile_rows_of(runner.lm.device, tree_tile_rows)
        self.tree_nodes_cut = 0  # nodes _fit_trees left out (specdec_tree_nodes_cut_total)
        try:
            self.kernels = resolve(kernels, runner.lm.device)  # "triton" | "torch"
            # the rule of seeded sampled requests: "coupled" (draft-invariant, specdec.seeding) or "rejection"
            self.seeded_sampling = check_seeded_sampling(seeded_sampling)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.tree_tile_rows == 0:  # a GPU's: measured (the pass's roofline knee, specdec.engine.pass_cost)
            from specdec.engine.pass_cost import measured_tile_rows

            self.tree_tile_rows = measured_tile_rows(self)

    def verify(self, sequence_id: str, token_ids: list[int], proposal: Proposal, params: SamplingParams) -> VerifyResult:
        result = until_finished(self.verify_batch, VerifyCall(sequence_id, token_ids, proposal, params))
        if isinstance(result, BaseException):
            raise result
        return result

    def verify_batch(self, calls: list[VerifyCall]) -> list[VerifyResult | SpecDecError]:
        runner = self.runner
        with runner.lock:

            def prepare(call: VerifyCall):
                check_proposal(call.proposal, runner.logits_vocab_size)
                kept = None  # a tree verified as its first branch: the nodes kept
                if call.proposal.is_tree and not self._tree_pass(call):
                    _note_once(f"a token tree is verified as its first branch: {self._why_chain(call)}")
                    proposal, kept = call.proposal.first_branch()
                    call = replace(call, proposal=proposal)
                seq = runner.get_or_create(call.sequence_id, call.params.seed, call.params.priority)
                seq.begin_round(len(call.token_ids))
                scored = call.params.prompt_logprobs is not None
                if scored:  # score the whole prompt: feed it all again (no prefix-cache hits)
                    runner.check_scoring(len(call.token_ids) + len(call.proposal.draft_token_ids))
                    runner.cache.truncate(seq, 0)
                fresh = call.feature_layers and not seq.prefilling  # a new call (not the next chunk of a prompt)
                if fresh:
                    seq.captured.clear()
                # (a prompt's later chunks take nothing from the prefix cache: its blocks' features are not checked)
                new = runner.sync(seq, call.token_ids, reuse=not scored and not (call.feature_layers and seq.prefilling))
                if fresh and call.feature_start < seq.length:  # features of positions already cached
                    new = call.token_ids[stored_features(runner.cache, seq, call.feature_start,
                                                         tuple(call.feature_layers)):]
                new = new + call.proposal.draft_token_ids
                runner.check_append(seq, new)  # a bad row fails alone, before the batched pass
                return call, seq, new, call.proposal.parents if call.proposal.is_tree else None, kept

            results, rows = _per_call(self._fit_trees(calls), prepare)
            if rows:
                all_logits = runner.forward_batch(
                    [r[2] for r in rows], [r[3] for r in rows],
                    [len(r[3]) if r[1].params.prompt_logprobs is not None else len(r[1].proposal.draft_token_ids) + 1
                     for r in rows], chunkable=[r[1].params.prompt_logprobs is None for r in rows],
                    lazy=[r[1].params.prompt_logprobs is not None for r in rows],  # read a slice at a time
                    capture=[r[1].feature_layers for r in rows], trees=[r[4] for r in rows])
                for r, lg in zip(rows, all_logits):
                    if not isinstance(lg, (torch.Tensor, RowLogits)):  # preempted (no room in the pool), or a prefill chunk
                        results[r[0]] = lg
                all_logits = [lg for lg in all_logits if isinstance(lg, (torch.Tensor, RowLogits))]
                rows = [r for r in rows if results[r[0]] is None]
                if not rows:
                    return results
                try:  # the last k + 1 rows of each: the target after each draft prefix
                    accepted = self._accept([r[1] for r in rows], [r[2] for r in rows],
                                            [materialize(lg[-(len(r[1].proposal.draft_token_ids) + 1):])
                                             for r, lg in zip(rows, all_logits)], [r[4] for r in rows])
                except SpecDecError as exc:  # the batch's rows share the error (none is expected here)
                    for i, *_ in rows:
                        results[i] = exc
                    return results
                trees = [(r[2], len(r[1].token_ids), path) for r, (_, _, path) in zip(rows, accepted) if path]
                if trees:  # each tree's accepted path moves to a chain's positions
                    runner.keep_path(*map(list, zip(*trees)))
                for r, (_, _, path) in zip(rows, accepted):  # a tree's features: the history's, then the path's
                    if r[4] is not None and r[1].feature_layers and r[2].captured:
                        start, captured = r[2].captured[-1]
                        history = captured.shape[0] - len(r[4])
                        r[2].captured[-1] = (start, torch.cat([captured[:history], captured[history:][path or []]]))
                for (i, call, seq, _, _, kept), logits, (n, next_token, path) in zip(rows, all_logits, accepted):
                    # The accepted drafts' keys/values stay; the rejected tail is dropped by moving the pointer.
                    runner.cache.truncate(seq, len(call.token_ids) + n)
                    try:
                        results[i] = with_logprobs(VerifyResult(n, next_token, features=taken_features(
                            seq, call.feature_start, len(call.token_ids) + n, runner.cache.features,
                            tuple(call.feature_layers)) if call.feature_layers else None,
                            accepted_path=path), call, logits, path)
                        if kept is not None:  # a tree verified as its first branch: the path in the tree's nodes
                            results[i].accepted_path = kept[:n]
                    except SpecDecError as exc:  # one row's error stays with that row
                        results[i] = exc
        return results

    def _fit_trees(self, calls: list[VerifyCall]) -> list[VerifyCall]:
        """The calls with their trees cut to the pass's rows (``fit_trees``): many sequences in one pass share
        the rows one sequence's tree has alone. A tree's first nodes are kept (its drafter puts the likeliest
        first); a call whose tree is malformed is left whole, for ``prepare`` to refuse."""
        trees = []
        for i, call in enumerate(calls):
            if call.proposal.is_tree and self._tree_pass(call):
                try:
                    check_parents(call.proposal.parents, len(call.proposal.draft_token_ids))
                except InvalidRequestError:
                    continue
                trees.append(i)
        if not trees or self.tree_tile_rows <= 0:
            return calls
        cached = {c.sequence_id: s.length for c in calls if (s := self.runner.sequences.get(c.sequence_id))}

        def history_rows(call: VerifyCall) -> int:  # the tokens the pass feeds before the drafts (>= the root)
            return max(1, len(call.token_ids) - cached.get(call.sequence_id, 0))

        other = sum(history_rows(c) + (0 if i in trees else len(c.proposal.draft_token_ids))
                    for i, c in enumerate(calls))
        keep = fit_trees([len(calls[i].proposal.draft_token_ids) for i in trees],
                         [levels(calls[i].proposal.parents) for i in trees], other, self.tree_tile_rows)
        calls = list(calls)
        for i, n in zip(trees, keep):
            if n < len(calls[i].proposal.draft_token_ids):
                self.tree_nodes_cut += len(calls[i].proposal.draft_token_ids) - n
                calls[i] = replace(calls[i], proposal=calls[i].proposal.truncated(n))
        return calls

    def _tree_pass(self, call: VerifyCall) -> bool:
        """Whether the call's tree is verified as a tree (else as its first branch): the lean forward, and none
        of what follows one path only (prompt scoring, a grammar's rows). EAGLE features are the accepted
        path's (``verify_batch`` keeps those rows of the pass's)."""
        return (self.runner.supports_trees and call.params.prompt_logprobs is None
                and call.proposal.token_bitmask is None)

    def _why_chain(self, call: VerifyCall) -> str:
        if not self.runner.supports_trees:
            return "the target runs transformers' forward (trees need the lean forward)"
        if call.params.prompt_logprobs is not None:
            return "the call scores its prompt (prompt_logprobs)"
        return "a grammar's allowed tokens follow one path"

    def _accept(self, calls: list[VerifyCall], seqs: list[CachedSequence], logits: list[torch.Tensor],
                trees: list[list[int] | None]) -> list[tuple[int, int, list[int] | None]]:
        """logits: per call [k + 1, vocab] — the target after each draft prefix (a tree's: the root, then each
        node). → (accepted, next token, a tree's accepted path or None) per call."""
        chains = [j for j, t in enumerate(trees) if t is None]
        out: list = [None] * len(calls)
        for j, tree in enumerate(trees):
            if tree is not None:
                path, token = self._accept_tree(calls[j], seqs[j], logits[j], tree)
                out[j] = (len(path), token, path)
        if chains:
            for j, (n, token) in zip(chains, self._accept_chains([calls[j] for j in chains], [seqs[j] for j in chains],
                                                                 [logits[j] for j in chains])):
                out[j] = (n, token, None)
        return out

    def _accept_tree(self, call: VerifyCall, seq: CachedSequence, logits: torch.Tensor,
                     parents: list[int]) -> tuple[list[int], int]:
        """The target's walk down a tree (``specdec.trees``): at each row the token the target alone takes at that
        position (greedy: the argmax; coupled seeded: the race's winner with the position's noise; else a draw
        from p), following the child that holds it."""
        params, drafts, first = call.params, call.proposal.draft_token_ids, len(call.token_ids)
        coupled = not params.greedy and self.seeded_sampling == "coupled" and params.couples
        eos = self.runner.lm.eos_token_ids

        def choose(row: int) -> int:
            before = [] if row == 0 else [drafts[i] for i in path_to(parents, row - 1)]
            ctx = penalty_context(params, call.token_ids, eos, after=before) if params.has_penalties else None
            if params.greedy:
                return int(apply_penalties(logits[row], params, ctx).argmax())
            p = process_logits(logits[row], params, ctx)
            if coupled:  # row r chooses the token at position first + len(before)
                noise = race_noise(params.seed, [first + len(before)], p.shape[-1], p.device)
                return int(race_scores(p[None], noise)[0].argmax())
            return int(sample(p, seq.generator))

        return walk(parents, drafts, choose)

    def _accept_chains(self, calls: list[VerifyCall], seqs: list[CachedSequence],
                       logits: list[torch.Tensor]) -> list[tuple[int, int]]:
        """Chains: logits per call [k + 1, vocab]. → (accepted, next token) per call, in one batched step."""
        greedy, targets = [], []
        for lg, c in zip(logits, calls):
            lg = apply_token_bitmask(lg, c.proposal.token_bitmask)  # a grammar's allowed tokens, before the rest
            # penalties: row i follows the history + drafts[:i] (the drafts before it count as generated)
            ctx = penalty_context(c.params, c.token_ids, self.runner.lm.eos_token_ids, c.proposal.draft_token_ids)
            # greedy rows need only the argmax: their (penalised) logits go in; sampled rows go in as p (processed)
            if c.params.greedy:
                targets.append(apply_penalties(lg, c.params, ctx))
                greedy.append(True)
                continue
            p = process_logits(lg, c.params, ctx)
            coupled = self.seeded_sampling == "coupled" and c.params.couples
            if coupled:  # the coupled rule is greedy matching on p / E (specdec.rejection): a greedy row
                first = len(c.token_ids)  # row j chooses the token at position len(history) + j
                p = race_scores(p, race_noise(c.params.seed, range(first, first + p.shape[0]), p.shape[-1], p.device))
            targets.append(p)
            greedy.append(coupled)
        batch = RaggedBatch.build([c.proposal.draft_token_ids for c in calls], targets,
                                  [c.proposal.draft_probs for c in calls], greedy, [s.generator for s in seqs],
                                  logits[0].device)
        num_accepted, next_tokens = accept_batch(batch, self.kernels).tolist()  # the round's one host sync
        return list(zip(num_accepted, next_tokens))

    def release(self, sequence_id: str) -> None:
        with self.runner.lock:
            self.runner.release(sequence_id)


def with_logprobs(result: VerifyResult, call: VerifyCall, logits: torch.Tensor | RowLogits,
                  path: list[int] | None = None) -> VerifyResult:
    """Add the logprobs the call asked for, read from the verify pass's rows: ``logits`` [m, vocab] ends
    with the k + 1 rows after each draft prefix; with prompt logprobs it holds every position (row j
    predicts token j + 1). Emitted token i (accepted drafts, then bonus/recovered) is scored by row i
    of the last k + 1: the target's distribution at that position, as target-only decoding has it (a tree's
    ``path``: the root's row, then its accepted nodes' rows)."""
    params = call.params
    if params.logprobs is not None:
        emitted = result.emitted(call.proposal.draft_token_ids)
        rows = materialize(logits[-(len(call.proposal.draft_token_ids) + 1):])
        if path is not None:
            rows = rows[[0] + [1 + node for node in path]]
        result.logprobs = token_logprobs(rows, emitted, params.logprobs)
    if params.prompt_logprobs is not None:
        result.prompt_logprobs = token_logprobs(logits[: len(call.token_ids) - 1], call.token_ids[1:],
                                                params.prompt_logprobs)
    return result


def stored_features(cache, seq: CachedSequence, start: int, layers: tuple[int, ...]) -> int:
    """Features asked from ``start``, before the sequence's cached length (a prefix-cache hit, or features asked
    again): the positions whose features ``cache.features`` holds are taken from it (appended to ``seq.captured``);
    from the first one it lacks, the sequence is rolled back and those positions are fed again. Returns the
    sequence's length after (where this call's feeding starts)."""
    store = cache.features
    cache.truncate(seq, store.available(seq.blocks, start, seq.length, layers))
    if seq.length > start:  # (a rollback into a shared block stops at its start: read no further than that)
        seq.captured.append((start, store.read(seq.blocks, start, seq.length)))
    return seq.length


def taken_features(seq: CachedSequence, start: int, end: int, store=None,
                   layers: tuple[int, ...] = ()) -> FeatureChunk | None:
    """The features the sequence's passes of this call captured, positions [start, end): those whose next token
    is now known (the fed history, the accepted drafts). Clears what was captured; ``store`` (the cache's
    ``BlockFeatures``) keeps them beside the sequence's blocks for a later prefix-cache hit."""
    parts, seq.captured = seq.captured, []
    if not parts:
        return None
    first = parts[0][0]
    like = parts[-1][1]  # the pass's (the store's rows are bfloat16 in host memory)
    rows = torch.cat([t.to(like.device, like.dtype) for _, t in parts]) if len(parts) > 1 else like
    if store is not None:
        store.write(seq.blocks, first, layers, rows[:end - first])
    begin = max(start, first)
    rows = rows[begin - first: end - first]
    return FeatureChunk(begin, rows.shape[0], rows.shape[1], str(rows.dtype).removeprefix("torch."), rows)


def tile_rows_of(device: Any, tree_tile_rows: int = 0) -> int:
    """The rows a verify pass costs by: ``tree_tile_rows`` when set (> 0; < 0: no tiles, trees are never cut),
    else by device: a CPU's batch-invariant tile (16 rows: a pass of 1-16 rows costs about one of 1, 17 steps up
    by ~1.5x; ``benchmarks/bench_verify_rows.py``); 0 on another device: the worker measures it when it starts
    (``specdec.engine.pass_cost``: a GPU's pass stays flat up to its roofline's knee, which depends on the card,
    the model and the dtype)."""
    if tree_tile_rows:
        return tree_tile_rows
    return INVARIANT_TILE_ROWS if torch.device(device).type == "cpu" else 0


def race_winner(q: torch.Tensor, seed: int, position: int) -> int:
    """A coupled draft's token: the exponential race over ``q`` [vocab] with the request's noise at
    ``position`` (the target's race at that position, over p): an exact sample of q."""
    return int(race_scores(q, race_noise(seed, [position], q.shape[-1], q.device)[0]).argmax())


def truncate_top_n(probs: torch.Tensor, top_n: int | None) -> torch.Tensor:
    """Keep the top_n most likely tokens of ``probs`` [vocab], renormalised (None/0: unchanged)."""
    if not top_n or top_n >= probs.shape[-1]:
        return probs
    values, idx = torch.topk(probs, top_n)
    out = torch.zeros_like(probs)
    out[idx] = values / values.sum()
    return out


def check_draft_sample_method(method: str) -> None:
    if method not in ("greedy", "probabilistic"):
        raise InvalidRequestError(
            f"draft_sample_method must be 'greedy' or 'probabilistic', got {method!r}", param="draft_sample_method"
        )


def check_proposal(proposal: Proposal, vocab_size: int) -> None:
    k = len(proposal.draft_token_ids)
    if proposal.parents is not None:
        check_parents(proposal.parents, k)
        if proposal.is_tree and proposal.draft_probs is not None:
            raise InvalidRequestError("a token tree's drafts are deterministic candidates: send no draft_probs with "
                                      "draft_parents (or send a chain)", param="draft_probs")
    if k > MAX_NUM_SPECULATIVE_TOKENS:
        raise InvalidRequestError(
            f"{k} draft tokens; at most {MAX_NUM_SPECULATIVE_TOKENS} (num_speculative_tokens) per call",
            param="draft_token_ids",
        )
    bad = [t for t in proposal.draft_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"draft token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                                  param="draft_token_ids")
    q = proposal.draft_probs
    if q is not None:
        if tuple(q.shape) != (k, vocab_size):
            raise InvalidRequestError(f"draft_probs has shape {tuple(q.shape)}, expected ({k}, {vocab_size})",
                                      param="draft_probs")
        if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
            raise InvalidRequestError("draft_probs must be finite and non-negative", param="draft_probs")
        drafted = q[torch.arange(k), torch.tensor(proposal.draft_token_ids, dtype=torch.long)]
        if bool((drafted <= 0).any()):
            raise InvalidRequestError("draft_probs gives probability 0 to a drafted token: q must be the "
                                      "distribution each draft token was sampled from", param="draft_probs")

"""Adaptive k: each sequence picks its number of drafts per round from its own recent acceptance and the
measured cost of a round, to maximise expected tokens per second.

Model (Leviathan et al. 2023, with the costs measured rather than assumed): drafts are accepted
independently with probability ``alpha``, so a round of k drafts emits ``(1 - alpha^(k+1)) / (1 - alpha)``
tokens on average; it costs ``propose[k] + verify[k]`` seconds (k draft steps, one target pass over k+1
tokens). Each round takes the k in ``[min_k, k_max]`` with the most tokens per second.

``alpha`` is estimated per sequence from its rounds, with recent outcomes weighing more: accepted drafts
count as successes, the first rejection of a round as a failure (a round that accepted all it drafted has
none). A prior of a few pseudo-rounds keeps the first rounds sensible. The costs come from
``RoundCosts``: measured by a calibration at start-up, then kept current from the calls' measured times
(the gateway uses Propose times only when a model drafts every round: a round a lookup drafted costs
next to nothing and would teach that drafting is free).

Any k is lossless: adaptivity changes speed, never the output.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from specdec.sequence import SequenceState

PRIOR_ALPHA = 0.5  # acceptance assumed before a sequence has rounds of its own
PRIOR_WEIGHT = 2.0  # ... worth this many drafts
DECAY = 0.85  # per draft outcome: older outcomes count for less (the text changes from copying to writing)
COST_DECAY = 0.9  # per measurement, in the running cost averages


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round of k drafts emits on average (the accepted drafts and the bonus/recovered token)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class RoundCosts:
    """Seconds of a round by k: ``verify[k]`` (a target pass over k + 1 tokens) and ``propose[k]`` (k drafts;
    ``propose[0]`` = 0). Thread-safe running averages, updated with each call's measured time."""

    def __init__(self, verify: Sequence[float], propose: Sequence[float]):
        if len(verify) != len(propose) or not verify:
            raise ValueError("verify and propose need one cost per k = 0..k_max")
        self.verify = [float(v) for v in verify]
        self.propose = [0.0] + [float(p) for p in propose[1:]]
        self._lock = threading.Lock()

    @property
    def k_max(self) -> int:
        return len(self.verify) - 1

    def observe(self, phase: str, k: int, seconds: float) -> None:
        """One measured call: ``phase`` "verify" (k drafts verified) or "propose" (k drafts asked for)."""
        costs = self.verify if phase == "verify" else self.propose
        if not 0 <= k < len(costs) or (phase == "propose" and k == 0) or seconds <= 0:
            return
        with self._lock:
            costs[k] = COST_DECAY * costs[k] + (1 - COST_DECAY) * seconds

    def best_k(self, alpha: float, k_max: int, min_k: int = 1) -> int:
        """The k in [min_k, k_max] with the most expected tokens per second."""
        k_max = min(k_max, self.k_max)
        cost, costs = 0.0, []
        for k in range(k_max + 1):  # more drafts never cost less: noise (or cheap lookup rounds) must not say so
            cost = max(cost, self.verify[k] + self.propose[k])
            costs.append(cost)
        candidates = range(min(min_k, k_max), k_max + 1)
        return max(candidates, key=lambda k: expected_tokens(alpha, k) / costs[k])


class AdaptiveK:
    """One sequence's k policy: call it with the sequence before each round (``decode``'s k)."""

    def __init__(self, costs: RoundCosts, k_max: int, min_k: int = 1):
        self.costs, self.k_max, self.min_k = costs, k_max, min_k
        self.accepted = PRIOR_ALPHA * PRIOR_WEIGHT  # decayed successes (accepted drafts)
        self.rejected = (1 - PRIOR_ALPHA) * PRIOR_WEIGHT  # decayed failures (first rejections)
        self._seen = (0, 0, 0)  # the sequence's (rounds with drafts, drafts, accepted) already counted
        self.chosen: list[int] = []  # the k of each round (for tests and the benchmark)

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def __call__(self, seq: SequenceState) -> int:
        s = seq.stats
        rounds, drafted, accepted = s.num_drafts - self._seen[0], s.num_draft_tokens - self._seen[1], \
            s.num_accepted_tokens - self._seen[2]
        if rounds > 0:  # the last round(s) since we were asked: each outcome ages the older ones
            rejections = 1.0 if accepted < drafted else 0.0
            age = DECAY ** (accepted + rejections)
            self.accepted = age * self.accepted + accepted
            self.rejected = age * self.rejected + rejections
        self._seen = (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
        k = self.costs.best_k(self.alpha, self.k_max, self.min_k)
        self.chosen.append(k)
        return k


def calibrate(draft, target, token_ids: list[int], k_max: int, reps: int = 3) -> RoundCosts:
    """Measure a round's costs by k with real calls on a scratch sequence (released at the end): ``verify[k]``
    with k drafts to check, ``propose[k]`` asking for k drafts. ``draft`` / ``target`` have the worker
    interface (in-process workers or the gateway's clients). Medians of ``reps`` calls each."""
    import statistics
    import time
    import uuid

    from specdec.proposal import Proposal
    from specdec.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=None)
    sid = f"__calibrate_{uuid.uuid4().hex[:8]}__"
    history = list(token_ids)
    verify: list[list[float]] = [[] for _ in range(k_max + 1)]
    propose: list[list[float]] = [[] for _ in range(k_max + 1)]
    try:
        for _ in range(reps):
            for k in range(k_max + 1):
                if k:
                    began = time.perf_counter()
                    draft.propose(sid, history, k, params)
                    propose[k].append(time.perf_counter() - began)
                began = time.perf_counter()  # k drafts to check (their values do not change the cost)
                result = target.verify(sid, history, Proposal([history[-1]] * k), params)
                verify[k].append(time.perf_counter() - began)
                history += result.emitted([history[-1]] * k)
    finally:
        for worker in (draft, target):
            worker.release(sid)
    return RoundCosts([statistics.median(v) for v in verify], [0.0] + [statistics.median(p) for p in propose[1:]])

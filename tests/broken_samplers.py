"""Deliberately broken acceptance rules (drop-in replacements for ``specdec.rejection.rejection_sample``):
negative controls that the statistical losslessness tests must reject.

The target worker accepts a whole batch in one ``specdec.engine.workers.accept_batch`` call; ``rowwise(rule)`` turns
a one-row rule into that call's replacement: ``monkeypatch.setattr(specdec.engine.workers, "accept_batch",
rowwise(recover_from_p))``."""

from __future__ import annotations

import torch


def rowwise(rule):
    """A drop-in for ``specdec.engine.workers.accept_batch`` that runs ``rule(draft, q, p, generator)`` on each
    sampled row of the batch (greedy rows keep the real greedy rule)."""
    from specdec.rejection import per_row

    def accept_batch(batch, backend="torch"):
        return per_row(batch, lambda i, draft, q, target: rule(draft, q, target, batch.generators[i]))

    accept_batch.__name__ = rule.__name__
    return accept_batch


def accept_always(draft_token_ids, draft_probs, target_probs, generator):
    """BROKEN: accept every draft (the output follows q, not p)."""
    k = draft_token_ids.shape[0]
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))


def recover_from_p(draft_token_ids, draft_probs, target_probs, generator):
    """BROKEN, the classic mistake: the usual accept test, but after a rejection sample from p instead
    of norm(max(p - q, 0))."""
    k = draft_token_ids.shape[0]
    rows = torch.arange(k)
    p_x = target_probs[rows, draft_token_ids]
    q_x = draft_probs[rows, draft_token_ids] if draft_probs is not None else torch.ones_like(p_x)
    u = torch.rand(k, generator=generator)
    rejected = (~(u * q_x < p_x)).nonzero()
    if rejected.numel() == 0:
        return k, int(torch.multinomial(target_probs[k], 1, generator=generator))
    n = int(rejected[0, 0])
    return n, int(torch.multinomial(target_probs[n], 1, generator=generator))


# --------------------------------------------------------------------------------------------------
# More negative controls for the served-distribution tests (tests/gateway/test_served_distribution.py).
# Each keeps everything else of the real algorithm, so only the one mistake it names can be detected.


def truncate_top_n_unnormalised(probs, top_n):
    """BROKEN drop-in for ``specdec.engine.workers.truncate_top_n``: keeps the top_n entries of q but forgets to
    renormalise them. The draft still samples from the renormalised top-N (``torch.multinomial`` normalises
    its input), but the q it sends to the target sums to the kept mass c < 1: every acceptance ratio
    p(x) / q(x) is inflated by 1 / c and the residual max(p - q, 0) is too big."""
    if not top_n or top_n >= probs.shape[-1]:
        return probs
    values, idx = torch.topk(probs, top_n)
    out = torch.zeros_like(probs)
    out[idx] = values
    return out


def bonus_from_q(draft_token_ids, draft_probs, target_probs, generator):
    """BROKEN: the real accept test and recovery, but when every draft is accepted the bonus token is drawn
    from the draft's q (its last row, the distribution the last draft came from; one-hot for greedy drafts)
    instead of from the target's p after the last draft, ``target_probs[k]``."""
    from specdec.rejection import rejection_sample

    k = draft_token_ids.shape[0]
    n, token = rejection_sample(draft_token_ids, draft_probs, target_probs, generator)
    if k == 0 or n < k:
        return n, token
    if draft_probs is None:
        return k, int(draft_token_ids[k - 1])
    return k, int(torch.multinomial(draft_probs[k - 1].to(target_probs.device), 1, generator=generator))


def accepted_off_by_one(draft_token_ids, draft_probs, target_probs, generator):
    """BROKEN: the real rule, but after a rejection at draft i it reports i + 1 accepted tokens (the count
    up to and including the rejected draft, instead of its index): the rejected draft is emitted too, and
    the recovered token, meant for its position, follows it."""
    from specdec.rejection import rejection_sample

    k = draft_token_ids.shape[0]
    n, token = rejection_sample(draft_token_ids, draft_probs, target_probs, generator)
    return (n + 1, token) if n < k else (n, token)

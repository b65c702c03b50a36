"""Deliberately broken acceptance rules (drop-in replacements for ``specdec.rejection.rejection_sample``):
negative controls that the statistical losslessness tests must reject."""

from __future__ import annotations

import torch


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

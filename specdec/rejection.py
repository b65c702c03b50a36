"""Acceptance of draft tokens: greedy matching and Leviathan/Chen rejection sampling.

Both return ``(num_accepted_tokens, next_token_id)``: the accepted prefix of ``draft_token_ids``
has length ``num_accepted_tokens``, and ``next_token_id`` follows it — the *bonus* token (sampled
from the target's distribution after the last draft) when all drafts were accepted, else the
*recovered* token (sampled from the residual distribution at the first rejection).

This is the plain torch reference; ``kernels/`` holds the batched Triton version tested against it.
"""

from __future__ import annotations

import torch


def greedy_accept(draft_token_ids: torch.Tensor, target_argmax: torch.Tensor) -> tuple[int, int]:
    """draft_token_ids: [k]; target_argmax: [k + 1] — the target's argmax after each prefix."""
    k = draft_token_ids.shape[0]
    mismatch = (draft_token_ids.to(target_argmax.device) != target_argmax[:k]).nonzero()
    n = int(mismatch[0, 0]) if mismatch.numel() else k
    return n, int(target_argmax[n])


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    draft_token_ids: [k]           tokens the draft sampled
    draft_probs:     [k, vocab]    q, the distributions they were sampled from; None = one-hot
                                   (a greedy draft), in which case q(x) = 1 at the draft token
    target_probs:    [k + 1, vocab] p, the target's processed distributions
    Accept draft i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from
    normalise(max(p_i - q_i, 0)); when all k are accepted sample the bonus from p_k.
    """
    k = draft_token_ids.shape[0]
    device = target_probs.device
    draft_token_ids = draft_token_ids.to(device)
    if draft_probs is not None:
        draft_probs = draft_probs.to(device)
    rows = torch.arange(k, device=device)
    p_x = target_probs[rows, draft_token_ids]  # [k]
    q_x = draft_probs[rows, draft_token_ids] if draft_probs is not None else torch.ones_like(p_x)
    u = torch.rand(k, generator=generator, dtype=torch.float32, device=device)
    accepted = u * q_x < p_x  # u < p/q without dividing; q_x > 0 for any token the draft drew
    rejected = (~accepted).nonzero()
    if rejected.numel() == 0:
        bonus = torch.multinomial(target_probs[k], 1, generator=generator)
        return k, int(bonus)
    n = int(rejected[0, 0])
    p = target_probs[n]
    if draft_probs is None:
        residual = p.clone()
        residual[draft_token_ids[n]] = 0.0
    else:
        residual = (p - draft_probs[n]).clamp_min_(0.0)
    total = residual.sum()
    if total <= 0:  # p == q exactly: rejection had probability 0; fall back to p (measure zero)
        residual = p
    recovered = torch.multinomial(residual, 1, generator=generator)
    return n, int(recovered)

"""Acceptance of draft tokens: greedy matching, the coupled rule and Leviathan/Chen rejection sampling (the
torch reference).

Every rule returns ``(num_accepted_tokens, next_token_id)`` per sequence: the accepted prefix of
``draft_token_ids`` has length ``num_accepted_tokens``, and ``next_token_id`` follows it — the *bonus*
token (sampled from the target's distribution after the last draft) when all drafts were accepted, else
the *recovered* token (sampled from the residual distribution at the first rejection).

This module is the specification; ``kernels/rejection.py`` is the batched Triton version, which must
make the same decisions from the same random numbers (``tests/kernels/`` compares them).

Random numbers (the fixed order both paths share). Greedy sequences draw nothing. A sampled sequence
with k drafts draws, from its own generator, ONE call ``torch.rand(k + vocab)``:
  * the first k are the acceptance uniforms u_0..u_{k-1}: draft i is accepted when u_i * q_i(x_i) < p_i(x_i)
    (u < min(1, p/q) without dividing; q is one-hot at the draft token when the draft sent no q);
  * the other ``vocab`` become exponential noise E_v = -log(u_v) ~ Exp(1), one per vocabulary id, and the
    next token is argmax_v r(v) / E_v (an exponential race: P(v wins) = r(v) / sum(r), so r need not be
    normalised), where r = max(p_n - q_n, 0) at the first rejection n (q_n one-hot: p_n with the draft
    token zeroed) and r = p_k for the bonus.
Measure-zero fallbacks, the same in both paths: when every r(v) / E_v is 0 (p == q, so rejection had
probability 0) the race runs on p; ties go to the lowest id.

The coupled rule (seeded sampled requests under ``seeded_sampling="coupled"``, the default; see
``specdec.seeding``): the token at position t is ``argmax_v p_t(v) / E_t(v)``, E_t the request's race
noise at t (a function of seed and t only). Draft j is accepted while it equals that winner; the first
mismatch emits the winner, and when all k match the bonus is the winner at position k. It is greedy
matching on the scores p / E (``coupled_accept``), so the batched paths run a coupled row as a greedy row
whose target rows are p / E: no uniforms, no q, and no draws from the sequence's generator. Each emitted
token is an exact sample of p_t (the race), and the same one whatever was proposed.

One ``torch.rand`` of ``vocab`` floats (+ a log) costs ~0.3 ms for 49,152 ids on one CPU core, less than the
``torch.multinomial`` it replaces (~1 ms), and the race needs no normalisation, cumsum or sort.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.sparse_probs import to_device


def greedy_accept(draft_token_ids: torch.Tensor, target_argmax: torch.Tensor) -> tuple[int, int]:
    """draft_token_ids: [k]; target_argmax: [k + 1] — the target's argmax after each prefix."""
    k = draft_token_ids.shape[0]
    mismatch = (draft_token_ids.to(target_argmax.device) != target_argmax[:k]).nonzero()
    n = int(mismatch[0, 0]) if mismatch.numel() else k
    return n, int(target_argmax[n])


def race_scores(target_probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The coupled rule's scores p / E [..., vocab] (float32): their argmax (lowest id on ties) is the
    exponential race's winner, a sample of p. p = 0 or E = +inf gives 0: that id cannot win."""
    return target_probs.float() / noise.to(target_probs.device)


def coupled_accept(draft_token_ids: torch.Tensor, target_probs: torch.Tensor, noise: torch.Tensor) -> tuple[int, int]:
    """The coupled rule for one sequence (the reference): target_probs [k + 1, vocab] are the target's
    processed p after each draft prefix, noise [k + 1, vocab] the race noise at those positions
    (``specdec.seeding.race_noise``). The accepted drafts and the next token are exactly the tokens the
    target alone would emit from the same noise, whatever ``draft_token_ids`` are."""
    return greedy_accept(draft_token_ids, race_scores(target_probs, noise).argmax(-1))


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for one sequence, as plainly as possible.

    draft_token_ids: [k]           tokens the draft sampled
    draft_probs:     [k, vocab]    q, the distributions they were sampled from; None = one-hot
                                   (a greedy draft), in which case q(x) = 1 at the draft token
    target_probs:    [k + 1, vocab] p, the target's processed distributions
    Accept draft i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from
    normalise(max(p_i - q_i, 0)); when all k are accepted sample the bonus from p_k. The random numbers
    are drawn as the module docstring says; ``accept_batch`` makes the same decisions for many rows.
    """
    k, vocab = draft_token_ids.shape[0], target_probs.shape[-1]
    u, noise = draw_row(k, vocab, generator, target_probs.device)  # [k], [vocab]
    return accept_row(draft_token_ids, draft_probs, target_probs, u, noise)


def accept_row(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
               u: torch.Tensor, noise: torch.Tensor) -> tuple[int, int]:
    """``rejection_sample`` with the row's random numbers already drawn (u [k], noise [vocab])."""
    k = draft_token_ids.shape[0]
    device = target_probs.device
    draft_token_ids = draft_token_ids.to(device)
    rows = torch.arange(k, device=device)
    p_x = target_probs[rows, draft_token_ids]  # [k]
    if draft_probs is not None:
        draft_probs = draft_probs.to(device, torch.float32)
        q_x = draft_probs[rows, draft_token_ids]
    else:
        q_x = torch.ones_like(p_x)
    rejected = (~(u * q_x < p_x)).nonzero()  # u < p/q without dividing; q_x > 0 for any token the draft drew
    n = int(rejected[0, 0]) if rejected.numel() else k
    p = target_probs[n]
    if n == k:  # every draft accepted: the bonus token from p_k
        residual = p
    elif draft_probs is not None:
        residual = (p - draft_probs[n]).clamp_min(0.0)
    else:  # q one-hot at the draft token: max(p - q, 0) is p without that token
        residual = p.clone()
        residual[draft_token_ids[n]] = 0.0
    return n, int(exponential_race(residual, p, noise))


def draw_row(k: int, vocab: int, generator: torch.Generator | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampled sequence's random numbers for one round: k acceptance uniforms [k] and Exp(1) noise
    [vocab], from ONE ``torch.rand(k + vocab)`` (the order every path shares)."""
    r = torch.rand(k + vocab, generator=generator, device=device)
    return r[:k], r[k:].log_().neg_()  # -log(u) ~ Exp(1); u = 0 gives +inf: that id cannot win


def exponential_race(residual: torch.Tensor, p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax r / E over the last dim: a sample of normalise(r) for E ~ Exp(1) i.i.d. (lowest id on ties);
    when every score is 0 (r == 0: an event of probability 0) the race runs on p instead."""
    score_r = residual / noise
    score_p = p / noise
    return torch.where(score_r.amax(-1) > 0, score_r.argmax(-1), score_p.argmax(-1))


@dataclass
class RaggedBatch:
    """Sequences with different k, flattened (vLLM's layout), with their random numbers already drawn.

    Row i has k_i = cu[i + 1] - cu[i] drafts at ``draft_token_ids[cu[i]:cu[i + 1]]`` and k_i + 1 target
    positions at ``target[cu[i] + i : cu[i + 1] + i + 1]``. Device tensors first, host lists after.
    """

    draft_token_ids: torch.Tensor  # [num_tokens] int64
    cu_num_draft_tokens: torch.Tensor  # [batch + 1] int64
    target: torch.Tensor  # [num_tokens + batch, vocab] float32: p for sampled rows; logits or p for greedy rows
    draft_probs: torch.Tensor | None  # [num_q_rows, vocab] float32: the q rows of the rows that sent q
    q_start: torch.Tensor  # [batch] int64: row i's q_0 is draft_probs[q_start[i]]; -1: no q (one-hot)
    greedy: torch.Tensor  # [batch] int32 (1: greedy row)
    uniforms: torch.Tensor  # [num_tokens] float32 acceptance uniforms (0 for greedy rows)
    noise: torch.Tensor  # [num_sampled, vocab] float32 Exp(1) noise of the sampled rows
    noise_row: torch.Tensor  # [batch] int64: row i's noise is noise[noise_row[i]]; -1 for greedy rows
    greedy_positions: torch.Tensor  # [num_greedy_positions] int64: the target rows whose argmax greedy rows use
    num_draft_tokens: list[int]
    noise_row_list: list[int]
    is_greedy: list[bool]
    has_q: list[bool]
    generators: list  # per row, for tests' per-row rules (tests/broken_samplers.py)

    @property
    def batch_size(self) -> int:
        return len(self.num_draft_tokens)

    @property
    def vocab_size(self) -> int:
        return self.target.shape[-1]

    @classmethod
    def build(cls, drafts: list[list[int]], targets: list[torch.Tensor], draft_probs: list[torch.Tensor | None],
              greedy: list[bool], generators: list, device: torch.device | str) -> "RaggedBatch":
        """drafts: per row the k_i draft ids; targets: per row [k_i + 1, vocab]; draft_probs: per row [k_i, vocab]
        or None. Draws each sampled row's random numbers from its generator, rows in order."""
        device = torch.device(device)
        ks = [len(d) for d in drafts]
        cu = [0]
        for k in ks:
            cu.append(cu[-1] + k)
        vocab = targets[0].shape[-1]
        qs = [q for q, g in zip(draft_probs, greedy) if q is not None and not g]
        q_start, offset = [], 0
        for k, q, g in zip(ks, draft_probs, greedy):
            if q is None or g:
                q_start.append(-1)
            else:
                q_start.append(offset)
                offset += k
        uniforms, noise, noise_row = [], [], []
        for k, g, gen in zip(ks, greedy, generators):
            if g:
                uniforms.append(torch.zeros(k, device=device))
                noise_row.append(-1)
                continue
            u, e = draw_row(k, vocab, gen, device)
            uniforms.append(u)
            noise.append(e)
            noise_row.append(len(noise) - 1)
        noise_t = torch.stack(noise) if noise else torch.empty(0, vocab, device=device)
        greedy_positions = [cu[i] + i + j for i, g in enumerate(greedy) if g for j in range(ks[i] + 1)]
        host = torch.tensor([*sum(drafts, []), *cu, *q_start, *noise_row, *greedy_positions, *map(int, greedy)],
                            dtype=torch.long)
        if device.type == "cuda":
            host = host.pin_memory()
        table = host.to(device, non_blocking=True)  # one transfer for every index table
        b, n = len(ks), cu[-1]
        parts = table.split([n, b + 1, b, b, len(greedy_positions), b])
        return cls(
            draft_token_ids=parts[0],
            cu_num_draft_tokens=parts[1],
            target=torch.cat([t.to(device, torch.float32) for t in targets]) if len(targets) > 1
            else targets[0].to(device, torch.float32),
            draft_probs=to_device(torch.cat([q.to(torch.float32) for q in qs]), device) if qs else None,
            q_start=parts[2],
            greedy=parts[5].to(torch.int32),
            uniforms=torch.cat(uniforms) if uniforms else torch.empty(0, device=device),
            noise=noise_t,
            noise_row=parts[3],
            greedy_positions=parts[4],
            num_draft_tokens=ks,
            noise_row_list=noise_row,
            is_greedy=list(greedy),
            has_q=[s >= 0 for s in q_start],
            generators=list(generators),
        )

    @functools.cached_property
    def host_offsets(self) -> tuple[list[int], list[int]]:
        """(cu, q_cu) as host lists: row i's drafts start at cu[i] and its q rows at q_cu[i] (computed once:
        the per-row rules read them for every row)."""
        cu, q_cu = [0], [0]
        for k, has_q in zip(self.num_draft_tokens, self.has_q):
            cu.append(cu[-1] + k)
            q_cu.append(q_cu[-1] + (k if has_q else 0))
        return cu, q_cu

    def row(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Row i as the one-sequence rules take it: (draft ids [k], q [k, vocab] or None, target [k + 1, vocab])."""
        cu, q_cu = self.host_offsets
        draft = self.draft_token_ids[cu[i]:cu[i + 1]]
        q = self.draft_probs[q_cu[i]:q_cu[i + 1]] if self.has_q[i] else None
        return draft, q, self.target[cu[i] + i: cu[i + 1] + i + 1]


def per_row(batch: RaggedBatch, sampled_rule) -> torch.Tensor:
    """Decide each row on its own: greedy rows by ``greedy_accept``, sampled rows by
    ``sampled_rule(i, draft, q, target)`` → (num accepted, next token) → [2, batch] int64."""
    out = []
    for i in range(batch.batch_size):
        draft, q, target = batch.row(i)
        if batch.is_greedy[i]:
            out.append(greedy_accept(draft, target.argmax(-1)))
        else:
            out.append(sampled_rule(i, draft, q, target))
    return torch.tensor(out, dtype=torch.long).reshape(-1, 2).T


def accept_rows(batch: RaggedBatch) -> torch.Tensor:
    """The same decisions as ``accept_batch``, row by row (``greedy_accept`` / ``accept_row``): fewer, bigger
    tensor operations, which is faster on a CPU, where a host sync costs nothing → [2, batch] int64."""
    cu = batch.host_offsets[0]
    return per_row(batch, lambda i, draft, q, target: accept_row(
        draft, q, target, batch.uniforms[cu[i]:cu[i + 1]], batch.noise[batch.noise_row_list[i]]))


def accept_batch(batch: RaggedBatch) -> torch.Tensor:
    """The torch reference over a ragged batch → [2, batch] int64 on the batch's device:
    (num_accepted_tokens, next token id) per row. No host synchronisation (index tables come built)."""
    device = batch.target.device
    ks = batch.num_draft_tokens
    b, kmax, vocab = batch.batch_size, max(ks, default=0), batch.vocab_size
    target = batch.target
    # per-row argmax of the greedy rows' positions
    argmax = torch.zeros(target.shape[0], dtype=torch.long, device=device)
    if batch.greedy_positions.numel():
        argmax[batch.greedy_positions] = target[batch.greedy_positions].argmax(-1)
    cu = batch.cu_num_draft_tokens
    k_t = cu[1:] - cu[:-1]  # [batch]
    base = cu[:-1] + torch.arange(b, device=device)  # [batch] row i's first target position
    j = torch.arange(kmax, device=device)
    valid = j[None, :] < k_t[:, None]  # [batch, kmax]
    jj = torch.minimum(j[None, :], (k_t[:, None] - 1).clamp_min(0))  # [batch, kmax], clamped into the row
    tok = (cu[:-1, None] + jj).clamp_max(max(batch.draft_token_ids.numel() - 1, 0))
    drafts = batch.draft_token_ids[tok] if batch.draft_token_ids.numel() else torch.zeros_like(tok)
    pos = base[:, None] + jj  # [batch, kmax]
    greedy_acc = argmax[pos] == drafts
    p_x = target[pos, drafts]  # [batch, kmax]
    has_q = batch.q_start >= 0
    if batch.draft_probs is not None:
        # rows without q (q_start -1) read a clamped row, discarded below
        q_x = batch.draft_probs[(batch.q_start[:, None] + jj).clamp(0, batch.draft_probs.shape[0] - 1), drafts]
        q_x = torch.where(has_q[:, None], q_x, torch.ones_like(q_x))
    else:
        q_x = torch.ones_like(p_x)
    u = batch.uniforms[tok] if batch.uniforms.numel() else torch.zeros_like(p_x)
    accepted = torch.where(batch.greedy[:, None].bool(), greedy_acc, u * q_x < p_x) & valid
    n = accepted.long().cumprod(1).sum(1)  # [batch] the accepted prefix
    chosen = base + n  # the position whose token comes next
    next_token = argmax[chosen]
    sampled = [i for i, g in enumerate(batch.is_greedy) if not g]
    if sampled:
        s = torch.tensor(sampled, device=device)
        n_s, k_s = n[s], k_t[s]
        p = target[chosen[s]]  # [num_sampled, vocab]
        rejected = n_s < k_s
        d_n = drafts[s].gather(1, n_s.clamp_max(max(kmax - 1, 0))[:, None])[:, 0] if kmax else n_s
        q = 0.0
        if batch.draft_probs is not None:
            use_q = rejected & has_q[s]
            q = batch.draft_probs[(batch.q_start[s] + n_s).clamp(0, batch.draft_probs.shape[0] - 1)] * use_q[:, None]
        residual = (p - q).clamp_min(0.0)
        one_hot = rejected & ~has_q[s]
        if not all(batch.has_q[i] for i in sampled):  # some row's q is one-hot: zero its draft token
            cols = torch.arange(vocab, device=device)
            residual = torch.where(one_hot[:, None] & (cols[None, :] == d_n[:, None]), 0.0, residual)
        race = exponential_race(residual, p, batch.noise[batch.noise_row[s]])
        next_token = next_token.index_put((s,), race)
    return torch.stack([n, next_token])


def accept_fn(backend: str, device) -> Callable:
    """``accept(batch) -> [2, batch] int64`` of ``backend`` (``kernels.dispatch.resolve``) on ``device``: the Triton
    kernels, or torch: vectorised without host syncs on a GPU, row by row on a CPU (faster there; the same
    decisions)."""
    if backend == "triton":
        from kernels.rejection import accept_batch as triton_accept

        return triton_accept
    return accept_batch if str(device).startswith("cuda") else accept_rows


def accept(batch: RaggedBatch, backend: str = "torch") -> torch.Tensor:
    """Accept a ragged batch with ``backend`` (see ``accept_fn``)."""
    return accept_fn(backend, batch.target.device)(batch)

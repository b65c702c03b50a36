"""Batched verification in Triton: the same decisions as ``specdec.rejection.accept_batch`` (the torch
reference and the specification) from the same random numbers, which are drawn outside the kernels.

Two launches per batch:
  * ``_argmax_kernel``, one program per target position of the greedy rows: a tiled argmax over the vocabulary
    (ties to the lowest id, like ``torch.argmax``);
  * ``_accept_kernel``, one program per sequence: the acceptance loop over its k drafts (greedy: draft ==
    argmax; sampled: u * q(x) < p(x)), then for sampled rows the exponential race argmax r(v) / E_v over the
    vocabulary in tiles (so a 262,144-id vocabulary never has to fit in one block), where r is the residual
    max(p - q, 0) at the first rejection or p for the bonus.
Every arithmetic step is the reference's, in float32 with correctly rounded division, so the decisions are
bit-identical, not merely equal in distribution.

Import this module through ``kernels.dispatch`` (it sets ``TRITON_INTERPRET=1`` first on a CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _argmax_kernel(x_ptr, rows_ptr, out_ptr, vocab, stride, BLOCK: tl.constexpr):
    row = tl.load(rows_ptr + tl.program_id(0))  # int64
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + cols, mask=cols < vocab, other=float("-inf"))
        m = tl.max(x, axis=0)
        i = tl.argmax(x, axis=0).to(tl.int64) + start
        take = m > best  # strictly: an equal value in a later tile has a higher id
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    tl.store(out_ptr + row, best_i)


@triton.jit
def _accept_kernel(
    draft_ptr, cu_ptr, target_ptr, t_stride, q_ptr, q_stride, q_start_ptr, greedy_ptr, argmax_ptr,
    u_ptr, noise_ptr, n_stride, noise_row_ptr, out_ptr, batch, vocab,
    HAS_Q: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    start = tl.load(cu_ptr + i)
    k = tl.load(cu_ptr + i + 1) - start
    base = start + i  # row i's first target position
    greedy = tl.load(greedy_ptr + i) != 0
    q_start = tl.load(q_start_ptr + i)
    n = k
    for j in range(0, k):
        d = tl.load(draft_ptr + start + j)
        if greedy:
            ok = tl.load(argmax_ptr + base + j) == d
        else:
            p_x = tl.load(target_ptr + (base + j) * t_stride + d)
            q_x = tl.full((), 1.0, tl.float32)
            if HAS_Q:  # a row without q (a greedy draft, text proposals): q is one-hot, q(x) = 1
                q_x = tl.load(q_ptr + (q_start + j) * q_stride + d, mask=q_start >= 0, other=1.0)
            u = tl.load(u_ptr + start + j)
            ok = u * q_x < p_x
        n = tl.where((ok == 0) & (n == k), j, n)
    chosen = base + n
    if greedy:
        token = tl.load(argmax_ptr + chosen)
    else:
        rejected = n < k
        d_n = tl.load(draft_ptr + start + n, mask=rejected, other=-1)  # -1: no column is zeroed
        one_hot = rejected & (q_start < 0)
        use_q = rejected & (q_start >= 0)
        noise_row = tl.load(noise_row_ptr + i)
        best_r = tl.full((), -1.0, tl.float32)
        best_p = tl.full((), -1.0, tl.float32)
        idx_r = tl.full((), 0, tl.int64)
        idx_p = tl.full((), 0, tl.int64)
        for v0 in range(0, vocab, BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            m = cols < vocab
            p = tl.load(target_ptr + chosen * t_stride + cols, mask=m, other=0.0)
            e = tl.load(noise_ptr + noise_row * n_stride + cols, mask=m, other=1.0)
            q = tl.zeros((BLOCK,), tl.float32)
            if HAS_Q:
                q = tl.load(q_ptr + (q_start + n) * q_stride + cols, mask=(m & use_q) != 0, other=0.0)  # != 0: the interpreter wants a fresh bool mask
            residual = tl.maximum(p - q, 0.0)
            residual = tl.where(one_hot & (cols == d_n), 0.0, residual)
            s_r = tl.where(m, tl.math.div_rn(residual, e), -1.0)  # masked lanes below any real score (>= 0)
            s_p = tl.where(m, tl.math.div_rn(p, e), -1.0)
            mr = tl.max(s_r, axis=0)
            ir = tl.argmax(s_r, axis=0).to(tl.int64) + v0
            take = mr > best_r
            idx_r = tl.where(take, ir, idx_r)
            best_r = tl.where(take, mr, best_r)
            mp = tl.max(s_p, axis=0)
            ip = tl.argmax(s_p, axis=0).to(tl.int64) + v0
            take = mp > best_p
            idx_p = tl.where(take, ip, idx_p)
            best_p = tl.where(take, mp, best_p)
        token = tl.where(best_r > 0, idx_r, idx_p)
    tl.store(out_ptr + i, n.to(tl.int64))
    tl.store(out_ptr + batch + i, token)


def _block(vocab: int, device: torch.device) -> int:
    # The interpreter runs each tile in numpy: bigger tiles, fewer Python iterations.
    cap = 4096 if device.type == "cuda" else 16384
    return min(triton.next_power_of_2(max(vocab, 16)), cap)


def accept_batch(batch) -> torch.Tensor:
    """Triton twin of ``specdec.rejection.accept_batch`` → [2, batch] int64 (num_accepted_tokens, next token);
    ``batch``: a ``specdec.rejection.RaggedBatch`` (read by its fields: the kernels import nothing above them)."""
    target = batch.target.contiguous()
    device, b, vocab = target.device, batch.batch_size, batch.vocab_size
    block = _block(vocab, device)
    argmax = torch.zeros(target.shape[0], dtype=torch.long, device=device)
    if batch.greedy_positions.numel():
        _argmax_kernel[(batch.greedy_positions.numel(),)](target, batch.greedy_positions, argmax, vocab,
                                                          target.stride(0), BLOCK=block)
    out = torch.empty(2 * b, dtype=torch.long, device=device)
    q = batch.draft_probs
    has_q = q is not None
    q = q.contiguous() if has_q else target  # a valid pointer the kernel never reads
    noise = batch.noise if batch.noise.numel() else target
    drafts = batch.draft_token_ids if batch.draft_token_ids.numel() else batch.cu_num_draft_tokens
    uniforms = batch.uniforms if batch.uniforms.numel() else target
    _accept_kernel[(b,)](
        drafts, batch.cu_num_draft_tokens, target, target.stride(0), q, q.stride(0), batch.q_start, batch.greedy,
        argmax, uniforms, noise, noise.stride(0), batch.noise_row, out, b, vocab, HAS_Q=has_q, BLOCK=block,
    )
    return out.view(2, b)

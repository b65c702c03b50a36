"""The training loss: forward KL from the teacher's renormalised top-k distribution to the draft's full
softmax (plus a cross-entropy term), computed by a fused, chunked lm_head + loss so the (tokens x vocab)
logits are never materialised."""

from __future__ import annotations

from typing import Any

import torch

from specdec.distill.modeling import body, final_softcap


class _FusedDistillLoss(torch.autograd.Function):
    """lm_head + top-k KL (+ CE) over row chunks, gradients computed in the forward pass: the
    (tokens x vocab) logits are never materialised. Returns the mean loss over rows."""

    @staticmethod
    def forward(ctx, hidden, weight, t_ids, t_p, t_logp, ce_ids, ce_weight, temperature, softcap, rows, stats):
        n = hidden.shape[0]
        w = weight.detach().to(torch.bfloat16)
        h = hidden.detach().to(torch.bfloat16)
        need_w = ctx.needs_input_grad[1]
        grad_h = torch.empty(h.shape, dtype=torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32) if need_w else None
        kl_sum = ce_sum = 0.0
        agree = 0
        scale = temperature / n  # d(T^2 * KL(z/T))/dz = T (q - p); mean over rows
        use_ce = ce_ids is not None and ce_weight != 0.0
        pending: list[tuple[int, int, torch.Tensor]] = []  # gradient chunks for one larger grad_w matmul

        def flush() -> None:
            if pending:
                lo, hi = pending[0][0], pending[-1][1]
                g_all = torch.cat([g for _, _, g in pending]) if len(pending) > 1 else pending[0][2]
                grad_w.add_(g_all.T @ h[lo:hi])
                pending.clear()

        for s in range(0, n, rows):
            e = min(n, s + rows)
            z = (h[s:e] @ w.T).float()
            if softcap:
                th = torch.tanh(z / softcap)
                z = th * softcap
            # Passes over the (rows x vocab) block: max+argmax, exp in place, sum, scale, cast.
            mx, am = z.max(dim=-1, keepdim=True)
            agree += int((am.squeeze(1) == t_ids[s:e, 0]).sum())
            z_top = z.gather(1, t_ids[s:e])
            if use_ce:
                z_ce = z.gather(1, ce_ids[s:e, None])
                q1 = None
                if temperature != 1.0:  # CE at T=1 needs its own softmax
                    q1 = torch.softmax(z, dim=-1)
                    ce_sum += float((torch.logsumexp(z, -1, keepdim=True) - z_ce).sum())
            if temperature != 1.0:
                z.div_(temperature)
                mx = mx / temperature
                z_top = z_top / temperature
            q = z.sub_(mx).exp_()  # exp(z/T - max), in place
            ssum = q.sum(dim=-1, keepdim=True)
            lse = mx + ssum.log()
            p = t_p[s:e]
            kl_sum += float((p * (t_logp[s:e] - (z_top - lse))).sum())
            coef = scale
            if use_ce and temperature == 1.0:
                ce_sum += float((lse - z_ce).sum())
                coef = scale + ce_weight / n
            g = q.mul_(coef / ssum)  # coef * softmax(z / T)
            if use_ce:
                if q1 is not None:
                    g.add_(q1, alpha=ce_weight / n)
                g.scatter_add_(1, ce_ids[s:e, None], torch.full((e - s, 1), -ce_weight / n))
            g.scatter_add_(1, t_ids[s:e], -p * scale)
            if softcap:
                g.mul_(1 - th * th)
            gb = g.to(torch.bfloat16)
            grad_h[s:e] = gb @ w
            if need_w:
                pending.append((s, e, gb))
                if pending[-1][1] - pending[0][0] >= 2048:
                    flush()
        if need_w:
            flush()
        t2 = temperature * temperature
        loss = (t2 * kl_sum + ce_weight * ce_sum) / n
        stats.update(kl=t2 * kl_sum / n, ce=ce_sum / n, agree=agree / n)
        ctx.save_for_backward(grad_h, grad_w if need_w else torch.empty(0))
        ctx.need_w = need_w
        ctx.hidden_dtype = hidden.dtype
        return torch.tensor(loss, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = (grad_h * grad_out).to(ctx.hidden_dtype)
        gw = grad_w * grad_out if ctx.need_w else None
        return gh, gw, None, None, None, None, None, None, None, None, None


def distill_loss(model: Any, input_ids: torch.Tensor, t_ids: torch.Tensor, t_logp: torch.Tensor,
                 ce_ids: torch.Tensor | None, ce_weight: float, temperature: float,
                 rows: int = 128) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over positions of T^2 KL(teacher top-k renormalised || draft softmax) + ce_weight * CE."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = body(model)(input_ids=input_ids.long()).last_hidden_state
    n = hidden.shape[0] * hidden.shape[1]
    hidden = hidden.reshape(n, -1)
    t_ids = t_ids.reshape(n, -1)
    t_logp = t_logp.reshape(n, -1).float() / temperature
    t_logp = t_logp - torch.logsumexp(t_logp, dim=-1, keepdim=True)  # renormalised over the top-k
    t_p = t_logp.exp()
    stats: dict[str, float] = {}
    loss = _FusedDistillLoss.apply(
        hidden, model.get_output_embeddings().weight, t_ids, t_p, t_logp,
        None if ce_ids is None else ce_ids.reshape(n).long(), float(ce_weight), float(temperature),
        final_softcap(model.config), rows, stats,
    )
    return loss, stats

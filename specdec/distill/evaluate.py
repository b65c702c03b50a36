"""Evaluation: held-out teacher-forced top-1 agreement with the target, and a free-running greedy
acceptance estimate of speculative decoding with the draft."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from specdec.distill.modeling import body, final_softcap

if TYPE_CHECKING:
    from specdec.distill.config import DistillConfig
    from specdec.distill.corpus import Dataset
    from specdec.distill.onpolicy import GeneratedData
    from specdec.distill.teacher import TeacherCache


@torch.no_grad()
def draft_argmax(model: Any, input_ids: torch.Tensor, rows: int = 1024, autocast: bool = True,
                 blocked: torch.Tensor | None = None) -> torch.Tensor:
    """The draft's greedy next token at every position (B,T), computed without full logits."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = body(model)(input_ids=input_ids.long()).last_hidden_state
    b, t, d = hidden.shape
    hidden = hidden.reshape(b * t, d)
    w = model.get_output_embeddings().weight
    if autocast:
        hidden, w = hidden.to(torch.bfloat16), w.to(torch.bfloat16)
    else:
        hidden = hidden.float()
    out = [(hidden[s: s + rows] @ w.T).masked_fill(blocked, float("-inf")).argmax(-1) if blocked is not None
           else (hidden[s: s + rows] @ w.T).argmax(-1) for s in range(0, b * t, rows)]
    return torch.cat(out).view(b, t)


# --------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def _eval_batch(model: Any, x: torch.Tensor, t_ids: torch.Tensor, t_logp: torch.Tensor,
                rows: int = 1024, blocked: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """(B,T) matches of the draft's argmax with the teacher's, and the summed KL(teacher top-k || draft).
    ``blocked`` (bool over the vocabulary): ids the argmax may not pick (outside a draft vocabulary)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = body(model)(input_ids=x.long()).last_hidden_state
    b, t, d = hidden.shape
    hidden = hidden.reshape(b * t, d).to(torch.bfloat16)
    w = model.get_output_embeddings().weight.to(torch.bfloat16)
    cap = final_softcap(model.config)
    ids = t_ids.reshape(b * t, -1)
    lp = t_logp.reshape(b * t, -1).float()
    lp = lp - torch.logsumexp(lp, dim=-1, keepdim=True)
    match, kl = [], 0.0
    for s in range(0, b * t, rows):
        z = (hidden[s: s + rows] @ w.T).float()
        if cap:
            z = torch.tanh(z / cap) * cap
        pick = z if blocked is None else z.masked_fill(blocked, float("-inf"))
        match.append(pick.argmax(-1) == ids[s: s + rows, 0])
        logq = z.gather(1, ids[s: s + rows]) - torch.logsumexp(z, dim=-1, keepdim=True)
        kl += float((lp[s: s + rows].exp() * (lp[s: s + rows] - logq)).sum())
    return torch.cat(match).view(b, t), kl


@torch.no_grad()
def evaluate(model: Any, data: Dataset, cache: TeacherCache, cfg: DistillConfig, limit: int | None = None,
             generated: "GeneratedData | None" = None, blocked: torch.Tensor | None = None) -> dict[str, Any]:
    """Teacher-forced top-1 agreement with the target on held-out chunks (overall and per kind) + KL.

    With ``generated``, also the agreement on the held-out on-policy continuations (the target's own
    greedy text, the closest match to what speculative decoding sees), reported apart from the corpus."""
    was_training = model.training
    model.eval()
    if limit is not None and limit < len(data.eval):  # a fixed subset spread over both kinds
        idx = torch.linspace(0, len(data.eval) - 1, limit).round().long().unique()
    else:
        idx = torch.arange(len(data.eval))
    hits: dict[str, list[int]] = {}
    kl_sum, count = 0.0, 0
    for s in range(0, len(idx), cfg.batch_size):
        bi = idx[s: s + cfg.batch_size]
        x = data.eval[bi]
        t_ids, t_logp = cache.get("eval", bi)
        match, kl = _eval_batch(model, x, t_ids, t_logp, blocked=blocked)
        for row, i in zip(match, bi.tolist()):
            h = hits.setdefault(data.eval_kinds[i], [0, 0])
            h[0] += int(row.sum())
            h[1] += row.numel()
        kl_sum += kl
        count += x.numel()
    result = {
        "agreement": sum(h[0] for h in hits.values()) / max(1, count),
        "agreement_by_kind": {k: h[0] / max(1, h[1]) for k, h in sorted(hits.items())},
        "kl": kl_sum / max(1, count),
        "tokens": count,
    }
    if generated is not None and generated.n["eval"]:
        gi = torch.arange(generated.n["eval"])
        if limit is not None:
            gi = gi[: max(1, limit // 4)]
        hit, n, gkl = 0, 0, 0.0
        for s in range(0, len(gi), cfg.batch_size):
            x, t_ids, t_logp = generated.get("eval", gi[s: s + cfg.batch_size])
            match, kl = _eval_batch(model, x, t_ids, t_logp, blocked=blocked)
            # the prompt part is corpus text (or sampled); count the greedy continuation only
            cont = match[:, cfg.generate_prompt_len - 1:]
            hit, n, gkl = hit + int(cont.sum()), n + cont.numel(), gkl + kl
        result["generated"] = {"agreement": hit / max(1, n), "tokens": n, "chunks": len(gi)}
    model.train(was_training)
    return result


@torch.no_grad()
def acceptance_estimate(teacher: Any, draft: Any, data: Dataset, n_prompts: int, prompt_len: int,
                        new_tokens: int, k: int, eos_ids: set[int],
                        blocked: torch.Tensor | None = None) -> dict[str, Any] | None:
    """Free-running greedy estimate: the target continues held-out prompts greedily; along its own
    trajectory a greedy draft's proposals equal its teacher-forced argmax until the first miss, so the
    per-position matches give the exact accepted lengths of greedy speculative decoding with ``k``."""
    if n_prompts <= 0 or new_tokens <= 0:
        return None
    n_prompts = min(n_prompts, len(data.eval))
    idx = torch.linspace(0, len(data.eval) - 1, n_prompts).round().long()
    prompts = data.eval[idx, :prompt_len].long()
    # Greedy continuation with the target's own KV cache, batched (equal-length prompts: no padding).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seqs = teacher.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                max_new_tokens=new_tokens,
                                pad_token_id=0, num_beams=1)
    pred = draft_argmax(draft, seqs[:, :-1], autocast=False, blocked=blocked)  # fp32 like the default draft runtime
    matches, accepted, steps, emitted, total_pos = 0, 0, 0, 0, 0
    for row in range(len(seqs)):
        gen = seqs[row, prompt_len:].tolist()
        hit = (pred[row, prompt_len - 1:] == seqs[row, prompt_len:]).tolist()
        end = len(gen)
        for j, tok in enumerate(gen):
            if tok in eos_ids:
                end = j + 1
                break
        hit = hit[:end]
        matches += sum(hit)
        total_pos += len(hit)
        p = 0
        while p < len(hit):
            a = 0
            while a < k and p + a < len(hit) and hit[p + a]:
                a += 1
            steps += 1
            accepted += a
            emitted += min(a + 1, len(hit) - p)
            p += a + 1
    if not steps:
        return None
    return {
        "prompts": int(n_prompts), "prompt_len": prompt_len, "new_tokens": new_tokens, "k": k,
        "token_acceptance": matches / max(1, total_pos),
        "acceptance_rate": accepted / (steps * k),
        "mean_accepted": accepted / steps,
        "tokens_per_target_step": emitted / steps,
    }


# --------------------------------------------------------------------------------------------------

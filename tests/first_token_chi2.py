"""The first sampled token after a prompt, against the target's distribution: a chi-square test shared by the
lookup drafters' sampling tests (n-gram, suffix), whose proposals carry no q."""

from __future__ import annotations

from collections import Counter


def target_first_token(target_dir, text: str, params):
    """(prompt ids, p, support): the target's processed distribution of the token after ``text``."""
    import torch

    from specdec.engine.models import load_model
    from specdec.sampling import process_logits

    lm = load_model(str(target_dir), dtype="float32")
    prompt = list(lm.tokenizer(text).input_ids)
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    p = process_logits(logits, params)
    return prompt, p, p.nonzero().squeeze(-1).tolist()


def first_token_pvalue(llm, prompt: list[int], params, p, support: list[int], chi2_pvalue, n: int = 600) -> float:
    """The p-value of ``n`` seeded generations' first tokens under ``p`` (off-support tokens expected 0 times)."""
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, [params.clone(seed=s) for s in range(n)])
    counts = Counter(o.outputs[0].token_ids[0] for o in outs)
    observed = [counts.get(t, 0) for t in support] + [sum(c for t, c in counts.items() if t not in support)]
    return chi2_pvalue(observed, [float(p[t]) for t in support] + [0.0])

"""On-policy data: the target's own continuations, labelled as they are generated."""

from __future__ import annotations

import torch

from specdec.distill.onpolicy import generate_onpolicy


def test_generate_onpolicy_is_the_targets_greedy_continuation_with_its_labels(setup):
    """The continuation equals HF greedy generation, and each position's labels equal a full forward's."""
    from specdec.engine.models import load_model

    _, _, target_dir = setup
    model = load_model(str(target_dir)).model
    prompts = torch.randint(2, 300, (3, 5))
    tokens, ids, lp = generate_onpolicy(model, prompts, seq_len=16, k=4, sample_until=5)
    assert tokens.shape == (3, 16) and ids.shape == lp.shape == (3, 16, 4)
    with torch.no_grad():
        ref = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                             max_new_tokens=11, pad_token_id=0)
        full = torch.log_softmax(model(input_ids=tokens.long()).logits.float(), dim=-1)
    assert torch.equal(tokens.long(), ref)
    top_v, top_i = torch.topk(full, 4, dim=-1)
    assert torch.equal(ids, top_i)
    assert torch.allclose(lp, top_v, atol=1e-4)
    # Sampled prefix: tokens before sample_until are drawn at T=1 (reproducible with a seeded generator).
    sep = torch.zeros(3, 1, dtype=torch.long)
    a = generate_onpolicy(model, sep, 16, 4, 8, torch.Generator().manual_seed(1))[0]
    b = generate_onpolicy(model, sep, 16, 4, 8, torch.Generator().manual_seed(1))[0]
    assert torch.equal(a, b) and len({tuple(r) for r in a[:, :8].tolist()}) > 1

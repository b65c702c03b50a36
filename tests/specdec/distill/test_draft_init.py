"""The draft's architecture and its initialisation from the target."""

from __future__ import annotations

import torch

from specdec.distill.config import DistillConfig
from specdec.distill.draft_init import init_draft, make_draft_config
from specdec.model_files import model_construction


def test_same_width_copy_init(setup):
    """At the target's width the draft copies the embeddings, a spread of layers and the final norm."""
    from transformers import AutoModelForCausalLM

    _, _, target_dir = setup
    with model_construction():
        teacher = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    cfg = DistillConfig(layers=2, hidden=64, intermediate=0)
    dcfg = make_draft_config(teacher.config, cfg)
    with model_construction():
        draft = AutoModelForCausalLM.from_config(dcfg, dtype=torch.float32)
    info = init_draft(teacher, draft, cfg, torch.zeros(1, 8, dtype=torch.long))
    assert info["layers"] == [0, 3]
    assert torch.equal(draft.model.layers[1].mlp.up_proj.weight, teacher.model.layers[3].mlp.up_proj.weight)
    assert torch.equal(draft.lm_head.weight, teacher.lm_head.weight)
    assert torch.equal(draft.model.norm.weight, teacher.model.norm.weight)

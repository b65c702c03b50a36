"""The exported draft's draft vocabulary (--draft-vocab)."""

from __future__ import annotations

import json

import torch

from tests.specdec.distill.helpers import distill_argv


def test_draft_vocab_is_written_used_and_removed(setup):
    """--draft-vocab N writes the N ids the target predicts most often (plus its special tokens), the model
    card reports their held-out coverage and the agreement drafting over them, the loaded draft drafts over
    them only; rerunning the finished command without the option re-exports and removes the file."""
    from specdec.entrypoints.cli import main
    from specdec.engine.runner import ModelRunner
    from specdec.engine.models import DRAFT_VOCAB_FILE, load_model

    root, corpus, target_dir = setup
    out = root / "draft-vocab"
    argv = distill_argv(target_dir, corpus, out, 10) + ["--generated-tokens", "512", "--generate-prompt-len", "8"]
    assert main(argv + ["--draft-vocab", "64"]) == 0
    body = json.loads((out / DRAFT_VOCAB_FILE).read_text())
    target = load_model(str(target_dir))
    special = set(target.tokenizer.all_special_ids)
    ids = body["token_ids"]
    assert ids == sorted(set(ids)) and special <= set(ids) and len(ids) == body["size"] <= 64 + len(special)
    assert 0 < body["coverage_heldout_corpus"] <= 1 and 0 < body["coverage_heldout_generated"] <= 1
    assert body["coverage_train"] > 0.5  # the frequent ids carry most of the mass

    # the ids are the most frequent top-1 predictions of the labelled training data
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    for f in (out / "cache").rglob("train-*.safetensors"):
        from safetensors.torch import load_file

        top1 = load_file(f)["ids"][..., 0].long()
        counts += torch.bincount((top1 + (32768 if top1.min() < 0 else 0)).flatten(), minlength=target.vocab_size)
    frequent = set(torch.argsort(counts, descending=True, stable=True)[:64 - len(special)].tolist())
    assert frequent <= set(ids)

    summary = json.loads((out / "distill.json").read_text())
    assert summary["draft_vocab"]["size"] == len(ids)
    # both measured (restricting can even help: a wrong rare guess gives way to a frequent right one)
    assert 0 < summary["eval"]["agreement"] <= 1 and 0 < summary["eval_full_vocab"]["agreement"] <= 1
    card = (out / "README.md").read_text()
    assert "Draft vocabulary" in card and f"the {len(ids):,} of {target.vocab_size:,} ids" in card

    draft = load_model(str(out))
    assert draft.draft_vocab.tolist() == ids
    runner = ModelRunner(draft, 64, role="draft")
    logits = runner.forward(runner.get_or_create("s", 0), [1, 2, 3])
    assert set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist()) == set(ids)

    assert main(argv) == 0  # finished: nothing to train, re-exported without a draft vocabulary
    assert not (out / DRAFT_VOCAB_FILE).exists() and load_model(str(out)).draft_vocab is None
    again = json.loads((out / "distill.json").read_text())
    assert again["draft_vocab"] is None
    # the re-export reports the first run's generation time, not this invocation's (none)
    assert again["generated"]["minutes"] == summary["generated"]["minutes"] > 0

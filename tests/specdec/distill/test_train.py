"""``specdec distill`` end to end on a tiny random Llama target (CPU, well under a minute): training,
resuming, the labelling budget, on-policy data and --init-from."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.distill import teacher
from specdec.distill.config import DistillConfig, add_arguments
from specdec.distill.onpolicy import GeneratedData
from specdec.distill.train import distill
from tests.specdec.distill.helpers import distill_argv


def test_distill_end_to_end_and_resume(setup):
    from specdec.entrypoints.cli import main
    from specdec.engine.models import load_model
    from specdec.model_files import tokenizer_fingerprint

    root, corpus, target_dir = setup
    out = root / "draft"
    assert main(distill_argv(target_dir, corpus, out, 30)) == 0

    state = torch.load(out / "checkpoint" / "state.pt", weights_only=False)
    assert state["step"] == 30
    losses = [e["loss"] for e in state["log"]]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:3]) / 3, losses

    draft = load_model(str(out))
    target = load_model(str(target_dir))
    assert tokenizer_fingerprint(draft.tokenizer) == tokenizer_fingerprint(target.tokenizer)
    assert draft.model.config.num_hidden_layers == 2 and draft.model.config.hidden_size == 32
    assert draft.vocab_size == target.vocab_size
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with torch.no_grad():
        logits = draft.model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, target.vocab_size) and torch.isfinite(logits).all()

    card = (out / "README.md").read_text()
    summary = json.loads((out / "distill.json").read_text())
    agreement = summary["eval"]["agreement"]
    assert summary["init_eval"]["agreement"] < agreement <= 1.0, "30 steps of distillation learned nothing"
    assert f"Held-out top-1 agreement with the target: {100 * agreement:.1f}%" in card
    assert "specdec distill" in card and "Initialisation" in card and "MB" in card
    assert summary["steps"] == 30 and summary["acceptance"] is not None
    assert (out / ".gitignore").exists()
    labels = list((out / "cache").rglob("train-*.safetensors"))
    assert labels, "teacher top-k labels are cached on disk"
    mtimes = {p: p.stat().st_mtime_ns for p in labels}

    # Same command with a larger step budget: resumes from the checkpoint, reusing the teacher labels.
    assert main(distill_argv(target_dir, corpus, out, 40)) == 0
    state2 = torch.load(out / "checkpoint" / "state.pt", weights_only=False)
    assert state2["step"] == 40
    assert [e["step"] for e in state2["log"]] == list(range(1, 41))
    assert state2["log"][:30] == state["log"]
    assert json.loads((out / "distill.json").read_text())["steps"] == 40
    assert all(p.stat().st_mtime_ns == m for p, m in mtimes.items())


@pytest.mark.heavy
def test_labelling_budget_limits_the_data(setup, monkeypatch):
    """Once labelling has used --label-fraction of --minutes, training continues on the labelled chunks only."""
    root, corpus, target_dir = setup
    monkeypatch.setattr(teacher, "SHARD_TOKENS", 16 * 32)  # shards of 16 chunks of 32 tokens
    out = root / "budget"
    cfg = DistillConfig(target=str(target_dir), out=str(out), corpus=[str(corpus)], layers=1, hidden=32,
                          intermediate=64, seq_len=32, batch_size=4, max_train_tokens=4096, eval_tokens=256,
                          top_k=4, minutes=0.05, label_fraction=0.0, eval_every=0, accept_prompts=0,
                          threads=1, no_progress=True)
    summary = distill(cfg)
    state = torch.load(out / "checkpoint" / "state.pt", weights_only=False)
    assert state["active"] == 16
    assert len(list((out / "cache").rglob("train-*.safetensors"))) == 1
    assert summary["labelled_tokens"] == 16 * 32
    if summary["steps"] > 4:  # past the first shard: later epochs cycle over the labelled chunks
        assert state["epoch"] >= 1


def test_distill_with_onpolicy_data_and_init_from(setup, monkeypatch):
    """--generated-tokens trains on the target's own continuations (reported apart in the card);
    --init-from starts from an existing draft and refuses one of another shape."""
    from specdec.entrypoints.cli import main
    from specdec.errors import ConfigError

    root, corpus, target_dir = setup
    out = root / "draft-onpolicy"
    argv = distill_argv(target_dir, corpus, out, 20) + ["--generated-tokens", "1024", "--generate-prompt-len", "8",
                                                  "--generate-batch", "8"]
    fetched: list[int] = []
    real_get = GeneratedData.get

    def spy(self, split, indices):
        if split == "train":
            fetched.extend(indices.tolist())
        return real_get(self, split, indices)

    monkeypatch.setattr(GeneratedData, "get", spy)
    assert main(argv) == 0
    summary = json.loads((out / "distill.json").read_text())
    assert summary["generated"]["train_chunks"] == 32 and summary["generated"]["eval_chunks"] == 4
    # 20 steps x 4 chunks over 128 corpus + 32 on-policy chunks: the on-policy ones are in the mix
    assert 0 < len(fetched) < 80 and all(0 <= i < 32 for i in fetched)
    gen_eval = summary["eval"]["generated"]
    assert gen_eval["tokens"] == 4 * (32 - 8 + 1) and 0 <= gen_eval["agreement"] <= 1
    card = (out / "README.md").read_text()
    assert "On-policy data: 8,192 tokens" not in card and "On-policy data: 1,024 tokens (32 chunks)" in card
    assert "On held-out on-policy text" in card
    shards = list((out / "cache").rglob("generated-*/train-*.safetensors"))
    assert shards, "on-policy chunks are stored with their labels"

    # Fine-tune the first draft further: starts where it ended (its agreement), not from scratch.
    out2 = root / "draft-finetuned"
    argv2 = distill_argv(target_dir, corpus, out2, 5) + ["--init-from", str(out)]
    assert main(argv2) == 0
    s2 = json.loads((out2 / "distill.json").read_text())
    assert s2["init_eval"]["agreement"] > summary["init_eval"]["agreement"]
    assert "--init-from" in (out2 / "README.md").read_text()
    bad = distill_argv(target_dir, corpus, root / "draft-bad", 5) + ["--init-from", str(out)]
    bad[bad.index("--hidden") + 1] = "48"
    with pytest.raises(ConfigError, match="does not fit the draft architecture"):
        distill(DistillConfig.from_args(_parse(bad)))


def _parse(argv: list[str]):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv[1:])

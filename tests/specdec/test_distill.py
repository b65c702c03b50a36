"""``specdec distill`` end to end on a tiny random Llama target (CPU, well under a minute)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from specdec import distill as D
from specdec.models import model_construction

WORDS = ("the model draft token target layer cache speculative decoding accepts rejects proposes verifies "
         "python function returns value list dict string number loop while for if else class method").split()


def _corpus(folder: Path) -> Path:
    rng = random.Random(0)
    folder.mkdir(parents=True)
    for i in range(12):
        sents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))).capitalize() + "." for _ in range(60)]
        (folder / f"doc{i}.txt").write_text(" ".join(sents) + "\n")
    for i in range(6):
        lines = []
        for j in range(40):
            a, b = rng.sample(WORDS, 2)
            lines.append(f"def {a}_{j}({b}):\n    return {b} + {j}\n")
        (folder / f"mod{i}.py").write_text("\n".join(lines))
    return folder


def _tokenizer(corpus: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in sorted(corpus.iterdir())], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest and spares a shared CPU
    root = tmp_path_factory.mktemp("distill")
    corpus = _corpus(root / "corpus")
    tok = _tokenizer(corpus)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with model_construction():
        target = LlamaForCausalLM(cfg)
    # A few LM steps on the corpus give the random target structure for the draft to learn.
    ids = tok("\n".join(p.read_text() for p in sorted(corpus.iterdir())))["input_ids"]
    data = torch.tensor(ids[: len(ids) // 64 * 64]).view(-1, 64)
    opt = torch.optim.AdamW(target.parameters(), lr=3e-3)
    for step in range(40):
        batch = data[torch.randint(0, len(data), (8,))]
        loss = target(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    target_dir = root / "target"
    target.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    yield root, corpus, target_dir
    torch.set_num_threads(threads)


def _argv(target_dir: Path, corpus: Path, out: Path, steps: int) -> list[str]:
    return ["distill", "--target", str(target_dir), "--out", str(out), "--corpus", str(corpus),
            "--layers", "2", "--hidden", "32", "--intermediate", "64", "--seq-len", "32", "--batch-size", "4",
            "--max-train-tokens", "4096", "--eval-tokens", "512", "--top-k", "8", "--minutes", "0",
            "--max-steps", str(steps), "--lr", "3e-3", "--init", "random", "--warmup-steps", "2", "--save-every", "5",
            "--eval-every", "10", "--accept-prompts", "4", "--accept-tokens", "12", "--threads", "1",
            "--no-progress"]


def test_distill_end_to_end_and_resume(setup):
    from specdec.cli import main
    from specdec.models import load_model, tokenizer_fingerprint

    root, corpus, target_dir = setup
    out = root / "draft"
    assert main(_argv(target_dir, corpus, out, 30)) == 0

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
    assert main(_argv(target_dir, corpus, out, 40)) == 0
    state2 = torch.load(out / "checkpoint" / "state.pt", weights_only=False)
    assert state2["step"] == 40
    assert [e["step"] for e in state2["log"]] == list(range(1, 41))
    assert state2["log"][:30] == state["log"]
    assert json.loads((out / "distill.json").read_text())["steps"] == 40
    assert all(p.stat().st_mtime_ns == m for p, m in mtimes.items())


def test_same_width_copy_init(setup):
    """At the target's width the draft copies the embeddings, a spread of layers and the final norm."""
    from transformers import AutoModelForCausalLM

    _, _, target_dir = setup
    with model_construction():
        teacher = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    cfg = D.DistillConfig(layers=2, hidden=64, intermediate=0)
    dcfg = D.make_draft_config(teacher.config, cfg)
    with model_construction():
        draft = AutoModelForCausalLM.from_config(dcfg, dtype=torch.float32)
    info = D.init_draft(teacher, draft, cfg, torch.zeros(1, 8, dtype=torch.long))
    assert info["layers"] == [0, 3]
    assert torch.equal(draft.model.layers[1].mlp.up_proj.weight, teacher.model.layers[3].mlp.up_proj.weight)
    assert torch.equal(draft.lm_head.weight, teacher.lm_head.weight)
    assert torch.equal(draft.model.norm.weight, teacher.model.norm.weight)


@pytest.mark.parametrize("temperature,ce_weight,softcap", [(1.0, 0.0, None), (2.0, 0.3, None), (1.0, 0.3, 5.0)])
def test_fused_loss_matches_reference(temperature, ce_weight, softcap):
    torch.manual_seed(0)
    n, h, v, k = 40, 16, 200, 8
    hid = torch.randn(n, h).bfloat16().float().requires_grad_()
    w = (torch.randn(v, h) * 0.5).bfloat16().float().requires_grad_()
    lp, ids = (torch.randn(n, v) * 2).log_softmax(-1).topk(k)
    tlp = (lp / temperature).log_softmax(-1)
    ce = torch.randint(0, v, (n,))
    loss = D._FusedDistillLoss.apply(hid, w, ids, tlp.exp(), tlp, ce, ce_weight, temperature, softcap, 7, {})
    loss.backward()
    gh, gw = hid.grad.clone(), w.grad.clone()
    hid.grad = w.grad = None
    z = hid @ w.T
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    logq = (z / temperature).log_softmax(-1).gather(1, ids)
    ref = temperature ** 2 * (tlp.exp() * (tlp - logq)).sum(-1).mean()
    ref = ref + ce_weight * torch.nn.functional.cross_entropy(z, ce)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-3 * abs(ref.item())
    assert (gh - hid.grad).abs().max() < 0.02 * hid.grad.abs().max()
    assert (gw - w.grad).abs().max() < 0.02 * w.grad.abs().max()


def test_default_corpus_mixes_prose_and_code():
    docs, desc = D.default_corpus()
    kinds = {d.kind for d in docs}
    assert kinds == {"prose", "code"}
    assert any(d.name.startswith("pydoc_data/topics.py") for d in docs)
    assert "standard library" in desc


def test_labelling_budget_limits_the_data(setup, monkeypatch):
    """Once labelling has used --label-fraction of --minutes, training continues on the labelled chunks only."""
    root, corpus, target_dir = setup
    monkeypatch.setattr(D, "SHARD_TOKENS", 16 * 32)  # shards of 16 chunks of 32 tokens
    out = root / "budget"
    cfg = D.DistillConfig(target=str(target_dir), out=str(out), corpus=[str(corpus)], layers=1, hidden=32,
                          intermediate=64, seq_len=32, batch_size=4, max_train_tokens=4096, eval_tokens=256,
                          top_k=4, minutes=0.05, label_fraction=0.0, eval_every=0, accept_prompts=0,
                          threads=1, no_progress=True)
    summary = D.distill(cfg)
    state = torch.load(out / "checkpoint" / "state.pt", weights_only=False)
    assert state["active"] == 16
    assert len(list((out / "cache").rglob("train-*.safetensors"))) == 1
    assert summary["labelled_tokens"] == 16 * 32
    if summary["steps"] > 4:  # past the first shard: later epochs cycle over the labelled chunks
        assert state["epoch"] >= 1


def test_generate_onpolicy_is_the_targets_greedy_continuation_with_its_labels(setup):
    """The continuation equals HF greedy generation, and each position's labels equal a full forward's."""
    from specdec.models import load_model

    _, _, target_dir = setup
    model = load_model(str(target_dir)).model
    prompts = torch.randint(2, 300, (3, 5))
    tokens, ids, lp = D.generate_onpolicy(model, prompts, seq_len=16, k=4, sample_until=5)
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
    a = D.generate_onpolicy(model, sep, 16, 4, 8, torch.Generator().manual_seed(1))[0]
    b = D.generate_onpolicy(model, sep, 16, 4, 8, torch.Generator().manual_seed(1))[0]
    assert torch.equal(a, b) and len({tuple(r) for r in a[:, :8].tolist()}) > 1


def test_distill_with_onpolicy_data_and_init_from(setup, monkeypatch):
    """--generated-tokens trains on the target's own continuations (reported apart in the card);
    --init-from starts from an existing draft and refuses one of another shape."""
    from specdec.cli import main
    from specdec.errors import ConfigError

    root, corpus, target_dir = setup
    out = root / "draft-onpolicy"
    argv = _argv(target_dir, corpus, out, 20) + ["--generated-tokens", "1024", "--generate-prompt-len", "8",
                                                  "--generate-batch", "8"]
    fetched: list[int] = []
    real_get = D.GeneratedData.get

    def spy(self, split, indices):
        if split == "train":
            fetched.extend(indices.tolist())
        return real_get(self, split, indices)

    monkeypatch.setattr(D.GeneratedData, "get", spy)
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
    argv2 = _argv(target_dir, corpus, out2, 5) + ["--init-from", str(out)]
    assert main(argv2) == 0
    s2 = json.loads((out2 / "distill.json").read_text())
    assert s2["init_eval"]["agreement"] > summary["init_eval"]["agreement"]
    assert "--init-from" in (out2 / "README.md").read_text()
    bad = _argv(target_dir, corpus, root / "draft-bad", 5) + ["--init-from", str(out)]
    bad[bad.index("--hidden") + 1] = "48"
    with pytest.raises(ConfigError, match="does not fit the draft architecture"):
        D.distill(D.DistillConfig.from_args(_parse(bad)))


def _parse(argv: list[str]):
    import argparse

    p = argparse.ArgumentParser()
    D.add_arguments(p)
    return p.parse_args(argv[1:])


def test_draft_vocab_is_written_used_and_removed(setup):
    """--draft-vocab N writes the N ids the target predicts most often (plus its special tokens), the model
    card reports their held-out coverage and the agreement drafting over them, the loaded draft drafts over
    them only; rerunning the finished command without the option re-exports and removes the file."""
    from specdec.cli import main
    from specdec.engine import ModelRunner
    from specdec.models import DRAFT_VOCAB_FILE, load_model

    root, corpus, target_dir = setup
    out = root / "draft-vocab"
    argv = _argv(target_dir, corpus, out, 10) + ["--generated-tokens", "512", "--generate-prompt-len", "8"]
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

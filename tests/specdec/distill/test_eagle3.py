"""``specdec distill --method eagle3`` on the tiny trained target: the loss falls, a killed run resumes from its
checkpoint without labelling again, and the exported head loads and drafts for its target."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from specdec.distill.chat_prompts import STYLES, names_a_benchmark_subject
from specdec.distill.eagle3 import chat_prompts


def _argv(target_dir, corpus, out, steps):
    return ["distill", "--method", "eagle3", "--target", str(target_dir), "--out", str(out), "--corpus", str(corpus),
            "--chat-prompts", "8", "--response-tokens", "16", "--corpus-tokens", "2048", "--top-k", "8",
            "--draft-vocab", "256", "--minutes", "0", "--max-steps", str(steps), "--batch-size", "4", "--lr", "3e-3",
            "--warmup-steps", "2", "--save-every", "5", "--threads", "1"]


def test_training_lowers_the_loss_and_exports_the_published_layout(setup):
    from specdec.entrypoints.cli import main
    from specdec.engine.eagle3_files import load_head
    from specdec.engine.models import load_model

    root, corpus, target_dir = setup
    out = root / "eagle3-a"
    assert main(_argv(target_dir, corpus, out, 40)) == 0
    state = torch.load(out / "checkpoint" / "eagle3.pt", weights_only=False)
    losses = state["log"]
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < 0.7 * sum(losses[:3]) / 3, losses
    summary = json.loads((out / "distill.json").read_text())
    assert summary["steps"] == 40 and summary["draft_vocab"] == 256 and len(summary["heldout_step_accuracy"]) == 3
    assert summary["heldout_step_accuracy"][0] > 0.2, summary  # a trained target is predictable from its features
    assert (out / "README.md").read_text().startswith("# EAGLE-3 head for")
    target = load_model(str(target_dir), dtype="float32")
    text = target.model.config.get_text_config()
    emb = target.model.get_input_embeddings().weight.detach()
    head, layers = load_head(out, target_hidden_size=text.hidden_size, target_vocab_size=emb.shape[0],
                             target_num_layers=text.num_hidden_layers, target_embedding=emb)
    assert list(layers) == summary["feature_layers"] and head.cfg.draft_vocab_size == 256


@pytest.mark.heavy
def test_a_killed_run_resumes_without_labelling_again(setup):
    """A real process, killed with SIGKILL after a checkpoint: the same command resumes at the checkpoint's step
    and reuses the cached features (the data file is not written again)."""
    from specdec.entrypoints.cli import main

    root, corpus, target_dir = setup
    out = root / "eagle3-b"
    ckpt = out / "checkpoint" / "eagle3.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from specdec.entrypoints.cli import main; "
                             "sys.exit(main(sys.argv[1:]))", *_argv(target_dir, corpus, out, 100000)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not ckpt.exists() or torch.load(ckpt, weights_only=False)["step"] < 10:
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint of 10 steps"
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    step = torch.load(ckpt, weights_only=False)["step"]
    data = out / "cache" / "eagle3_data.pt"
    written = data.stat().st_mtime_ns
    assert main(_argv(target_dir, corpus, out, step + 5)) == 0
    summary = json.loads((out / "distill.json").read_text())
    assert summary["resumed_at_step"] == step and summary["steps"] == step + 5
    assert data.stat().st_mtime_ns == written


def test_labels_of_a_shared_forward_are_each_sequences_own(setup):
    """Sequences of several lengths labelled together, right-padded, get the features and top-k of a forward of
    each alone."""
    from specdec.distill.eagle3 import _label
    from specdec.engine.models import load_model

    _, _, target_dir = setup
    lm = load_model(str(target_dir), dtype="float32")
    seqs = [[5 + (7 * i + j) % 300 for j in range(n)] for i, n in enumerate((3, 17, 40, 9, 40, 25))]
    together = _label(lm, seqs, (1, 2, 3), 8)
    alone = [_label(lm, [s], (1, 2, 3), 8)[0] for s in seqs]
    assert [len(t["ids"]) for t in together] == [len(s) for s in seqs]
    for t, a in zip(together, alone):
        clear = (a["top_lp"][:, 0] - a["top_lp"][:, 1]).float() > 1e-2  # (a near tie may go either way)
        assert torch.equal(t["ids"], a["ids"]) and torch.equal(t["top_ids"][clear, 0], a["top_ids"][clear, 0])
        assert torch.allclose(t["feats"].float(), a["feats"].float(), atol=2e-2, rtol=2e-2)
        assert torch.allclose(t["top_lp"].float(), a["top_lp"].float(), atol=1e-2)


@pytest.mark.heavy
def test_more_chat_prompts_extend_the_cache_and_init_from_trains_the_head_further(setup, capfd):
    """A second run asking more prompts answers only the new ones (the cached answers are kept, held out by their
    text whatever else is asked), and ``--init-from`` starts from the first run's head, not from scratch."""
    from specdec.distill.eagle3 import held_out
    from specdec.entrypoints.cli import main

    root, corpus, target_dir = setup
    first, second = root / "eagle3-c", root / "eagle3-d"
    assert main(_argv(target_dir, corpus, first, 30)) == 0
    cached = torch.load(first / "cache" / "eagle3_data.pt", weights_only=True)
    assert len(cached["answers"]) == 8 and cached["corpus"]
    (second / "cache").mkdir(parents=True)
    (second / "cache" / "eagle3_data.pt").write_bytes((first / "cache" / "eagle3_data.pt").read_bytes())
    argv = _argv(target_dir, corpus, second, 1)
    argv[argv.index("--chat-prompts") + 1] = "12"
    capfd.readouterr()
    assert main(argv + ["--init-from", str(first)]) == 0
    log = capfd.readouterr().err
    assert "8 of 12 answers" in log and "4/4 answers" in log and "starting from" in log, log
    grown = torch.load(second / "cache" / "eagle3_data.pt", weights_only=True)
    assert list(grown["answers"])[:8] == list(cached["answers"]) == chat_prompts(8, 0)
    assert list(grown["answers"]) == chat_prompts(12, 0)
    for p, seq in cached["answers"].items():
        assert torch.equal(seq["ids"], grown["answers"][p]["ids"]) and torch.equal(seq["feats"],
                                                                                   grown["answers"][p]["feats"])
    assert all(torch.equal(a["ids"], b["ids"]) for a, b in zip(cached["corpus"], grown["corpus"]))
    prompts = chat_prompts(4000, 0)
    assert sum(held_out(p) for p in prompts) in range(120, 280)  # one in 20
    assert all(held_out(p + style) == held_out(p) for p in prompts[:50] for style in STYLES)  # a prompt's styles too
    # one step from the first head: held-out accuracy near the first run's, far above a fresh head's one step
    a = json.loads((first / "distill.json").read_text())["heldout_step_accuracy"][0]
    b = json.loads((second / "distill.json").read_text())
    assert b["init_from"] == str(first) and b["heldout_step_accuracy"][0] > 0.8 * a, (a, b)
    # resuming the second run's checkpoint with other data is refused with what to do
    argv[argv.index("--chat-prompts") + 1] = "16"
    capfd.readouterr()
    assert main(argv) != 0
    assert "--no-resume" in capfd.readouterr().err
    # a head of other feature layers is refused, not loaded (its fc has the same shape)
    third = _argv(target_dir, corpus, root / "eagle3-e", 1) + ["--init-from", str(first), "--feature-layers", "0,1,2"]
    capfd.readouterr()
    assert main(third) != 0
    assert "reads layers" in capfd.readouterr().err


def test_chat_prompts_leave_the_benchmarks_out():
    import json as _json
    from importlib import resources

    bench = _json.loads(resources.files("specdec").joinpath("assets/prompts/drafting.json").read_text())
    held = {p for v in bench.values() if isinstance(v, list) for p in v}
    prompts = chat_prompts(10_000, 0)
    assert len(prompts) == len(set(prompts)) > 4000
    assert not held & set(prompts)
    assert "Write a poem about the ocean at night." not in prompts
    # nor a near copy: no prompt names a benchmark prompt's subject (no robot, no palindrome, ...)
    assert not [p for p in prompts if names_a_benchmark_subject(p)]
    assert names_a_benchmark_subject("Write a Python function that checks whether a string is a palindrome.")
    # any count is balanced over the kinds of request: 19 kinds in the first 19, code among the first 200
    first = chat_prompts(200, 0)
    assert first == prompts[:200] and sum("Python" in p or "JavaScript" in p for p in first) >= 15

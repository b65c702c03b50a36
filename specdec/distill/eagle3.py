"""``specdec distill --method eagle3``: train an EAGLE-3 head for a target on this machine.

1. **Data** (once; cached in ``OUT/cache/eagle3_data.pt`` by prompt, so a second run only trains, and a run with
   more prompts answers only the new ones). Self-distillation as
   EAGLE-3 regenerates its data: the target answers ``--chat-prompts`` chat prompts greedily
   (``specdec.distill.chat_prompts``: 19 kinds of request over subjects of their own; the benchmarks' prompts
   and subjects are left out), ``--response-tokens`` each, through its chat template; beside
   them ``--corpus-tokens`` of the corpus (``specdec.distill.corpus``). For every sequence the target's features
   (the inputs of its ``--feature-layers``, concatenated, bf16) and its top-k next-token log-probabilities.
2. **Head**: the target's width and MLP, one decoder layer, ``fc`` (3 x hidden -> hidden), the LM head over the
   ``--draft-vocab`` target tokens the data predicts most (default 8192; ``d2t``/``t2d`` map it), initialised
   from the target's LM head rows and final norm; the token embedding is the target's, frozen.
3. **Training**: EAGLE-3's training-time test (``Eagle3Head.train_steps``): ``--ttt-steps`` steps, each on the
   head's own outputs of the step before, weighted 0.8^s; the loss is the cross-entropy against the target's
   top-k distribution restricted to the draft vocabulary (positions whose top token lies outside it are
   masked). AdamW, warmup then cosine over the run's progress, gradient clipping, checkpoints every
   ``--save-every`` steps in ``OUT/checkpoint``: a killed run resumes where it was (``--minutes`` and
   ``--max-steps`` are totals over resumed runs).
4. **Export**: the head in the published layout (``specdec.engine.eagle3_files``: config.json, model.safetensors
   in bf16, without the target's embedding), the target's tokenizer files, ``distill.json`` and a model card with
   the held-out accuracy of each step and the tokens per target pass they predict.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdec.distill.chat_prompts import base_prompt, chat_prompts
from specdec.distill.config import CACHE_DIR, CHECKPOINT_DIR, DistillConfig
from specdec.engine.eagle3 import Eagle3Config, Eagle3Head
from specdec.engine.eagle3_files import save_head
from specdec.errors import ConfigError
from specdec.features import default_feature_layers

logger = logging.getLogger("specdec.distill")
DEFAULT_DRAFT_VOCAB = 8192
STEP_WEIGHT = 0.8  # EAGLE-3's weight of training-time-test step s: 0.8^s
HELDOUT_EVERY = 20  # one sequence in 20 is held out (``held_out``)

# -- data ----------------------------------------------------------------------------------------------
def _answers(lm: Any, prompts: list[str], tokens: int, batch: int = 32) -> list[list[int]]:
    """Each prompt through the chat template, and the target's greedy answer after it (ids of both)."""
    tok, model = lm.tokenizer, lm.model
    out = []
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    for i in range(0, len(prompts), batch):
        if getattr(tok, "chat_template", None):
            ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=True) for p in prompts[i:i + batch]]
            ids = [list(x["input_ids"] if hasattr(x, "keys") else x) for x in ids]
        else:  # a base model: the prompt as text
            ids = [tok(p).input_ids for p in prompts[i:i + batch]]
        width = max(len(x) for x in ids)
        inp = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.no_grad():
            gen = model.generate(input_ids=inp, attention_mask=mask, max_new_tokens=tokens, do_sample=False,
                                 pad_token_id=pad)
        for x, row in zip(ids, gen[:, width:].tolist()):
            answer = []
            for t in row:
                answer.append(t)
                if t in lm.eos_token_ids:
                    break
            out.append(x + answer)
        logger.info("eagle3 data: %d/%d answers", len(out), len(prompts))
    return out


def _corpus(lm: Any, cfg: DistillConfig, seq_len: int = 256) -> list[list[int]]:
    if cfg.corpus_tokens <= 0:
        return []
    from specdec.distill.corpus import build_dataset, corpus_from_paths, default_corpus

    docs, _ = corpus_from_paths(cfg.corpus) if cfg.corpus else default_corpus()
    data = build_dataset(lm.tokenizer, docs, seq_len, cfg.corpus_tokens, seq_len, cfg.seed, cfg.prose_fraction)
    return [row.tolist() for row in data["train"]]


LABEL_BATCH_LOGITS = 1 << 27  # logits per labelling forward (512 MB of fp32; sequences of similar length share one)


@torch.no_grad()
def _label(lm: Any, seqs: list[list[int]], layers: tuple[int, ...], top_k: int) -> list[dict[str, torch.Tensor]]:
    """Per sequence: ids, the target's features [n, 3 x hidden] (bf16), top-k next-token ids and log-probs.

    Sequences of similar length share a forward, right-padded: causal attention keeps every real position's
    outputs those of the sequence alone (up to the rounding of a wider matmul)."""
    out: list[dict[str, torch.Tensor]] = [{}] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    tokens = max(1, LABEL_BATCH_LOGITS // lm.model.get_output_embeddings().weight.shape[0])
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and len(seqs[order[end]]) * (end - start + 1) <= tokens:
            end += 1
        group = order[start:end]
        width = len(seqs[group[-1]])
        inp = torch.tensor([seqs[i] + [0] * (width - len(seqs[i])) for i in group])
        mask = torch.tensor([[1] * len(seqs[i]) + [0] * (width - len(seqs[i])) for i in group])
        res = lm.model(input_ids=inp, attention_mask=mask, output_hidden_states=True)
        feats = torch.cat([res.hidden_states[j] for j in layers], dim=-1).to(torch.bfloat16)
        lp = res.logits.float().log_softmax(-1)
        top_lp, top_ids = lp.topk(top_k, dim=-1)
        for row, i in enumerate(group):
            n = len(seqs[i])
            out[i] = {"ids": torch.tensor(seqs[i], dtype=torch.int32), "feats": feats[row, :n].clone(),
                      "top_ids": top_ids[row, :n].to(torch.int32), "top_lp": top_lp[row, :n].to(torch.float16)}
        start = end
    return out


def prepare_data(cfg: DistillConfig, lm: Any, layers: tuple[int, ...], out: Path
                 ) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """The labelled sequences, (train, held out): the answers to ``--chat-prompts`` prompts, then the corpus.

    Cached in OUT/cache: the answers by prompt, and the corpus. A run asking other or more prompts (the rest of
    the data options equal) answers and labels only the prompts the cache lacks."""
    key = {"target": cfg.target, "layers": list(layers), "response_tokens": cfg.response_tokens,
           "corpus_tokens": cfg.corpus_tokens, "corpus": cfg.corpus, "top_k": cfg.top_k, "seed": cfg.seed}
    path = out / CACHE_DIR / "eagle3_data.pt"
    answers: dict[str, dict[str, torch.Tensor]] = {}
    corpus: list[dict[str, torch.Tensor]] | None = None
    if path.exists():
        cached = torch.load(path, weights_only=True)
        if cached.get("key") == json.loads(json.dumps(key)) and "answers" in cached:
            answers, corpus = cached["answers"], cached["corpus"]
    prompts = chat_prompts(cfg.chat_prompts, cfg.seed) if cfg.chat_prompts else []
    missing = [p for p in prompts if p not in answers]
    if missing or corpus is None:
        began = time.perf_counter()
        if answers:
            logger.info("eagle3 data: %d of %d answers in %s; answering %d prompts", len(prompts) - len(missing),
                        len(prompts), path, len(missing))
        seqs = _answers(lm, missing, cfg.response_tokens, cfg.generate_batch) if missing else []
        answers.update(zip(missing, _label(lm, seqs, layers, cfg.top_k)))
        if corpus is None:
            corpus = _label(lm, [s for s in _corpus(lm, cfg) if len(s) >= 3], layers, cfg.top_k)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"key": key, "answers": answers, "corpus": corpus}, tmp)
        tmp.replace(path)
        logger.info("eagle3 data: %d answers and %d corpus sequences labelled in %.0f s", len(seqs), len(corpus),
                    time.perf_counter() - began)
    else:
        logger.info("eagle3 data: %d answers and %d corpus sequences from %s", len(prompts), len(corpus), path)
    train, heldout = [], []
    for item, seq in [*((p, answers[p]) for p in prompts), *enumerate(corpus)]:
        (heldout if held_out(item) else train).append(seq)
    return train, heldout or train[:1]


def held_out(item: str | int) -> bool:
    """One chat prompt in HELDOUT_EVERY (by the hash of its text less a style's ending: the same whatever else
    is asked, and a prompt's other styles on the same side) and every HELDOUT_EVERY-th corpus sequence."""
    if isinstance(item, str):
        return zlib.crc32(base_prompt(item).encode()) % HELDOUT_EVERY == 0
    return item % HELDOUT_EVERY == HELDOUT_EVERY - 1


# -- the head ------------------------------------------------------------------------------------------
def draft_vocabulary(seqs: list[dict[str, torch.Tensor]], vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` target ids the target predicts most often in the data (its top-1), sorted."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s["top_ids"][:, 0].long(), minlength=vocab_size)
        counts += torch.bincount(s["ids"].long(), minlength=vocab_size)
    size = min(size, vocab_size)
    return counts.topk(size).indices.sort().values


def new_head(lm: Any, draft_ids: torch.Tensor, layers: tuple[int, ...], seed: int) -> Eagle3Head:
    text = lm.model.config.get_text_config()
    heads = text.num_attention_heads
    cfg = Eagle3Config(hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
                       num_attention_heads=heads, num_key_value_heads=getattr(text, "num_key_value_heads", heads),
                       vocab_size=lm.model.get_input_embeddings().weight.shape[0], draft_vocab_size=len(draft_ids),
                       head_dim=getattr(text, "head_dim", None), rms_norm_eps=text.rms_norm_eps,
                       rope_theta=getattr(text, "rope_theta", None) or 10000.0,
                       max_position_embeddings=text.max_position_embeddings, feature_layers=layers)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for m in (head.fc, head.q_proj, head.k_proj, head.v_proj, head.o_proj, head.gate_proj, head.up_proj,
                  head.down_proj):
            m.weight.normal_(0, 0.02)
        head.embed_tokens.weight.copy_(lm.model.get_input_embeddings().weight.float())
        head.lm_head.weight.copy_(lm.model.get_output_embeddings().weight[draft_ids].float())
        final_norm = getattr(lm.model.model, "norm", None)
        if final_norm is not None and final_norm.weight.shape == head.norm.shape:
            head.norm.copy_(final_norm.weight.float())
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    return head


def sequence_loss(head: Eagle3Head, seq: dict[str, torch.Tensor], to_draft: torch.Tensor, steps: int
                  ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The training-time-test loss of one sequence, and (correct, counted) top-1 per step."""
    ids, feats = seq["ids"].long(), seq["feats"].float()
    outs = head.train_steps(ids, feats, steps)
    n = ids.shape[0] - 1
    # row p predicts token p + 2: the target's distribution at position p + 1
    top_ids, top_p = seq["top_ids"][1:n + 1].long(), seq["top_lp"][1:n + 1].float().exp()
    draft = to_draft[top_ids]  # [n, k] draft ids (-1 outside)
    inside = draft >= 0
    valid = inside[:, 0].clone()
    valid[n - 1] = False  # the last row's next token is not in the data
    weights = torch.where(inside, top_p, torch.zeros_like(top_p))
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-9)
    total, stats = feats.new_zeros(()), []
    for s, logits in enumerate(outs):
        rows = valid.clone()
        rows[:s] = False  # no drafting step s happens at positions before s
        if not bool(rows.any()):
            stats.append((0, 0))
            continue
        lp = logits[rows].float().log_softmax(-1)
        picked = lp.gather(-1, draft[rows].clamp_min(0))
        total = total + STEP_WEIGHT ** s * -(weights[rows] * picked).sum(-1).mean()
        stats.append((int((logits[rows].argmax(-1) == draft[rows, 0]).sum()), int(rows.sum())))
    return total, stats


def evaluate(head: Eagle3Head, seqs: list[dict[str, torch.Tensor]], to_draft: torch.Tensor, steps: int) -> list[float]:
    """Held-out top-1 accuracy of each training-time-test step (step s given the earlier tokens right)."""
    correct, counted = [0] * steps, [0] * steps
    with torch.no_grad():
        for seq in seqs:
            _, stats = sequence_loss(head, seq, to_draft, steps)
            for s, (c, n) in enumerate(stats):
                correct[s] += c
                counted[s] += n
    return [c / n if n else 0.0 for c, n in zip(correct, counted)]


def tokens_per_pass(accuracy: list[float], k: int) -> float:
    """Greedy tokens per target pass that step accuracies predict with k drafts (the last step's beyond)."""
    total, chain = 1.0, 1.0
    for j in range(k):
        chain *= accuracy[min(j, len(accuracy) - 1)]
        total += chain
    return total


# the head's shape: a head to start from must have these of the head this run builds for its target
_SHAPE = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "dim", "vocab_size",
          "rms_norm_eps", "rope_theta", "rope_scaling")
# taken from this run's target and draft vocabulary, never from the head started from
_OWN = ("embed_tokens.weight", "d2t", "t2d")


def _start_from(cfg: DistillConfig, lm: Any, layers: tuple[int, ...]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any] | None:
    """``--init-from``: a head folder (the published layout) or a run's OUT folder (its checkpoint, in full
    precision): (its draft ids, its weights less ``_OWN``, its Eagle3Config or None), to train further on new
    data with a new schedule. A checkpoint of another target or other feature layers is refused."""
    if not cfg.init_from:
        return None
    folder = Path(cfg.init_from).expanduser()
    ckpt = folder / CHECKPOINT_DIR / "eagle3.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        summary = folder / "distill.json"
        made = json.loads(summary.read_text()) if summary.exists() else {}
        theirs = state.get("layers", made.get("feature_layers"))
        target = state.get("target", made.get("target"))
        if theirs is None or tuple(theirs) != tuple(layers) or target != cfg.target:
            raise ConfigError(f"--init-from {folder}: its head reads layers {theirs} of target {target!r}; this run "
                              f"trains on layers {list(layers)} of {cfg.target!r}")
        logger.info("eagle3: starting from %s (step %d)", ckpt, state["step"])
        return state["draft_ids"], {k: v for k, v in state["head"].items() if k not in _OWN}, None
    from specdec.engine.eagle3_files import load_head

    text = lm.model.config.get_text_config()
    emb = lm.model.get_input_embeddings().weight.detach().float()
    head, theirs = load_head(folder, target_hidden_size=text.hidden_size, target_vocab_size=emb.shape[0],
                             target_num_layers=text.num_hidden_layers, target_embedding=emb)
    if tuple(theirs) != tuple(layers):
        raise ConfigError(f"--init-from {folder} reads target layers {list(theirs)}, but this run's features are of "
                          f"layers {list(layers)}: give --feature-layers {','.join(map(str, theirs))}")
    draft_ids = (head.d2t.long() + torch.arange(len(head.d2t))).cpu()
    logger.info("eagle3: starting from the head in %s", folder)
    return draft_ids, {k: v.float() for k, v in head.state_dict().items() if k not in _OWN}, head.cfg


def _load_start(head: Eagle3Head, start: tuple[torch.Tensor, dict[str, torch.Tensor], Any], source: str) -> None:
    """The weights of the head started from, into this run's head (its shape checked first)."""
    if start[2] is not None:
        differ = [f"{k} {getattr(start[2], k)} (this run: {getattr(head.cfg, k)})" for k in _SHAPE
                  if getattr(start[2], k) != getattr(head.cfg, k)]
        if differ:
            raise ConfigError(f"--init-from {source}: the head's shape is not the one this run trains for its "
                              f"target: {'; '.join(differ)}")
    missing, unexpected = head.load_state_dict(start[1], strict=False)
    if unexpected or set(missing) - set(_OWN):
        raise ConfigError(f"--init-from {source}: weights {sorted(unexpected)[:5]} unexpected, "
                          f"{sorted(set(missing) - set(_OWN))[:5]} missing")


# -- the run -------------------------------------------------------------------------------------------
def train_eagle3(cfg: DistillConfig) -> dict[str, Any]:
    """Run (or resume) the head's training; returns the summary also written to OUT/distill.json."""
    from specdec.engine.models import load_model

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    (out / ".gitignore").write_text(f"{CACHE_DIR}/\n{CHECKPOINT_DIR}/\n")
    lm = load_model(cfg.target, dtype="float32")
    text = lm.model.config.get_text_config()
    layers = (tuple(int(x) for x in cfg.feature_layers.split(",")) if cfg.feature_layers
              else default_feature_layers(text.num_hidden_layers))
    train, heldout = prepare_data(cfg, lm, layers, out)
    ckpt = out / CHECKPOINT_DIR / "eagle3.pt"
    state = torch.load(ckpt, weights_only=False) if ckpt.exists() and cfg.resume is not False else None
    if state and len(state["order"]) != len(train):  # (order: a permutation of the training sequences)
        raise ConfigError(f"{ckpt} was trained on {len(state['order'])} sequences, but this command's data has "
                          f"{len(train)}: give the same data options, or --no-resume (with --init-from {out} to "
                          "start from the head trained so far)")
    if state and cfg.init_from:
        logger.warning("eagle3: resuming %s; --init-from %s is not read (it starts a new run: --no-resume)", ckpt,
                       cfg.init_from)
    vocab = lm.model.get_input_embeddings().weight.shape[0]
    start = None if state else _start_from(cfg, lm, layers)
    if state:
        draft_ids = state["draft_ids"]
    elif start is not None:
        draft_ids = start[0]
    else:
        draft_ids = draft_vocabulary(train, vocab, cfg.draft_vocab or DEFAULT_DRAFT_VOCAB)
    head = new_head(lm, draft_ids, layers, cfg.seed)
    if start is not None:
        _load_start(head, start, cfg.init_from)
    to_draft = torch.full((vocab,), -1, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    step, spent, order, cursor, log = 0, 0.0, list(range(len(train))), 0, []
    rng = random.Random(cfg.seed)
    rng.shuffle(order)
    if state:
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        step, spent, order, cursor, log = (state["step"], state["seconds"], state["order"], state["cursor"],
                                           state["log"])
        logger.info("eagle3: resumed at step %d (%.1f min trained)", step, spent / 60)
    began = time.perf_counter() - spent
    budget = cfg.minutes * 60 if cfg.minutes > 0 else math.inf

    def progress() -> float:
        by_steps = step / cfg.max_steps if cfg.max_steps else 0.0
        return min(1.0, max(by_steps, (time.perf_counter() - began) / budget))

    def save() -> None:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step, "order": order,
                    "cursor": cursor, "seconds": time.perf_counter() - began, "draft_ids": draft_ids,
                    "log": log, "layers": list(layers), "target": cfg.target}, tmp)
        tmp.replace(ckpt)

    head.train()
    while progress() < 1.0:
        frac = progress()
        lr = cfg.lr * min(1.0, (step + 1) / max(cfg.warmup_steps, 1)) * (
            cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for _ in range(cfg.batch_size):
            if cursor >= len(order):
                rng.shuffle(order)
                cursor = 0
            loss, _ = sequence_loss(head, train[order[cursor]], to_draft, cfg.ttt_steps)
            cursor += 1
            (loss / cfg.batch_size).backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        log.append(loss_sum / cfg.batch_size)
        if step % 10 == 0 or step == 1:
            logger.info("eagle3 step %d: loss %.3f, lr %.2e, %.1f min", step, loss_sum / cfg.batch_size, lr,
                        (time.perf_counter() - began) / 60)
        if step % cfg.save_every == 0:
            save()
    save()
    head.eval()
    accuracy = evaluate(head, heldout, to_draft, cfg.ttt_steps)
    export = head.to(torch.bfloat16)
    save_head(export, out, layers, with_embedding=False)
    lm.tokenizer.save_pretrained(out)
    summary = {"out": str(out), "target": cfg.target, "feature_layers": list(layers), "steps": step,
               "resumed_at_step": state["step"] if state else 0,
               "init_from": None if state else cfg.init_from,
               "train_minutes": round((time.perf_counter() - began) / 60, 2), "draft_vocab": len(draft_ids),
               "sequences": len(train), "heldout_sequences": len(heldout),
               "train_tokens": sum(len(s["ids"]) for s in train), "ttt_steps": cfg.ttt_steps,
               "heldout_step_accuracy": [round(a, 4) for a in accuracy],
               "predicted_tokens_per_pass": {k: round(tokens_per_pass(accuracy, k), 3) for k in (1, 2, 3, 4, 5)}}
    (out / "distill.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "README.md").write_text(_card(summary))
    return summary


def _card(s: dict[str, Any]) -> str:
    acc = ", ".join(f"step {i}: {100 * a:.1f}%" for i, a in enumerate(s["heldout_step_accuracy"]))
    tpp = ", ".join(f"k={k}: {v:.2f}" for k, v in s["predicted_tokens_per_pass"].items())
    return (f"# EAGLE-3 head for {s['target']}\n\nTrained by `specdec distill --method eagle3` ({s['steps']} steps, "
            f"{s['train_minutes']:.1f} min, {s['train_tokens']} tokens of {s['sequences']} sequences: the target's "
            f"own answers to chat prompts and corpus text). Reads the inputs of target layers {s['feature_layers']}; "
            f"a draft vocabulary of {s['draft_vocab']} ids.\n\nHeld-out top-1 agreement with the target by drafting "
            f"step (each given the earlier tokens right): {acc}.\nPredicted greedy tokens per target pass: {tpp}.\n\n"
            "Use: `LLM(model=TARGET, speculative_config={\"method\": \"eagle3\", \"model\": THIS_FOLDER, "
            "\"num_speculative_tokens\": 3})`.\n")


def run_eagle3(cfg: DistillConfig) -> int:
    try:
        s = train_eagle3(cfg)
    except KeyboardInterrupt:
        print("interrupted; run the same command to resume from OUT/checkpoint")
        return 130
    print(f"EAGLE-3 head saved to {s['out']}: held-out step accuracy {s['heldout_step_accuracy']}, predicted "
          f"tokens per pass {s['predicted_tokens_per_pass']}, {s['steps']} steps, {s['train_minutes']:.1f} min")
    return 0

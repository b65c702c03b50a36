"""The ``specdec distill`` run: prepare the data, build and initialise the draft, train it (resumably), then
export and evaluate it."""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from specdec.distill.checkpoint import Progress, checkpoint_file, load_checkpoint, save_checkpoint
from specdec.distill.config import DistillConfig, command_line
from specdec.distill.draft_init import Draft, init_draft, load_draft_weights, make_draft_config
from specdec.distill.evaluate import acceptance_estimate, evaluate
from specdec.distill.export import build_draft_vocab, export_draft, write_draft_vocab
from specdec.distill.loss import distill_loss
from specdec.distill.model_card import fmt_mb, write_model_card
from specdec.distill.prepare import Prepared, label_shards, prepare
from specdec.distill.schedule import lr_at, make_optimizer, training_progress
from specdec.distill.summary import summarize
from specdec.model_files import model_construction

logger = logging.getLogger("specdec.distill")  # one logger for the whole command


def run(args: argparse.Namespace) -> int:
    cfg = DistillConfig.from_args(args)
    if cfg.method == "eagle3":
        from specdec.distill.eagle3 import run_eagle3

        return run_eagle3(cfg)
    try:
        summary = distill(cfg)
    except KeyboardInterrupt:
        ckpt = checkpoint_file(Path(cfg.out).expanduser())
        print("interrupted" + (f"; run the same command to resume from {ckpt}" if ckpt.exists() else ""),
              file=sys.stderr)
        return 130
    ev = summary["eval"]
    print(f"draft saved to {summary['out']}: held-out agreement {100 * ev['agreement']:.1f}%, "
          f"{summary['steps']} steps, {summary['train_minutes']:.1f} min, {fmt_mb(summary['size_bytes'])}")
    return 0


def distill(cfg: DistillConfig, command: str | None = None) -> dict[str, Any]:
    """Run (or resume) a distillation; returns the summary also written to OUT/distill.json."""
    cfg.validate()
    t_invocation = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    ckpt_file = checkpoint_file(out)
    state = load_checkpoint(cfg, ckpt_file)
    prep = prepare(cfg, out)
    draft = _build_draft(prep, state)
    progress = _start(prep, draft, state, ckpt_file)

    def save() -> None:
        save_checkpoint(ckpt_file, draft.model, draft.config, draft.optimizer, progress, cfg, draft.init_info,
                        prep.data.key, progress.wall_before + time.perf_counter() - t_invocation)

    _train(prep, draft, progress, save)
    return _export_and_evaluate(prep, draft, progress, command or command_line(cfg), t_invocation)


def _build_draft(prep: Prepared, state: dict[str, Any] | None) -> Draft:
    """The draft model (initialised from the target, from --init-from, or from the checkpoint) and its optimizer."""
    from transformers import AutoModelForCausalLM

    cfg, teacher = prep.cfg, prep.teacher
    dcfg = make_draft_config(teacher.config, cfg)
    with model_construction():
        draft = AutoModelForCausalLM.from_config(dcfg, dtype=torch.float32)
    if draft.get_output_embeddings().weight is not draft.get_input_embeddings().weight:
        raise RuntimeError("the draft's lm_head is not tied to its embeddings")
    same_width = dcfg.hidden_size == teacher.config.get_text_config().hidden_size
    embed_scale = cfg.embed_lr_scale
    if embed_scale is None:
        embed_scale = 1.0 if cfg.init == "random" else (0.0 if same_width else 0.1)
    if state is None and cfg.init_from:
        init_info = load_draft_weights(draft, cfg.init_from)
    elif state is None:
        sample = prep.data.train[: min(16, len(prep.data.train))]
        init_info = init_draft(teacher, draft, cfg, sample)
    else:
        draft.load_state_dict(state["model"])
        init_info = state["init_info"]
    draft.get_input_embeddings().weight.requires_grad_(embed_scale > 0)
    draft.train()
    n_params = sum(p.numel() for p in draft.parameters())
    logger.info("draft: %s, %.1fM parameters; init: %s", type(draft).__name__, n_params / 1e6, init_info["text"])
    return Draft(draft, dcfg, make_optimizer(draft, cfg, embed_scale), init_info, embed_scale, same_width)


def _start(prep: Prepared, draft: Draft, state: dict[str, Any] | None, ckpt_file: Path) -> Progress:
    """The training loop's counters: restored from the checkpoint (with the optimizer and the RNG states), or
    fresh, with the agreement at initialisation."""
    cfg = prep.cfg
    if state is None:  # generating is labelling; both count in --minutes
        progress = Progress(active=len(prep.data.train), train_seconds=prep.gen_seconds,
                            label_seconds=prep.gen_seconds, gen_seconds=prep.gen_seconds)
        init_eval = evaluate(draft.model, prep.data, prep.cache, cfg, limit=32, generated=prep.generated)
        progress.init_eval = init_eval
        logger.info("agreement at initialisation: %.1f%%%s", 100 * init_eval["agreement"],
                    f" (on-policy {100 * init_eval['generated']['agreement']:.1f}%)" if "generated" in init_eval else "")
        return progress
    draft.optimizer.load_state_dict(state["optimizer"])
    progress = Progress.restored(state, len(prep.data.train), prep.gen_seconds)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    logger.info("resumed from %s at step %d (epoch %d, %.1f min trained)", ckpt_file, progress.step, progress.epoch,
                progress.train_seconds / 60)
    return progress


# --------------------------------------------------------------------------------------------------
# Training loop


def _train(prep: Prepared, draft: Draft, p: Progress, save: Callable[[], None]) -> None:
    """Train until the step / time budget is spent; checkpoints every --save-every steps and at the end (also
    when interrupted, then re-raising KeyboardInterrupt)."""
    cfg = prep.cfg
    bar = tqdm(total=cfg.max_steps or None, initial=p.step, desc="distill", unit="step", disable=cfg.no_progress,
               dynamic_ncols=True)
    interrupted = False
    try:
        _loop(prep, draft, p, save, _Display(bar, cfg, p.log[-1].get("eval_agreement") if p.log else None))
    except KeyboardInterrupt:
        interrupted = True
        logger.warning("interrupted: saving a checkpoint at step %d", p.step)
    finally:
        bar.close()
    save()
    if interrupted:
        raise KeyboardInterrupt


def _loop(prep: Prepared, draft: Draft, p: Progress, save: Callable[[], None], display: _Display) -> None:
    cfg = prep.cfg
    perm = _epoch_order(prep, p.active, p.epoch)
    batch_chunks = cfg.batch_size
    while training_progress(cfg, p.step, p.train_seconds) < 1.0:
        t_start = time.perf_counter()
        if p.pos + batch_chunks > len(perm):
            p.epoch += 1
            p.pos = 0
            perm = _epoch_order(prep, p.active, p.epoch)
            batch_chunks = min(batch_chunks, len(perm))
        idx = perm[p.pos: p.pos + batch_chunks]
        shards = sorted({i // prep.shard_size for i in idx.tolist() if i < prep.n_corpus})
        if _labelling_budget_spent(prep, p, shards, batch_chunks):
            p.pos = len(perm)  # start the next epoch over the labelled chunks
            continue
        p.label_seconds += label_shards(prep, "train", shards, prep.data.train, "teacher labels")
        t_step = time.perf_counter()
        x, loss, stats, lr, gnorm = _optimizer_step(prep, draft, p, idx)
        now = time.perf_counter()
        display.step_times.append(now - t_step)
        p.timed[0] += now - t_step
        p.timed[1] += 1
        p.train_seconds += now - t_start
        p.step += 1
        p.pos += batch_chunks
        p.tokens_seen += int(x.numel())
        entry = {"step": p.step, "loss": loss, "kl": stats["kl"], "train_agreement": stats["agree"], "lr": lr,
                 "grad_norm": gnorm, "seconds": round(p.train_seconds, 2), "epoch": p.epoch}
        if cfg.eval_every and p.step % cfg.eval_every == 0:
            ev = evaluate(draft.model, prep.data, prep.cache, cfg, limit=32, generated=prep.generated)
            entry["eval_agreement"] = display.last_eval = ev["agreement"]
            if "generated" in ev:
                entry["eval_generated_agreement"] = ev["generated"]["agreement"]
            p.train_seconds += time.perf_counter() - now
        p.log.append(entry)
        display.update(loss, stats["agree"], lr, int(x.numel()), p.train_seconds)
        if p.step % cfg.save_every == 0:
            save()


def _epoch_order(prep: Prepared, active: int, ep: int) -> torch.Tensor:
    """The chunk indices of epoch ``ep``: [0, n_corpus) are corpus chunks, [n_corpus, n_corpus + n_gen)
    on-policy chunks."""
    n_corpus, n_gen = prep.n_corpus, prep.n_gen
    g = torch.Generator().manual_seed(prep.cfg.seed * 1000 + ep)
    gen_idx = torch.arange(n_corpus, n_corpus + n_gen)
    if ep == 0:  # corpus chunks are already shuffled and labelled in order as training reaches them;
        # on-policy chunks are spread among them at random places
        keys = torch.cat([torch.arange(n_corpus) / max(1, n_corpus), torch.rand(n_gen, generator=g)])
        return torch.cat([torch.arange(n_corpus), gen_idx])[torch.argsort(keys, stable=True)]
    both = torch.cat([torch.arange(active), gen_idx])
    return both[torch.randperm(len(both), generator=g)]


def _labelling_budget_spent(prep: Prepared, p: Progress, shards: list[int], batch_chunks: int) -> bool:
    """Whether to stop labelling: labelling has used --label-fraction of --minutes and this batch needs new
    labels. Then training goes on over the labelled chunks only (``p.active`` shrinks to them), if they
    make a batch."""
    cfg, cache, shard_size = prep.cfg, prep.cache, prep.shard_size
    if not (p.active == len(prep.data.train) and cfg.minutes > 0 and 0 <= cfg.label_fraction < 1
            and p.label_seconds >= cfg.label_fraction * cfg.minutes * 60
            and any(not cache.has("train", sh) for sh in shards)):
        return False
    done = 0
    while done * shard_size < len(prep.data.train) and cache.has("train", done):
        done += 1
    if done * shard_size + prep.n_gen < batch_chunks:  # too few labelled for a batch: labelling goes on
        return False
    p.active = min(len(prep.data.train), done * shard_size)
    logger.info("labelling budget spent (%.1f min): training on the %d labelled chunks from now on",
                p.label_seconds / 60, p.active)
    return True


def _optimizer_step(prep: Prepared, draft: Draft, p: Progress,
                    idx: torch.Tensor) -> tuple[torch.Tensor, float, dict[str, float], float, float]:
    """One step on the chunks ``idx``; returns the batch's tokens, the loss, its stats, the LR and the
    gradient norm."""
    cfg, opt = prep.cfg, draft.optimizer
    x, t_ids, t_logp = _fetch(prep, idx)
    ce_ids = None
    if cfg.ce_weight:
        if cfg.ce_target == "teacher":
            ce_ids = t_ids[..., 0]
        else:  # the data's next token; the last position has none: use the teacher's there
            ce_ids = torch.cat([x[:, 1:].long(), t_ids[:, -1:, 0]], dim=1)
    lr = lr_at(cfg, p.step, training_progress(cfg, p.step, p.train_seconds))
    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    loss, stats = distill_loss(draft.model, x, t_ids, t_logp, ce_ids, cfg.ce_weight, cfg.temperature)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = float(torch.nn.utils.clip_grad_norm_([q for q in draft.model.parameters() if q.requires_grad],
                                                 cfg.grad_clip))
    opt.step()
    return x, float(loss.detach()), stats, lr, gnorm


def _fetch(prep: Prepared, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, teacher ids and log-probs of a batch mixing corpus and on-policy chunks."""
    cfg, n_corpus = prep.cfg, prep.n_corpus
    corpus = idx < n_corpus
    x = torch.empty(len(idx), cfg.seq_len, dtype=torch.int32)
    t_ids = torch.empty(len(idx), cfg.seq_len, cfg.top_k, dtype=torch.long)
    t_logp = torch.empty(len(idx), cfg.seq_len, cfg.top_k)
    if corpus.any():
        ci = idx[corpus]
        x[corpus] = prep.data.train[ci]
        t_ids[corpus], t_logp[corpus] = prep.cache.get("train", ci)
    if (~corpus).any():
        x[~corpus], t_ids[~corpus], t_logp[~corpus] = prep.generated.get("train", idx[~corpus] - n_corpus)
    return x, t_ids, t_logp


class _Display:
    """The progress bar's figures: smoothed loss, train agreement, throughput, LR, last evaluation, time left."""

    def __init__(self, bar: Any, cfg: DistillConfig, last_eval: float | None):
        self.bar, self.cfg, self.last_eval = bar, cfg, last_eval
        self.ema: float | None = None
        self.step_times: list[float] = []  # optimizer step seconds (excluding labelling) of this invocation

    def update(self, loss: float, agree: float, lr: float, batch_tokens: int, train_seconds: float) -> None:
        self.ema = loss if self.ema is None else 0.95 * self.ema + 0.05 * loss
        recent = self.step_times[-20:]
        tps = batch_tokens * len(recent) / max(1e-9, sum(recent))
        post = {"loss": f"{self.ema:.3f}", "agree": f"{100 * agree:.0f}%", "tok/s": f"{tps:.0f}", "lr": f"{lr:.1e}"}
        if self.last_eval is not None:
            post["eval"] = f"{100 * self.last_eval:.1f}%"
        if self.cfg.minutes > 0:
            post["left"] = f"{max(0.0, self.cfg.minutes - train_seconds / 60):.1f}m"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)


# --------------------------------------------------------------------------------------------------
# Export and final evaluation


def _export_and_evaluate(prep: Prepared, draft: Draft, p: Progress, command: str,
                         t_invocation: float) -> dict[str, Any]:
    """Export the draft (and its draft vocabulary), evaluate it on the bf16 weights that ship, and write the
    model card and distill.json; returns the summary."""
    cfg, out = prep.cfg, prep.out
    draft.model.eval()
    rounded, size = export_draft(draft.model, prep.target, out)
    blocked, vocab_info, full_vocab_eval = _export_draft_vocab(prep, rounded)
    final = evaluate(rounded, prep.data, prep.cache, cfg, generated=prep.generated, blocked=blocked)
    accept = acceptance_estimate(prep.teacher, rounded, prep.data, cfg.accept_prompts, min(64, cfg.seq_len),
                                 cfg.accept_tokens, cfg.num_speculative_tokens, set(prep.target.eos_token_ids),
                                 blocked)
    summary = summarize(prep, draft, p, command=command, size=size, final=final, accept=accept,
                        vocab_info=vocab_info, full_vocab_eval=full_vocab_eval,
                        wall_seconds=p.wall_before + time.perf_counter() - t_invocation)
    write_model_card(out, summary)
    (out / "distill.json").write_text(json.dumps(summary, indent=1, default=str))
    logger.info("held-out agreement %.1f%%%s; saved %s (%s)", 100 * final["agreement"],
                f", {accept['tokens_per_target_step']:.2f} tokens/target step (k={accept['k']})" if accept else "",
                out, fmt_mb(size))
    return summary


def _export_draft_vocab(prep: Prepared, rounded: Any) -> tuple[torch.Tensor | None, dict | None, dict | None]:
    """With --draft-vocab: write draft_vocab.json and evaluate ``rounded`` over the whole vocabulary too; returns
    the ids outside the draft vocabulary (a mask), its info and that evaluation. Without: remove the file."""
    cfg, vocab = prep.cfg, prep.vocab
    if not (cfg.draft_vocab and cfg.draft_vocab < vocab):
        write_draft_vocab(prep.out, None, None)
        return None, None, None
    vocab_ids, vocab_info = build_draft_vocab(
        cfg.draft_vocab, vocab, prep.cache, math.ceil(len(prep.data.train) / prep.shard_size), prep.n_eval_shards,
        prep.generated, set(prep.target.tokenizer.all_special_ids) | set(prep.target.eos_token_ids))
    write_draft_vocab(prep.out, vocab_ids, vocab_info)
    blocked = torch.ones(vocab, dtype=torch.bool)
    blocked[vocab_ids] = False
    full_vocab_eval = evaluate(rounded, prep.data, prep.cache, cfg, generated=prep.generated)
    return blocked, vocab_info, full_vocab_eval

"""The run's summary: written to OUT/distill.json, and what the model card reports."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from specdec.distill.checkpoint import Progress
    from specdec.distill.prepare import Prepared
    from specdec.distill.draft_init import Draft


def summarize(prep: Prepared, draft: Draft, p: Progress, *, command: str, size: int, final: dict[str, Any],
              accept: dict[str, Any] | None, vocab_info: dict[str, Any] | None,
              full_vocab_eval: dict[str, Any] | None, wall_seconds: float) -> dict[str, Any]:
    cfg, data, dcfg = prep.cfg, prep.data, draft.config
    recent_losses = [e["loss"] for e in p.log[-20:]] or [float("nan")]
    n_steps_timed = p.timed[1]
    step_s = p.timed[0] / n_steps_timed if n_steps_timed else float("nan")
    labelled = sum(int(data.train[s * prep.shard_size:(s + 1) * prep.shard_size].numel())
                   for s in range(math.ceil(len(data.train) / prep.shard_size)) if prep.cache.has("train", s))
    tc = prep.teacher.config.get_text_config()
    embed_scale = draft.embed_scale
    return {
        "out": str(prep.out), "target": cfg.target, "command": command,
        "architecture": type(draft.model).__name__,
        "config_summary": (f"{dcfg.num_hidden_layers} layers, hidden {dcfg.hidden_size}, {dcfg.num_attention_heads} "
                           f"heads / {dcfg.num_key_value_heads} KV heads of dim {dcfg.head_dim}, MLP "
                           f"{dcfg.intermediate_size}, vocab {dcfg.vocab_size}, tied embeddings (target: "
                           f"{tc.num_hidden_layers} layers, hidden {tc.hidden_size})"),
        "params": sum(q.numel() for q in draft.model.parameters()),
        "embedding_params": draft.model.get_input_embeddings().weight.numel(), "size_bytes": size,
        "init": draft.init_info["text"],
        "embed_note": ("frozen (copied unchanged from the target)" if embed_scale == 0 and draft.same_width else
                       "frozen" if embed_scale == 0 else f"trained at {embed_scale} x the learning rate"),
        "corpus": _corpus_summary(prep, p.active),
        "top_k": cfg.top_k, "temperature": cfg.temperature, "ce_weight": cfg.ce_weight, "ce_target": cfg.ce_target,
        "lr": cfg.lr, "warmup_steps": cfg.warmup_steps, "min_lr_ratio": cfg.min_lr_ratio, "batch_size": cfg.batch_size,
        "grad_clip": cfg.grad_clip, "threads": torch.get_num_threads(),
        "steps": p.step, "tokens_seen": p.tokens_seen,
        "epochs": p.tokens_seen / max(1, (p.active + prep.n_gen) * cfg.seq_len),
        "train_minutes": p.train_seconds / 60, "label_minutes": p.label_seconds / 60, "labelled_tokens": labelled,
        "active_chunks": p.active, "wall_minutes": wall_seconds / 60,
        "step_seconds": step_s,
        "tokens_per_second": (cfg.batch_size * cfg.seq_len / step_s) if n_steps_timed else float("nan"),
        "final_loss": sum(recent_losses) / len(recent_losses), "first_loss": p.log[0]["loss"] if p.log else float("nan"),
        "eval": final, "init_eval": p.init_eval, "acceptance": accept,
        "generated": None if prep.generated is None else {
            "train_chunks": prep.n_gen, "eval_chunks": prep.generated.n["eval"], "tokens": prep.n_gen * cfg.seq_len,
            "prompt_len": cfg.generate_prompt_len, "free_fraction": cfg.generate_free_fraction,
            "minutes": p.gen_seconds / 60},
        "init_from": cfg.init_from,
        "draft_vocab": vocab_info, "eval_full_vocab": full_vocab_eval,
    }


def _corpus_summary(prep: Prepared, active: int) -> dict[str, Any]:
    """The corpus, its kinds' shares of the training chunks, and of the ``active`` ones trained on."""
    meta = prep.data.meta
    counts = meta["counts"]
    used = meta.get("train_kinds", [])[:active]
    tot = sum(c["train_tokens"] for c in counts.values()) or 1
    return {
        "description": meta["description"], "documents": meta["documents"],
        "train_tokens": meta["train_tokens"], "train_chunks": meta["train_chunks"],
        "eval_tokens": meta["eval_tokens"], "seq_len": prep.cfg.seq_len,
        "by_kind": ", ".join(f"{100 * c['train_tokens'] / tot:.0f}% {k}" for k, c in sorted(counts.items())),
        "used_by_kind": ", ".join(f"{100 * used.count(k) / max(1, len(used)):.0f}% {k}" for k in sorted(set(used))),
    }

"""Export: the draft as a Hugging Face folder in bf16 with the target's tokenizer, and its draft vocabulary."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdec.distill.config import CACHE_DIR, CHECKPOINT_DIR

if TYPE_CHECKING:
    from specdec.distill.onpolicy import GeneratedData
    from specdec.distill.teacher import TeacherCache


def export_draft(model: Any, target: Any, out: Path) -> tuple[Any, int]:
    """Save the draft in bf16 with the target's tokenizer; returns the bf16-rounded fp32 model and the
    size of model.safetensors."""
    bf = copy.deepcopy(model).to(torch.bfloat16)
    bf.config.dtype = "bfloat16"
    bf.generation_config = copy.deepcopy(target.model.generation_config)
    bf.save_pretrained(out)
    target.tokenizer.save_pretrained(out)
    gi = out / ".gitignore"
    if not gi.exists():
        gi.write_text(f"# distillation work files (not part of the model)\n{CACHE_DIR}/\n{CHECKPOINT_DIR}/\n")
    rounded = bf.float()
    rounded.eval()
    return rounded, (out / "model.safetensors").stat().st_size


def _top1_counts(labels: TeacherCache, split: str, shards: int, vocab: int, offset: int,
                 first_position: int = 0) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.long)
    for sh in range(shards):
        if labels.has(split, sh):
            top1 = labels._shard(split, sh)["ids"][:, first_position:, 0].long() + offset
            counts += torch.bincount(top1.flatten(), minlength=vocab)[:vocab]
    return counts


def build_draft_vocab(size: int, vocab: int, cache: TeacherCache, n_train_shards: int, n_eval_shards: int,
                      generated: "GeneratedData | None", always: set[int]) -> tuple[torch.Tensor, dict[str, Any]]:
    """The ``size`` ids the target predicts most often (its top-1) over the labelled training data (corpus
    and on-policy chunks), plus ``always`` (special tokens); and how much of the held-out top-1 they cover."""
    counts = _top1_counts(cache, "train", n_train_shards, vocab, cache.offset)
    held = _top1_counts(cache, "eval", n_eval_shards, vocab, cache.offset)
    held_gen = torch.zeros(vocab, dtype=torch.long)
    if generated is not None:
        counts += _top1_counts(generated.labels, "train", generated.shards("train"), vocab, 0)
        held_gen = _top1_counts(generated.labels, "eval", generated.shards("eval"), vocab, 0,
                                first_position=generated.cfg.generate_prompt_len - 1)
    order = torch.argsort(counts, descending=True, stable=True)  # ties: lower id first
    chosen = set(int(i) for i in always if 0 <= i < vocab)
    for i in order.tolist():
        if len(chosen) >= size:
            break
        chosen.add(i)
    ids = torch.tensor(sorted(chosen), dtype=torch.long)

    def cover(c: torch.Tensor) -> float | None:
        return float(c[ids].sum() / c.sum()) if c.sum() else None

    info = {"size": len(ids), "vocab_size": vocab, "training_positions": int(counts.sum()),
            "distinct_predicted": int((counts > 0).sum()), "coverage_train": cover(counts),
            "coverage_heldout_corpus": cover(held), "coverage_heldout_generated": cover(held_gen)}
    return ids, info


DRAFT_VOCAB_NOTE = "draft_vocab.json: specdec drafts over these ids only and computes just their LM-head rows"


def write_draft_vocab(out: Path, ids: torch.Tensor | None, info: dict[str, Any] | None) -> None:
    from specdec.engine.models import DRAFT_VOCAB_FILE

    path = out / DRAFT_VOCAB_FILE
    if ids is None:
        path.unlink(missing_ok=True)  # a stale vocabulary of an earlier run would restrict this draft
        return
    body = {"description": "the ids this draft proposes (the target's most frequent top-1 predictions in the "
                           "distillation data); specdec computes only these rows of the draft's LM head",
            **(info or {}), "token_ids": ids.tolist()}
    path.write_text(json.dumps(body))

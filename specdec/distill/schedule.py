"""The learning-rate schedule, the optimizer and the run's progress through its step / time budget."""

from __future__ import annotations

import math
from typing import Any

import torch

from specdec.distill.config import DistillConfig


def lr_at(cfg: DistillConfig, step: int, progress: float) -> float:
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    p = min(1.0, max(0.0, progress))
    cos = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    return cfg.lr * warm * cos


def make_optimizer(model: Any, cfg: DistillConfig, embed_scale: float) -> torch.optim.Optimizer:
    emb = model.get_input_embeddings().weight
    decay, no_decay = [], []
    for name, prm in model.named_parameters():
        if prm is emb or not prm.requires_grad:
            continue
        (decay if prm.ndim >= 2 else no_decay).append(prm)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay, "lr_scale": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0}]
    if embed_scale > 0:
        groups.append({"params": [emb], "weight_decay": 0.0, "lr_scale": embed_scale})
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def training_progress(cfg: DistillConfig, step: int, seconds: float) -> float:
    """How much of the budget is spent (1 = done): the larger of steps / --max-steps and time / --minutes."""
    parts = []
    if cfg.max_steps > 0:
        parts.append(step / cfg.max_steps)
    if cfg.minutes > 0:
        parts.append(seconds / (cfg.minutes * 60))
    return max(parts) if parts else 0.0

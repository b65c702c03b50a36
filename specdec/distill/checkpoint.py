"""Checkpoints in ``OUT/checkpoint``: the draft, the optimizer and the training loop's counters; running the
same command again resumes from them."""

from __future__ import annotations

import logging
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.distill.config import CHECKPOINT_DIR, DistillConfig
from specdec.errors import ConfigError

logger = logging.getLogger("specdec.distill")  # one logger for the whole command

# The draft's architecture: a resumed run keeps the checkpoint's (with a warning when the command line differs).
ARCH_KEYS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "init", "init_layers", "projection",
             "embed_lr_scale")
# The data a checkpoint was trained on: a resumed run must use the same.
DATA_KEYS = ("target", "corpus", "seq_len", "max_train_tokens", "eval_tokens", "prose_fraction", "seed", "top_k",
             "generated_tokens", "generate_prompt_len", "generate_free_fraction", "init_from")


def checkpoint_file(out: Path) -> Path:
    return out / CHECKPOINT_DIR / "state.pt"


@dataclass
class Progress:
    """The training loop's counters: saved in every checkpoint, restored on resume."""

    active: int  # training chunks in use (fewer once the labelling budget is spent)
    step: int = 0
    epoch: int = 0
    pos: int = 0  # position in the epoch's chunk order
    tokens_seen: int = 0
    train_seconds: float = 0.0  # the training loop incl. labelling: what --minutes limits
    label_seconds: float = 0.0
    gen_seconds: float = 0.0  # on-policy generation
    timed: list = field(default_factory=lambda: [0.0, 0])  # seconds and count of optimizer steps (excluding labelling)
    wall_before: float = 0.0  # wall time of the earlier invocations
    log: list[dict[str, Any]] = field(default_factory=list)
    init_eval: dict[str, Any] | None = None  # held-out agreement at initialisation

    @classmethod
    def restored(cls, state: dict[str, Any], active: int, gen_seconds: float) -> "Progress":
        """The counters of checkpoint ``state``; ``active`` and ``gen_seconds`` (of this invocation) where the
        checkpoint has none."""
        return cls(
            active=state.get("active", active), step=state["step"], epoch=state["epoch"], pos=state["pos"],
            tokens_seen=state["tokens_seen"], train_seconds=state["train_seconds"],
            label_seconds=state.get("label_seconds", 0.0),
            gen_seconds=gen_seconds + state.get("gen_seconds", 0.0),  # on-policy generation of the earlier invocations
            timed=list(state.get("timed", [0.0, 0])), wall_before=state.get("wall_seconds", 0.0),
            log=state["log"], init_eval=state.get("init_eval"),
        )


def load_checkpoint(cfg: DistillConfig, ckpt_file: Path) -> dict[str, Any] | None:
    """The checkpoint to resume from (None: start over). The checkpoint's draft architecture replaces ``cfg``'s;
    data settings that differ from the checkpoint's are an error."""
    ckpt_dir = ckpt_file.parent
    if cfg.resume is True and not ckpt_file.exists():
        raise ConfigError(f"--resume: no checkpoint at {ckpt_file}")
    resume = ckpt_file.exists() and cfg.resume is not False
    if not resume:
        return None
    state = torch.load(ckpt_file, weights_only=False)
    saved = state["config"]
    changed = [k for k in ARCH_KEYS if saved.get(k) != getattr(cfg, k)]
    if changed:
        logger.warning("resuming: keeping the checkpoint's %s (the command line differs)", ", ".join(changed))
        for k in ARCH_KEYS:
            setattr(cfg, k, saved.get(k))
    for k in DATA_KEYS:
        if saved.get(k) != getattr(cfg, k):
            raise ConfigError(
                f"the checkpoint in {ckpt_dir} was trained with {k}={saved.get(k)!r}, not {getattr(cfg, k)!r}; "
                "rerun with the same data settings or pass --no-resume to start over"
            )
    return state


def save_checkpoint(ckpt_file: Path, draft: Any, draft_config: Any, opt: torch.optim.Optimizer, p: Progress,
                    cfg: DistillConfig, init_info: dict[str, Any], data_key: str, wall_seconds: float) -> None:
    """Save the training state (with the global RNG states) and the draft's config in ``ckpt_file``'s folder."""
    ckpt_dir = ckpt_file.parent
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    _atomic_torch_save({
        "model": draft.state_dict(), "optimizer": opt.state_dict(), "step": p.step, "epoch": p.epoch, "pos": p.pos,
        "tokens_seen": p.tokens_seen, "train_seconds": p.train_seconds, "label_seconds": p.label_seconds,
        "gen_seconds": p.gen_seconds,
        "timed": p.timed, "active": p.active, "wall_seconds": wall_seconds,
        "log": p.log, "config": asdict(cfg), "init_info": init_info, "init_eval": p.init_eval,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}, "data_key": data_key,
    }, ckpt_file)
    draft_config.save_pretrained(ckpt_dir)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)

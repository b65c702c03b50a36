"""The ``specdec distill`` command line and its configuration (no torch needed)."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass

from specdec.errors import ConfigError

DEFAULT_TARGET = "smollm2-135m"
CHECKPOINT_DIR = "checkpoint"  # OUT/checkpoint: the training state a rerun resumes from
CACHE_DIR = "cache"  # OUT/cache: tokenized corpus, teacher labels, on-policy data


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    p.add_argument("--out", required=True, help="output folder (the draft; work files in OUT/cache, OUT/checkpoint)")
    p.add_argument("--method", choices=["draft_model", "eagle3"], default="draft_model",
                   help="draft_model: a small model of the target's class (default); eagle3: an EAGLE-3 head that "
                        "drafts from the target's hidden states (specdec.distill.eagle3)")
    _add_eagle3_arguments(p.add_argument_group("EAGLE-3 head (--method eagle3)"))
    _add_architecture_arguments(p.add_argument_group("draft architecture (the target's model class)"))
    _add_data_arguments(p.add_argument_group("data"))
    _add_training_arguments(p.add_argument_group("training"))


def _add_eagle3_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--chat-prompts", type=int, default=384,
                   help="chat prompts the target answers for the head's training data (self-distillation; default "
                   "384; the answers are cached by prompt: more prompts later answer only the new ones)")
    g.add_argument("--response-tokens", type=int, default=160,
                   help="tokens of each answer (greedy, the target's own; default 160)")
    g.add_argument("--corpus-tokens", type=int, default=65_536,
                   help="corpus tokens beside the answers (the --corpus, default the Python library's text; "
                        "default 65536)")
    g.add_argument("--ttt-steps", type=int, default=3,
                   help="training-time test: steps unrolled on the head's own predictions (default 3)")
    g.add_argument("--feature-layers", default=None,
                   help="comma-separated target layers whose inputs the head reads (default: vLLM's 2, L/2, L-3)")


def _add_architecture_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    g.add_argument("--hidden", type=int, default=256,
                   help="hidden size (default 256: the tied 49152x256 embedding is 25 MB in bf16)")
    g.add_argument("--heads", type=int, default=None,
                   help="attention heads (default: the target's, or the most whole KV groups of them whose count "
                   "divides --hidden: 4 heads / 2 KV heads for smollm2-135m at hidden 256)")
    g.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: see --heads)")
    g.add_argument("--head-dim", type=int, default=None, help="head dimension (default: the target's)")
    g.add_argument("--intermediate", type=int, default=1024, help="MLP width (default 1024; 0 = the target's)")
    g.add_argument("--init", choices=["copy", "embed", "random"], default="copy",
                   help="copy: embeddings and a spread of the target's layers (projected when --hidden is "
                   "smaller; default); embed: embeddings only; random: nothing")
    g.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from an existing draft (a Hugging Face folder with this architecture), e.g. to "
                        "fine-tune a shipped draft on new data; --method eagle3: a head (an earlier run's OUT or the "
                        "published layout), trained further with a new schedule")
    g.add_argument("--init-layers", default=None,
                   help="comma-separated target layers to copy (default: evenly spread, first and last included)")
    g.add_argument("--projection", choices=["hidden", "embedding"], default="hidden",
                   help="projection to a smaller hidden size: principal directions of the target's residual "
                   "stream (default) or of its embedding matrix")


def _add_data_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--corpus", action="append", default=None, metavar="PATH",
                   help="text file or folder of .txt/.md/.rst/.py (repeatable; default: the Python standard "
                   "library's sources and pydoc topics)")
    g.add_argument("--seq-len", type=int, default=256, help="tokens per training chunk (default 256)")
    g.add_argument("--max-train-tokens", type=int, default=2_000_000,
                   help="at most this many unique training tokens (teacher-labelled once, reused across epochs; "
                   "default 2M)")
    g.add_argument("--label-fraction", type=float, default=0.5,
                   help="with --minutes: once teacher labelling has taken this fraction of the budget, train "
                   "on the chunks labelled so far only (more epochs instead of more data; default 0.5)")
    g.add_argument("--prose-fraction", type=float, default=0.3,
                   help="share of prose tokens in the data when the corpus has prose and code, as far as the "
                   "prose suffices (default 0.3; -1 keeps the corpus's proportions)")
    g.add_argument("--eval-tokens", type=int, default=16_384, help="held-out tokens (default 16384)")
    g.add_argument("--top-k", type=int, default=32, help="teacher top-k ids/log-probs stored per position (default 32)")
    g.add_argument("--teacher-batch", type=int, default=16, help="chunks per teacher forward (default 16)")
    g.add_argument("--generated-tokens", type=int, default=0,
                   help="on-policy data: this many tokens of the target's own greedy continuations of corpus "
                        "snippets, labelled while they are generated (default 0 = none)")
    g.add_argument("--generate-prompt-len", type=int, default=32,
                   help="tokens of corpus text (or of free sampling) before each greedy continuation (default 32)")
    g.add_argument("--generate-free-fraction", type=float, default=0.25,
                   help="share of continuations whose prompt is sampled from the target itself (T=1) instead of "
                        "taken from the corpus, for general text (default 0.25)")
    g.add_argument("--generate-batch", type=int, default=32, help="continuations generated at once (default 32)")


def _add_training_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--minutes", type=float, default=60.0,
                   help="wall-time budget of the training loop incl. teacher labelling, total over resumed runs "
                   "(default 60; 0 = none)")
    g.add_argument("--max-steps", type=int, default=0, help="stop after this many steps, total (default 0 = none)")
    g.add_argument("--batch-size", type=int, default=8, help="chunks per step (default 8: 2048 tokens)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final LR as a fraction of the peak (default 0.1)")
    g.add_argument("--warmup-steps", type=int, default=50, help="linear warmup steps (default 50)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--embed-lr-scale", type=float, default=None,
                   help="LR multiplier of the (tied) embeddings; 0 freezes them (default 0.1 when projected, "
                   "0 when copied at the target's width, 1 when random)")
    g.add_argument("--temperature", type=float, default=1.0, help="distillation temperature (default 1)")
    g.add_argument("--ce-weight", type=float, default=0.1,
                   help="weight of the cross-entropy term added to the KL (default 0.1)")
    g.add_argument("--ce-target", choices=["teacher", "data"], default="teacher",
                   help="cross-entropy on the teacher's argmax (default) or on the data's next token")
    g.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps (default 200)")
    g.add_argument("--eval-every", type=int, default=250,
                   help="quick held-out evaluation (8k tokens) every N steps (default 250; 0 = only at the end)")
    g.add_argument("--accept-prompts", type=int, default=8,
                   help="held-out prompts for the free-running acceptance estimate (default 8; 0 skips it)")
    g.add_argument("--accept-tokens", type=int, default=64, help="tokens the target generates per prompt (default 64)")
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="k of the acceptance estimate (default 4)")
    g.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="write a draft vocabulary of the N ids the target most often predicts in the training data "
                        "(draft_vocab.json): the draft then drafts over these only and computes N rows of its "
                        "LM head instead of the whole vocabulary (default 0 = the whole vocabulary)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                   help="resume from OUT/checkpoint (default: when it exists); --no-resume starts over")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


@dataclass
class DistillConfig:
    target: str = DEFAULT_TARGET
    out: str = "draft"
    method: str = "draft_model"
    chat_prompts: int = 384
    response_tokens: int = 160
    corpus_tokens: int = 65_536
    ttt_steps: int = 3
    feature_layers: str | None = None
    layers: int = 4
    hidden: int = 256
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    intermediate: int | None = 1024
    init: str = "copy"
    init_layers: str | None = None
    init_from: str | None = None
    projection: str = "hidden"
    corpus: list[str] | None = None
    seq_len: int = 256
    max_train_tokens: int = 2_000_000
    eval_tokens: int = 16_384
    prose_fraction: float = 0.3
    label_fraction: float = 0.5
    top_k: int = 32
    teacher_batch: int = 16
    generated_tokens: int = 0
    generate_prompt_len: int = 32
    generate_free_fraction: float = 0.25
    generate_batch: int = 32
    draft_vocab: int = 0
    minutes: float = 60.0
    max_steps: int = 0
    batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    embed_lr_scale: float | None = None
    temperature: float = 1.0
    ce_weight: float = 0.1
    ce_target: str = "teacher"
    save_every: int = 200
    eval_every: int = 250
    accept_prompts: int = 8
    accept_tokens: int = 64
    num_speculative_tokens: int = 4
    seed: int = 0
    threads: int | None = None
    resume: bool | None = None
    no_progress: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DistillConfig":
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def validate(self) -> None:
        for name in ("layers", "hidden", "seq_len", "batch_size", "top_k", "teacher_batch", "save_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.seq_len < 2:
            raise ConfigError("--seq-len must be >= 2")
        if self.minutes <= 0 and self.max_steps <= 0:
            raise ConfigError("give --minutes or --max-steps (both are 0: training would never stop)")
        if self.temperature <= 0:
            raise ConfigError("--temperature must be > 0")
        if self.generated_tokens < 0:
            raise ConfigError("--generated-tokens must be >= 0")
        if self.generated_tokens and not 1 <= self.generate_prompt_len < self.seq_len:
            raise ConfigError(f"--generate-prompt-len must be between 1 and --seq-len - 1 ({self.seq_len - 1})")
        if not 0 <= self.generate_free_fraction <= 1:
            raise ConfigError("--generate-free-fraction must be between 0 and 1")
        if self.generate_batch < 1:
            raise ConfigError("--generate-batch must be >= 1")
        if self.method == "eagle3":
            for name in ("response_tokens", "ttt_steps"):
                if getattr(self, name) < 1:
                    raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
            if self.chat_prompts < 0 or self.corpus_tokens < 0 or self.chat_prompts + self.corpus_tokens == 0:
                raise ConfigError("--chat-prompts and --corpus-tokens must be >= 0, and one of them > 0")
        if self.draft_vocab < 0:
            raise ConfigError("--draft-vocab must be >= 0 (0 = the whole vocabulary)")


def command_line(cfg: DistillConfig) -> str:
    """The ``specdec distill`` command equivalent to ``cfg`` (options that differ from the defaults)."""
    default = DistillConfig()
    parts = ["specdec", "distill", "--target", cfg.target, "--out", cfg.out]
    for name in DistillConfig.__dataclass_fields__:
        value, dflt = getattr(cfg, name), getattr(default, name)
        if name in ("target", "out", "resume", "no_progress") or value == dflt:
            continue
        flag = "--" + name.replace("_", "-")
        if name == "corpus":
            for c in value or []:
                parts += [flag, str(c)]
        elif value is None:
            continue
        else:
            parts += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return " ".join(shlex.quote(p) for p in parts)

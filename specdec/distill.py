"""``specdec distill``: train a small draft model for a target by knowledge distillation.

The draft shares the target's tokenizer (it is saved next to the weights), so it drafts for the target
without any vocabulary mapping. Pipeline:

1. **Corpus.** By default, text that ships with the Python interpreter, so it works offline: prose
   (``pydoc_data/topics.py``, the language/library reference topics of ``help()``, plus the ``.txt``
   files and IDLE's ``help.html`` of the standard library) and code (the standard library's ``.py``
   sources, test suites and codec tables left out). ``--corpus PATH`` (a file or a folder of
   .txt/.md/.rst/.py, repeatable) replaces it. Documents are tokenized with the target's tokenizer,
   joined with a separator token and cut into fixed-length chunks; whole documents are held out for
   evaluation. Cached under ``OUT/cache``.
2. **Teacher signal.** The target's top-k log-probabilities (ids + values, bf16 on disk) for every
   position of a chunk, computed once by batched bf16-autocast inference and stored in shards under
   ``OUT/cache``. Training shards are labelled lazily, the first time training reaches them, so a
   time-budgeted run labels only what it uses; later epochs and resumed runs reuse the shards.
3. **Draft.** The target's model class and config with fewer layers / a smaller hidden size. With the
   target's hidden size, the draft copies the target's embeddings (tied lm_head) and a spread of the
   target's layers (e.g. 0, 10, 20, 29) and its final norm. With a smaller hidden size ``H`` everything
   is copied through a projection ``P`` (target hidden x H, orthonormal columns): the top-H principal
   directions of the target's residual stream (``--projection hidden``, default; or of its embedding
   matrix, ``--projection embedding``). Embedding = ``E @ P`` (tied lm_head), each copied layer's
   input matrices = ``W diag(g) P`` (the RMSNorm gain ``g`` folded in, the norm reset to ones, rescaled
   for the RMS over H instead of the full width), its output matrices = ``P^T W``; kept MLP neurons
   are the target's most important ones when ``--intermediate`` is smaller, kept heads the first of
   each kept KV group. Before training such a draft agrees with the target no more than a random one
   (skipping 26 of 30 layers breaks the target's computation), but it learns several times faster:
   in a 2-minute trial (46 steps) 13.9% held-out agreement against 4.4% from random layers.
4. **Training.** Forward KL from the teacher's renormalised top-k distribution to the draft's full
   softmax (plus ``--ce-weight`` x cross-entropy on the teacher's argmax or the data), computed by a
   fused, chunked lm_head + loss so the (tokens x vocab) logits are never materialised. bf16 autocast,
   AdamW, linear warmup then cosine decay over the run's progress (the larger of steps/--max-steps and
   time/--minutes), gradient clipping. The teacher costs several times more per token than a draft
   step, so once labelling has used ``--label-fraction`` of ``--minutes`` the run stops labelling and
   trains more epochs over the labelled chunks. The embeddings (tied with the lm_head) train at
   ``--embed-lr-scale`` times the learning rate (0 freezes them; default 0.1 when projected, 0 when
   copied unchanged at the target's width).
5. **Checkpoints** every ``--save-every`` steps in ``OUT/checkpoint`` (model, optimizer, step, data
   position, RNG, elapsed time); running the same command again resumes. ``--minutes`` and
   ``--max-steps`` are totals over resumed runs.
6. **Evaluation and export.** Held-out teacher-forced top-1 agreement with the target (periodically and
   at the end, on the exported bf16 weights), a free-running greedy acceptance estimate (the target
   generates; the fraction of the draft's greedy guesses it would accept and the tokens per target
   step for ``k`` speculative tokens), then a Hugging Face folder in ``OUT``: config.json,
   model.safetensors (bf16), the target's tokenizer files, generation_config.json, README.md (model
   card) and distill.json. ``OUT/cache`` and ``OUT/checkpoint`` are work files (listed in
   ``OUT/.gitignore``); ship the rest.

Defaults, for ``smollm2-135m`` (30 layers, hidden 576, vocab 49152) on 2 CPU cores: 4 layers, hidden
256, 4 heads / 2 KV heads of dim 64, MLP 1024 -> 16.5M parameters, of which 12.6M are the tied
49152x256 embedding; model.safetensors is 33 MB in bf16 (hidden 576 would need 56 MB for the embedding
alone). The vocabulary projection dominates both the training cost (the lm_head and its softmax are
~70% of a step) and the drafting cost, so width is kept small and depth cheap. Measured on a shared
2-core AVX512-bf16 machine, 1 thread: a step of 8 x 256 tokens takes ~2.4 s (~850 training tokens/s);
teacher labelling runs at ~250-290 tokens/s. With --minutes 60 and both cores, about half the budget
labels ~1M tokens and the rest adds epochs over them.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import inspect
import json
import logging
import math
import os
import random
import re
import shlex
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m"
CHECKPOINT_DIR = "checkpoint"
CACHE_DIR = "cache"
SHARD_TOKENS = 16384  # teacher labels are stored and computed in shards of about this many tokens
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings"}


# --------------------------------------------------------------------------------------------------
# Command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    p.add_argument("--out", required=True, help="output folder (the draft; work files in OUT/cache, OUT/checkpoint)")
    g = p.add_argument_group("draft architecture (the target's model class)")
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
                        "fine-tune a shipped draft on new data")
    g.add_argument("--init-layers", default=None,
                   help="comma-separated target layers to copy (default: evenly spread, first and last included)")
    g.add_argument("--projection", choices=["hidden", "embedding"], default="hidden",
                   help="projection to a smaller hidden size: principal directions of the target's residual "
                   "stream (default) or of its embedding matrix")
    g = p.add_argument_group("data")
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
    g = p.add_argument_group("training")
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
        if self.draft_vocab < 0:
            raise ConfigError("--draft-vocab must be >= 0 (0 = the whole vocabulary)")


# --------------------------------------------------------------------------------------------------
# Corpus


@dataclass
class Document:
    name: str
    kind: str  # "prose" or "code"
    text: str


def _html_to_text(source: str) -> str:
    from html.parser import HTMLParser

    parts: list[str] = []

    class P(HTMLParser):
        skip = 0

        def handle_starttag(self, tag, attrs):
            if tag in ("script", "style"):
                self.skip += 1
            elif tag in ("p", "div", "br", "li", "h1", "h2", "h3", "h4", "pre", "dt", "dd", "tr"):
                parts.append("\n")

        def handle_endtag(self, tag):
            if tag in ("script", "style"):
                self.skip = max(0, self.skip - 1)

        def handle_data(self, data):
            if not self.skip:
                parts.append(data)

    P().feed(source)
    text = "".join(parts)
    return re.sub(r"\n\s*\n(\s*\n)+", "\n\n", text).strip()


def default_corpus() -> tuple[list[Document], str]:
    """Text shipped with the Python interpreter: pydoc topics and .txt files (prose), stdlib .py (code)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs: list[Document] = []
    topics_file = stdlib / "pydoc_data" / "topics.py"
    if topics_file.exists():
        tree = ast.parse(topics_file.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                topics = ast.literal_eval(node.value)
                for key, text in sorted(topics.items()):
                    if isinstance(text, str) and text.strip():
                        docs.append(Document(f"pydoc_data/topics.py:{key}", "prose", text))
    help_html = stdlib / "idlelib" / "help.html"
    if help_html.exists():
        docs.append(Document("idlelib/help.html", "prose", _html_to_text(help_html.read_text(encoding="utf-8", errors="replace"))))
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        for fname in sorted(files):
            path = Path(root) / fname
            if fname.endswith(".txt"):
                kind = "prose"
            elif fname.endswith(".py") and path != topics_file:
                kind = "code"
            else:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                docs.append(Document(str(path.relative_to(stdlib)), kind, text))
    desc = (f"the Python {sys.version.split()[0]} standard library shipped with the interpreter: prose = "
            "pydoc_data/topics.py (help() topics), idlelib/help.html and the stdlib .txt files; code = the "
            "stdlib .py sources (test suites, codec tables and site-packages excluded)")
    return docs, desc


def corpus_from_paths(paths: list[str]) -> tuple[list[Document], str]:
    docs: list[Document] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        else:
            raise ConfigError(f"--corpus {raw}: no such file or folder")
        for f in files:
            try:
                text = f.read_text(encoding="utf-8", errors="replace")
            except OSError as exc:
                raise ConfigError(f"--corpus: cannot read {f}: {exc}") from None
            if text.strip():
                docs.append(Document(str(f), "code" if f.suffix.lower() == ".py" else "prose", text))
    if not docs:
        raise ConfigError(f"--corpus {' '.join(paths)}: no non-empty .txt/.md/.rst/.py files")
    return docs, "user corpus: " + ", ".join(paths)


def _separator_id(tokenizer: Any) -> int | None:
    vocab = tokenizer.get_vocab()
    for tok in ("<|endoftext|>", "</s>", "<eos>"):
        if tok in vocab:
            return int(vocab[tok])
    return tokenizer.eos_token_id


def _chunk(stream: list[int], seq_len: int) -> torch.Tensor:
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.int32).view(n, seq_len)


def build_dataset(tokenizer: Any, docs: list[Document], seq_len: int, max_train_tokens: int, eval_tokens: int,
                  seed: int, prose_fraction: float | None = None) -> dict[str, Any]:
    """Tokenize documents into fixed-length chunks: shuffled training chunks and held-out evaluation chunks
    made of whole documents, with a kind per eval chunk. ``prose_fraction`` (when both kinds exist) is the
    wanted share of prose tokens in both splits, limited by the prose available; otherwise the corpus's
    own proportions are kept."""
    rng = random.Random(seed)
    sep = _separator_id(tokenizer)
    by_kind: dict[str, list[Document]] = {}
    for d in docs:
        by_kind.setdefault(d.kind, []).append(d)
    chars = {k: sum(len(d.text) for d in v) for k, v in by_kind.items()}
    total_chars = sum(chars.values()) or 1
    share = {k: c / total_chars for k, c in chars.items()}
    if prose_fraction is not None and set(by_kind) == {"prose", "code"}:
        share = {"prose": prose_fraction, "code": 1.0 - prose_fraction}
    # Read only about as much text as the budgets need (generous 6 chars per token bound).
    budget_chars = (max_train_tokens + eval_tokens) * 6
    tokens: dict[str, list[list[int]]] = {}
    for kind in sorted(by_kind):
        kdocs = by_kind[kind]
        rng.shuffle(kdocs)
        picked, n_chars = [], 0
        for d in kdocs:
            if n_chars >= budget_chars * share[kind] + 1:
                break
            picked.append(d)
            n_chars += len(d.text)
        ids_list: list[list[int]] = []
        for i in range(0, len(picked), 64):
            ids_list.extend(tokenizer([d.text for d in picked[i: i + 64]], add_special_tokens=False)["input_ids"])
        tokens[kind] = [ids + ([sep] if sep is not None else []) for ids in ids_list if ids]
    avail = {k: sum(map(len, v)) for k, v in tokens.items()}
    total_avail = sum(avail.values()) or 1
    # Shares achievable: a kind with too little text gives up its surplus share to the others.
    want_total = min(total_avail, max_train_tokens + eval_tokens)
    want = {k: share[k] * want_total for k in tokens}
    short = {k for k in tokens if avail[k] < want[k]}
    if short and len(short) < len(tokens):
        spare = sum(want[k] - avail[k] for k in short)
        rest = [k for k in tokens if k not in short]
        rest_share = sum(share[k] for k in rest)
        for k in short:
            want[k] = avail[k]
        for k in rest:
            want[k] += spare * share[k] / rest_share
    train_by_kind: dict[str, torch.Tensor] = {}
    eval_chunks: list[torch.Tensor] = []
    eval_kinds: list[str] = []
    counts: dict[str, dict[str, int]] = {}
    for kind in sorted(tokens):
        ids_list = tokens[kind]
        # Held out in the wanted shares, at most a quarter of a kind's text.
        want_eval = min(int(round(eval_tokens * share[kind] / sum(share[k] for k in tokens))), avail[kind] // 4)
        want_train = int(want[kind]) - want_eval
        eval_stream: list[int] = []
        stream: list[int] = []
        for ids in ids_list:
            if len(eval_stream) < want_eval and len(ids_list) > 1:
                eval_stream.extend(ids[: max(seq_len, want_eval - len(eval_stream) + seq_len)])
            elif len(stream) < want_train:
                stream.extend(ids)
        stream = stream[: max(want_train, 0)]
        ec = _chunk(eval_stream, seq_len) if eval_stream else torch.empty(0, seq_len, dtype=torch.int32)
        ec = ec[: max(1, math.ceil(want_eval / seq_len))] if want_eval else ec[:0]
        eval_chunks.append(ec)
        eval_kinds.extend([kind] * len(ec))
        counts[kind] = {"documents": len(ids_list), "train_tokens": len(stream) // seq_len * seq_len,
                        "eval_tokens": int(ec.numel())}
        chunks = _chunk(stream, seq_len)
        gen = torch.Generator().manual_seed(seed + len(train_by_kind))
        train_by_kind[kind] = chunks[torch.randperm(len(chunks), generator=gen)]
    # Training order (epoch 0, and the order in which a time-limited run labels chunks): each next chunk
    # is of a kind drawn with the kind's share while it lasts, so a scarce kind (prose in the default
    # corpus) keeps its share at the front of the stream instead of being spread thin over all of it.
    left = {k: list(range(len(v))) for k, v in train_by_kind.items() if len(v)}
    weight = {k: max(share.get(k, 0.0), 1e-9) for k in left}
    picked: list[torch.Tensor] = []
    train_kinds: list[str] = []
    while left:
        kinds = sorted(left)
        kind = rng.choices(kinds, weights=[weight[k] for k in kinds])[0]
        picked.append(train_by_kind[kind][left[kind].pop()])
        train_kinds.append(kind)
        if not left[kind]:
            del left[kind]
    n_train = max(1, max_train_tokens // seq_len)
    train = torch.stack(picked[:n_train]) if picked else torch.empty(0, seq_len, dtype=torch.int32)
    train_kinds = train_kinds[:n_train]
    for kind in counts:
        counts[kind]["train_tokens"] = train_kinds.count(kind) * seq_len
    eval_ = torch.cat(eval_chunks) if eval_chunks else torch.empty(0, seq_len, dtype=torch.int32)
    if len(train) == 0 or len(eval_) == 0:
        raise ConfigError(
            f"corpus too small for --seq-len {seq_len}: {len(train)} training and {len(eval_)} held-out chunks"
        )
    return {"train": train, "eval": eval_, "eval_kinds": eval_kinds, "train_kinds": train_kinds, "counts": counts}


@dataclass
class Dataset:
    key: str
    folder: Path
    train: torch.Tensor  # (N, T) int32
    eval: torch.Tensor  # (M, T) int32
    eval_kinds: list[str]
    meta: dict[str, Any]


def prepare_data(cfg: DistillConfig, tokenizer: Any, fingerprint: str, out: Path) -> Dataset:
    from safetensors.torch import load_file, save_file

    spec = {
        "corpus": [str(Path(c).expanduser().resolve()) for c in cfg.corpus] if cfg.corpus else "default",
        "seq_len": cfg.seq_len, "max_train_tokens": cfg.max_train_tokens, "eval_tokens": cfg.eval_tokens,
        "seed": cfg.seed, "prose_fraction": cfg.prose_fraction, "tokenizer": fingerprint, "version": 2,
    }
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    folder = out / CACHE_DIR / f"data-{key}"
    meta_file = folder / "meta.json"
    if meta_file.exists() and (folder / "tokens.safetensors").exists():
        meta = json.loads(meta_file.read_text())
        t = load_file(folder / "tokens.safetensors")
        logger.info("reusing tokenized corpus %s", folder)
        return Dataset(key, folder, t["train"], t["eval"], meta["eval_kinds"], meta)
    t0 = time.perf_counter()
    docs, desc = corpus_from_paths(cfg.corpus) if cfg.corpus else default_corpus()
    logger.info("tokenizing %d documents (%s)", len(docs), desc)
    data = build_dataset(tokenizer, docs, cfg.seq_len, cfg.max_train_tokens, cfg.eval_tokens, cfg.seed,
                         cfg.prose_fraction if cfg.prose_fraction >= 0 else None)
    meta = {
        "spec": spec, "description": desc, "documents": len(docs), "counts": data["counts"],
        "train_chunks": len(data["train"]), "eval_chunks": len(data["eval"]), "seq_len": cfg.seq_len,
        "train_tokens": int(data["train"].numel()), "eval_tokens": int(data["eval"].numel()),
        "eval_kinds": data["eval_kinds"], "train_kinds": data["train_kinds"],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"train": data["train"].contiguous(), "eval": data["eval"].contiguous()}, folder / "tokens.safetensors")
    meta_file.write_text(json.dumps(meta, indent=1))
    logger.info("corpus: %d train chunks, %d eval chunks of %d tokens (%.1f s)",
                meta["train_chunks"], meta["eval_chunks"], cfg.seq_len, meta["seconds"])
    return Dataset(key, folder, data["train"], data["eval"], data["eval_kinds"], meta)


# --------------------------------------------------------------------------------------------------
# Teacher signal


def _final_softcap(config: Any) -> float | None:
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def _body(model: Any) -> Any:
    """The decoder stack (``model.model`` for *ForCausalLM)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


@torch.no_grad()
def teacher_topk(teacher: Any, input_ids: torch.Tensor, k: int, rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k next-token log-probabilities of every position: ids (B,T,k) int64, log-probs (B,T,k) fp32."""
    cap = _final_softcap(teacher.config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = _body(teacher)(input_ids=input_ids.long()).last_hidden_state
    b, t, h = hidden.shape
    hidden = hidden.reshape(b * t, h).to(torch.bfloat16)
    w = teacher.get_output_embeddings().weight.to(torch.bfloat16)
    out_ids, out_lp = [], []
    for s in range(0, b * t, rows):
        z = (hidden[s: s + rows] @ w.T).float()
        if cap:
            z = torch.tanh(z / cap) * cap
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        vals, idx = torch.topk(z, k, dim=-1, sorted=True)
        out_ids.append(idx)
        out_lp.append(vals - lse)
    return torch.cat(out_ids).view(b, t, k), torch.cat(out_lp).view(b, t, k)


class TeacherCache:
    """Teacher top-k labels stored as safetensors shards of ``shard_size`` chunks, labelled on demand."""

    def __init__(self, folder: Path, k: int, vocab: int, shard_size: int):
        self.folder = folder
        self.k = k
        self.shard_size = shard_size
        self.offset = 32768 if vocab <= 65536 else 0  # ids stored as int16 (id - 32768) when they fit
        self.id_dtype = torch.int16 if self.offset else torch.int32
        self._loaded: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        folder.mkdir(parents=True, exist_ok=True)

    def _path(self, split: str, shard: int) -> Path:
        return self.folder / f"{split}-{shard:05d}.safetensors"

    def has(self, split: str, shard: int) -> bool:
        return (split, shard) in self._loaded or self._path(split, shard).exists()

    def label(self, split: str, shard: int, chunks: torch.Tensor, teacher: Any, batch: int,
              bar: Any = None) -> None:
        from safetensors.torch import save_file

        lo = shard * self.shard_size
        part = chunks[lo: lo + self.shard_size]
        ids_all, lp_all = [], []
        for s in range(0, len(part), batch):
            ids, lp = teacher_topk(teacher, part[s: s + batch], self.k)
            ids_all.append((ids - self.offset).to(self.id_dtype))
            lp_all.append(lp.to(torch.bfloat16))
            if bar is not None:
                bar.update(int(part[s: s + batch].numel()))
        tensors = {"ids": torch.cat(ids_all).contiguous(), "logp": torch.cat(lp_all).contiguous()}
        tmp = self._path(split, shard).with_suffix(".tmp")
        save_file(tensors, tmp)
        os.replace(tmp, self._path(split, shard))
        self._loaded[(split, shard)] = tensors

    def _shard(self, split: str, shard: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        key = (split, shard)
        if key not in self._loaded:
            self._loaded[key] = load_file(self._path(split, shard))
        return self._loaded[key]

    def get(self, split: str, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (n,T,k) int64 and log-probs (n,T,k) fp32 of the given chunk indices (all labelled)."""
        ids, lps = [], []
        for i in indices.tolist():
            sh = self._shard(split, i // self.shard_size)
            j = i % self.shard_size
            ids.append(sh["ids"][j].long() + self.offset)
            lps.append(sh["logp"][j].float())
        return torch.stack(ids), torch.stack(lps)


# --------------------------------------------------------------------------------------------------
# On-policy data: the target's own continuations


@torch.no_grad()
def generate_onpolicy(model: Any, prompts: torch.Tensor, seq_len: int, k: int, sample_until: int,
                      generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target continues ``prompts`` (B,P) to ``seq_len`` tokens in one batched KV-cache loop, greedily
    from position ``sample_until`` on (tokens before it are sampled at T=1). The top-k next-token
    log-probabilities of every position come from the same forward passes, so the chunk is labelled as it
    is generated. Returns tokens (B,T) int32, top-k ids (B,T,k) int64, log-probs (B,T,k) fp32."""
    from transformers import DynamicCache

    b, p = prompts.shape
    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    cache = DynamicCache(config=model.config)
    tokens = torch.empty(b, seq_len, dtype=torch.long)
    tokens[:, :p] = prompts
    ids = torch.empty(b, seq_len, k, dtype=torch.long)
    lps = torch.empty(b, seq_len, k, dtype=torch.float32)
    pos, inp = 0, prompts.long()
    while True:
        n = inp.shape[1]
        out = model(input_ids=inp, position_ids=torch.arange(pos, pos + n).expand(b, n), use_cache=True,
                    **{cache_kw: cache})
        logp = torch.log_softmax(out.logits.float(), dim=-1)  # the model's forward applies any softcap
        v, i = torch.topk(logp, k, dim=-1, sorted=True)
        ids[:, pos: pos + n], lps[:, pos: pos + n] = i, v
        pos += n
        if pos >= seq_len:
            break
        last = logp[:, -1]
        if pos < sample_until:
            nxt = torch.multinomial(last.exp(), 1, generator=generator)
        else:
            nxt = last.argmax(-1, keepdim=True)
        tokens[:, pos] = nxt[:, 0]
        inp = nxt
    return tokens.to(torch.int32), ids, lps


class GeneratedData:
    """On-policy chunks (tokens + teacher labels in the same file), stored in shards like TeacherCache.

    Training prompts are windows of the training chunks, held-out ones windows of the held-out chunks,
    so the held-out continuations start from text the draft never trains on. A ``free_fraction`` of the
    rows instead start from the separator token and let the target sample its own first tokens (T=1),
    which covers general text that the corpus lacks. Each row is fully determined by the seed and its
    index, so an interrupted generation resumes shard by shard."""

    def __init__(self, folder: Path, cfg: "DistillConfig", data: "Dataset", sep_id: int | None, shard_size: int):
        self.cfg = cfg
        self.data = data
        self.sep_id = sep_id
        self.n = {"train": cfg.generated_tokens // cfg.seq_len,
                  "eval": min(16, max(4, cfg.generated_tokens // cfg.seq_len // 20)) if cfg.generated_tokens else 0}
        self.labels = TeacherCache(folder, cfg.top_k, 1 << 20, shard_size)  # int32 ids: generic vocab
        self.shard_size = shard_size

    def shards(self, split: str) -> int:
        return math.ceil(self.n[split] / self.shard_size)

    def _row_prompt(self, split: str, row: int) -> tuple[torch.Tensor, bool]:
        cfg = self.cfg
        rng = random.Random(f"{cfg.seed}:{split}:{row}")
        free = self.sep_id is not None and rng.random() < cfg.generate_free_fraction
        if free:
            return torch.tensor([self.sep_id]), True
        src = self.data.train if split == "train" else self.data.eval
        chunk = src[rng.randrange(len(src))]
        start = rng.randrange(0, cfg.seq_len - cfg.generate_prompt_len + 1)
        return chunk[start: start + cfg.generate_prompt_len].long(), False

    def generate(self, model: Any, split: str, shard: int, bar: Any = None) -> None:
        from safetensors.torch import save_file

        cfg = self.cfg
        rows = range(shard * self.shard_size, min(self.n[split], (shard + 1) * self.shard_size))
        prompts = [self._row_prompt(split, r) for r in rows]
        out_tok = torch.empty(len(rows), cfg.seq_len, dtype=torch.int32)
        out_ids = torch.empty(len(rows), cfg.seq_len, cfg.top_k, dtype=torch.int32)
        out_lp = torch.empty(len(rows), cfg.seq_len, cfg.top_k, dtype=torch.bfloat16)
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + shard + (1 << 20) * (split == "eval"))
        for free in (False, True):  # equal prompt lengths within a batch: no padding
            members = [j for j, (_, f) in enumerate(prompts) if f == free]
            for s in range(0, len(members), cfg.generate_batch):
                batch = members[s: s + cfg.generate_batch]
                x = torch.stack([prompts[j][0] for j in batch])
                tok, ids, lp = generate_onpolicy(model, x, cfg.seq_len, cfg.top_k, cfg.generate_prompt_len, gen)
                out_tok[batch], out_ids[batch], out_lp[batch] = tok, ids.to(torch.int32), lp.to(torch.bfloat16)
                if bar is not None:
                    bar.update(len(batch) * cfg.seq_len)
        self.labels.folder.mkdir(parents=True, exist_ok=True)
        path = self.labels._path(split, shard)
        tmp = path.with_suffix(".tmp")
        save_file({"tokens": out_tok, "ids": out_ids, "logp": out_lp}, tmp)
        os.replace(tmp, path)

    def tokens(self, split: str, indices: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.labels._shard(split, i // self.shard_size)["tokens"][i % self.shard_size]
                            for i in indices.tolist()])

    def get(self, split: str, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens (n,T), teacher ids (n,T,k) and log-probs (n,T,k) of on-policy chunks."""
        ids, lp = self.labels.get(split, indices)
        return self.tokens(split, indices), ids, lp


# --------------------------------------------------------------------------------------------------
# Draft construction


def make_draft_config(target_config: Any, cfg: DistillConfig) -> Any:
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    dc = copy.deepcopy(tc)
    t_heads = tc.num_attention_heads
    t_kv = getattr(tc, "num_key_value_heads", None) or t_heads
    t_head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // t_heads
    if cfg.heads:
        heads = cfg.heads
        kv = cfg.kv_heads or math.gcd(heads, t_kv)
    else:  # the target's layout, or the largest cut of it (whole KV groups) whose head count divides --hidden
        t_group = t_heads // t_kv
        options = [(g * k, k) for k in range(1, t_kv + 1) for g in range(1, t_group + 1)
                   if cfg.hidden % (g * k) == 0 and (not cfg.kv_heads or k == cfg.kv_heads)]
        if not options:
            raise ConfigError(f"no head layout cut from the target's fits --hidden {cfg.hidden}; give --heads")
        heads, kv = max(options)
    if heads % kv:
        raise ConfigError(f"--heads {heads} must be a multiple of --kv-heads {kv}")
    if cfg.hidden % heads:
        raise ConfigError(f"--hidden {cfg.hidden} must be a multiple of the number of heads ({heads})")
    dc.num_hidden_layers = cfg.layers
    dc.hidden_size = cfg.hidden
    dc.num_attention_heads = heads
    dc.num_key_value_heads = kv
    dc.head_dim = cfg.head_dim or t_head_dim
    dc.intermediate_size = cfg.intermediate or tc.intermediate_size
    dc.tie_word_embeddings = True
    dc.use_cache = True
    if isinstance(getattr(dc, "layer_types", None), list):
        idx = _spread(tc.num_hidden_layers, cfg.layers)
        dc.layer_types = [tc.layer_types[i] for i in idx]
    for attr in ("_name_or_path", "_model_name_or_path"):
        if hasattr(dc, attr):
            try:
                delattr(dc, attr)
            except AttributeError:
                pass
    dc.dtype = "bfloat16"
    try:
        if hasattr(dc, "validate"):
            dc.validate()
    except Exception as exc:  # transformers' own checks, e.g. hidden size vs heads
        raise ConfigError(f"invalid draft architecture: {exc}") from None
    return dc


def _spread(n_target: int, n: int) -> list[int]:
    if n == 1:
        return [n_target - 1]
    return [round(i * (n_target - 1) / (n - 1)) for i in range(n)]


def _llama_like(model: Any) -> bool:
    layer = _body(model).layers[0]
    names = {n for n, _ in layer.named_parameters()}
    allowed = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
               "input_layernorm.weight", "post_attention_layernorm.weight",
               "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
    return names <= allowed and type(_body(model).norm).__name__.endswith("RMSNorm") and \
        not type(_body(model).norm).__name__.startswith("Gemma")


@torch.no_grad()
def residual_projection(teacher: Any, sample: torch.Tensor, hidden: int, kind: str) -> torch.Tensor:
    """(target hidden, hidden) orthonormal columns: the top principal directions of the target's
    residual stream (unit-normalised states of every layer on ``sample``) or of its embedding matrix."""
    emb = teacher.get_input_embeddings().weight.float()
    if kind == "embedding":
        _, _, vh = torch.linalg.svd(emb, full_matrices=False)
        return vh[:hidden].T.contiguous()
    d = emb.shape[1]
    cov = torch.zeros(d, d, dtype=torch.float64)
    for s in range(0, len(sample), 4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = _body(teacher)(input_ids=sample[s: s + 4].long(), output_hidden_states=True)
        for hs in out.hidden_states:
            x = hs.float().reshape(-1, d)
            x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)
            cov += (x.T @ x).double()
    evals, evecs = torch.linalg.eigh(cov)
    return evecs[:, torch.argsort(evals, descending=True)[:hidden]].float().contiguous()


def load_draft_weights(draft: Any, folder: str) -> dict[str, Any]:
    """Start from an existing draft's weights (``--init-from``); its architecture must match."""
    from safetensors.torch import load_file

    path = Path(folder).expanduser()
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise ConfigError(f"--init-from {folder}: no *.safetensors weights in that folder")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    own = draft.state_dict()
    wrong = [f"{k}: {tuple(v.shape)} here, {tuple(own[k].shape)} wanted" for k, v in weights.items()
             if k in own and v.shape != own[k].shape]
    unknown = sorted(set(weights) - set(own))
    missing = sorted(set(own) - set(weights) - {"lm_head.weight"})  # the lm_head is tied to the embeddings
    if wrong or unknown or missing:
        raise ConfigError(
            f"--init-from {folder} does not fit the draft architecture of this command (give the same --layers, "
            f"--hidden, --heads, --intermediate as it was made with): "
            + "; ".join(wrong[:3] + [f"unexpected {k}" for k in unknown[:3]] + [f"missing {k}" for k in missing[:3]])
        )
    draft.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    draft.tie_weights()
    return {"text": f"the weights of the existing draft {folder} (--init-from)"}


@torch.no_grad()
def init_draft(teacher: Any, draft: Any, cfg: DistillConfig, sample: torch.Tensor) -> dict[str, Any]:
    """Initialise ``draft`` from ``teacher`` in place; returns a description for the model card."""
    tc, dc = teacher.config.get_text_config(), draft.config
    info: dict[str, Any] = {"method": cfg.init}
    if cfg.init == "random":
        info["text"] = "random initialisation (the target's initializer_range)"
        return info
    same_width = dc.hidden_size == tc.hidden_size
    t_emb = teacher.get_input_embeddings().weight.float()
    if same_width:
        P = None
        draft.get_input_embeddings().weight.copy_(t_emb)
        emb_text = "embeddings (tied lm_head) copied from the target"
    else:
        if dc.hidden_size > tc.hidden_size:
            raise ConfigError(f"--hidden {dc.hidden_size} exceeds the target's hidden size {tc.hidden_size}")
        P = residual_projection(teacher, sample, dc.hidden_size, cfg.projection)
        draft.get_input_embeddings().weight.copy_(t_emb @ P)
        src = ("principal directions of the target's residual stream" if cfg.projection == "hidden"
               else "right singular vectors of the target's embedding matrix")
        emb_text = f"embeddings (tied lm_head) = target embeddings projected to {dc.hidden_size} dims ({src})"
    info["embeddings"] = emb_text
    if cfg.init == "embed":
        info["text"] = emb_text + "; layers random"
        return info
    if cfg.init_layers:
        try:
            layer_ids = [int(x) for x in cfg.init_layers.split(",")]
        except ValueError:
            raise ConfigError(f"--init-layers {cfg.init_layers!r}: comma-separated integers expected") from None
        if len(layer_ids) != dc.num_hidden_layers or not all(0 <= i < tc.num_hidden_layers for i in layer_ids):
            raise ConfigError(f"--init-layers needs {dc.num_hidden_layers} indices in [0, {tc.num_hidden_layers})")
    else:
        layer_ids = _spread(tc.num_hidden_layers, dc.num_hidden_layers)
    info["layers"] = layer_ids
    t_layers, d_layers = _body(teacher).layers, _body(draft).layers
    t_norm, d_norm = _body(teacher).norm, _body(draft).norm
    exact = same_width and all(
        getattr(dc, a, None) == getattr(tc, a, None)
        for a in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
    )
    if exact:
        for di, ti in enumerate(layer_ids):
            d_layers[di].load_state_dict(t_layers[ti].state_dict())
        d_norm.load_state_dict(t_norm.state_dict())
        info["text"] = f"{emb_text}; layers = target layers {layer_ids} (copied); final norm copied"
        return info
    if not _llama_like(teacher):
        info["text"] = f"{emb_text}; layers random (projected layer copy supports Llama-style layers only)"
        logger.warning("projected layer copy needs Llama-style layers; the draft's layers start random")
        return info
    # Projected / pruned copy. Width scale c: the RMS over H dims of x P is ~ sqrt(D/H) x the RMS over D.
    D, H = tc.hidden_size, dc.hidden_size
    Pm = P if P is not None else torch.eye(D)
    c = math.sqrt(D / H) if P is not None else 1.0
    t_heads, t_kv, hd = tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim
    d_heads, d_kv = dc.num_attention_heads, dc.num_key_value_heads
    if dc.head_dim != hd or d_kv > t_kv or d_heads // d_kv > t_heads // t_kv:
        info["text"] = f"{emb_text}; layers random (attention shape incompatible with the target's)"
        logger.warning("draft attention (%d heads / %d kv / dim %d) cannot be cut from the target's "
                       "(%d / %d / %d); layers start random", d_heads, d_kv, dc.head_dim, t_heads, t_kv, hd)
        return info
    t_group, d_group = t_heads // t_kv, d_heads // d_kv
    q_heads = [g * t_group + j for g in range(d_kv) for j in range(d_group)]
    q_rows = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in q_heads])
    kv_rows = torch.cat([torch.arange(g * hd, (g + 1) * hd) for g in range(d_kv)])
    I = dc.intermediate_size
    if I > tc.intermediate_size:
        raise ConfigError(f"--intermediate {I} exceeds the target's {tc.intermediate_size} (use --init embed)")

    def inp(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:  # reads the normalised residual
        return (w.float() * g.float()[None, :]) @ Pm * c if P is not None else w.float()

    def outp(w: torch.Tensor) -> torch.Tensor:  # writes the residual
        return Pm.T @ w.float() if P is not None else w.float()

    for di, ti in enumerate(layer_ids):
        tl, dl = t_layers[ti], d_layers[di]
        g1, g2 = tl.input_layernorm.weight, tl.post_attention_layernorm.weight
        a, da = tl.self_attn, dl.self_attn
        da.q_proj.weight.copy_(inp(a.q_proj.weight[q_rows], g1))
        da.k_proj.weight.copy_(inp(a.k_proj.weight[kv_rows], g1))
        da.v_proj.weight.copy_(inp(a.v_proj.weight[kv_rows], g1))
        for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            tb, db = getattr(a, name).bias, getattr(da, name).bias
            if tb is not None and db is not None:
                db.copy_(tb[rows])
        da.o_proj.weight.copy_(outp(a.o_proj.weight[:, q_rows]))
        m, dm = tl.mlp, dl.mlp
        if I < tc.intermediate_size:  # keep the neurons with the largest weight-norm product
            score = (m.gate_proj.weight.float().norm(dim=1) * m.up_proj.weight.float().norm(dim=1)
                     * m.down_proj.weight.float().norm(dim=0))
            keep = torch.sort(torch.topk(score, I).indices).values
        else:
            keep = torch.arange(I)
        dm.gate_proj.weight.copy_(inp(m.gate_proj.weight[keep], g2))
        dm.up_proj.weight.copy_(inp(m.up_proj.weight[keep], g2))
        dm.down_proj.weight.copy_(outp(m.down_proj.weight[:, keep]))
        if P is not None:
            dl.input_layernorm.weight.fill_(1.0)
            dl.post_attention_layernorm.weight.fill_(1.0)
        else:
            dl.input_layernorm.weight.copy_(g1)
            dl.post_attention_layernorm.weight.copy_(g2)
    if P is not None:  # diag approx of c P^T diag(g_final) P
        d_norm.weight.copy_(c * ((Pm ** 2) * t_norm.weight.float()[:, None]).sum(0))
    else:
        d_norm.weight.copy_(t_norm.weight)
    parts = [emb_text, f"layers = target layers {layer_ids}"]
    if P is not None:
        parts[-1] += f" projected to {H} dims (RMSNorm gains folded in)"
    if d_heads != t_heads or d_kv != t_kv:
        parts.append(f"attention: {d_heads} of {t_heads} heads, {d_kv} of {t_kv} KV heads")
    if I < tc.intermediate_size:
        parts.append(f"MLP: the {I} of {tc.intermediate_size} neurons with the largest weight norms")
    parts.append("final norm " + ("projected" if P is not None else "copied"))
    info["text"] = "; ".join(parts)
    return info


# --------------------------------------------------------------------------------------------------
# Loss


class _FusedDistillLoss(torch.autograd.Function):
    """lm_head + top-k KL (+ CE) over row chunks, gradients computed in the forward pass: the
    (tokens x vocab) logits are never materialised. Returns the mean loss over rows."""

    @staticmethod
    def forward(ctx, hidden, weight, t_ids, t_p, t_logp, ce_ids, ce_weight, temperature, softcap, rows, stats):
        n = hidden.shape[0]
        w = weight.detach().to(torch.bfloat16)
        h = hidden.detach().to(torch.bfloat16)
        need_w = ctx.needs_input_grad[1]
        grad_h = torch.empty(h.shape, dtype=torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32) if need_w else None
        kl_sum = ce_sum = 0.0
        agree = 0
        scale = temperature / n  # d(T^2 * KL(z/T))/dz = T (q - p); mean over rows
        use_ce = ce_ids is not None and ce_weight != 0.0
        pending: list[tuple[int, int, torch.Tensor]] = []  # gradient chunks for one larger grad_w matmul

        def flush() -> None:
            if pending:
                lo, hi = pending[0][0], pending[-1][1]
                g_all = torch.cat([g for _, _, g in pending]) if len(pending) > 1 else pending[0][2]
                grad_w.add_(g_all.T @ h[lo:hi])
                pending.clear()

        for s in range(0, n, rows):
            e = min(n, s + rows)
            z = (h[s:e] @ w.T).float()
            if softcap:
                th = torch.tanh(z / softcap)
                z = th * softcap
            # Passes over the (rows x vocab) block: max+argmax, exp in place, sum, scale, cast.
            mx, am = z.max(dim=-1, keepdim=True)
            agree += int((am.squeeze(1) == t_ids[s:e, 0]).sum())
            z_top = z.gather(1, t_ids[s:e])
            if use_ce:
                z_ce = z.gather(1, ce_ids[s:e, None])
                q1 = None
                if temperature != 1.0:  # CE at T=1 needs its own softmax
                    q1 = torch.softmax(z, dim=-1)
                    ce_sum += float((torch.logsumexp(z, -1, keepdim=True) - z_ce).sum())
            if temperature != 1.0:
                z.div_(temperature)
                mx = mx / temperature
                z_top = z_top / temperature
            q = z.sub_(mx).exp_()  # exp(z/T - max), in place
            ssum = q.sum(dim=-1, keepdim=True)
            lse = mx + ssum.log()
            p = t_p[s:e]
            kl_sum += float((p * (t_logp[s:e] - (z_top - lse))).sum())
            coef = scale
            if use_ce and temperature == 1.0:
                ce_sum += float((lse - z_ce).sum())
                coef = scale + ce_weight / n
            g = q.mul_(coef / ssum)  # coef * softmax(z / T)
            if use_ce:
                if q1 is not None:
                    g.add_(q1, alpha=ce_weight / n)
                g.scatter_add_(1, ce_ids[s:e, None], torch.full((e - s, 1), -ce_weight / n))
            g.scatter_add_(1, t_ids[s:e], -p * scale)
            if softcap:
                g.mul_(1 - th * th)
            gb = g.to(torch.bfloat16)
            grad_h[s:e] = gb @ w
            if need_w:
                pending.append((s, e, gb))
                if pending[-1][1] - pending[0][0] >= 2048:
                    flush()
        if need_w:
            flush()
        t2 = temperature * temperature
        loss = (t2 * kl_sum + ce_weight * ce_sum) / n
        stats.update(kl=t2 * kl_sum / n, ce=ce_sum / n, agree=agree / n)
        ctx.save_for_backward(grad_h, grad_w if need_w else torch.empty(0))
        ctx.need_w = need_w
        ctx.hidden_dtype = hidden.dtype
        return torch.tensor(loss, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = (grad_h * grad_out).to(ctx.hidden_dtype)
        gw = grad_w * grad_out if ctx.need_w else None
        return gh, gw, None, None, None, None, None, None, None, None, None


def distill_loss(model: Any, input_ids: torch.Tensor, t_ids: torch.Tensor, t_logp: torch.Tensor,
                 ce_ids: torch.Tensor | None, ce_weight: float, temperature: float,
                 rows: int = 128) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over positions of T^2 KL(teacher top-k renormalised || draft softmax) + ce_weight * CE."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = _body(model)(input_ids=input_ids.long()).last_hidden_state
    n = hidden.shape[0] * hidden.shape[1]
    hidden = hidden.reshape(n, -1)
    t_ids = t_ids.reshape(n, -1)
    t_logp = t_logp.reshape(n, -1).float() / temperature
    t_logp = t_logp - torch.logsumexp(t_logp, dim=-1, keepdim=True)  # renormalised over the top-k
    t_p = t_logp.exp()
    stats: dict[str, float] = {}
    loss = _FusedDistillLoss.apply(
        hidden, model.get_output_embeddings().weight, t_ids, t_p, t_logp,
        None if ce_ids is None else ce_ids.reshape(n).long(), float(ce_weight), float(temperature),
        _final_softcap(model.config), rows, stats,
    )
    return loss, stats


@torch.no_grad()
def draft_argmax(model: Any, input_ids: torch.Tensor, rows: int = 1024, autocast: bool = True,
                 blocked: torch.Tensor | None = None) -> torch.Tensor:
    """The draft's greedy next token at every position (B,T), computed without full logits."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        hidden = _body(model)(input_ids=input_ids.long()).last_hidden_state
    b, t, d = hidden.shape
    hidden = hidden.reshape(b * t, d)
    w = model.get_output_embeddings().weight
    if autocast:
        hidden, w = hidden.to(torch.bfloat16), w.to(torch.bfloat16)
    else:
        hidden = hidden.float()
    out = [(hidden[s: s + rows] @ w.T).masked_fill(blocked, float("-inf")).argmax(-1) if blocked is not None
           else (hidden[s: s + rows] @ w.T).argmax(-1) for s in range(0, b * t, rows)]
    return torch.cat(out).view(b, t)


# --------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def _eval_batch(model: Any, x: torch.Tensor, t_ids: torch.Tensor, t_logp: torch.Tensor,
                rows: int = 1024, blocked: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """(B,T) matches of the draft's argmax with the teacher's, and the summed KL(teacher top-k || draft).
    ``blocked`` (bool over the vocabulary): ids the argmax may not pick (outside a draft vocabulary)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = _body(model)(input_ids=x.long()).last_hidden_state
    b, t, d = hidden.shape
    hidden = hidden.reshape(b * t, d).to(torch.bfloat16)
    w = model.get_output_embeddings().weight.to(torch.bfloat16)
    cap = _final_softcap(model.config)
    ids = t_ids.reshape(b * t, -1)
    lp = t_logp.reshape(b * t, -1).float()
    lp = lp - torch.logsumexp(lp, dim=-1, keepdim=True)
    match, kl = [], 0.0
    for s in range(0, b * t, rows):
        z = (hidden[s: s + rows] @ w.T).float()
        if cap:
            z = torch.tanh(z / cap) * cap
        pick = z if blocked is None else z.masked_fill(blocked, float("-inf"))
        match.append(pick.argmax(-1) == ids[s: s + rows, 0])
        logq = z.gather(1, ids[s: s + rows]) - torch.logsumexp(z, dim=-1, keepdim=True)
        kl += float((lp[s: s + rows].exp() * (lp[s: s + rows] - logq)).sum())
    return torch.cat(match).view(b, t), kl


@torch.no_grad()
def evaluate(model: Any, data: Dataset, cache: TeacherCache, cfg: DistillConfig, limit: int | None = None,
             generated: "GeneratedData | None" = None, blocked: torch.Tensor | None = None) -> dict[str, Any]:
    """Teacher-forced top-1 agreement with the target on held-out chunks (overall and per kind) + KL.

    With ``generated``, also the agreement on the held-out on-policy continuations (the target's own
    greedy text, the closest match to what speculative decoding sees), reported apart from the corpus."""
    was_training = model.training
    model.eval()
    if limit is not None and limit < len(data.eval):  # a fixed subset spread over both kinds
        idx = torch.linspace(0, len(data.eval) - 1, limit).round().long().unique()
    else:
        idx = torch.arange(len(data.eval))
    hits: dict[str, list[int]] = {}
    kl_sum, count = 0.0, 0
    for s in range(0, len(idx), cfg.batch_size):
        bi = idx[s: s + cfg.batch_size]
        x = data.eval[bi]
        t_ids, t_logp = cache.get("eval", bi)
        match, kl = _eval_batch(model, x, t_ids, t_logp, blocked=blocked)
        for row, i in zip(match, bi.tolist()):
            h = hits.setdefault(data.eval_kinds[i], [0, 0])
            h[0] += int(row.sum())
            h[1] += row.numel()
        kl_sum += kl
        count += x.numel()
    result = {
        "agreement": sum(h[0] for h in hits.values()) / max(1, count),
        "agreement_by_kind": {k: h[0] / max(1, h[1]) for k, h in sorted(hits.items())},
        "kl": kl_sum / max(1, count),
        "tokens": count,
    }
    if generated is not None and generated.n["eval"]:
        gi = torch.arange(generated.n["eval"])
        if limit is not None:
            gi = gi[: max(1, limit // 4)]
        hit, n, gkl = 0, 0, 0.0
        for s in range(0, len(gi), cfg.batch_size):
            x, t_ids, t_logp = generated.get("eval", gi[s: s + cfg.batch_size])
            match, kl = _eval_batch(model, x, t_ids, t_logp, blocked=blocked)
            # the prompt part is corpus text (or sampled); count the greedy continuation only
            cont = match[:, cfg.generate_prompt_len - 1:]
            hit, n, gkl = hit + int(cont.sum()), n + cont.numel(), gkl + kl
        result["generated"] = {"agreement": hit / max(1, n), "tokens": n, "chunks": len(gi)}
    model.train(was_training)
    return result


@torch.no_grad()
def acceptance_estimate(teacher: Any, draft: Any, data: Dataset, n_prompts: int, prompt_len: int,
                        new_tokens: int, k: int, eos_ids: set[int],
                        blocked: torch.Tensor | None = None) -> dict[str, Any] | None:
    """Free-running greedy estimate: the target continues held-out prompts greedily; along its own
    trajectory a greedy draft's proposals equal its teacher-forced argmax until the first miss, so the
    per-position matches give the exact accepted lengths of greedy speculative decoding with ``k``."""
    if n_prompts <= 0 or new_tokens <= 0:
        return None
    n_prompts = min(n_prompts, len(data.eval))
    idx = torch.linspace(0, len(data.eval) - 1, n_prompts).round().long()
    prompts = data.eval[idx, :prompt_len].long()
    # Greedy continuation with the target's own KV cache, batched (equal-length prompts: no padding).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seqs = teacher.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                max_new_tokens=new_tokens,
                                pad_token_id=0, num_beams=1)
    pred = draft_argmax(draft, seqs[:, :-1], autocast=False, blocked=blocked)  # fp32 like the default draft runtime
    matches, accepted, steps, emitted, total_pos = 0, 0, 0, 0, 0
    for row in range(len(seqs)):
        gen = seqs[row, prompt_len:].tolist()
        hit = (pred[row, prompt_len - 1:] == seqs[row, prompt_len:]).tolist()
        end = len(gen)
        for j, tok in enumerate(gen):
            if tok in eos_ids:
                end = j + 1
                break
        hit = hit[:end]
        matches += sum(hit)
        total_pos += len(hit)
        p = 0
        while p < len(hit):
            a = 0
            while a < k and p + a < len(hit) and hit[p + a]:
                a += 1
            steps += 1
            accepted += a
            emitted += min(a + 1, len(hit) - p)
            p += a + 1
    if not steps:
        return None
    return {
        "prompts": int(n_prompts), "prompt_len": prompt_len, "new_tokens": new_tokens, "k": k,
        "token_acceptance": matches / max(1, total_pos),
        "acceptance_rate": accepted / (steps * k),
        "mean_accepted": accepted / steps,
        "tokens_per_target_step": emitted / steps,
    }


# --------------------------------------------------------------------------------------------------
# Schedule, optimizer, checkpoints


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


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


ARCH_KEYS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "init", "init_layers", "projection",
             "embed_lr_scale")


def _progress(cfg: DistillConfig, step: int, seconds: float) -> float:
    parts = []
    if cfg.max_steps > 0:
        parts.append(step / cfg.max_steps)
    if cfg.minutes > 0:
        parts.append(seconds / (cfg.minutes * 60))
    return max(parts) if parts else 0.0


# --------------------------------------------------------------------------------------------------
# Export


def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def _fmt_mb(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.1f} MB"


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
    from specdec.models import DRAFT_VOCAB_FILE

    path = out / DRAFT_VOCAB_FILE
    if ids is None:
        path.unlink(missing_ok=True)  # a stale vocabulary of an earlier run would restrict this draft
        return
    body = {"description": "the ids this draft proposes (the target's most frequent top-1 predictions in the "
                           "distillation data); specdec computes only these rows of the draft's LM head",
            **(info or {}), "token_ids": ids.tolist()}
    path.write_text(json.dumps(body))


def write_model_card(out: Path, s: dict[str, Any]) -> None:
    ev = s["eval"]
    acc = s.get("acceptance")
    kinds = ", ".join(f"{k} {100 * v:.1f}%" for k, v in ev["agreement_by_kind"].items())
    lines = [
        "---",
        "library_name: transformers",
        f"base_model: {s['target']}",
        "tags: [speculative-decoding, draft-model, knowledge-distillation]",
        "---",
        "",
        f"# Draft model for `{s['target']}`",
        "",
        f"A {_fmt_params(s['params'])}-parameter {s['architecture']} trained by knowledge distillation from "
        f"`{s['target']}` with `specdec distill`, for lossless speculative decoding. It uses the target's "
        "tokenizer (saved here), so it drafts for the target directly.",
        "",
        "## Results",
        "",
        f"- **Held-out top-1 agreement with the target: {100 * ev['agreement']:.1f}%** (teacher-forced: the draft's "
        f"greedy next token equals the target's, over {ev['tokens']:,} held-out tokens; by kind: {kinds}; "
        "measured on the exported bf16 weights).",
        f"- Held-out KL(target top-{s['top_k']} || draft): {ev['kl']:.3f} nats/token.",
    ]
    if ev.get("generated"):
        g = ev["generated"]
        lines.append(f"- **On held-out on-policy text** (the target's own greedy continuations of {g['chunks']} held-out "
                     f"prompts, {g['tokens']:,} tokens): {100 * g['agreement']:.1f}% agreement.")
    if acc:
        lines.append(
            f"- Free-running greedy estimate ({acc['prompts']} held-out prompts of {acc['prompt_len']} tokens, "
            f"{acc['new_tokens']} tokens generated by the target): {100 * acc['token_acceptance']:.1f}% of the "
            f"target's tokens predicted; with k={acc['k']} speculative tokens {acc['mean_accepted']:.2f} accepted "
            f"per step ({100 * acc['acceptance_rate']:.1f}% acceptance), {acc['tokens_per_target_step']:.2f} tokens "
            "per target forward."
        )
    dv, full = s.get("draft_vocab"), s.get("eval_full_vocab")
    if dv:
        pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        lines.append(
            f"- **Draft vocabulary** ({DRAFT_VOCAB_NOTE}): the {dv['size']:,} of {dv['vocab_size']:,} ids the target "
            f"predicts most often in the training data; they cover {pct(dv['coverage_heldout_corpus'])} of its held-out "
            f"corpus predictions and {pct(dv['coverage_heldout_generated'])} of its held-out on-policy ones. The "
            "numbers above are measured drafting over it"
            + (f"; over the whole vocabulary the held-out agreement is {100 * full['agreement']:.1f}%" if full else "")
            + ".")
    init_eval = s.get("init_eval")
    if init_eval:
        lines.append(f"- Agreement at initialisation (before training): {100 * init_eval['agreement']:.1f}%"
                     + (f"; on-policy {100 * init_eval['generated']['agreement']:.1f}%" if init_eval.get("generated") else "")
                     + ".")
    lines += [
        "",
        "## Model",
        "",
        f"- Architecture: {s['architecture']}, {s['config_summary']}.",
        f"- Parameters: {s['params']:,} ({s['embedding_params']:,} in the tied embedding / lm_head).",
        f"- Size: model.safetensors {_fmt_mb(s['size_bytes'])} (bf16).",
        f"- Initialisation: {s['init']}.",
        f"- Embeddings: {s['embed_note']}.",
        "",
        "## Training",
        "",
        f"- Command: `{s['command']}`",
        f"- Corpus: {s['corpus']['description']}. {s['corpus']['documents']:,} documents; "
        f"{s['corpus']['train_tokens']:,} training tokens in {s['corpus']['train_chunks']:,} chunks of "
        f"{s['corpus']['seq_len']} ({s['corpus']['by_kind']}), {s['corpus']['eval_tokens']:,} held-out tokens "
        "(whole documents).",
        f"- Teacher signal: the target's top-{s['top_k']} next-token log-probabilities per position (bf16 autocast), "
        f"computed once and cached; {s['labelled_tokens']:,} training tokens labelled; trained on "
        f"{s['active_chunks']:,} chunks ({s['corpus']['used_by_kind']}).",
    ] + ([
        f"- On-policy data: {g['tokens']:,} tokens ({g['train_chunks']:,} chunks) of the target's own greedy "
        f"continuations, each after a {g['prompt_len']}-token prompt ({100 * (1 - g['free_fraction']):.0f}% windows of "
        f"the training corpus, {100 * g['free_fraction']:.0f}% sampled by the target itself at T=1 after the separator "
        f"token); labelled by the same forward passes that generated them, in {g['minutes']:.1f} min (bf16). Mixed "
        "with the corpus chunks in every epoch."
    ] if (g := s.get("generated")) else []) + [
        f"- Loss: T^2 KL(teacher top-{s['top_k']} renormalised || draft) at T={s['temperature']}"
        + (f" + {s['ce_weight']} x CE on the {'teacher argmax' if s['ce_target'] == 'teacher' else 'data'} next token" if s["ce_weight"] else "") + ".",
        f"- Optimisation: AdamW (peak LR {s['lr']}, {s['warmup_steps']} warmup steps, cosine to "
        f"{s['min_lr_ratio']} x peak), batch {s['batch_size']} x {s['corpus']['seq_len']} tokens, gradient clipping "
        f"{s['grad_clip']}, bf16 autocast on CPU ({s['threads']} thread{'s' if s['threads'] != 1 else ''}).",
        f"- Steps: {s['steps']:,} ({s['tokens_seen']:,} tokens, {s['epochs']:.2f} epochs over the labelled chunks). "
        f"Wall time {s['wall_minutes']:.1f} min in all, of which the training loop {s['train_minutes']:.1f} min "
        f"incl. {s['label_minutes']:.1f} min of teacher labelling; {s['step_seconds']:.2f} s per step, "
        f"{s['tokens_per_second']:.0f} training tokens/s excluding labelling.",
        f"- Final training loss: {s['final_loss']:.4f} (mean of the last 20 steps; first step: {s['first_loss']:.4f}).",
        "",
        "## Use",
        "",
        "```python",
        "from specdec.llm import LLM",
        f"llm = LLM({s['target']!r}, speculative_config={{\"method\": \"draft_model\", "
        f"\"model\": \"path/to/this/folder\", \"num_speculative_tokens\": 4}})",
        "```",
        "",
        "Speculative decoding is lossless: the draft only changes speed, never the target's output distribution.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


# --------------------------------------------------------------------------------------------------
# Main


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


def run(args: argparse.Namespace) -> int:
    cfg = DistillConfig.from_args(args)
    try:
        summary = distill(cfg)
    except KeyboardInterrupt:
        ckpt = Path(cfg.out).expanduser() / CHECKPOINT_DIR / "state.pt"
        print("interrupted" + (f"; run the same command to resume from {ckpt}" if ckpt.exists() else ""),
              file=sys.stderr)
        return 130
    ev = summary["eval"]
    print(f"draft saved to {summary['out']}: held-out agreement {100 * ev['agreement']:.1f}%, "
          f"{summary['steps']} steps, {summary['train_minutes']:.1f} min, {_fmt_mb(summary['size_bytes'])}")
    return 0


def distill(cfg: DistillConfig, command: str | None = None) -> dict[str, Any]:
    """Run (or resume) a distillation; returns the summary also written to OUT/distill.json."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from specdec.models import load_model, model_construction, tokenizer_fingerprint

    cfg.validate()
    t_invocation = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / CHECKPOINT_DIR
    ckpt_file = ckpt_dir / "state.pt"
    if cfg.resume is True and not ckpt_file.exists():
        raise ConfigError(f"--resume: no checkpoint at {ckpt_file}")
    resume = ckpt_file.exists() and cfg.resume is not False
    state = torch.load(ckpt_file, weights_only=False) if resume else None
    if state is not None:
        saved = state["config"]
        changed = [k for k in ARCH_KEYS if saved.get(k) != getattr(cfg, k)]
        if changed:
            logger.warning("resuming: keeping the checkpoint's %s (the command line differs)", ", ".join(changed))
            for k in ARCH_KEYS:
                setattr(cfg, k, saved.get(k))
        for k in ("target", "corpus", "seq_len", "max_train_tokens", "eval_tokens", "prose_fraction", "seed", "top_k",
                  "generated_tokens", "generate_prompt_len", "generate_free_fraction", "init_from"):
            if saved.get(k) != getattr(cfg, k):
                raise ConfigError(
                    f"the checkpoint in {ckpt_dir} was trained with {k}={saved.get(k)!r}, not {getattr(cfg, k)!r}; "
                    "rerun with the same data settings or pass --no-resume to start over"
                )

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    target = load_model(cfg.target, dtype="float32")
    teacher = target.model
    fp = tokenizer_fingerprint(target.tokenizer)
    data = prepare_data(cfg, target.tokenizer, fp, out)
    vocab = int(teacher.get_output_embeddings().weight.shape[0])
    tkey = hashlib.sha256(f"{target.source}|{fp}|{cfg.top_k}|bf16-autocast|v1".encode()).hexdigest()[:10]
    shard_size = max(1, SHARD_TOKENS // cfg.seq_len)  # chunks per shard
    cache = TeacherCache(data.folder / f"teacher-{tkey}-k{cfg.top_k}-s{shard_size}", cfg.top_k, vocab, shard_size)
    progress_off = cfg.no_progress

    def label(split: str, shards: list[int], chunks: torch.Tensor, desc: str) -> float:
        todo = [s for s in shards if not cache.has(split, s)]
        if not todo:
            return 0.0
        t0 = time.perf_counter()
        n_tok = sum(int(chunks[s * shard_size: (s + 1) * shard_size].numel()) for s in todo)
        with tqdm(total=n_tok, desc=desc, unit="tok", unit_scale=True, leave=False, disable=progress_off) as bar:
            for s in todo:
                cache.label(split, s, chunks, teacher, cfg.teacher_batch, bar)
        return time.perf_counter() - t0

    n_eval_shards = math.ceil(len(data.eval) / shard_size)
    label("eval", list(range(n_eval_shards)), data.eval, "teacher labels (held-out)")

    # On-policy data: generated (and labelled in the same passes) before training, by a bf16 copy
    generated, gen_seconds = None, 0.0
    if cfg.generated_tokens:
        gspec = {"data": data.key, "teacher": tkey, "tokens": cfg.generated_tokens, "seed": cfg.seed,
                 "prompt_len": cfg.generate_prompt_len, "free": cfg.generate_free_fraction, "v": 1}
        gkey = hashlib.sha256(json.dumps(gspec, sort_keys=True).encode()).hexdigest()[:10]
        generated = GeneratedData(data.folder / f"generated-{gkey}", cfg, data, _separator_id(target.tokenizer),
                                  shard_size)
        todo = [(sp, sh) for sp in ("eval", "train") for sh in range(generated.shards(sp))
                if not generated.labels.has(sp, sh)]
        if todo:
            t0 = time.perf_counter()
            with model_construction():
                gen_model = copy.deepcopy(teacher).to(torch.bfloat16)
            n_tok = sum(min(generated.n[sp] - sh * shard_size, shard_size) * cfg.seq_len for sp, sh in todo)
            with tqdm(total=n_tok, desc="on-policy continuations", unit="tok", unit_scale=True, leave=False,
                      disable=progress_off) as gbar:
                for sp, sh in todo:
                    generated.generate(gen_model, sp, sh, gbar)
            del gen_model
            gen_seconds = time.perf_counter() - t0
            logger.info("generated %d on-policy chunks in %.1f min", sum(generated.n.values()), gen_seconds / 60)
    n_gen = generated.n["train"] if generated is not None else 0
    n_corpus = len(data.train)

    # Draft
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
        sample = data.train[: min(16, len(data.train))]
        init_info = init_draft(teacher, draft, cfg, sample)
    else:
        draft.load_state_dict(state["model"])
        init_info = state["init_info"]
    draft.get_input_embeddings().weight.requires_grad_(embed_scale > 0)
    draft.train()
    n_params = sum(p.numel() for p in draft.parameters())
    emb_params = draft.get_input_embeddings().weight.numel()
    logger.info("draft: %s, %.1fM parameters; init: %s", type(draft).__name__, n_params / 1e6, init_info["text"])

    opt = make_optimizer(draft, cfg, embed_scale)
    step, epoch, pos, tokens_seen, train_seconds, label_seconds = 0, 0, 0, 0, 0.0, 0.0
    log: list[dict[str, Any]] = []
    timed = [0.0, 0]  # seconds and count of optimizer steps (excluding labelling), over resumed runs
    init_eval = None
    active = len(data.train)  # training chunks in use (fewer once the labelling budget is spent)
    wall_before = 0.0
    if state is None:
        train_seconds = label_seconds = gen_seconds  # generating is labelling; both count in --minutes
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        step, epoch, pos = state["step"], state["epoch"], state["pos"]
        tokens_seen, train_seconds = state["tokens_seen"], state["train_seconds"]
        label_seconds = state.get("label_seconds", 0.0)
        gen_seconds += state.get("gen_seconds", 0.0)  # on-policy generation of the earlier invocations
        log = state["log"]
        timed[:] = state.get("timed", [0.0, 0])
        init_eval = state.get("init_eval")
        active = state.get("active", active)
        wall_before = state.get("wall_seconds", 0.0)
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        logger.info("resumed from %s at step %d (epoch %d, %.1f min trained)", ckpt_file, step, epoch,
                    train_seconds / 60)
    else:
        init_eval = evaluate(draft, data, cache, cfg, limit=32, generated=generated)
        logger.info("agreement at initialisation: %.1f%%%s", 100 * init_eval["agreement"],
                    f" (on-policy {100 * init_eval['generated']['agreement']:.1f}%)" if "generated" in init_eval else "")

    # Chunk indices: [0, n_corpus) are corpus chunks, [n_corpus, n_corpus + n_gen) on-policy chunks.
    def order(ep: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(cfg.seed * 1000 + ep)
        gen_idx = torch.arange(n_corpus, n_corpus + n_gen)
        if ep == 0:  # corpus chunks are already shuffled and labelled in order as training reaches them;
            # on-policy chunks are spread among them at random places
            keys = torch.cat([torch.arange(n_corpus) / max(1, n_corpus), torch.rand(n_gen, generator=g)])
            return torch.cat([torch.arange(n_corpus), gen_idx])[torch.argsort(keys, stable=True)]
        both = torch.cat([torch.arange(active), gen_idx])
        return both[torch.randperm(len(both), generator=g)]

    def fetch(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens, teacher ids and log-probs of a batch mixing corpus and on-policy chunks."""
        corpus = idx < n_corpus
        x = torch.empty(len(idx), cfg.seq_len, dtype=torch.int32)
        t_ids = torch.empty(len(idx), cfg.seq_len, cfg.top_k, dtype=torch.long)
        t_logp = torch.empty(len(idx), cfg.seq_len, cfg.top_k)
        if corpus.any():
            ci = idx[corpus]
            x[corpus] = data.train[ci]
            t_ids[corpus], t_logp[corpus] = cache.get("train", ci)
        if (~corpus).any():
            x[~corpus], t_ids[~corpus], t_logp[~corpus] = generated.get("train", idx[~corpus] - n_corpus)
        return x, t_ids, t_logp

    def save() -> None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        _atomic_torch_save({
            "model": draft.state_dict(), "optimizer": opt.state_dict(), "step": step, "epoch": epoch, "pos": pos,
            "tokens_seen": tokens_seen, "train_seconds": train_seconds, "label_seconds": label_seconds,
            "gen_seconds": gen_seconds,
            "timed": timed, "active": active, "wall_seconds": wall_before + time.perf_counter() - t_invocation,
            "log": log, "config": asdict(cfg), "init_info": init_info, "init_eval": init_eval,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}, "data_key": data.key,
        }, ckpt_file)
        dcfg.save_pretrained(ckpt_dir)

    perm = order(epoch)
    batch_chunks = cfg.batch_size
    last_eval = log[-1].get("eval_agreement") if log else None
    ema = None
    step_times: list[float] = []
    bar = tqdm(total=cfg.max_steps or None, initial=step, desc="distill", unit="step", disable=progress_off,
               dynamic_ncols=True)
    interrupted = False
    try:
        while _progress(cfg, step, train_seconds) < 1.0:
            t_start = time.perf_counter()
            if pos + batch_chunks > len(perm):
                epoch += 1
                pos = 0
                perm = order(epoch)
                if batch_chunks > len(perm):
                    batch_chunks = len(perm)
            idx = perm[pos: pos + batch_chunks]
            shards = sorted({i // shard_size for i in idx.tolist() if i < n_corpus})
            if (active == len(data.train) and cfg.minutes > 0 and 0 <= cfg.label_fraction < 1
                    and label_seconds >= cfg.label_fraction * cfg.minutes * 60
                    and any(not cache.has("train", sh) for sh in shards)):
                done = 0
                while done * shard_size < len(data.train) and cache.has("train", done):
                    done += 1
                if done * shard_size + n_gen >= batch_chunks:  # enough labelled: more epochs, no more labelling
                    active = min(len(data.train), done * shard_size)
                    logger.info("labelling budget spent (%.1f min): training on the %d labelled chunks from now on",
                                label_seconds / 60, active)
                    pos = len(perm)  # start the next epoch over the labelled chunks
                    continue
            lab = label("train", shards, data.train, "teacher labels")
            label_seconds += lab
            t_step = time.perf_counter()
            x, t_ids, t_logp = fetch(idx)
            ce_ids = None
            if cfg.ce_weight:
                if cfg.ce_target == "teacher":
                    ce_ids = t_ids[..., 0]
                else:  # the data's next token; the last position has none: use the teacher's there
                    ce_ids = torch.cat([x[:, 1:].long(), t_ids[:, -1:, 0]], dim=1)
            lr = lr_at(cfg, step, _progress(cfg, step, train_seconds))
            for g in opt.param_groups:
                g["lr"] = lr * g.get("lr_scale", 1.0)
            loss, stats = distill_loss(draft, x, t_ids, t_logp, ce_ids, cfg.ce_weight, cfg.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_([p for p in draft.parameters() if p.requires_grad],
                                                         cfg.grad_clip))
            opt.step()
            now = time.perf_counter()
            step_times.append(now - t_step)
            timed[0] += now - t_step
            timed[1] += 1
            train_seconds += now - t_start
            step += 1
            pos += batch_chunks
            tokens_seen += int(x.numel())
            lv = float(loss.detach())
            ema = lv if ema is None else 0.95 * ema + 0.05 * lv
            entry = {"step": step, "loss": lv, "kl": stats["kl"], "train_agreement": stats["agree"], "lr": lr,
                     "grad_norm": gnorm, "seconds": round(train_seconds, 2), "epoch": epoch}
            if cfg.eval_every and step % cfg.eval_every == 0:
                ev = evaluate(draft, data, cache, cfg, limit=32, generated=generated)
                entry["eval_agreement"] = last_eval = ev["agreement"]
                if "generated" in ev:
                    entry["eval_generated_agreement"] = ev["generated"]["agreement"]
                train_seconds += time.perf_counter() - now
            log.append(entry)
            recent = step_times[-20:]
            tps = x.numel() * len(recent) / max(1e-9, sum(recent))
            post = {"loss": f"{ema:.3f}", "agree": f"{100 * stats['agree']:.0f}%", "tok/s": f"{tps:.0f}",
                    "lr": f"{lr:.1e}"}
            if last_eval is not None:
                post["eval"] = f"{100 * last_eval:.1f}%"
            if cfg.minutes > 0:
                post["left"] = f"{max(0.0, cfg.minutes - train_seconds / 60):.1f}m"
            bar.set_postfix(post, refresh=False)
            bar.update(1)
            if step % cfg.save_every == 0:
                save()
    except KeyboardInterrupt:
        interrupted = True
        logger.warning("interrupted: saving a checkpoint at step %d", step)
    finally:
        bar.close()
    save()
    if interrupted:
        raise KeyboardInterrupt

    # Export and final evaluation (on the bf16 weights that ship)
    draft.eval()
    rounded, size = export_draft(draft, target, out)
    blocked, vocab_info, full_vocab_eval = None, None, None
    if cfg.draft_vocab and cfg.draft_vocab < vocab:
        vocab_ids, vocab_info = build_draft_vocab(
            cfg.draft_vocab, vocab, cache, math.ceil(len(data.train) / shard_size), n_eval_shards, generated,
            set(target.tokenizer.all_special_ids) | set(target.eos_token_ids))
        write_draft_vocab(out, vocab_ids, vocab_info)
        blocked = torch.ones(vocab, dtype=torch.bool)
        blocked[vocab_ids] = False
        full_vocab_eval = evaluate(rounded, data, cache, cfg, generated=generated)
    else:
        write_draft_vocab(out, None, None)
    final = evaluate(rounded, data, cache, cfg, generated=generated, blocked=blocked)
    accept = acceptance_estimate(teacher, rounded, data, cfg.accept_prompts, min(64, cfg.seq_len),
                                 cfg.accept_tokens, cfg.num_speculative_tokens, set(target.eos_token_ids), blocked)
    recent_losses = [e["loss"] for e in log[-20:]] or [float("nan")]
    n_steps_timed = timed[1]
    step_s = timed[0] / n_steps_timed if n_steps_timed else float("nan")
    counts = data.meta["counts"]
    used = data.meta.get("train_kinds", [])[:active]
    tot = sum(c["train_tokens"] for c in counts.values()) or 1
    labelled = sum(int(data.train[s * shard_size:(s + 1) * shard_size].numel())
                   for s in range(math.ceil(len(data.train) / shard_size)) if cache.has("train", s))
    tc = teacher.config.get_text_config()
    summary = {
        "out": str(out), "target": cfg.target, "command": command or command_line(cfg),
        "architecture": type(draft).__name__,
        "config_summary": (f"{dcfg.num_hidden_layers} layers, hidden {dcfg.hidden_size}, {dcfg.num_attention_heads} "
                           f"heads / {dcfg.num_key_value_heads} KV heads of dim {dcfg.head_dim}, MLP "
                           f"{dcfg.intermediate_size}, vocab {dcfg.vocab_size}, tied embeddings (target: "
                           f"{tc.num_hidden_layers} layers, hidden {tc.hidden_size})"),
        "params": n_params, "embedding_params": emb_params, "size_bytes": size,
        "init": init_info["text"],
        "embed_note": ("frozen (copied unchanged from the target)" if embed_scale == 0 and same_width else
                       "frozen" if embed_scale == 0 else f"trained at {embed_scale} x the learning rate"),
        "corpus": {
            "description": data.meta["description"], "documents": data.meta["documents"],
            "train_tokens": data.meta["train_tokens"], "train_chunks": data.meta["train_chunks"],
            "eval_tokens": data.meta["eval_tokens"], "seq_len": cfg.seq_len,
            "by_kind": ", ".join(f"{100 * c['train_tokens'] / tot:.0f}% {k}" for k, c in sorted(counts.items())),
            "used_by_kind": ", ".join(f"{100 * used.count(k) / max(1, len(used)):.0f}% {k}" for k in sorted(set(used))),
        },
        "top_k": cfg.top_k, "temperature": cfg.temperature, "ce_weight": cfg.ce_weight, "ce_target": cfg.ce_target,
        "lr": cfg.lr, "warmup_steps": cfg.warmup_steps, "min_lr_ratio": cfg.min_lr_ratio, "batch_size": cfg.batch_size,
        "grad_clip": cfg.grad_clip, "threads": torch.get_num_threads(),
        "steps": step, "tokens_seen": tokens_seen, "epochs": tokens_seen / max(1, (active + n_gen) * cfg.seq_len),
        "train_minutes": train_seconds / 60, "label_minutes": label_seconds / 60, "labelled_tokens": labelled,
        "active_chunks": active, "wall_minutes": (wall_before + time.perf_counter() - t_invocation) / 60,
        "step_seconds": step_s, "tokens_per_second": (cfg.batch_size * cfg.seq_len / step_s) if n_steps_timed else float("nan"),
        "final_loss": sum(recent_losses) / len(recent_losses), "first_loss": log[0]["loss"] if log else float("nan"),
        "eval": final, "init_eval": init_eval, "acceptance": accept,
        "generated": None if generated is None else {
            "train_chunks": n_gen, "eval_chunks": generated.n["eval"], "tokens": n_gen * cfg.seq_len,
            "prompt_len": cfg.generate_prompt_len, "free_fraction": cfg.generate_free_fraction,
            "minutes": gen_seconds / 60},
        "init_from": cfg.init_from,
        "draft_vocab": vocab_info, "eval_full_vocab": full_vocab_eval,
    }
    write_model_card(out, summary)
    (out / "distill.json").write_text(json.dumps(summary, indent=1, default=str))
    logger.info("held-out agreement %.1f%%%s; saved %s (%s)", 100 * final["agreement"],
                f", {accept['tokens_per_target_step']:.2f} tokens/target step (k={accept['k']})" if accept else "",
                out, _fmt_mb(size))
    return summary

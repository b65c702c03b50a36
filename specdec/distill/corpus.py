"""The corpus: documents (by default the text that ships with the Python interpreter), tokenized into
fixed-length training chunks and held-out chunks of whole documents, cached under ``OUT/cache``."""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import math
import os
import random
import re
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.distill.config import CACHE_DIR, DistillConfig
from specdec.errors import ConfigError

logger = logging.getLogger("specdec.distill")  # one logger for the whole command

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings"}


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


def separator_id(tokenizer: Any) -> int | None:
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
    by_kind: dict[str, list[Document]] = {}
    for d in docs:
        by_kind.setdefault(d.kind, []).append(d)
    share = _kind_shares(by_kind, prose_fraction)
    # Read only about as much text as the budgets need (generous 6 chars per token bound).
    tokens = _tokenize_kinds(tokenizer, by_kind, share, (max_train_tokens + eval_tokens) * 6, rng)
    avail = {k: sum(map(len, v)) for k, v in tokens.items()}
    want = _achievable_tokens(share, avail, max_train_tokens + eval_tokens)
    train_by_kind: dict[str, torch.Tensor] = {}
    eval_chunks: list[torch.Tensor] = []
    eval_kinds: list[str] = []
    counts: dict[str, dict[str, int]] = {}
    for kind in sorted(tokens):
        # Held out in the wanted shares, at most a quarter of a kind's text.
        want_eval = min(int(round(eval_tokens * share[kind] / sum(share[k] for k in tokens))), avail[kind] // 4)
        ec, chunks = _split_kind(tokens[kind], seq_len, want_eval, int(want[kind]) - want_eval)
        eval_chunks.append(ec)
        eval_kinds.extend([kind] * len(ec))
        counts[kind] = {"documents": len(tokens[kind]), "train_tokens": int(chunks.numel()),
                        "eval_tokens": int(ec.numel())}
        gen = torch.Generator().manual_seed(seed + len(train_by_kind))
        train_by_kind[kind] = chunks[torch.randperm(len(chunks), generator=gen)]
    train, train_kinds = _interleave(train_by_kind, share, rng, max(1, max_train_tokens // seq_len), seq_len)
    for kind in counts:
        counts[kind]["train_tokens"] = train_kinds.count(kind) * seq_len
    eval_ = torch.cat(eval_chunks) if eval_chunks else torch.empty(0, seq_len, dtype=torch.int32)
    if len(train) == 0 or len(eval_) == 0:
        raise ConfigError(
            f"corpus too small for --seq-len {seq_len}: {len(train)} training and {len(eval_)} held-out chunks"
        )
    return {"train": train, "eval": eval_, "eval_kinds": eval_kinds, "train_kinds": train_kinds, "counts": counts}


def _kind_shares(by_kind: dict[str, list[Document]], prose_fraction: float | None) -> dict[str, float]:
    """The wanted share of each kind's tokens: ``prose_fraction`` when the corpus has prose and code, else
    each kind's share of the corpus's characters."""
    chars = {k: sum(len(d.text) for d in v) for k, v in by_kind.items()}
    total_chars = sum(chars.values()) or 1
    share = {k: c / total_chars for k, c in chars.items()}
    if prose_fraction is not None and set(by_kind) == {"prose", "code"}:
        share = {"prose": prose_fraction, "code": 1.0 - prose_fraction}
    return share


def _tokenize_kinds(tokenizer: Any, by_kind: dict[str, list[Document]], share: dict[str, float], budget_chars: int,
                    rng: random.Random) -> dict[str, list[list[int]]]:
    """Per kind, the token ids of its documents in a shuffled order, each followed by the separator token:
    only as many documents as the kind's share of ``budget_chars`` needs."""
    sep = separator_id(tokenizer)
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
    return tokens


def _achievable_tokens(share: dict[str, float], avail: dict[str, int], budget: int) -> dict[str, float]:
    """Tokens wanted of each kind: its share of the budget, where a kind with too little text gives up its
    surplus share to the others."""
    total_avail = sum(avail.values()) or 1
    want_total = min(total_avail, budget)
    want = {k: share[k] * want_total for k in avail}
    short = {k for k in avail if avail[k] < want[k]}
    if short and len(short) < len(avail):
        spare = sum(want[k] - avail[k] for k in short)
        rest = [k for k in avail if k not in short]
        rest_share = sum(share[k] for k in rest)
        for k in short:
            want[k] = avail[k]
        for k in rest:
            want[k] += spare * share[k] / rest_share
    return want


def _split_kind(ids_list: list[list[int]], seq_len: int, want_eval: int,
                want_train: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One kind's documents as held-out chunks (the first whole documents, about ``want_eval`` tokens) and
    training chunks (the following documents, ``want_train`` tokens)."""
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
    return ec, _chunk(stream, seq_len)


def _interleave(train_by_kind: dict[str, torch.Tensor], share: dict[str, float], rng: random.Random, n_train: int,
                seq_len: int) -> tuple[torch.Tensor, list[str]]:
    """The first ``n_train`` training chunks in training order, and their kinds.

    Training order (epoch 0, and the order in which a time-limited run labels chunks): each next chunk
    is of a kind drawn with the kind's share while it lasts, so a scarce kind (prose in the default
    corpus) keeps its share at the front of the stream instead of being spread thin over all of it."""
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
    train = torch.stack(picked[:n_train]) if picked else torch.empty(0, seq_len, dtype=torch.int32)
    return train, train_kinds[:n_train]


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

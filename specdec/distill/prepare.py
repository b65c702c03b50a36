"""What training reads, set up before the first step: the target (the teacher), the tokenized corpus, the
teacher's labels of the held-out chunks and the on-policy data."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdec.distill.config import DistillConfig
from specdec.distill.corpus import Dataset, prepare_data, separator_id
from specdec.distill.onpolicy import GeneratedData
from specdec.distill.teacher import TeacherCache, chunks_per_shard
from specdec.engine.models import load_model
from specdec.model_files import model_construction, tokenizer_fingerprint

logger = logging.getLogger("specdec.distill")  # one logger for the whole command


@dataclass
class Prepared:
    """The run's inputs: the target, the corpus and the teacher's labels (and the on-policy data)."""

    cfg: DistillConfig
    out: Path
    target: Any  # the loaded target (specdec.engine.models): .model is the teacher
    data: Dataset
    vocab: int  # rows of the target's lm_head
    cache: TeacherCache  # teacher labels of the corpus chunks
    shard_size: int  # chunks per shard of teacher labels
    n_eval_shards: int
    generated: GeneratedData | None = None  # on-policy chunks (--generated-tokens)
    gen_seconds: float = 0.0  # time this invocation spent generating them

    @property
    def teacher(self) -> Any:
        return self.target.model

    @property
    def n_corpus(self) -> int:
        """Training chunks of the corpus: chunk indices [0, n_corpus) are corpus chunks, the n_gen after them
        on-policy chunks."""
        return len(self.data.train)

    @property
    def n_gen(self) -> int:
        return self.generated.n["train"] if self.generated is not None else 0


def prepare(cfg: DistillConfig, out: Path) -> Prepared:
    """Seed, load the target, tokenize the corpus, label the held-out chunks and generate the on-policy data
    (each reused from ``OUT/cache`` when there)."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    target = load_model(cfg.target, dtype="float32")
    fp = tokenizer_fingerprint(target.tokenizer)
    data = prepare_data(cfg, target.tokenizer, fp, out)
    vocab = int(target.model.get_output_embeddings().weight.shape[0])
    tkey = hashlib.sha256(f"{target.source}|{fp}|{cfg.top_k}|bf16-autocast|v1".encode()).hexdigest()[:10]
    shard_size = chunks_per_shard(cfg.seq_len)
    cache = TeacherCache(data.folder / f"teacher-{tkey}-k{cfg.top_k}-s{shard_size}", cfg.top_k, vocab, shard_size)
    prep = Prepared(cfg, out, target, data, vocab, cache, shard_size, math.ceil(len(data.eval) / shard_size))
    label_shards(prep, "eval", list(range(prep.n_eval_shards)), data.eval, "teacher labels (held-out)")
    if cfg.generated_tokens:
        prep.generated, prep.gen_seconds = _generate_onpolicy_data(prep, tkey)
    return prep


def label_shards(prep: Prepared, split: str, shards: list[int], chunks: torch.Tensor, desc: str) -> float:
    """Teacher-label those of ``shards`` that are not labelled yet; returns the seconds it took."""
    cache, shard_size = prep.cache, prep.shard_size
    todo = [s for s in shards if not cache.has(split, s)]
    if not todo:
        return 0.0
    t0 = time.perf_counter()
    n_tok = sum(int(chunks[s * shard_size: (s + 1) * shard_size].numel()) for s in todo)
    with tqdm(total=n_tok, desc=desc, unit="tok", unit_scale=True, leave=False, disable=prep.cfg.no_progress) as bar:
        for s in todo:
            cache.label(split, s, chunks, prep.teacher, prep.cfg.teacher_batch, bar)
    return time.perf_counter() - t0


def _generate_onpolicy_data(prep: Prepared, tkey: str) -> tuple[GeneratedData, float]:
    """The on-policy data, generated (and labelled in the same passes) before training by a bf16 copy of the
    target where not cached; returns it and the seconds generating took."""
    cfg, data = prep.cfg, prep.data
    gspec = {"data": data.key, "teacher": tkey, "tokens": cfg.generated_tokens, "seed": cfg.seed,
             "prompt_len": cfg.generate_prompt_len, "free": cfg.generate_free_fraction, "v": 1}
    gkey = hashlib.sha256(json.dumps(gspec, sort_keys=True).encode()).hexdigest()[:10]
    generated = GeneratedData(data.folder / f"generated-{gkey}", cfg, data, separator_id(prep.target.tokenizer),
                              prep.shard_size)
    todo = [(sp, sh) for sp in ("eval", "train") for sh in range(generated.shards(sp))
            if not generated.labels.has(sp, sh)]
    if not todo:
        return generated, 0.0
    t0 = time.perf_counter()
    with model_construction():
        gen_model = copy.deepcopy(prep.teacher).to(torch.bfloat16)
    n_tok = sum(min(generated.n[sp] - sh * prep.shard_size, prep.shard_size) * cfg.seq_len for sp, sh in todo)
    with tqdm(total=n_tok, desc="on-policy continuations", unit="tok", unit_scale=True, leave=False,
              disable=cfg.no_progress) as gbar:
        for sp, sh in todo:
            generated.generate(gen_model, sp, sh, gbar)
    del gen_model
    gen_seconds = time.perf_counter() - t0
    logger.info("generated %d on-policy chunks in %.1f min", sum(generated.n.values()), gen_seconds / 60)
    return generated, gen_seconds

"""On-policy data: the target's own continuations of corpus snippets, labelled as they are generated."""

from __future__ import annotations

import inspect
import math
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdec.distill.teacher import TeacherCache

if TYPE_CHECKING:
    from specdec.distill.config import DistillConfig
    from specdec.distill.corpus import Dataset


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

"""The teacher signal: the target's top-k next-token log-probabilities of every position, computed once
by batched bf16-autocast inference and stored in shards (safetensors, bf16) under ``OUT/cache``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from specdec.distill.modeling import body, final_softcap

SHARD_TOKENS = 16384  # teacher labels are stored and computed in shards of about this many tokens


def chunks_per_shard(seq_len: int) -> int:
    """Chunks of ``seq_len`` tokens in a shard of teacher labels."""
    return max(1, SHARD_TOKENS // seq_len)


@torch.no_grad()
def teacher_topk(teacher: Any, input_ids: torch.Tensor, k: int, rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k next-token log-probabilities of every position: ids (B,T,k) int64, log-probs (B,T,k) fp32."""
    cap = final_softcap(teacher.config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = body(teacher)(input_ids=input_ids.long()).last_hidden_state
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

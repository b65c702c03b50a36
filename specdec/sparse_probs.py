"""q rows (a draft's distributions) as sparse rows and back: the tensor side of their wire form.

A row is ``(token_ids, probs)``: the non-zero entries when that is smaller, else every entry with
``token_ids`` empty. The protobuf side (``specdec.serving.wire``) only copies these lists.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from specdec.errors import InvalidRequestError

Row = tuple[Sequence[int], Sequence[float]]


def to_rows(probs: torch.Tensor | None) -> list[Row]:
    """[k, vocab] → k rows, each sparse when that is smaller."""
    if probs is None:
        return []
    probs = to_host(probs)  # one device -> host copy, not one per row
    out: list[Row] = []
    for row in probs:
        nz = row.nonzero().squeeze(-1)
        if nz.numel() * 2 < row.numel():
            out.append((nz.tolist(), row[nz].tolist()))
        else:
            out.append(([], row.tolist()))
    return out


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor copied to the host through pinned memory in one transfer; a CPU tensor as it is."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (off the wire) onto ``device``, through pinned memory when that is a GPU."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def from_rows(rows: Iterable[Row], k: int, vocab_size: int) -> torch.Tensor | None:
    """k rows → [k, vocab_size] float32 (None when there are no rows: one-hot drafts)."""
    rows = list(rows)
    if not rows:
        return None
    if len(rows) != k:
        raise InvalidRequestError(f"draft_probs has {len(rows)} rows for {k} draft tokens", param="draft_probs")
    out = torch.zeros((k, vocab_size), dtype=torch.float32)
    for i, (ids, probs) in enumerate(rows):
        if len(ids):
            if len(ids) != len(probs):
                raise InvalidRequestError("draft_probs: token_ids and probs differ in length", param="draft_probs")
            index = torch.tensor(list(ids), dtype=torch.long)
            if int(index.max()) >= vocab_size:
                raise InvalidRequestError("draft_probs names a token outside the vocabulary", param="draft_probs")
            out[i, index] = torch.tensor(list(probs), dtype=torch.float32)
        else:
            if len(probs) > vocab_size:  # shorter: a draft with a smaller (padded) vocabulary
                raise InvalidRequestError(
                    f"dense draft_probs row has {len(probs)} entries, the vocabulary has {vocab_size}",
                    param="draft_probs",
                )
            out[i, : len(probs)] = torch.tensor(list(probs), dtype=torch.float32)
    return out

"""Perplexity of a causal LM over shipped text: the quality measure of an execution mode.

:func:`shipped_text` reads the two English texts shipped in ``specdec/assets/text`` (original prose written
for specdec; see the README there): ``calibration`` (for calibrating activation-smoothing scales) and
``heldout`` (for measuring). :func:`perplexity` scores a token sequence window by window, each window a fresh
sequence from position 0, through either a transformers causal LM or specdec's lean decoder
(:class:`specdec.engine.lean_decoder.LeanDecoder`), so a mode's perplexity can be compared with the
reference's on the same tokens. :func:`text_perplexity` tokenizes a text first.

Windows do not overlap by default (``stride = window``): every token but the first of each window is
predicted from the tokens before it in its window. With ``stride < window`` the evaluation slides: each
window after the first scores only its last ``stride`` tokens, so every token after the first is predicted
with at least ``window - stride`` tokens of context. Log-probabilities are taken in fp32 whatever the
model's dtype, and the negative log-likelihoods are summed in fp64.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import torch

TEXT_DIR = Path(__file__).resolve().parents[1] / "assets" / "text"  # specdec/assets/text
TEXTS = ("calibration", "heldout")


def shipped_text(name: str) -> str:
    """The shipped text ``name`` (one of :data:`TEXTS`), read from ``specdec/assets/text/{name}.txt``."""
    if name not in TEXTS:
        raise ValueError(f"unknown text {name!r}; choose one of {list(TEXTS)}")
    return (TEXT_DIR / f"{name}.txt").read_text(encoding="utf-8")


def _logits(net: Any, ids: torch.Tensor) -> torch.Tensor:
    """One fresh sequence's logits [n, vocab] for ``ids`` [n] at positions 0..n-1."""
    positions = torch.arange(ids.shape[0], device=ids.device)[None]
    if isinstance(net, torch.nn.Module):  # a transformers causal LM (5.x renamed `past_key_values` to `cache`)
        from transformers import DynamicCache

        cache_kwarg = "cache" if "cache" in inspect.signature(net.forward).parameters else "past_key_values"
        out = net(input_ids=ids[None], position_ids=positions, use_cache=True,
                  **{cache_kwarg: DynamicCache()})
    else:  # a LeanDecoder: a cache whose layers exist up front (it updates cache.layers[i] itself), as the runner's
        from specdec.engine.kv_cache import SequenceKVCache

        cache = SequenceKVCache(len(net.layers), ids.shape[0])
        out = net(ids[None], positions, cache=cache, logits_to_keep=0)
    return out.logits[0]


def _device(net: Any) -> torch.device:
    if isinstance(net, torch.nn.Module):
        return next(net.parameters()).device
    return net.embed.device


def windows(length: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, first)`` per window: run tokens ``[begin, end)``, score the targets ``[first, end)``."""
    out: list[tuple[int, int, int]] = []
    scored = 1  # the first token is never predicted
    for begin in range(0, length, stride):
        end = min(begin + window, length)
        first = max(scored, begin + 1)  # a window's own first token has no prediction in it
        if first < end:
            out.append((begin, end, first))
        scored = end
        if end == length:
            break
    return out


@torch.inference_mode()
def perplexity(net: Any, token_ids: torch.Tensor | list[int], window: int = 512,
               stride: int | None = None) -> dict[str, float | int]:
    """Perplexity of ``net`` (a transformers causal LM or a ``LeanDecoder``) on ``token_ids``.

    Returns ``{"perplexity": exp(nll), "nll": mean negative log-likelihood per predicted token (nats),
    "tokens": number of predicted tokens}``.
    """
    stride = window if stride is None else stride
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window (got window={window}, stride={stride})")
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().to(_device(net))
    if ids.numel() < 2:
        raise ValueError(f"need at least 2 tokens to predict one (got {ids.numel()})")
    total, count = 0.0, 0
    for begin, end, first in windows(ids.numel(), window, stride):
        logits = _logits(net, ids[begin:end])
        # the logits at position t - 1 predict token t: the rows of the scored targets only
        rows = logits[first - 1 - begin:end - 1 - begin].float().log_softmax(-1)
        targets = ids[first:end]
        total -= float(rows.gather(-1, targets[:, None]).double().sum())
        count += end - first
    nll = total / count
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": count}


def text_perplexity(net: Any, tokenizer: Any, text: str, window: int = 512,
                    max_tokens: int | None = None) -> dict[str, float | int]:
    """:func:`perplexity` of ``text`` tokenized with the tokenizer's own special tokens (a BOS where it
    adds one), cut to its first ``max_tokens`` tokens."""
    ids = list(tokenizer(text, add_special_tokens=True).input_ids)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return perplexity(net, ids, window=window)

"""Allowed-token bitmasks: what a grammar lets each verified position emit, applied to the target's logits.

One row per position, ``ceil(vocab / 32)`` int32 words, bit ``t % 32`` of word ``t // 32`` set when token
``t`` is allowed (xgrammar's and vLLM's layout, so a matcher fills rows in place). Rows travel to the
target service as little-endian bytes (``VerifyRequest.token_bitmask``). Plain torch: the same code
masks CPU and CUDA logits. No grammar engine here: the target service needs none.
"""

from __future__ import annotations

import torch

from specdec.errors import InvalidRequestError

_BITS = torch.arange(32, dtype=torch.int32)


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_rows(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 → [rows, vocab_size] bool (True: allowed)."""
    bits = _BITS.to(bitmask.device)
    unpacked = (bitmask.to(torch.int32)[:, :, None] >> bits) & 1  # [rows, words, 32]
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """Logits ``[rows, vocab]`` with every token the row's mask forbids at -inf (a new tensor; ``None``:
    unchanged). Applied first, before penalties, temperature, top-k/top-p (vLLM's order), so the target's
    distribution at each position is the constrained one target-only decoding samples from."""
    if bitmask is None:
        return logits
    rows, vocab = logits.shape
    if bitmask.shape[0] != rows:
        raise InvalidRequestError(f"token_bitmask has {bitmask.shape[0]} rows, expected {rows} (one per draft "
                                  "token and one for the next token)", param="token_bitmask")
    allowed = allowed_rows(bitmask.to(logits.device), vocab)
    return logits.masked_fill(~allowed, float("-inf"))


def allows(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    return bool((int(bitmask[row, token_id // 32]) >> (token_id % 32)) & 1)


def from_bytes(data: bytes, rows: int, vocab_size: int) -> torch.Tensor | None:
    """``specdec.serving.wire.mask_to_bytes``'s rows back ([rows, words] int32; None for b""), checked against the call's shape."""
    if not data:
        return None
    words = num_words(vocab_size)
    if len(data) != 4 * rows * words:
        raise InvalidRequestError(
            f"token_bitmask has {len(data)} bytes; {rows} rows (draft tokens + 1) of {words} int32 words over a "
            f"vocabulary of {vocab_size} take {4 * rows * words}", param="token_bitmask")
    return torch.frombuffer(bytearray(data), dtype=torch.int32).reshape(rows, words).clone()

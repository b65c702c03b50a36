"""Scoring a whole prompt (``prompt_logprobs``, ``echo``) in memory that does not grow with [prompt, vocabulary].

A pass that scores every position of a prompt needs a distribution per position. Materialised at once that is
``[prompt length, vocabulary]`` fp32 logits (a 32k-token prompt on Gemma-3's 262,144-token vocabulary: 34 GB),
then as much again for their log-softmax. The runner instead keeps such a row's last hidden states
(``[prompt length, hidden]``, the size of one layer's activations) as :class:`RowLogits`, and the logprobs are
read from it a chunk of rows at a time (:func:`specdec.sampling.token_logprobs`): each chunk goes through the
final norm and the LM head, then log-softmax and top-N, and is dropped before the next. A chunk is at most
``specdec.sampling.LOGPROBS_CHUNK_BYTES`` of fp32 logits, so the peak is independent of the prompt's length.

Every step is per row (norm, LM head, softcap, log-softmax), so a chunk's rows are the same numbers they are in
one big product wherever the products are batch-invariant (the CPU target's default, ``--batch-invariant``);
elsewhere they may differ in the last bits, as any two pass shapes do.

What still grows with the prompt is refused up front (:func:`check_scoring`, an ``InvalidRequestError``:
gRPC INVALID_ARGUMENT, HTTP 400) instead of running out of memory: the transformers forward
(``--no-lean-forward``) returns the pass's logits whole, and SDPA attention on CPU without the batch-invariant
kernel builds ``[query rows, keys]`` masks for a prompt fed in one pass.
"""

from __future__ import annotations

from typing import Callable

import torch

from specdec.errors import InvalidRequestError

# A pass that scores a whole prompt may hold at most this many bytes of [prompt, vocabulary] logits or
# [rows, keys] attention masks; a request that would need more is refused with a 400 saying so.
SCORING_PASS_MAX_BYTES = 2 << 30


class RowLogits:
    """One row's logits [m, vocab] fp32, computed on demand: ``self[a:b]`` is the same for rows a..b (nothing
    computed yet), ``materialize()`` projects its rows through the LM head."""

    def __init__(self, hidden: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor], vocab_size: int):
        self.hidden = hidden  # [m, hidden]
        self.project = project  # hidden rows [r, hidden] -> logits [r, vocab] fp32
        self.shape = (int(hidden.shape[0]), vocab_size)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> RowLogits:
        if not isinstance(rows, slice):
            raise TypeError("RowLogits takes a slice of rows")
        return RowLogits(self.hidden[rows], self.project, self.shape[1])

    def materialize(self) -> torch.Tensor:
        with torch.inference_mode():
            return self.project(self.hidden)


def materialize(logits: torch.Tensor | RowLogits) -> torch.Tensor:
    """``logits`` as a tensor (a RowLogits projected)."""
    return logits if isinstance(logits, torch.Tensor) else logits.materialize()


def scoring_pass_bytes(num_tokens: int, vocab_size: int, paged: bool, sdpa_masks: bool, group: int,
                       num_kinds: int) -> int:
    """Bytes a pass that scores ``num_tokens`` positions at once holds beyond the model and its KV cache, in the
    parts that grow faster than the prompt: whole logits (transformers' forward: the model's copy, the fp32
    copy), and on the SDPA path a boolean and an fp32 mask of [group * tokens, tokens] per layer kind."""
    total = 0 if paged else 2 * num_tokens * vocab_size * 4
    if sdpa_masks:
        total += num_kinds * group * num_tokens * num_tokens * (1 + 4)
    return total


def check_scoring(role: str, num_tokens: int, need: int) -> None:
    """Refuse scoring ``num_tokens`` positions when the pass would hold ``need`` > SCORING_PASS_MAX_BYTES."""
    if need > SCORING_PASS_MAX_BYTES:
        raise InvalidRequestError(
            f"{role}: scoring a prompt of {num_tokens} tokens (prompt_logprobs / echo) would need "
            f"{need / 2**30:.1f} GiB in one pass here (at most {SCORING_PASS_MAX_BYTES / 2**30:.0f} GiB); "
            "send a shorter prompt, or ask without prompt logprobs", param="prompt_logprobs")

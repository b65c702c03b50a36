"""Which tokens each pass feeds: decode first, then prefill chunks, under one token budget (pure Python).

A pass takes every row's decode or verify tokens whole; what is left of ``max_num_batched_tokens`` goes to
prompts being prefilled, in chunks, shortest first. While other sequences are decoding (in this pass or
between two of their calls), a long prompt gets at most ``long_prefill_token_threshold`` tokens per pass and
at most ``max_num_partial_prefills`` prompts progress at once (vLLM's settings of the same names), so a pass
that carries a chunk costs about one decode round more, never the whole prompt. Alone, a prompt takes the
whole budget per pass: its time to first token is what it was.

``long_prefill_token_threshold = 0`` (the default) sizes the chunk from what this service measured: the
seconds a pass spends per fed token and the decoding sequences' round period (the time between two calls of
one sequence, measured while nothing prefills), so that a chunk costs ``PREFILL_SHARE`` round periods. The
trade is between the decoding streams' rounds and the prompt's time to first token: on a 2-core CPU
(``benchmarks/bench_interference.py``, SmolLM2-135M, a 3,500-token prompt beside one stream), chunks of 16 /
48 / 96 / 160 / 320 tokens gave the stream a round every 129 / 199 / 275 / 494 / 761 ms (45 ms alone) and the
prompt 2.9 / 1.57 / 1.28 / 1.19 / 1.07x its time to first token alone; one 3,500-token pass (the old way) gave
the stream no round for 8.8 s. ``PREFILL_SHARE`` = 3 lands near 48 there: a stream keeps a round every few
hundred ms, a pasted document waits ~1.6x. A GPU, whose chunk costs little more than a decode step, gets the
whole budget from the same rule.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Sequence
from typing import Any

# vLLM's max_num_batched_tokens: tokens fed per pass at most (decode rows are never cut; prompts are chunked).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
# vLLM's long_prefill_token_threshold: beside decoding sequences, a prompt's chunk per pass (0: measured).
DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD = 0
# vLLM's max_num_partial_prefills: prompts prefilled in the same pass while others decode.
DEFAULT_MAX_NUM_PARTIAL_PREFILLS = 1
# auto threshold: a chunk's pass costs this many round periods of the decoding sequences (see the module)
PREFILL_SHARE = 3.0
# a sequence called within this many seconds is decoding (mid round trip) unless its prompt is being prefilled
DECODING_WINDOW_S = 1.0
# passes feeding at least this many tokens measure the seconds per token
_MEASURED_FEED = 32


class PassScheduler:
    """Decides each pass's tokens per row, and measures what passes cost to size prefill chunks."""

    def __init__(self, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 long_prefill_token_threshold: int = DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
                 max_num_partial_prefills: int = DEFAULT_MAX_NUM_PARTIAL_PREFILLS, block_size: int = 16,
                 row_multiple: int = 1, short_kind: str = "decode"):
        check_budget(max_num_batched_tokens, long_prefill_token_threshold, max_num_partial_prefills)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_num_partial_prefills = max_num_partial_prefills
        self.block_size = block_size
        # Rows a pass's products compute in whole multiples of (batch-invariant CPU passes: 16-row tiles, each
        # reading the weights once): a chunk beside decode rows is cut so the pass fills its last tile.
        self.row_multiple = row_multiple
        self.short_kind = short_kind  # what a short row is (a draft's: decode steps; a target's: verify windows)
        self.seconds_per_token: float | None = None  # EMA over passes feeding >= _MEASURED_FEED tokens
        self._periods: collections.deque[float] = collections.deque(maxlen=64)  # decoding sequences' round periods
        # what passes fed (for metrics and tests): tokens by kind, and passes planned
        self.fed = {"decode": 0, "verify": 0, "prefill": 0}
        self.passes = 0

    # -- measurements ----------------------------------------------------------------------------
    def note_pass(self, tokens: int, seconds: float) -> None:
        if tokens >= _MEASURED_FEED and seconds > 0:
            x = seconds / tokens
            self.seconds_per_token = x if self.seconds_per_token is None else 0.8 * self.seconds_per_token + 0.2 * x

    def note_round(self, seconds: float) -> None:
        """A decoding sequence's time between two calls (its round period)."""
        if 0 < seconds < DECODING_WINDOW_S:
            self._periods.append(seconds)

    def round_period(self) -> float | None:
        return statistics.median(self._periods) if self._periods else None

    def prefill_chunk(self) -> int:
        """A long prompt's tokens per pass while other sequences decode."""
        if self.long_prefill_token_threshold:
            return self.long_prefill_token_threshold
        period, cost, bs = self.round_period(), self.seconds_per_token, self.block_size
        if period is None or cost is None:
            return 4 * bs  # nothing measured yet: a small chunk, measured as it runs
        chunk = int(PREFILL_SHARE * period / cost) // bs * bs
        return max(bs, min(chunk, self.max_num_batched_tokens))

    # -- the plan ----------------------------------------------------------------------------------
    def plan(self, feeds: Sequence[int], chunkable: Sequence[bool], arrival: Sequence[Any],
             decoding_elsewhere: bool) -> list[int]:
        """Tokens each row feeds this pass. Rows that are not ``chunkable`` (verify windows, scored prompts) feed
        whole; chunkable rows that fit feed whole, shortest first; a long prompt gets a chunk (at most
        ``prefill_chunk()`` while anyone else decodes), the lowest ``arrival`` first (a rank: the runner gives
        (priority, arrival order)), at most ``max_num_partial_prefills`` of them while others decode. A prompt always gets at least one block when it
        is the pass's only work, so every pass makes progress."""
        take = [0 if c else f for f, c in zip(feeds, chunkable)]
        left = self.max_num_batched_tokens - sum(take)
        chunk = self.prefill_chunk()
        order = sorted((i for i, c in enumerate(chunkable) if c), key=lambda i: (feeds[i], arrival[i]))
        whole = [i for i in order if feeds[i] <= chunk]
        for i in whole:  # short feeds (the draft's decode rows, short prompts) whole while they fit
            if feeds[i] <= left:
                take[i], left = feeds[i], left - feeds[i]
        longs = sorted((i for i in order if take[i] == 0), key=lambda i: arrival[i])
        others = decoding_elsewhere or any(take)
        partial = self.max_num_partial_prefills if others else len(longs)
        m = self.row_multiple
        for i in longs[:partial]:
            n = min(feeds[i], max(left, 0), chunk if others else feeds[i])
            if others and m > 1 and n < feeds[i]:  # fill the pass's last tile, never past the budget
                used = sum(take)
                filled = -(-(used + n) // m) * m - used
                n = min(feeds[i], filled if used + filled <= self.max_num_batched_tokens else n)
            if n <= 0 and not any(take):
                n = min(feeds[i], self.block_size)  # the pass's only work: progress
            take[i], left = n, left - n
        self.passes += 1
        for t, f in zip(take, feeds):
            self.fed[self.short_kind if t == f and f <= chunk else "prefill"] += t
        return take

    def stats(self) -> dict:
        return {"tokens": dict(self.fed), "passes": self.passes, "max_num_batched_tokens": self.max_num_batched_tokens,
                "prefill_chunk_tokens": self.prefill_chunk()}


def check_budget(max_num_batched_tokens: int, long_prefill_token_threshold: int, max_num_partial_prefills: int) -> None:
    """The scheduler's settings, checked (ValueError naming the flag)."""
    if max_num_batched_tokens < 1:
        raise ValueError(f"--max-num-batched-tokens must be >= 1, got {max_num_batched_tokens}")
    if long_prefill_token_threshold < 0:
        raise ValueError(f"--long-prefill-token-threshold must be >= 0 (0: measured), got {long_prefill_token_threshold}")
    if max_num_partial_prefills < 1:
        raise ValueError(f"--max-num-partial-prefills must be >= 1, got {max_num_partial_prefills}")

"""Deadlines of the gateway's backend calls, from the measured time of each backend's calls.

A call the client set no deadline for still gets one: ``factor`` x the slowest recent call of that
backend, and for a call that sends many tokens (a prefill) ``factor`` x the slowest recent time per
token sent times its tokens, never less than ``floor`` seconds. A busy backend is waited for and a
long prefill is not cut, but a backend that stops answering (SIGSTOP, a stuck GPU, a half-open TCP
connection) is found out within seconds: the call fails with UNAVAILABLE naming the backend, and the
gateway moves the sequence to another replica or answers 503.
"""

from __future__ import annotations

import collections
import threading

# Before any call was measured, a call gets the floor for every this many tokens it sends.
UNMEASURED_TOKENS_PER_FLOOR = 1024
# Calls sending at least this many tokens teach the time per token (a decode round's time is its overhead).
MIN_TOKENS_PER_TOKEN_RATE = 16


class CallDeadline:
    """The deadline (seconds) of a backend's next call, learnt from its recent calls.

    A prefill's time grows with its tokens, and faster than linearly (attention reads every earlier token):
    a call sending more tokens than any measured one gets the largest one's time scaled by the square of the
    ratio, an upper bound of that growth, so a 16k-token prompt is not cut by what 100-token prompts took.
    """

    def __init__(self, floor: float, factor: float, window: int = 64):
        self.floor = floor
        self.factor = factor
        self._calls: collections.deque[float] = collections.deque(maxlen=window)  # seconds of recent decode calls
        # (tokens sent, seconds) of recent calls that sent at least MIN_TOKENS_PER_TOKEN_RATE tokens
        self._prefills: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, seconds: float, tokens: int) -> None:
        """A call that sent ``tokens`` tokens answered after ``seconds``."""
        with self._lock:
            if tokens >= MIN_TOKENS_PER_TOKEN_RATE:
                self._prefills.append((tokens, seconds))
            else:  # a decode round's: a prefill's time (many passes, in chunks beside the decoding sequences) would
                self._calls.append(seconds)  # stretch every round's deadline (it has its own, by its tokens)

    def timeout(self, tokens: int) -> float:
        """The deadline of a call that sends ``tokens`` tokens."""
        with self._lock:
            slowest = max(self._calls, default=0.0)
            prefills = list(self._prefills)
        larger = [s * tokens / t for t, s in prefills if t >= tokens]
        if larger:  # calls at least this size, scaled down linearly (time grows at least linearly)
            estimate = max(larger)
        elif prefills:  # larger than any measured: the largest one's time x the square of the ratio
            t, s = max(prefills)
            estimate = s * (tokens / t) ** 2
        else:  # unmeasured: the floor for every UNMEASURED_TOKENS_PER_FLOOR tokens, quadratic past that many
            ratio = tokens / UNMEASURED_TOKENS_PER_FLOOR
            estimate = self.floor * ratio * max(1.0, ratio) / self.factor
        return max(self.floor, self.factor * slowest, self.factor * estimate)

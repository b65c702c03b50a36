"""The target's hidden states on their way to an EAGLE head (no torch here, no grpc).

An EAGLE-3 head drafts from the target's own features: for each position ``p`` whose next token is known, the
hidden states of a few target layers concatenated (``specdec.engine.eagle3``). The target computes them in its
verify pass when asked (``VerifyCall.feature_layers``); the draft consumes them in its next proposal
(``ProposeCall.features``). Between the two, a ``FeatureRelay`` keeps, per sequence, the features the draft has
not yet taken: in-process (the offline ``LLM``) the chunks hold tensors, in the gateway they hold the wire form.

The relay's protocol, per sequence:
- ``verify_from``: the first position whose features the target should return (normally the target's own
  cache length, so nothing is fed twice);
- ``put``: the target's chunk, appended;
- ``pending``: the chunks the draft is sent with its next Propose;
- ``acknowledge``: the draft's answer, the first position it still lacks a feature for (``Proposal.
  features_from``). Chunks wholly before it are dropped. When the draft holds less than the relay kept (a draft
  restarted, or evicted the sequence), the relay forgets what it kept and asks the target for features from
  that position at the next verify (the target feeds those positions again): one round verifies without drafts,
  and the output is the target's either way.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

# EAGLE-3's default layers, as vLLM picks them: low, middle, high (the input of these decoder layers)
def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


@dataclass
class FeatureChunk:
    """The features of positions [start, start + rows): ``data`` is a tensor [rows, width] (in-process) or the
    row-major bytes of one in ``dtype`` (on the wire)."""

    start: int
    rows: int
    width: int
    dtype: str  # "bfloat16" | "float16" | "float32"
    data: Any

    @property
    def end(self) -> int:
        return self.start + self.rows


@dataclass
class _Kept:
    chunks: list[FeatureChunk] = field(default_factory=list)
    next_start: int = 0  # the first position the target has not returned features for


class FeatureRelay:
    """Per sequence, the target's features the draft has not consumed yet (thread-safe)."""

    def __init__(self, layers: tuple[int, ...], max_rows: int = 4096):
        self.layers = tuple(layers)
        self.max_rows = max_rows  # kept per sequence at most; past it the oldest go (the draft then asks again)
        self._kept: dict[str, _Kept] = {}
        self._lock = threading.Lock()

    def verify_from(self, sequence_id: str) -> int:
        with self._lock:
            kept = self._kept.get(sequence_id)
            return 0 if kept is None else kept.next_start

    def put(self, sequence_id: str, chunk: FeatureChunk | None) -> None:
        if chunk is None:
            return
        with self._lock:
            kept = self._kept.setdefault(sequence_id, _Kept())
            if kept.chunks and chunk.start != kept.chunks[-1].end:  # not contiguous: keep the newest only
                kept.chunks.clear()
            kept.chunks = [c for c in kept.chunks if c.end <= chunk.start]
            kept.chunks.append(chunk)
            kept.next_start = chunk.end
            while sum(c.rows for c in kept.chunks) > self.max_rows and len(kept.chunks) > 1:
                kept.chunks.pop(0)

    def pending(self, sequence_id: str) -> list[FeatureChunk]:
        with self._lock:
            kept = self._kept.get(sequence_id)
            return [] if kept is None else list(kept.chunks)

    def acknowledge(self, sequence_id: str, features_from: int | None) -> None:
        """The draft holds target features for the positions before ``features_from``."""
        if features_from is None:
            return
        with self._lock:
            kept = self._kept.setdefault(sequence_id, _Kept())
            first = kept.chunks[0].start if kept.chunks else kept.next_start
            if features_from < first:  # the draft lost what the relay dropped: the target computes it again
                kept.chunks.clear()
                kept.next_start = features_from
                return
            kept.chunks = [c for c in kept.chunks if c.end > features_from]

    def drop(self, sequence_id: str) -> None:
        with self._lock:
            self._kept.pop(sequence_id, None)

    def __len__(self) -> int:
        return len(self._kept)


class RelayedTarget:
    """A target worker (``verify_batch``) that returns features through ``relay`` (the offline LLM's)."""

    def __init__(self, worker: Any, relay: FeatureRelay):
        self.worker, self.relay = worker, relay
        self.runner = worker.runner

    def verify(self, sequence_id: str, token_ids: list[int], proposal: Any, params: Any) -> Any:
        from specdec.calls import VerifyCall, until_finished

        call = VerifyCall(sequence_id, token_ids, proposal, params, feature_layers=self.relay.layers,
                          feature_start=self.relay.verify_from(sequence_id))
        result = until_finished(self.worker.verify_batch, call)
        if isinstance(result, BaseException):
            raise result
        self.relay.put(sequence_id, result.features)
        return result

    def release(self, sequence_id: str) -> None:
        self.relay.drop(sequence_id)
        self.worker.release(sequence_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)


class RelayedDraft:
    """An EAGLE draft worker (``propose_batch``) fed the relay's features (the offline LLM's)."""

    def __init__(self, worker: Any, relay: FeatureRelay):
        self.worker, self.relay = worker, relay
        self.runner = worker.runner
        self.tli = None

    def propose(self, sequence_id: str, token_ids: list[int], num_speculative_tokens: int, params: Any) -> Any:
        from specdec.calls import ProposeCall, until_finished

        call = ProposeCall(sequence_id, token_ids, num_speculative_tokens, params,
                           features=self.relay.pending(sequence_id))
        result = until_finished(self.worker.propose_batch, call)
        if isinstance(result, BaseException):
            raise result
        self.relay.acknowledge(sequence_id, result.features_from)
        return result

    def release(self, sequence_id: str) -> None:
        self.worker.release(sequence_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)

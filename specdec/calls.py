"""The calls a draft and a target worker serve, as the services and the offline LLM build them (no torch here).

``specdec.engine.workers`` runs batches of them; a service's batcher (``specdec.serving.batching``) queues them
and runs a call again while its result is ``UNFINISHED`` (its prompt is being prefilled in chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.proposal import Proposal
from specdec.sampling_params import SamplingParams


@dataclass
class ProposeCall:
    sequence_id: str
    token_ids: list[int]  # the sequence's full committed history
    num_speculative_tokens: int
    params: SamplingParams
    draft_sample_method: str | None = None  # None: the worker's default
    # an EAGLE head's input: the target's features not yet sent (specdec.features.FeatureChunk, oldest first)
    features: list | None = None


@dataclass
class VerifyCall:
    sequence_id: str
    token_ids: list[int]  # the sequence's full committed history
    proposal: Proposal
    params: SamplingParams
    # return the target's features (the input of these decoder layers, concatenated) for the positions from
    # feature_start whose next token this call decides (specdec.features); () computes none
    feature_layers: tuple[int, ...] = ()
    feature_start: int = 0


class Unfinished:
    """A row's result when its prompt is prefilled in chunks: this pass fed a chunk (or nothing); the batcher
    runs the call again in its next batch (``requeue``), where the runner feeds what is still missing."""

    requeue = True

    def __repr__(self) -> str:
        return "UNFINISHED"


UNFINISHED = Unfinished()


def until_finished(run_batch, call):
    """``run_batch([call])``'s one result, run again while its prompt is being prefilled in chunks."""
    while True:
        (result,) = run_batch([call])
        if result is not UNFINISHED:
            return result

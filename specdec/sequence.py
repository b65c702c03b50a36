"""A request's canonical token sequence: appending tokens, detokenizing, and stop conditions."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from specdec.history import TokenHistory
from specdec.proposal import Proposal, TokenLogprob, VerifyResult
from specdec.sampling_params import SamplingParams, SpecDecodeStats


class IncrementalDetokenizer:
    """Text deltas from a growing list of token ids, never splitting a multi-byte character.

    Decodes a short window (prefix_offset..end) each step instead of the whole output, and holds
    back text that ends in U+FFFD (an incomplete UTF-8 sequence) until the next token completes it.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A few prompt tokens give the decoder the context it needs for leading spaces.
        self.ids: list[int] = list(prompt_token_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is held back (a character cut by the end of generation)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


@dataclass
class SequenceState:
    """One output being generated: the canonical token ids and everything derived from them."""

    prompt_token_ids: list[int]
    params: SamplingParams
    tokenizer: Any
    eos_token_ids: frozenset[int]
    max_model_len: int
    sequence_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival_time: float = field(default_factory=time.monotonic)  # when the request arrived (monotonic clock)
    output_index: int = 0  # which of a request's n outputs this is
    priority: int = 0  # with --scheduling-policy priority: lower starts first (vLLM's request priority)
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    # the request's grammar state (specdec.structured.Constraint; None: unconstrained), advanced by append
    constraint: Any = None

    def __post_init__(self) -> None:
        # Only ever appended to (``append``): readers that kept a mark of it compare only what is new
        # (``specdec.history``).
        self.token_ids: TokenHistory = TokenHistory(self.prompt_token_ids)
        if self.params.has_penalties and self.params.num_prompt_tokens != len(self.prompt_token_ids):
            # the workers count generated tokens (penalties, min_tokens) from where the prompt ends
            self.params = self.params.clone(num_prompt_tokens=len(self.prompt_token_ids))
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids)
        self._max_stop_len = max((len(s) for s in self.params.stop), default=0)
        self._stop_ids = frozenset(self.params.stop_token_ids)
        self._emitted = 0  # characters of self.text already returned by append()
        # The target's logprobs, one per output token (params.logprobs), and per prompt token with None
        # for the first (params.prompt_logprobs, filled by the first round).
        self.logprobs: list[TokenLogprob] | None = [] if self.params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self._pending_logprobs: list[TokenLogprob] = []  # the round's, appended with its tokens
        # prompt logprobs are asked for in the first round only
        self._later_params = (self.params.clone(prompt_logprobs=None) if self.params.prompt_logprobs is not None
                              else self.params)
        if self.budget <= 0:
            self.finish_reason = "length"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def budget(self) -> int:
        """How many more tokens may be generated (max_tokens and max_model_len)."""
        room = self.max_model_len - len(self.token_ids)
        if self.params.max_tokens is None:
            return room
        return min(room, self.params.max_tokens - len(self.output_token_ids))

    @property
    def verify_params(self) -> SamplingParams:
        """The parameters of this round's verification (prompt logprobs only before any output)."""
        return self.params if not self.output_token_ids else self._later_params

    def note_verify(self, result: VerifyResult) -> None:
        """Keep a round's logprobs: the prompt's now, the emitted tokens' as ``append`` takes them."""
        if result.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None, *result.prompt_logprobs]
        self._pending_logprobs = list(result.logprobs or [])

    def constrain(self, proposal: Proposal, k: int) -> Proposal:
        """This round's proposal under the request's grammar (unchanged without one): drafts checked, forced
        text proposed when drafting (k > 0), and the allowed tokens of every verified position."""
        if self.constraint is None:
            return proposal
        proposal, _ = proposal.first_branch()  # a grammar follows one path: a tree's first branch
        limit = self.budget - 1 if k > 0 else 0
        return self.constraint.constrain(proposal, limit, min(k, limit))

    def append(self, token_id: int) -> str:
        """Append one generated token; return the text that became final (may be empty).

        With stop strings, the last ``len(longest stop) - 1`` characters are held back until they can
        no longer start a stop string, so a streaming client never sees part of one.
        """
        assert not self.finished, "append after finish"
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.constraint is not None:
            self.constraint.accept(token_id)
        if self.logprobs is not None and self._pending_logprobs:
            self.logprobs.append(self._pending_logprobs.pop(0))
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            self.finish_reason, self.stop_reason = "stop", None
        elif token_id in self._stop_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
        else:
            self._add_text(self._detok.step(token_id))
            if not self.finished and self.budget <= 0:
                self.finish_reason = "length"
        if self.finished:
            self._add_text(self._detok.flush())
        return self._take_final_text()

    def _add_text(self, piece: str) -> None:
        if not piece or self.finish_reason == "stop" and isinstance(self.stop_reason, str):
            return
        if len(self.output_token_ids) < self.params.min_tokens:  # no stop strings before min_tokens (vLLM)
            self.text += piece
            return
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += piece
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            idx = self.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is not None:
            idx, stop = best
            self.text = self.text[: idx + len(stop) if self.params.include_stop_str_in_output else idx]
            self.finish_reason, self.stop_reason = "stop", stop

    def _take_final_text(self) -> str:
        limit = len(self.text) if self.finished else len(self.text) - max(0, self._max_stop_len - 1)
        if limit <= self._emitted:
            return ""
        delta = self.text[self._emitted : limit]
        self._emitted = limit
        return delta

    def abort(self) -> None:
        if not self.finished:
            self.finish_reason = "abort"

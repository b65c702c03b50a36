"""OpenAI's logprobs shapes from the target's ``TokenLogprob`` entries (vLLM's formatting).

The values are the target's raw log-probabilities (before temperature, top-k/top-p and penalties:
vLLM's default ``logprobs_mode="raw_logprobs"``), read from the verify pass that emitted the tokens.
A position with no logprob (the first prompt token) is ``null``. ``-inf`` is not JSON: it is clamped
to -9999.0 as vLLM does. A token's text is its own decoding (``tokenizer.decode([id])``); a token
that is part of a multi-byte character reads as U+FFFD, and its ``bytes`` are those of that text.
"""

from __future__ import annotations

from typing import Any

from specdec.proposal import TokenLogprob

LOGPROB_FLOOR = -9999.0


def _clamp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class LogprobFormatter:
    """Token texts (cached per id) and the completion / chat shapes."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def completion(self, token_ids: list[int], entries: list[TokenLogprob | None], top_n: int,
                   offset: int = 0) -> dict:
        """/v1/completions' ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict of the
        top ``top_n`` texts, and the chosen token's) and ``text_offset`` (characters from ``offset``,
        each token's text length after the one before)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, entries):
            text = self.text(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            chosen = _clamp(entry.logprob)
            top = {self.text(t): _clamp(v) for t, v in entry.top[:top_n]}
            top.setdefault(text, chosen)
            out["token_logprobs"].append(chosen)
            out["top_logprobs"].append(top)
        return out

    def chat(self, entries: list[TokenLogprob], top_n: int) -> dict:
        """/v1/chat/completions' ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
        def item(token_id: int, logprob: float) -> dict:
            text = self.text(token_id)
            return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(e.token_id, e.logprob),
                             "top_logprobs": [item(t, v) for t, v in e.top[:top_n]]} for e in entries]}

    def prompt_logprobs(self, entries: list[TokenLogprob | None], top_n: int) -> list[dict | None]:
        """vLLM's ``prompt_logprobs`` extension: per prompt token ``null`` (the first) or
        ``{token_id: {logprob, rank, decoded_token}}`` for the token and the position's top ``top_n``
        (rank 1 = most likely; the prompt token's rank is known when it is among the top)."""
        out: list[dict | None] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            ranks = {t: r for r, (t, _) in enumerate(entry.top, start=1)}
            position = {str(entry.token_id): {"logprob": _clamp(entry.logprob), "rank": ranks.get(entry.token_id),
                                              "decoded_token": self.text(entry.token_id)}}
            for rank, (t, v) in enumerate(entry.top[:top_n], start=1):
                position.setdefault(str(t), {"logprob": _clamp(v), "rank": rank, "decoded_token": self.text(t)})
            out.append(position)
        return out

"""The draft model's view of the committed text, kept up to date incrementally.

With Token-Level Intersection the target decides what text is committed (its own token ids), and the
draft — which has a different tokenizer — must see the same text as *its* token ids. Re-tokenizing the
whole text after every step would change ids all over and throw the draft's KV cache away, so
:class:`DraftContext` keeps the ids of a stable prefix and re-tokenizes only a short tail: the last
``window_tokens`` tokens / ``window_bytes`` bytes before the point where the text changed, plus the new
text. Each update returns how many leading ids are unchanged since the previous state, so the caller
can roll its KV cache back to that length and feed ``ids[stable:]``.

Invariant (checked on every update): the concatenated bytes of the draft ids (:func:`token_bytes`) are
exactly the committed bytes — whitespace runs, emoji and ZWJ sequences, CJK, code and accents included —
and ``tokenizer.decode(ids)`` gives the committed text back (for tokenizers whose decoder does not strip
a leading space). Committed text is never altered: a tail that the tokenizer's own ``encode`` cannot
reproduce byte-for-byte (normalisation, a SentencePiece dummy-prefix space, a literal special-token
string, ``<unk>``) is repaired or, failing that, tokenized greedily (longest match) over the draft's
byte table. Bytes that are not valid UTF-8 (a target token that ends inside a multi-byte character)
are represented by single-byte tokens until the rest of the character arrives, when the window
re-tokenizes them properly.
"""

from __future__ import annotations

import bisect
import logging
import re
from typing import Any, Iterable, Sequence

from specdec.errors import ConfigError
from specdec.tli.vocab_mapping import _backend, analyze_tokenizer

logger = logging.getLogger(__name__)

_ESCAPED_RUN = re.compile("([\udc80-\udcff]+)")
_WS = frozenset(b" \t\n\r\x0b\x0c")


class DraftContext:
    """Draft-side token ids of an append-mostly committed text.

    Args:
        draft_tokenizer: the draft's fast Hugging Face tokenizer.
        target_tokenizer: optional; needed only by :meth:`extend_target_ids`.
        prefix_ids: ids always kept in front (e.g. ``[bos_token_id]``); they count in ``stable``.
        window_tokens: how many tokens before the changed point are re-tokenized with the new text.
        window_bytes: ... and at least this many bytes.
    """

    def __init__(
        self,
        draft_tokenizer: Any,
        *,
        target_tokenizer: Any = None,
        prefix_ids: Sequence[int] = (),
        window_tokens: int = 4,
        window_bytes: int = 16,
        text: str = "",
    ) -> None:
        if window_tokens < 1:
            raise ValueError("window_tokens must be >= 1")
        self._tokenizer = draft_tokenizer
        self._backend = _backend(draft_tokenizer)
        table = analyze_tokenizer(draft_tokenizer)
        self._bytes: list[bytes | None] = table.bytes
        self._rev: dict[bytes, int] = table.canonical()
        self._max_len = table.max_token_bytes  # computed once per tokenizer, not per sequence
        self._byte_ids = [self._rev.get(bytes([b])) for b in range(256)]
        self._special_strings = [
            piece for i in table.special_ids if (piece := self._backend.id_to_token(i)) is not None
        ]
        self._target_bytes = analyze_tokenizer(target_tokenizer).bytes if target_tokenizer is not None else None
        self.prefix_ids: list[int] = [int(i) for i in prefix_ids]
        self.window_tokens = int(window_tokens)
        self.window_bytes = int(window_bytes)
        self._data = bytearray()
        self._ids: list[int] = []
        self._ends: list[int] = []  # cumulative byte end of each text id
        self.last_stable = len(self.prefix_ids)
        self.updates = 0
        self.retokenized_bytes = 0
        self.fallbacks = 0
        if text:
            self.extend(text)

    # -- views -----------------------------------------------------------------------------------------

    @property
    def ids(self) -> list[int]:
        """``prefix_ids`` + the ids of the committed text (a copy)."""
        return self.prefix_ids + self._ids

    @property
    def text_ids(self) -> list[int]:
        """The ids of the committed text, without ``prefix_ids`` (a copy)."""
        return list(self._ids)

    def ids_from(self, start: int) -> list[int]:
        """``ids[start:]`` without copying the whole list: what to feed the draft after rolling its KV cache
        back to ``start`` (the value an update returned)."""
        p = len(self.prefix_ids)
        if start < p:
            return self.prefix_ids[start:] + self._ids
        return self._ids[start - p :]

    @property
    def committed_bytes(self) -> bytes:
        return bytes(self._data)

    @property
    def text(self) -> str:
        """The committed text (an incomplete trailing UTF-8 sequence shows as U+FFFD)."""
        return self._data.decode("utf-8", "replace")

    def __len__(self) -> int:
        return len(self.prefix_ids) + len(self._ids)

    # -- updates ---------------------------------------------------------------------------------------

    def extend(self, text: str) -> int:
        """Append committed text; return the number of leading ids (prefix included) left unchanged."""
        return self.extend_bytes(text.encode("utf-8"))

    def extend_bytes(self, data: bytes) -> int:
        return self._update(len(self._data), bytes(data))

    def extend_target_ids(self, target_ids: Iterable[int], skip_special: bool = True) -> int:
        """Append the text of target tokens (decoded exactly through the target's byte table)."""
        if self._target_bytes is None:
            raise ValueError("DraftContext needs target_tokenizer= to accept target token ids")
        table = self._target_bytes
        parts = []
        for i in target_ids:
            i = int(i)
            b = table[i] if 0 <= i < len(table) else None
            if b is None:
                if not skip_special:
                    raise ValueError(f"target token {i} has no text (special or unknown id)")
                continue
            parts.append(b)
        return self.extend_bytes(b"".join(parts))

    def set_text(self, text: str) -> int:
        """Replace the committed text (normally an extension of it); only the changed tail is re-tokenized."""
        return self.set_bytes(text.encode("utf-8"))

    def set_bytes(self, data: bytes) -> int:
        data = bytes(data)
        old = self._data
        n = min(len(old), len(data))
        if data[: len(old)] == old:  # fast path: the new text extends the old one
            common = len(old)
        else:
            common = 0
            while common < n and old[common] == data[common]:
                common += 1
        return self._update(common, data[common:])

    def reset(self, text: str = "") -> int:
        self._data, self._ids, self._ends = bytearray(), [], []
        self.last_stable = len(self.prefix_ids)
        return self.extend(text) if text else self.last_stable

    def _update(self, common: int, suffix: bytes) -> int:
        """The new committed text is ``committed[:common] + suffix``."""
        self.updates += 1
        data = self._data
        if common == len(data) and not suffix:
            self.last_stable = len(self)
            return self.last_stable
        new_len = common + len(suffix)

        def at(pos: int) -> int:  # byte ``pos`` of the new committed text
            return data[pos] if pos < common else suffix[pos - common]

        ends = self._ends
        k = bisect.bisect_right(ends, common)  # ids lying entirely inside the unchanged prefix
        k = max(0, k - self.window_tokens)
        limit = common - self.window_bytes
        extra = 0
        while k > 0:
            cut = ends[k - 1]
            if cut > limit or (cut < new_len and (at(cut) & 0xC0) == 0x80):  # keep whole characters
                k -= 1
                continue
            # do not cut inside a whitespace run: tokenizers group runs differently with context
            if extra < 8 and cut < new_len and at(cut - 1) in _WS and at(cut) in _WS:
                k -= 1
                extra += 1
                continue
            break
        cut = ends[k - 1] if k else 0
        tail = bytes(data[cut:common]) + suffix
        tail_ids = self._encode_bytes(tail)
        self.retokenized_bytes += len(tail)
        same = 0
        for a, b in zip(self._ids[k : k + len(tail_ids)], tail_ids):
            if a != b:
                break
            same += 1
        del self._ids[k:], ends[k:], data[common:]
        data += suffix
        self._ids.extend(tail_ids)
        pos = cut
        for i in tail_ids:
            pos += len(self._bytes[i])  # type: ignore[arg-type]
            ends.append(pos)
        if pos != new_len:  # pragma: no cover - _encode_bytes guarantees it
            raise AssertionError("draft ids do not cover the committed text")
        self.last_stable = len(self.prefix_ids) + k + same
        return self.last_stable

    # -- exact tokenization ----------------------------------------------------------------------------

    def _encode_bytes(self, data: bytes) -> list[int]:
        """Token ids whose bytes are exactly ``data`` (invalid UTF-8 bytes become single-byte tokens)."""
        if not data:
            return []
        out: list[int] = []
        for k, run in enumerate(_ESCAPED_RUN.split(data.decode("utf-8", "surrogateescape"))):
            if not run:
                continue
            if k % 2 == 0:
                out.extend(self._encode_text(run))
            else:
                for ch in run:
                    tid = self._byte_ids[ord(ch) - 0xDC00]
                    if tid is None:
                        raise ConfigError(
                            f"the draft tokenizer has no token for the byte {ord(ch) - 0xDC00:#04x}, so it cannot "
                            "follow a target whose text is not valid UTF-8 there"
                        )
                    out.append(tid)
        return out

    def _encode_text(self, text: str, depth: int = 0) -> list[int]:
        want = text.encode("utf-8")
        ids = self._try_encode(self._backend, text, want)
        if ids is None and self._has_special_text(text):
            # a literal special-token string ("<|im_start|>") is text here: encode it as ordinary pieces
            ids = self._try_encode(self._plain_backend(), text, want)
        if ids is not None:
            return ids
        # isolate the part the tokenizer cannot reproduce: split at a word start near the middle
        cut = _split_point(text)
        if cut is not None and depth < 16:
            return self._encode_text(text[:cut], depth + 1) + self._encode_text(text[cut:], depth + 1)
        self.fallbacks += 1
        logger.debug("draft tokenizer's encode does not reproduce %r exactly; tokenizing by longest match", text[:40])
        return self._greedy(want)

    def _try_encode(self, backend: Any, text: str, want: bytes) -> list[int] | None:
        ids = backend.encode(text, add_special_tokens=False).ids
        got = self._join(ids)
        if got == want:
            return ids
        if got is None or got != b" " + want:
            return None
        # SentencePiece dummy prefix (" " added in front): drop it from the first token ...
        rest = self._bytes[ids[0]][1:]  # type: ignore[index]
        if not rest:
            return ids[1:]
        # ... or encode behind an anchor ("\n") that ends a token, and drop the anchor's tokens
        anchored = backend.encode("\n" + text, add_special_tokens=False).ids
        pos = 0
        for k, i in enumerate(anchored):
            b = self._bytes[i]
            if b is None:
                break
            pos += len(b)
            if pos in (1, 2):  # b"\n" or b" \n"
                lead = self._join(anchored[: k + 1])
                if lead in (b"\n", b" \n") and self._join(anchored[k + 1 :]) == want:
                    return anchored[k + 1 :]
            if pos >= 2:
                break
        rid = self._rev.get(rest)
        return [rid] + ids[1:] if rid is not None else None

    def _join(self, ids: Sequence[int]) -> bytes | None:
        parts = [self._bytes[i] for i in ids]
        if any(p is None for p in parts):
            return None
        return b"".join(parts)  # type: ignore[arg-type]

    def _has_special_text(self, text: str) -> bool:
        return any(s and s in text for s in self._special_strings)

    def _plain_backend(self) -> Any:
        """A copy of the draft's Rust tokenizer that treats special-token strings as ordinary text."""
        plain = getattr(self._tokenizer, "_specdec_tli_plain_backend", None)
        if plain is None:
            from tokenizers import Tokenizer

            plain = Tokenizer.from_str(self._backend.to_str())
            plain.encode_special_tokens = True
            try:
                self._tokenizer._specdec_tli_plain_backend = plain
            except AttributeError:
                pass
        return plain

    def _greedy(self, data: bytes) -> list[int]:
        out: list[int] = []
        i, n = 0, len(data)
        while i < n:
            for length in range(min(self._max_len, n - i), 0, -1):
                tid = self._rev.get(data[i : i + length])
                if tid is not None:
                    out.append(tid)
                    i += length
                    break
            else:
                raise ConfigError(
                    f"the draft tokenizer cannot represent the byte {data[i]:#04x} of the committed text exactly "
                    "(no byte-level or byte-fallback token for it)"
                )
        return out


def _split_point(text: str) -> int | None:
    """A position near the middle of ``text`` where a whitespace run starts after a non-space, else any
    position near the middle; None for texts too short to split."""
    n = len(text)
    if n < 2:
        return None
    mid = n // 2
    best = None
    for i in range(1, n):
        if text[i].isspace() and not text[i - 1].isspace():
            if best is None or abs(i - mid) < abs(best - mid):
                best = i
    return best if best is not None else mid


def encode_exact(tokenizer: Any, text: str) -> list[int]:
    """Token ids (no special tokens) whose bytes are exactly ``text``'s UTF-8 bytes."""
    return DraftContext(tokenizer)._encode_bytes(text.encode("utf-8"))

"""A sequence's token ids kept in one list from round to round, with what changed since a reader looked.

Rounds append to a history (accepted drafts, the bonus token) and now and then cut it back (a
lookahead's drafts lost, a service's history rolled back to where a new one differs). Whatever is
derived from the history — what a service holds (the gateway's clients), the history a service rebuilds
from ``start_position``, the n-gram index, TLI's re-tokenized context, the penalty counts — used to be
compared with or rebuilt from the whole list every round: O(history) per round and sequence, which
4k-32k token prompts make real. A ``TokenHistory`` records its cuts, so a reader that kept a ``mark()``
asks ``unchanged_since(mark)`` how many leading ids are still what they were, and reworks only the rest:
O(new tokens) per round.

Only appending (``append`` / ``extend`` / ``+=``) and cutting back (``truncate``, ``del h[n:]``, ``pop()``,
``clear()``) change it; writing, inserting or deleting anywhere else raises TypeError, so a mark cannot
be fooled. Appending costs what it costs on a list. A reader checks that it is given the very object it
marked (``is``); anything else (a plain list, another object) is compared in full, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

Mark = tuple[int, int]  # (cuts recorded so far, length) when the mark was taken


class TokenHistory(list):
    """A list of token ids that only grows at its end or is cut back, and remembers where it was cut."""

    __slots__ = ("_cuts", "_forgotten", "origin", "cache")
    MAX_CUTS = 64  # cuts remembered; a mark older than the oldest one reads as "nothing known"

    def __init__(self, iterable: Iterable[int] = (), origin: tuple["TokenHistory", Mark, int] | None = None):
        super().__init__(iterable)
        self._cuts: list[int] = []  # the length left by each cut, oldest first
        self._forgotten = 0  # cuts dropped from the front of _cuts
        # (history, its mark, n): this list's first n ids were copied from that history when it had that mark
        # (``h + drafts`` sets it, so a reader of the copy can reuse what it derived from ``h``)
        self.origin = origin
        # what readers derive from this history, kept with it (e.g. the penalty counts): name -> their state
        self.cache: dict[Any, Any] = {}

    # -- marks -----------------------------------------------------------------------------------------
    def mark(self) -> Mark:
        return (self._forgotten + len(self._cuts), len(self))

    def unchanged_since(self, mark: Mark) -> int:
        """How many leading ids are the same as when ``mark`` was taken (they may have been cut and
        appended again since; this says only what is known without comparing)."""
        cuts, n = mark
        i = cuts - self._forgotten
        if i < 0:
            return 0
        for cut in self._cuts[i:]:
            if cut < n:
                n = cut
        return min(n, len(self))

    # -- changes ---------------------------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        """Keep the first ``n`` ids (a no-op when there are no more)."""
        if n < 0:
            raise ValueError(f"truncate({n})")
        if n >= len(self):
            return
        list.__delitem__(self, slice(n, None))
        self._cuts.append(n)
        if len(self._cuts) > self.MAX_CUTS:
            drop = len(self._cuts) - self.MAX_CUTS // 2
            del self._cuts[:drop]
            self._forgotten += drop

    def __delitem__(self, key) -> None:
        if isinstance(key, slice) and key.step in (None, 1) and (key.stop is None or key.stop >= len(self)):
            start = key.start or 0
            self.truncate(max(0, len(self) + start) if start < 0 else start)
            return
        raise TypeError("a TokenHistory only loses ids at its end: del h[n:] or truncate(n)")

    def pop(self, index: int = -1) -> int:
        if index not in (-1, len(self) - 1) or not self:
            raise TypeError("a TokenHistory only loses ids at its end: pop() takes the last one")
        last = self[-1]
        self.truncate(len(self) - 1)
        return last

    def clear(self) -> None:
        self.truncate(0)

    def _refuse(self, *args, **kwargs):
        raise TypeError("a TokenHistory only grows at its end or is cut back (truncate); it is never edited in place")

    __setitem__ = insert = remove = sort = reverse = __imul__ = _refuse

    def __add__(self, other: Iterable[int]) -> "TokenHistory":
        """A copy followed by ``other`` (e.g. the history + drafts), which knows what it was copied from."""
        out = TokenHistory(self, origin=(self, self.mark(), len(self)))
        out.extend(other)
        return out

    def __reduce__(self):
        return (TokenHistory, (list(self),))


def common_prefix(a: Sequence[int], b: Sequence[int], known: int = 0) -> int:
    """How many leading ids ``a`` and ``b`` have in common, given that the first ``known`` are equal:
    only what follows them is compared."""
    n = min(len(a), len(b))
    if known >= n:
        return n
    if known == 0:  # no copy when one is a prefix of the other (the usual case: a history grew)
        if (a if n == len(a) else a[:n]) == (b if n == len(b) else b[:n]):
            return n
    elif a[known:n] == b[known:n]:
        return n
    return next(i for i in range(known, n) if a[i] != b[i])


def unchanged_prefix(source: Any, mark: Mark | None, token_ids: Sequence[int]) -> int:
    """How many leading ids of ``token_ids`` are known, without comparing, to be what a reader saw when it
    took ``mark`` of ``source``: 0 unless ``token_ids`` is that very TokenHistory."""
    if mark is None or token_ids is not source or not isinstance(token_ids, TokenHistory):
        return 0
    return token_ids.unchanged_since(mark)


def mark_of(token_ids: Sequence[int]) -> tuple[Any, Mark | None]:
    """(source, mark) for a reader to keep after reading ``token_ids``: (None, None) for a plain list."""
    if isinstance(token_ids, TokenHistory):
        return token_ids, token_ids.mark()
    return None, None

"""An EAGLE target's features beside its KV blocks (``specdec.features``): what a prefix-cache hit lacks.

A target asked for features (an EAGLE head's: the hidden states of a few layers at each position) used to feed
every position again rather than take keys and values from the prefix cache, because a cached block held no
features. A shared system prompt or tool list then cost a whole prefill per request, and under load (when
``disable_by_batch_size`` turns drafting off) the target lost its prefix cache altogether.

``BlockFeatures`` keeps, per KV block, the features of the positions the block holds, written when a verify
call returns them (``specdec.engine.workers.taken_features``): a block that enters the prefix cache keeps its
features with it, and a later sequence that adopts the block reads them back instead of recomputing. A block's
rows are valid from its first position up to a count (a partly written block, a rollback); a block handed out
again (``KVCacheManager.reserve``) forgets its rows. Rows are kept in bfloat16 (the wire's default feature
dtype) in host memory (they go to the wire from there anyway; a GPU's memory stays the KV pool's): about 3.5 kB per
position for SmolLM2-135M's three layers. The store holds at most ``max_bytes`` (the KV cache manager gives it
FEATURE_BUDGET_FRACTION of the pool's bytes); past that the blocks written longest ago are forgotten first, and a
request that needs their features has those positions fed again.
"""

from __future__ import annotations

import torch

STORE_DTYPE = torch.bfloat16
FEATURE_BUDGET_FRACTION = 0.125  # of the KV pool's bytes, in host memory


class BlockFeatures:
    """Per KV block: (the layers asked, [block_size, width] rows, how many leading rows are valid)."""

    def __init__(self, block_size: int, max_bytes: int | None = None):
        self.block_size = block_size
        self.max_bytes = max_bytes  # None: no bound
        self._blocks: dict[int, tuple[tuple[int, ...], torch.Tensor, int]] = {}  # in the order first written
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def write(self, blocks: list[int], start: int, layers: tuple[int, ...], rows: torch.Tensor) -> None:
        """The features of positions [start, start + len(rows)) of a sequence whose block table is ``blocks``.
        A block's rows stay valid only from its first position on without a gap (a write past a gap is not kept)."""
        bs, n = self.block_size, rows.shape[0]
        pos = start
        while pos < start + n:
            index, offset = divmod(pos, bs)
            if index >= len(blocks):
                return
            take = min(bs - offset, start + n - pos)
            have = self._blocks.get(blocks[index])
            if have is not None and (have[0] != layers or have[1].shape[1] != rows.shape[1]):
                have = None
            valid = have[2] if have is not None else 0
            if offset <= valid:  # contiguous with what the block holds
                data = have[1] if have is not None else self._new(blocks[index], bs, rows.shape[1])
                data[offset:offset + take] = rows[pos - start:pos - start + take]
                self._blocks[blocks[index]] = (layers, data, max(valid, offset + take))
            pos += take

    def _new(self, block: int, bs: int, width: int) -> torch.Tensor:
        """A block's rows (its old ones, of other layers, dropped), within ``max_bytes``: the oldest go first."""
        self.forget([block])
        size = bs * width * torch.finfo(STORE_DTYPE).bits // 8
        while self.max_bytes is not None and self._blocks and self._bytes + size > self.max_bytes:
            self.forget([next(iter(self._blocks))])
        self._bytes += size
        return torch.empty(bs, width, dtype=STORE_DTYPE)

    def available(self, blocks: list[int], start: int, end: int, layers: tuple[int, ...]) -> int:
        """The first position in [start, end) without stored features (``end``: all are stored)."""
        bs, pos = self.block_size, start
        while pos < end:
            index, offset = divmod(pos, bs)
            have = self._blocks.get(blocks[index]) if index < len(blocks) else None
            if have is None or have[0] != layers or have[2] <= offset:
                return pos
            pos = min(end, index * bs + have[2])
        return end

    def read(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """The stored rows of positions [start, end) (``available`` said they are all there)."""
        bs, parts, pos = self.block_size, [], start
        while pos < end:
            index, offset = divmod(pos, bs)
            take = min(bs - offset, end - pos)
            parts.append(self._blocks[blocks[index]][1][offset:offset + take])
            pos += take
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def cut(self, blocks: list[int], n: int) -> None:
        """A sequence rolled back to ``n`` positions: its block holding position ``n`` keeps the rows before it."""
        index, offset = divmod(n, self.block_size)
        if offset and index < len(blocks):
            have = self._blocks.get(blocks[index])
            if have is not None and have[2] > offset:
                self._blocks[blocks[index]] = (have[0], have[1], offset)

    def forget(self, blocks: list[int]) -> None:
        """Blocks handed out for new positions."""
        for b in blocks:
            gone = self._blocks.pop(b, None)
            if gone is not None:
                self._bytes -= gone[1].numel() * gone[1].element_size()

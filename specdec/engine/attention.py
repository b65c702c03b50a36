"""Attention over the KV pool, read in place: one pass, many sequences, each with its own block table.

A pass feeds the new tokens of every sequence as one flat ``[tokens, hidden]`` batch (no padding); only
attention needs to know which sequence a token belongs to. :class:`PagedPass` describes that once per pass:
the pool slot each new token's key/value goes to, and for each sequence the slices of the pool that hold its
keys. Because the pool's slot axis is laid out block after block and allocation keeps a sequence's blocks
consecutive where it can (``specdec.engine.block_pool``), a sequence's history is a few long slices
(usually one), read as views: nothing is gathered or padded.

On CPU each slice is one scaled-dot-product-attention call (the grouped query heads folded into the query
axis, so a kv head's keys are read once); a sequence spread over several slices merges their partial
results by their log-sum-exp, as flash-decoding does. On CUDA the whole pass is one Triton kernel over the
block tables (``kernels.paged_attention``). With batch-invariant passes (``kernel="cpu"``) the CPU runs
``kernels.cpu_attention`` instead: a C kernel that reduces each query's keys in fixed chunks at fixed
positions, so a query's output does not depend on the rest of the pass (SDPA's blocking follows the number
of queries and keys, which changes the last bits).

Token trees (``trees``, ``specdec.trees``): a row's last nodes are a tree's, written one per position after the
history in node order; each attends to the history and its own ancestors at its depth's position (its rotary
position is the runner's to give: ``positions``). The kernels read each node's path
(``kernels.paged_attention.TreePaths``: in the C kernel a node's output is the same bits as the chain of its path);
SDPA gets the tree's mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.paged_attention import TreePaths, tree_layout
from specdec.engine.kv_cache import KVPool
from specdec.trees import path_to

_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def block_runs(table: list[int], length: int, block_size: int) -> list[tuple[int, int, int]]:
    """The first ``length`` positions of a block table as maximal slices of consecutive slots:
    (first slot, first position, number of positions)."""
    runs: list[tuple[int, int, int]] = []
    for i in range(-(-length // block_size)):
        n = min(block_size, length - i * block_size)
        b = table[i]
        if runs and runs[-1][0] + runs[-1][2] == b * block_size and runs[-1][2] % block_size == 0:
            s, p, m = runs[-1]
            runs[-1] = (s, p, m + n)
        else:
            runs.append((b * block_size, i * block_size, n))
    return runs


class PagedPass:
    """Where one pass's new tokens go in the pool and what each sequence reads (see the module).

    ``tables[i]`` is sequence i's block table (already long enough for its new tokens), ``starts[i]`` its
    cached length before the pass and ``counts[i]`` its new tokens, which are the flat batch's rows
    ``[sum(counts[:i]), sum(counts[:i + 1]))``. ``windows`` maps each layer kind to its sliding window (None:
    full attention); ``group`` is the query heads per kv head (the masks are laid out for it once per pass).
    ``trees[i]``: the parents of row i's tree when the row ends with a token tree's nodes (None: a chain; the
    nodes before the row's were fed by earlier passes: ``kernels.paged_attention.tree_layout``); ``positions``
    [tokens] holds each token's position (a node's: the tree's first position plus its depth)."""

    def __init__(self, pool: KVPool, tables: list[list[int]], starts: list[int], counts: list[int],
                 windows: dict[str, int | None], kernel: str | None = None, group: int = 1,
                 trees: list[list[int] | None] | None = None):
        self.pool = pool
        bs = pool.block_size
        device = pool.key_data.device
        slots: list[int] = []
        self.segments: list[tuple[int, int, dict[str, list[tuple[int, int, torch.Tensor | None]]]]] = []
        q0 = 0
        # a kernel over the block tables: Triton on CUDA (or forced, "triton": Triton's interpreter on CPU, for
        # tests); "cpu": the batch-invariant C kernel (kernels.cpu_attention); None: SDPA per slice (below)
        self.kernel = kernel or ("auto" if device.type == "cuda" else None)
        trees = trees if trees and any(trees) else None
        self.tree = TreePaths.of(tables, starts, counts, trees, bs, device) if trees and self.kernel else None
        positions: list[int] = []
        for i, (table, start, n) in enumerate(zip(tables, starts, counts)):
            end = start + n
            parents = trees[i] if trees else None
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if parents:
                chain, root, new, depth = tree_layout(start, n, parents)
                positions += list(range(start, start + chain)) + [root + d for d in depth[new:]]
            else:
                positions += range(start, end)
            if not self.kernel:
                runs = block_runs(table, end, bs)
                per_kind = {kind: _visible(runs, start, n, window, device, group) if not parents else
                            _visible_tree(runs, start, n, parents, window, device, group)
                            for kind, window in windows.items()}
                self.segments.append((q0, n, per_kind))
            q0 += n
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)  # [tokens]
        self.num_tokens = q0
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)  # [tokens]
        if self.kernel:
            width = max(len(t) for t in tables)
            self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                             device=device)  # [seqs, max blocks]
            self.context_lens = torch.tensor([s + n for s, n in zip(starts, counts)], dtype=torch.int32, device=device)
            cum = [0]
            for n in counts:
                cum.append(cum[-1] + n)
            self.query_start_loc = torch.tensor(cum, dtype=torch.int32, device=device)
            self.windows = windows
            if self.kernel == "cpu":
                from kernels.cpu_attention import CpuAttentionPlan

                self.cpu_plan = CpuAttentionPlan(self.block_tables, self.context_lens, self.query_start_loc,
                                                 set(windows.values()), self.tree)

    def attend(self, layer: int, kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Write this pass's k, v [1, kv_heads, tokens, d] into layer ``layer``'s blocks and attend with
        q [1, heads, tokens, d]; returns [1, tokens, heads * d]."""
        keys, values = self.pool.keys[layer], self.pool.values[layer]  # [kv_heads, slots, d]
        keys.index_copy_(1, self.slots, k[0])
        values.index_copy_(1, self.slots, v[0])
        heads, tokens, d = q.shape[1], q.shape[2], q.shape[3]
        if self.kernel == "cpu":
            out = self.cpu_plan(q[0].transpose(0, 1), keys, values, self.pool.block_size, scale, self.windows[kind])
            return out.reshape(1, tokens, heads * d)
        if self.kernel:
            from kernels.paged_attention import paged_attention

            out = paged_attention(q[0].transpose(0, 1), keys, values, self.block_tables, self.context_lens,
                                  self.query_start_loc, self.pool.block_size, scale, window=self.windows[kind],
                                  backend=self.kernel, tree=self.tree)  # [tokens, heads, d]
            return out.reshape(1, tokens, heads * d)
        kv_heads = keys.shape[0]
        group = heads // kv_heads
        out = q.new_empty((tokens, heads, d))
        for q0, n, per_kind in self.segments:
            # [heads, n, d] -> [1, kv_heads, group * n, d]: each kv head's queries in one call
            qs = q[0, :, q0: q0 + n].reshape(1, kv_heads, group * n, d)
            runs = per_kind[kind]
            if len(runs) == 1:
                s0, s1, mask, _, _ = runs[0]
                o = F.scaled_dot_product_attention(qs, keys[None, :, s0:s1], values[None, :, s0:s1],
                                                   attn_mask=mask, scale=scale)
            else:
                o = _merged(qs, keys, values, runs, scale)
            out[q0: q0 + n] = o.view(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, heads, d)
        return out.view(1, tokens, heads * d)


def _visible(runs: list[tuple[int, int, int]], start: int, n: int, window: int | None, device: torch.device,
             group: int) -> list[tuple]:
    """The slices whose keys some of the queries at positions [start, start + n) see (causal, and within
    ``window`` keys when one is set), each as (first slot, end slot, boolean mask [group * n, keys] or None,
    the same as an additive mask, which folded query rows see a key of the slice [group * n] or None)."""
    lo = max(0, start + 1 - window) if window else 0
    q = torch.arange(start, start + n, device=device)[:, None] if n > 1 or window else None
    out = []
    for slot, pos, m in runs:
        a, b = max(pos, lo), pos + m  # visible positions of this slice
        if a >= b:
            continue
        mask = additive = seen = None
        if b - 1 > start or (window and a <= start + n - 1 - window):  # some query cannot see some key
            kv = torch.arange(a, b, device=device)[None, :]
            allowed = kv <= q
            if window:
                allowed &= kv > q - window
            mask = allowed.repeat(group, 1)  # the folded rows: head-major, as the fold lays them
            additive = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
            seen = mask.any(-1)
        out.append((slot + a - pos, slot + b - pos, mask, additive, seen))
    return out


def _visible_tree(runs: list[tuple[int, int, int]], start: int, n: int, parents: list[int], window: int | None,
                  device: torch.device, group: int) -> list[tuple]:
    """``_visible`` for a row that ends with a tree's nodes (``tree_layout``): the chain tokens before them see
    the keys up to their own position; node i sees the history and its path, as a chain of its path would
    (the window counts positions by depth)."""
    end = start + n
    chain, root, new, depth = tree_layout(start, n, parents)
    t = len(parents)
    # each query's position (a node's: by depth) and each key's (history keys: their own; nodes': by depth)
    q_pos = torch.tensor(list(range(start, start + chain)) + [root + d for d in depth[new:]], device=device)
    k_pos = torch.cat([torch.arange(root, device=device), root + torch.tensor(depth, device=device, dtype=torch.long)])
    full = k_pos[None, :] <= q_pos[:, None]  # [n, end]: causal by position (history keys)
    if window:
        full &= k_pos[None, :] > q_pos[:, None] - window
    ancestor = torch.zeros((t, t), dtype=torch.bool)  # ancestor[i, a]: node a is on node i's path
    for i in range(t):
        ancestor[i, path_to(parents, i)] = True
    full[:, root:] &= torch.cat([torch.zeros((chain, t), dtype=torch.bool), ancestor[new:]]).to(device)
    out = []
    for slot, pos, m in runs:
        mask = full[:, pos: pos + m]
        if not bool(mask.any()):
            continue
        mask = mask.repeat(group, 1)  # the folded rows, head-major
        additive = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
        out.append((slot, slot + m, mask, additive, mask.any(-1)))
    return out


def _merged(qs: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, runs: list, scale: float) -> torch.Tensor:
    """Attention over several slices: each slice's softmax-weighted values, merged by their log-sum-exp."""
    outs, lses = [], []
    for s0, s1, _, additive, seen in runs:
        o, lse = _flash_with_lse(qs, keys[None, :, s0:s1], values[None, :, s0:s1], 0.0, False,
                                 attn_mask=None if additive is None else additive.to(qs.dtype), scale=scale)
        lse = lse.float()  # [1, kv_heads, rows]
        if seen is not None:  # a row that sees no key of this slice comes back as 0 with lse 0: weigh it 0
            lse = lse.masked_fill(~seen, float("-inf"))
        outs.append(o.float())
        lses.append(lse)
    lse = torch.stack(lses)  # [runs, 1, kv_heads, rows]
    top = lse.max(dim=0).values  # every row sees at least its own key in some slice: finite
    weights = torch.exp(lse - top)
    total = sum(o * w[..., None] for o, w in zip(outs, weights))
    return (total / weights.sum(dim=0)[..., None]).to(qs.dtype)

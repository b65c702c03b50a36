"""The logits processing shared by every path (the parameters: ``specdec.sampling_params``).

The target-only path, the draft's proposals and the target's verification all go through
``process_logits`` with the same parameters, which is what makes speculative sampling lossless.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specdec.errors import InvalidRequestError
from specdec.history import TokenHistory
from specdec.proposal import TokenLogprob
# the parameters themselves are plain data (no torch), defined there and re-exported here
from specdec.sampling_params import MAX_LOGPROBS, SamplingParams, SpecDecodeStats  # noqa: F401


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


@dataclass
class PenaltyContext:
    """What history-dependent processing reads, for rows ``[m, vocab]`` of logits: row j follows
    ``token_ids + after + drafts[:j]`` (inside a block of drafts, the drafts before a row count as
    generated, as they would had the target decoded them one by one)."""

    token_ids: list[int]  # the sequence before row 0: prompt, then generated tokens (a TokenHistory: not copied)
    num_prompt_tokens: int
    min_tokens_stop_ids: frozenset[int]  # what min_tokens holds back: EOS (unless ignore_eos) + stop_token_ids
    drafts: list[int] = field(default_factory=list)
    # ids that follow token_ids before every row (a draft's own drafts so far this round): the same as
    # token_ids + after, without copying the history
    after: list[int] = field(default_factory=list)


def penalty_context(params: SamplingParams, token_ids: list[int], eos_token_ids, drafts: list[int] = (),
                    after: list[int] = ()) -> PenaltyContext | None:
    """The context for ``apply_penalties`` (None when the params have no penalties or biases)."""
    if not params.has_penalties:
        return None
    if params.needs_history and params.num_prompt_tokens is None:
        raise InvalidRequestError("num_prompt_tokens (where the prompt ends) is required with penalties or "
                                  "min_tokens", param="num_prompt_tokens")
    stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_token_ids))
    # A TokenHistory is read where it is (its counts are kept with it, see PenaltyCounts); a list is copied.
    ids = token_ids if isinstance(token_ids, TokenHistory) else list(token_ids)
    return PenaltyContext(ids, params.num_prompt_tokens or 0, stops, list(drafts), list(after))


def apply_penalties(logits: torch.Tensor, params: SamplingParams, ctx: PenaltyContext | None) -> torch.Tensor:
    """Raw logits ``[m, vocab]`` (or ``[vocab]``) → penalised logits (a new float32 tensor), in vLLM's
    order: logit_bias and min_tokens, then repetition (prompt + generated: a positive logit divided by
    it, a negative one multiplied), frequency (times the token's count among generated tokens) and
    presence (once if it was generated). Temperature, top-k and top-p come after (process_logits).

    With a ``TokenHistory`` (the loop's and the services' histories, and ``history + drafts``), the
    counts come from its ``PenaltyCounts``, brought up to date with what changed since the last round:
    O(new tokens) of Python per round instead of O(history). Anything else is counted in full."""
    if ctx is None:
        return logits.float()
    rp = params.repetition_penalty
    if (isinstance(ctx.token_ids, TokenHistory) and (params.min_tokens or params.presence_penalty
                                                     or params.frequency_penalty or rp != 1)):
        return _apply_counted(logits, params, ctx, PenaltyCounts.of(ctx.token_ids, ctx.num_prompt_tokens, rp != 1))
    return apply_penalties_in_full(logits, params, ctx)


def apply_penalties_in_full(logits: torch.Tensor, params: SamplingParams, ctx: PenaltyContext | None) -> torch.Tensor:
    """``apply_penalties`` counting the whole history (the reference the kept counts must match)."""
    if ctx is None:
        return logits.float()
    if ctx.after:
        ctx = replace(ctx, token_ids=list(ctx.token_ids) + ctx.after, after=[])
    squeeze = logits.dim() == 1
    logits = logits.float().reshape(-1, logits.shape[-1]).clone()  # [m, vocab]
    m, vocab = logits.shape
    device = logits.device
    generated = [t for t in ctx.token_ids[ctx.num_prompt_tokens:] if t < vocab]
    _bias_and_min_tokens(logits, params, ctx, len(generated))
    rp = params.repetition_penalty
    if params.presence_penalty or params.frequency_penalty or rp != 1:
        # Only the columns of tokens that occurred are touched: [m, columns], not [m, vocab].
        drafts = [t for t in ctx.drafts[: m - 1] if t < vocab]
        prompt = {t for t in ctx.token_ids[: ctx.num_prompt_tokens] if t < vocab} if rp != 1 else set()
        columns = sorted(set(generated) | set(drafts) | prompt)
        if columns:
            where = {t: i for i, t in enumerate(columns)}
            counts = torch.zeros(m, len(columns), device=device)  # generated-token counts before each row
            if generated:
                counts += torch.bincount(torch.tensor([where[t] for t in generated], device=device),
                                         minlength=len(columns)).float()
            for j, t in enumerate(ctx.drafts[: m - 1]):
                if t < vocab:
                    counts[j + 1:, where[t]] += 1
            idx = torch.tensor(columns, dtype=torch.long, device=device)
            sub = logits[:, idx]  # [m, columns]
            if rp != 1:
                seen = counts > 0
                if prompt:
                    seen[:, torch.tensor([where[t] for t in sorted(prompt)], device=device)] = True
                sub = torch.where(seen, torch.where(sub > 0, sub / rp, sub * rp), sub)
            logits[:, idx] = sub - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return logits[0] if squeeze else logits


def _bias_and_min_tokens(logits: torch.Tensor, params: SamplingParams, ctx: PenaltyContext, num_generated: int) -> None:
    """logit_bias, then min_tokens (EOS and stop ids at -inf in the rows before ``min_tokens`` generated ids),
    in place on ``logits`` [m, vocab]."""
    m, vocab = logits.shape
    device = logits.device
    if params.allowed_token_ids is not None:  # first: every other token is out (vLLM's allowed_token_ids)
        keep = torch.zeros(vocab, dtype=torch.bool, device=device)
        keep[torch.tensor([t for t in params.allowed_token_ids if t < vocab], dtype=torch.long, device=device)] = True
        logits.masked_fill_(~keep, float("-inf"))
    if params.logit_bias:
        ids = torch.tensor([t for t in params.logit_bias if t < vocab], dtype=torch.long, device=device)
        vals = torch.tensor([float(v) for t, v in params.logit_bias.items() if t < vocab], device=device)
        logits[:, ids] += vals
    if params.min_tokens:
        stops = torch.tensor(sorted(t for t in ctx.min_tokens_stop_ids if t < vocab), dtype=torch.long, device=device)
        held = [j for j in range(m) if num_generated + j < params.min_tokens]
        if held and stops.numel():
            logits[torch.tensor(held, device=device)[:, None], stops[None, :]] = float("-inf")


def _apply_counted(logits: torch.Tensor, params: SamplingParams, ctx: PenaltyContext,
                   kept: tuple["PenaltyCounts", TokenHistory, int]) -> torch.Tensor:
    """``apply_penalties_in_full``'s arithmetic over the kept counts: the same columns (in another order,
    which changes nothing: each column is penalised on its own), so the same values."""
    state, root, n = kept
    extra = ctx.token_ids[n:] + ctx.after  # ids after the kept history's (the drafts of ``history + drafts``)
    if len(extra) > PenaltyCounts.TAIL:
        return apply_penalties_in_full(logits, params, ctx)
    with state.lock:
        state.sync(root)
        state.push(extra)
        try:
            idx, counted, in_prompt = state.tensors()  # [columns] each, CPU
            if idx.numel() and int(idx.max()) >= logits.shape[-1]:  # ids the logits do not cover
                return apply_penalties_in_full(logits, params, ctx)
            return _penalise(logits, params, ctx, state.num_generated, state.where, idx, counted, in_prompt)
        finally:
            state.pop(n)


def _penalise(logits: torch.Tensor, params: SamplingParams, ctx: PenaltyContext, num_generated: int,
              where: dict[int, int], idx: torch.Tensor, counted: torch.Tensor, in_prompt: torch.Tensor) -> torch.Tensor:
    squeeze = logits.dim() == 1
    logits = logits.float().reshape(-1, logits.shape[-1]).clone()  # [m, vocab]
    m, vocab = logits.shape
    device = logits.device
    _bias_and_min_tokens(logits, params, ctx, num_generated)
    rp = params.repetition_penalty
    if params.presence_penalty or params.frequency_penalty or rp != 1:
        d = idx.numel()
        extra: dict[int, int] = {}  # draft ids without a column -> their column
        for t in ctx.drafts[: m - 1]:
            if t < vocab and t not in where and t not in extra:
                extra[t] = d + len(extra)
        if d + len(extra):
            columns = torch.cat([idx, torch.tensor(list(extra), dtype=torch.long)]).to(device)
            counts = torch.zeros(m, d + len(extra), device=device)  # generated-token counts before each row
            counts[:, :d] = counted.to(device)
            for j, t in enumerate(ctx.drafts[: m - 1]):
                if t < vocab:
                    c = where.get(t)
                    counts[j + 1:, extra[t] if c is None else c] += 1
            sub = logits[:, columns]  # [m, columns]
            if rp != 1:
                seen = counts > 0
                seen[:, :d] |= in_prompt.to(device)
                sub = torch.where(seen, torch.where(sub > 0, sub / rp, sub * rp), sub)
            logits[:, columns] = sub - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return logits[0] if squeeze else logits


class PenaltyCounts:
    """What the penalties read of one history, kept with it (``TokenHistory.cache``) and brought up to
    date with what was appended or cut back since: one column per token id that occurs among the
    generated ids (positions >= num_prompt_tokens) or, when the repetition penalty reads the prompt, in
    the prompt; its count among the generated ids and whether the prompt holds it. Columns are in no
    particular order; an id that no longer occurs loses its column. A cut deeper than the ids kept to
    undo it (``TAIL``) recounts from the history."""

    TAIL = 1024

    def __init__(self, num_prompt_tokens: int, with_prompt: bool):
        self.num_prompt = num_prompt_tokens
        self.with_prompt = with_prompt
        self.lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.length = 0  # ids counted
        self.num_generated = 0
        self.mark = None  # the history's mark when last synced
        self.columns: list[int] = []  # token id per column
        self.where: dict[int, int] = {}  # token id -> column
        self.generated: list[int] = []  # per column: count among the generated ids
        self.in_prompt: list[int] = []  # per column: count in the prompt (with_prompt only)
        self._tail: list[int] = []  # the last ids counted, to undo a cut
        self._tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # CPU, with spare room
        self._dirty: set[int] = set()  # columns changed since the tensors were written

    @staticmethod
    def of(token_ids: TokenHistory, num_prompt_tokens: int, with_prompt: bool):
        """(the counts kept for the history ``token_ids`` starts with, that history, how many ids of
        ``token_ids`` it covers): ``history + drafts`` uses the counts of ``history``."""
        root, n = token_ids, len(token_ids)
        if token_ids.origin is not None:
            origin, mark, length = token_ids.origin
            if len(origin) == length and origin.unchanged_since(mark) >= length:
                root, n = origin, length
        key = ("penalties", num_prompt_tokens, with_prompt)
        state = root.cache.get(key)
        if state is None:
            state = root.cache[key] = PenaltyCounts(num_prompt_tokens, with_prompt)
        return state, root, n

    # -- keeping up with the history ---------------------------------------------------------------------
    def sync(self, history: TokenHistory) -> None:
        keep = min(history.unchanged_since(self.mark), self.length) if self.mark is not None else 0
        if self.length - keep > len(self._tail):  # cut deeper than the ids kept to undo it: recount
            self._reset()
            keep = 0
        self.pop(keep)
        self.push(history[keep:])
        self.mark = history.mark()

    def push(self, new: list[int]) -> None:
        """Count ``new``, the ids that follow those counted."""
        for p, t in enumerate(new, self.length):
            if p >= self.num_prompt:
                self.generated[self._column(t)] += 1
                self.num_generated += 1
            elif self.with_prompt:
                self.in_prompt[self._column(t)] += 1
        self.length += len(new)
        tail = self._tail
        tail += new
        if len(tail) > 2 * self.TAIL:
            del tail[: len(tail) - self.TAIL]

    def pop(self, n: int) -> None:
        """Uncount the ids after the first ``n`` (at most ``len(_tail)`` of them)."""
        tail = self._tail
        for p in range(self.length - 1, n - 1, -1):
            t = tail.pop()
            c = self.where.get(t)
            if p >= self.num_prompt:
                self.generated[c] -= 1
                self.num_generated -= 1
            elif self.with_prompt:
                self.in_prompt[c] -= 1
            else:
                continue
            self._dirty.add(c)
            if not self.generated[c] and not self.in_prompt[c]:
                self._drop(c)
        self.length = min(self.length, n)

    def _column(self, t: int) -> int:
        c = self.where.get(t)
        if c is None:
            c = self.where[t] = len(self.columns)
            self.columns.append(t)
            self.generated.append(0)
            self.in_prompt.append(0)
        self._dirty.add(c)
        return c

    def _drop(self, c: int) -> None:
        """Remove column c (the last column takes its place)."""
        last = len(self.columns) - 1
        del self.where[self.columns[c]]
        if c != last:
            self.columns[c], self.generated[c], self.in_prompt[c] = (self.columns[last], self.generated[last],
                                                                     self.in_prompt[last])
            self.where[self.columns[c]] = c
        self.columns.pop()
        self.generated.pop()
        self.in_prompt.pop()

    # -- as tensors ----------------------------------------------------------------------------------------
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token ids, generated counts as float32, in the prompt) per column, on the CPU; only the columns
        that changed since the last call are written."""
        d = len(self.columns)
        if self._tensors is None or self._tensors[0].numel() < d:
            room = max(16, 2 * d)
            pad = room - d
            self._tensors = (torch.tensor(self.columns + [0] * pad, dtype=torch.long),
                             torch.tensor(self.generated + [0] * pad, dtype=torch.float32),
                             torch.tensor(self.in_prompt + [0] * pad, dtype=torch.long) > 0)
        elif self._dirty:
            changed = [c for c in self._dirty if c < d]
            if changed:
                at = torch.tensor(changed, dtype=torch.long)
                idx, counted, in_prompt = self._tensors
                idx[at] = torch.tensor([self.columns[c] for c in changed], dtype=torch.long)
                counted[at] = torch.tensor([float(self.generated[c]) for c in changed])
                in_prompt[at] = torch.tensor([self.in_prompt[c] > 0 for c in changed])
        self._dirty.clear()
        idx, counted, in_prompt = self._tensors
        return idx[:d], counted[:d], in_prompt[:d]


def process_logits(logits: torch.Tensor, params: SamplingParams, ctx: PenaltyContext | None = None) -> torch.Tensor:
    """Turn raw logits ``[..., vocab]`` into the sampling distribution ``[..., vocab]`` (float32):
    penalties and biases (``ctx``, see apply_penalties), then temperature, top-k, top-p.

    Greedy requests get a one-hot distribution on the (penalised) argmax, so one code path serves both.
    """
    logits = apply_penalties(logits, params, ctx)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if params.min_p > 0.0:  # after temperature, before top-k/top-p (vLLM's order)
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if params.top_k not in (0, -1) and params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the top-1 always stays)
        before = sorted_probs.cumsum(-1) - sorted_probs
        remove_sorted = before >= params.top_p
        remove = torch.zeros_like(remove_sorted).scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of ``probs`` ``[..., vocab]`` → ``[...]`` (int64)."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.reshape(probs.shape[:-1])


def token_logprobs(logits: Any, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """The raw log-probabilities of ``token_ids`` (one per row of ``logits`` [m, vocab]) and each row's
    ``top_n`` most likely tokens: log_softmax of the model's logits, before any processing (vLLM's
    default ``raw_logprobs``). ``logits``: a tensor, or anything that gives row slices as tensors
    (``specdec.engine.scoring.RowLogits``, which projects only the rows asked for)."""
    out: list[TokenLogprob] = []
    rows = logprob_chunk_rows(logits.shape[-1])
    for start in range(0, len(token_ids), rows):  # a long prompt: a chunk of rows at a time
        ids = token_ids[start: start + rows]
        chunk = logits[start: start + len(ids)]
        if not isinstance(chunk, torch.Tensor):  # RowLogits: the chunk's rows projected now, dropped after
            chunk = chunk.materialize()
        lp = torch.log_softmax(chunk.float(), dim=-1)  # [rows, vocab]
        chosen = lp.gather(-1, torch.tensor(ids, dtype=torch.long, device=lp.device)[:, None]).squeeze(-1).tolist()
        if top_n:
            values, idx = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), values.tolist())]
        else:
            tops = [[] for _ in ids]
        out += [TokenLogprob(t, c, top) for t, c, top in zip(ids, chosen, tops)]
    return out


# fp32 logits per chunk of rows read by token_logprobs (a 32k-token prompt x Gemma-3's 262k vocabulary would be
# 34 GB at once; at this budget a chunk is 64 rows of it, whatever the prompt's length)
LOGPROBS_CHUNK_BYTES = 64 << 20


def logprob_chunk_rows(vocab_size: int) -> int:
    """Rows of [rows, vocab_size] fp32 logits per chunk: LOGPROBS_CHUNK_BYTES of them, at least one."""
    return max(1, LOGPROBS_CHUNK_BYTES // (4 * vocab_size))

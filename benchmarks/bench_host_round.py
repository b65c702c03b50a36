"""Host work of one speculative round per sequence, without a model: what the gateway, the services and the
workers do around the forward passes, at histories of 512, 4,096 and 32,768 tokens, before (the whole-list
code as it was at 435da96, kept below) and after (the incremental code: ``specdec.history.TokenHistory`` and
its readers). Each round the target accepts 2 of k = 4 drafts and adds its own token (3 new tokens); where
the draft's history carries the round's drafts (a lookahead's bet), it loses them again the round after.
Per component, the median over the rounds, in microseconds:

  gateway clients        the target's and the draft's client: where the history stops sharing what was
                         last sent, and recording what was sent
  lookahead              the bet's history (committed tokens + drafts) and its check in the next round
  backend history        a service rebuilding the history from (start_position, new ids)
  n-gram index, grows    an n-gram draft following a history that only grows
  n-gram index, cut back a hybrid draft following the lookahead's history (drafts cut back every round)
  tli history            a TLI draft's re-tokenized context of a growing history (the --smoke TLI pair's
                         real BPE tokenizers); a cut-back history still re-tokenizes it whole (as before)
  target penalties       presence, frequency and repetition penalties over a verification's k + 1 rows
  draft penalties        the same over the draft's k steps (history + the drafts so far)

The penalties' columns (one per distinct token seen) are still gathered and scattered as tensors each
round, so their cost keeps growing with the distinct tokens of the history (text-like ids here), not with
its length. ``history + drafts``, which the draft worker builds per step, is a copy of the history
(specdec/engine, out of this benchmark's reach): counted in both.

    python benchmarks/bench_host_round.py
    python benchmarks/bench_host_round.py --smoke      # tiny histories: checks the script runs
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import PROMPTS, _truncated_tokenizer, add_common_args, json_path, print_table, ratio, write_json  # noqa: E402

from gateway.clients import SentHistory  # noqa: E402
from specdec.decoding import Lookahead  # noqa: E402
from specdec.drafting_state import DraftingState  # noqa: E402
from specdec.history import TokenHistory, mark_of  # noqa: E402
from specdec.ngram import NgramIndex  # noqa: E402
from specdec.proposal import Proposal  # noqa: E402
from specdec.sampling import (SamplingParams, SpecDecodeStats, apply_penalties, apply_penalties_in_full,  # noqa: E402
                              penalty_context)
from specdec.serving.backend import Backend, BackendConfig  # noqa: E402

COLUMNS = ["component", "history", "before us", "after us", "before / after"]
COMPONENTS = ["gateway clients", "lookahead", "backend history", "n-gram index, grows", "n-gram index, cut back",
              "tli history", "target penalties", "draft penalties", "draft penalties, after="]
K, ACCEPTED = 4, 2  # drafts per round, accepted per round (+ the target's token: 3 new tokens)
VOCAB = 49152
EOS = {0}


# --------------------------------------------------------------------------------------------------
# the code before (435da96), as it was


def old_shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if (a if n == len(a) else a[:n]) == (b if n == len(b) else b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])


class OldNgramIndex:
    def __init__(self, min_n: int, max_n: int):
        self.tokens: list[int] = []
        self._after = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, new_tokens):
        tokens = self.tokens
        for token in new_tokens:
            tokens.append(token)
            end = len(tokens) - 1
            for n, table in self._after.items():
                if end >= n:
                    table[tuple(tokens[end - n:end])] = end

    def sync(self, token_ids):
        n = len(self.tokens)
        if len(token_ids) >= n and token_ids[:n] == self.tokens:
            self.extend(token_ids[n:])
            return
        self.tokens = []
        for table in self._after.values():
            table.clear()
        self.extend(token_ids)


def old_draft_history(adapter, state: dict, target_ids: list[int]) -> list[int]:
    from specdec.tli.draft_context import DraftContext

    ctx = state.get("ctx")
    seen = state.get("target_ids", [])
    if ctx is None or len(seen) > len(target_ids) or target_ids[: len(seen)] != seen:
        ctx = DraftContext(adapter.draft_tokenizer, target_tokenizer=adapter.target_tokenizer,
                           prefix_ids=state["prefix"])
        seen = []
        state["ctx"] = ctx
    ctx.extend_target_ids(target_ids[len(seen):])
    state["target_ids"] = list(target_ids)
    return ctx.ids


# --------------------------------------------------------------------------------------------------
# rounds


def text_like(rng: random.Random, n: int) -> list[int]:
    """Ids with a skewed frequency, as text has (a few thousand distinct ids in 32k)."""
    return [int(VOCAB * rng.random() ** 4) for _ in range(n)]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def gateway_clients(n: int, rounds: int, old: bool, rng: random.Random) -> list[float]:
    committed = TokenHistory(text_like(rng, n))
    bet = TokenHistory()  # the lookahead's history (after: one list kept in place)
    target, draft = SentHistory(), SentHistory()
    held = {"target": [], "draft": []}

    def send(history, sent: SentHistory, role: str) -> None:
        if old:
            start = old_shared_prefix(held[role], history)
            history[start:]
            held[role] = list(history)
        else:
            start = sent.start(history)
            sent.sent(history, start, history[start:], sent.version, *mark_of(history))

    times = []
    for r in range(rounds + 1):
        committed += text_like(rng, ACCEPTED + 1)
        drafts = text_like(rng, K)
        if old:
            lookahead = list(committed) + drafts
        else:
            bet.truncate(len(committed) - ACCEPTED - 1)
            bet += committed[len(bet):]
            bet += drafts
            lookahead = bet
        times.append(timed(lambda: (send(committed, target, "target"), send(lookahead, draft, "draft"))))
    return times[1:]


class _Seq:  # what Lookahead reads of a sequence
    def __init__(self, ids):
        self.sequence_id, self.token_ids, self.budget = "s", ids, 1 << 30
        self.params, self.stats = SamplingParams(temperature=0), SpecDecodeStats()


class _Draft:
    def propose(self, *args):  # never called: the benchmark resolves the bets itself
        raise AssertionError


def lookahead(n: int, rounds: int, old: bool, rng: random.Random) -> list[float]:
    prompt = text_like(rng, n)
    seq = _Seq(list(prompt) if old else TokenHistory(prompt))
    ahead, base = Lookahead(), None
    times = []
    for r in range(rounds + 1):
        drafts = text_like(rng, K)
        if old:
            def bet():
                nonlocal base
                if base is not None:
                    seq.token_ids[: len(base)] != base  # the check of last round's bet
                base = seq.token_ids + drafts
        else:
            def bet():
                ahead.take(seq, K)
                ahead.start(_Draft(), seq, Proposal(drafts), K)
                ahead.resolve(lambda: Proposal(text_like(rng, K + 1)))
        times.append(timed(bet))
        seq.token_ids += drafts[:ACCEPTED] + text_like(rng, 1)  # the bet is lost: 2 of 4 accepted
    return times[1:]


class _Runner:  # what Backend.history reads of a runner
    def __init__(self):
        self.lock, self.sequences = threading.RLock(), {}


class _HeldSeq:
    def __init__(self, tokens):
        self.tokens, self.state, self.last_used = tokens, DraftingState(), 0.0


def backend_history(n: int, rounds: int, old: bool, rng: random.Random) -> list[float]:
    backend = Backend("target", BackendConfig(model="bench"))
    backend.runner = _Runner()
    seq = backend.runner.sequences["s"] = _HeldSeq(text_like(rng, n))  # the target's KV tokens
    times = []
    for r in range(rounds + 1):
        start, new = len(seq.tokens), text_like(rng, ACCEPTED + 1)
        if old:
            times.append(timed(lambda: seq.tokens[:start] + list(new)))
        else:
            times.append(timed(lambda: backend.history("s", start, new)))
        seq.tokens += new  # what the worker's pass adds
    return times[1:]


def ngram(n: int, rounds: int, old: bool, rng: random.Random, cut_back: bool) -> list[float]:
    index = OldNgramIndex(2, 4) if old else NgramIndex(2, 4)
    history = TokenHistory(text_like(rng, n))
    index.sync(list(history) if old else history)
    times = []
    for r in range(rounds + 1):
        if cut_back:  # last round's drafts: 2 accepted, the rest replaced by the target's token and new drafts
            history.truncate(len(history) - K + ACCEPTED)
            history += text_like(rng, 1 + K)
        else:
            history += text_like(rng, ACCEPTED + 1)
        given = list(history) if old else history  # (before: a new list per call from the service)
        times.append(timed(lambda: index.sync(given)))
    return times[1:]


def tli_history(n: int, rounds: int, old: bool, adapter, text_ids: list[int]) -> list[float]:
    history = TokenHistory(text_ids[:n])
    probe = adapter.draft_tokenizer("a").input_ids
    bos = adapter.draft_tokenizer.bos_token_id
    state = {"prefix": [bos] if bos is not None and probe and probe[0] == bos else []} if old else DraftingState()
    (old_draft_history(adapter, state, list(history)) if old else adapter.draft_history(state, history))
    times = []
    for r in range(rounds + 1):
        history += text_ids[len(history):len(history) + ACCEPTED + 1]
        if old:
            given = list(history)
            times.append(timed(lambda: old_draft_history(adapter, state, given)))
        else:
            times.append(timed(lambda: adapter.draft_history(state, history)))
    return times[1:]


PENALTIES = dict(temperature=1.0, presence_penalty=0.1, frequency_penalty=0.2, repetition_penalty=1.1)


def penalties(n: int, rounds: int, old: bool, rng: random.Random, draft: bool, after: bool = False) -> list[float]:
    params = SamplingParams(**PENALTIES, num_prompt_tokens=n)
    history = TokenHistory(text_like(rng, n))
    listed = list(history)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(K + 1, VOCAB, generator=g)
    times = []
    for r in range(rounds + 1):
        new = text_like(rng, ACCEPTED + 1)
        history += new
        listed += new
        drafts = text_like(rng, K)
        if draft:  # the draft worker: one row per step, after history + the drafts so far
            def work():
                for j in range(K):
                    if old:
                        apply_penalties_in_full(logits[j], params, penalty_context(params, listed + drafts[:j], EOS))
                    elif after:
                        apply_penalties(logits[j], params, penalty_context(params, history, EOS, after=drafts[:j]))
                    else:
                        apply_penalties(logits[j], params, penalty_context(params, history + drafts[:j], EOS))
        else:  # the target worker: k + 1 rows, the drafts before each row counted
            def work():
                if old:
                    apply_penalties_in_full(logits, params, penalty_context(params, listed, EOS, drafts))
                else:
                    apply_penalties(logits, params, penalty_context(params, history, EOS, drafts))
        times.append(timed(work))
    return times[1:]


def tli_pair(root: Path):
    """The --smoke TLI pair's tokenizers: SmolLM2's (target) and SmolLM2's cut to 8,192 ids (draft)."""
    from transformers import AutoTokenizer

    from specdec.config import default_draft_path
    from specdec.tli.adapter import TLIAdapter

    src = default_draft_path()
    if src is None:
        return None, "the embedded default draft (SmolLM2's tokenizer) is missing"
    os.environ.setdefault("SPECDEC_CACHE", str(root / "cache"))  # the pair's vocabulary mapping
    target_tok = AutoTokenizer.from_pretrained(src)
    draft_tok = _truncated_tokenizer(src, root / "tli-tokenizer", 8192)
    return TLIAdapter(draft_tok, target_tok, len(target_tok)), None


def median_us(times: list[float]) -> float:
    times = sorted(times)
    return 1e6 * times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--histories", default="512,4096,32768")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    histories = [64, 256] if args.smoke else [int(x) for x in args.histories.split(",")]
    rounds = 3 if args.smoke else args.rounds
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="specdec-bench-host-") as tmp:
        adapter, why = tli_pair(Path(tmp))
        if adapter is not None:
            text = "\n\n".join(PROMPTS)
            ids = adapter.target_tokenizer(text).input_ids
            text_ids = (ids * (max(histories) // len(ids) + 2))[: max(histories) + (rounds + 2) * (ACCEPTED + 1)]
        rows, skipped = [], {}
        distinct = {n: len(set(text_like(random.Random(n), n))) for n in histories}
        for component in COMPONENTS:
            for n in histories:
                def run(old: bool) -> float | None:
                    rng = random.Random(n)
                    if component == "gateway clients":
                        return median_us(gateway_clients(n, rounds, old, rng))
                    if component == "lookahead":
                        return median_us(lookahead(n, rounds, old, rng))
                    if component == "backend history":
                        return median_us(backend_history(n, rounds, old, rng))
                    if component.startswith("n-gram"):
                        return median_us(ngram(n, rounds, old, rng, cut_back=component.endswith("cut back")))
                    if component == "tli history":
                        return None if adapter is None else median_us(tli_history(n, rounds, old, adapter, text_ids))
                    return median_us(penalties(n, rounds, old, rng, draft=component.startswith("draft"),
                                               after=component.endswith("after=")))

                before, after = run(old=True), run(old=False)
                if before is None:
                    skipped[component] = why
                rows.append({"component": component, "history": n, "before us": before, "after us": after,
                             "before / after": ratio(before, after)})
                print(rows[-1], flush=True)
    print()
    print_table(rows, COLUMNS)
    lo, hi = min(histories), max(histories)
    growth = {}
    for component in COMPONENTS:
        at = {r["history"]: r for r in rows if r["component"] == component}
        growth[component] = {key: ratio(at[hi][key], at[lo][key]) for key in ("before us", "after us")}
    print(f"\nper-round cost at {hi} tokens / at {lo} tokens:")
    for component, g in growth.items():
        print(f"  {component:25s} before x{_x(g['before us'])}   after x{_x(g['after us'])}")
    for component, why in skipped.items():
        print(f"  ({component}: not measured: {why})")
    write_json(json_path(args, "bench_host_round"), {
        "smoke": bool(args.smoke), "histories": histories, "rounds": rounds, "k": K, "accepted": ACCEPTED,
        "vocab": VOCAB, "penalties": PENALTIES, "distinct_ids": distinct, "growth": growth, "skipped": skipped,
        "rows": rows})


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


if __name__ == "__main__":
    main()

"""What one draft step costs next to one target pass, per draft runtime (side by side in one run).

The draft's cost per speculative round is k steps; on 2 CPU cores a small draft's step is mostly
framework overhead and its vocabulary projection, not its decoder. Rows, for the embedded default pair:

- the draft through transformers' forward (the full 49,152-row LM head),
- the draft through specdec's lean forward (``specdec.lean_decoder``), full vocabulary,
- the lean forward over the draft's vocabulary (``draft_vocab.json``; what specdec runs by default),

each in fp32 and bf16, through ``ModelRunner`` exactly as the draft worker calls it (one token per
step, KV cache, logits out). The target rows give one-token and (k+1)-token passes, the cost a draft
step is measured against (c = draft step / target step).

    python benchmarks/bench_draft_step.py --reps 40
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from specdec.config import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402
from specdec.workers import ModelRunner  # noqa: E402
from specdec.models import load_model  # noqa: E402


def step_ms(runner: ModelRunner, n: int, context: int, reps: int) -> float:
    """Median time of a pass of ``n`` new tokens after ``context`` cached ones (rolled back each time)."""
    g = torch.Generator().manual_seed(0)
    vocab = runner.lm.model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (context + n,), generator=g).tolist()
    seq = runner.get_or_create(f"bench-{n}", 0)
    runner.forward(seq, ids[:context])
    times = []
    for _ in range(reps + 3):
        seq.cache.truncate(context)
        del seq.tokens[context:]
        t = time.perf_counter()
        runner.forward(seq, ids[context:], num_logits=n)
        times.append(time.perf_counter() - t)
    runner.release(f"bench-{n}")
    times = sorted(times[3:])
    return 1000 * times[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--context", type=int, default=96, help="cached tokens before the timed pass (default 96)")
    ap.add_argument("--k", type=int, default=4, help="the target's verification pass scores k+1 tokens (default 4)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default="bench_results/draft_step.json")
    args = ap.parse_args()

    rows = []
    target_ms = {}
    for dtype in ("float32", "bfloat16"):
        target = load_model(args.target, dtype=dtype)
        runner = ModelRunner(target, 4096, role="target")
        one, verify = step_ms(runner, 1, args.context, args.reps), step_ms(runner, args.k + 1, args.context, args.reps)
        target_ms[dtype] = one
        rows.append({"model": f"target {args.target}", "dtype": dtype, "runtime": "transformers",
                     "vocab rows": target.vocab_size, "ms/pass": one, f"ms/{args.k + 1}-token pass": verify})
        del runner, target
    for dtype in ("float32", "bfloat16"):
        draft = load_model(args.draft, dtype=dtype)
        variants = [("transformers", False, None), ("lean", True, None)]
        if draft.draft_vocab is not None:
            variants.append(("lean + draft vocab", True, draft.draft_vocab))
        for name, lean, vocab in variants:
            draft.draft_vocab = vocab
            runner = ModelRunner(draft, 4096, role="draft", lean_forward=lean)
            ms = step_ms(runner, 1, args.context, args.reps)
            rows.append({"model": f"draft {Path(args.draft).name}", "dtype": dtype, "runtime": name,
                         "vocab rows": draft.vocab_size if vocab is None else len(vocab), "ms/pass": ms,
                         "c (fp32 target)": ms / target_ms["float32"], "c (bf16 target)": ms / target_ms["bfloat16"]})
    cols = ["model", "dtype", "runtime", "vocab rows", "ms/pass", f"ms/{args.k + 1}-token pass", "c (fp32 target)",
            "c (bf16 target)"]
    print(f"threads={torch.get_num_threads()}, context={args.context}, median of {args.reps}")
    print_table(rows, cols)
    write_json(args.json, {"rows": rows, "args": vars(args)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What one draft step costs next to one target pass, per draft runtime (side by side in one run).

The draft's cost per speculative round is k steps; on 2 CPU cores a small draft's step is mostly
framework overhead and its vocabulary projection, not its decoder. Rows, for the embedded default pair:

- the draft through transformers' forward (the full 49,152-row LM head),
- the draft through specdec's lean forward (``specdec.engine.lean_decoder``), full vocabulary,
- the lean forward over the draft's vocabulary (``draft_vocab.json``; what specdec runs by default),

each in fp32 and bf16, through ``ModelRunner`` exactly as the draft worker calls it (one token per
step, KV cache, logits out). The target rows give one-token and (k+1)-token passes in the target's
default runtime (the lean forward where it supports the model), the cost a draft step is measured
against (c = draft step / target step).

    python benchmarks/bench_draft_step.py --reps 40
    python benchmarks/bench_draft_step.py --smoke   # tiny random-weight pair, seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, json_path, print_table, smoke_environment, smoke_models, step_ms, write_json  # noqa: E402

from specdec.config import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402
from specdec.engine.lean_forward import unsupported_reason  # noqa: E402
from specdec.engine.models import load_model  # noqa: E402
from specdec.engine.runner import ModelRunner  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--context", type=int, default=96, help="cached tokens before the timed pass (default 96)")
    ap.add_argument("--k", type=int, default=4, help="the target's verification pass scores k+1 tokens (default 4)")
    ap.add_argument("--reps", type=int, default=30)
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "draft_step")
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)
        models = smoke_models(tmp.name, draft_vocab=True)  # a draft vocabulary, as the shipped draft has
        args.target, args.draft, args.context, args.reps = models.target, models.draft, 8, 2
    max_len = args.context + args.k + 1

    rows = []
    target_ms = {}
    for dtype in ("float32", "bfloat16"):
        target = load_model(args.target, dtype=dtype)
        runner = ModelRunner(target, max_len, role="target")
        one, verify = step_ms(runner, 1, args.context, args.reps), step_ms(runner, args.k + 1, args.context, args.reps)
        target_ms[dtype] = one
        runtime = "transformers" if runner.net is target.model else "lean"  # the target's default runtime
        rows.append({"model": f"target {Path(args.target).name}", "dtype": dtype, "runtime": runtime,
                     "vocab rows": target.vocab_size, "ms/pass": one, f"ms/{args.k + 1}-token pass": verify})
        del runner, target
    for dtype in ("float32", "bfloat16"):
        draft = load_model(args.draft, dtype=dtype)
        # where the lean forward does not support the architecture, ModelRunner runs transformers' instead
        lean_name = "lean" if unsupported_reason(draft.model) is None else "transformers (no lean forward)"
        variants = [("transformers", False, None), (lean_name, True, None)]
        if draft.draft_vocab is not None:
            variants.append((f"{lean_name} + draft vocab", True, draft.draft_vocab))
        for name, lean, vocab in variants:
            draft.draft_vocab = vocab
            runner = ModelRunner(draft, max_len, role="draft", lean_forward=lean)
            ms = step_ms(runner, 1, args.context, args.reps)
            rows.append({"model": f"draft {Path(args.draft).name}", "dtype": dtype, "runtime": name,
                         "vocab rows": draft.vocab_size if vocab is None else len(vocab), "ms/pass": ms,
                         "c (fp32 target)": ms / target_ms["float32"], "c (bf16 target)": ms / target_ms["bfloat16"]})
    cols = ["model", "dtype", "runtime", "vocab rows", "ms/pass", f"ms/{args.k + 1}-token pass", "c (fp32 target)",
            "c (bf16 target)"]
    print(f"threads={torch.get_num_threads()}, context={args.context}, median of {args.reps}")
    print_table(rows, cols)
    write_json(out_path, {"smoke": args.smoke, "rows": rows, "args": vars(args)})
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

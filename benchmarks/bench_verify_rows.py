"""What a verify pass costs by draft length: the target's pass over k + 1 rows, k = 0 .. 32.

Suffix decoding proposes long drafts where the match is long, so how a pass grows with its rows decides how far
drafting pays. Side by side in one run, on one target (default: the embedded ``smollm2-135m``, float32), after
a ``--context``-token prompt (300):

  * the batch-invariant target (the target service's default): every product in calls of exactly 16 rows
    (``specdec.engine.lean_linear.INVARIANT_TILE_ROWS``), so the cost steps at 16, 32, 48 rows;
  * the same target without batch invariance (``--no-batch-invariant``): oneDNN picks its kernel by row count.

Each cell is the median of ``--reps`` verify calls (``TargetWorker.verify_batch``, one sequence, drafts that
are rejected, so the history grows by one token a call), in ms, and its ratio to the one-row pass (k = 0). A
profile of the largest k under batch invariance splits a pass into the weights' products, attention and the
rest (``--no-profile`` to skip).

    python benchmarks/bench_verify_rows.py
    python benchmarks/bench_verify_rows.py --smoke
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, cpu_info, json_path, print_table, smoke_environment, smoke_models, write_json  # noqa: E402

from specdec.config import DEFAULT_TARGET  # noqa: E402

KS = [0, 1, 2, 4, 8, 15, 16, 24, 31, 32]


def measure(worker, context: list[int], k: int, reps: int, name: str) -> float:
    from specdec.calls import VerifyCall
    from specdec.proposal import Proposal
    from specdec.sampling import SamplingParams

    params = SamplingParams(temperature=0)
    worker.verify_batch([VerifyCall(name, context, Proposal([]), params)])  # the prefill
    history, times = list(context), []
    for _ in range(reps + 1):
        drafts = [history[-1]] * k
        start = time.perf_counter()
        (result,) = worker.verify_batch([VerifyCall(name, history, Proposal(drafts), params)])
        times.append(time.perf_counter() - start)
        history = history + result.emitted(drafts)
    worker.runner.release(name)
    return statistics.median(times[1:]) * 1000


def profile_split(worker, context: list[int], k: int, reps: int) -> dict:
    prof = cProfile.Profile()
    prof.enable()
    measure(worker, context, k, reps, "profiled")
    prof.disable()
    stats = pstats.Stats(prof).stats
    total = products = attention = 0.0
    for (file, _, func), (_, _, tottime, _, _) in stats.items():
        total += tottime
        if "_linear_pointwise" in func or func in ("linear", "_int_mm", "qlinear_pointwise"):
            products += tottime
        elif file.endswith("cpu_attention.py") and func == "__call__":
            attention += tottime
    share = {"weights' products": products, "attention": attention, "the rest": total - products - attention}
    return {name: seconds / total for name, seconds in share.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-profile", action="store_true")
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "verify_rows")
    cpu = cpu_info()
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)
        args.target, args.context, args.reps = smoke_models(tmp.name).target, 24, 2
    from specdec.engine.models import load_model
    from specdec.engine.runner import ModelRunner
    from specdec.engine.workers import TargetWorker

    lm = load_model(args.target, dtype=args.dtype)
    context = [(7 * i + 3) % min(lm.vocab_size, 1000) + 10 for i in range(args.context)]
    workers = {mode: TargetWorker(ModelRunner(lm, args.context + 64, role="target", batch_invariant=mode))
               for mode in (True, False)}
    rows = []
    for k in KS:
        row = {"k": k, "rows": k + 1}
        for mode, label in ((True, "invariant"), (False, "not invariant")):
            row[f"{label} ms"] = measure(workers[mode], context, k, args.reps, f"{label}-{k}")
        rows.append(row)
    for label in ("invariant", "not invariant"):
        one = rows[0][f"{label} ms"]  # k = 0: a one-row pass (plain decoding)
        for row in rows:
            row[f"{label} x1"] = row[f"{label} ms"] / one
    print(f"\n{args.target}, {args.dtype}, one sequence after {args.context} tokens, median of {args.reps} passes")
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags']) or 'no avx2/avx512/amx'}\n")
    print_table(rows, ["k", "rows", "invariant ms", "invariant x1", "not invariant ms", "not invariant x1"])
    result = {"smoke": args.smoke, "target": args.target, "dtype": args.dtype, "context": args.context, "cpu": cpu,
              "rows": rows}
    if not args.no_profile:
        result["profile_k"] = KS[-1]
        result["profile"] = profile_split(workers[True], context, KS[-1], args.reps)
        print(f"\nwhere a batch-invariant pass of k={KS[-1]} goes: "
              + ", ".join(f"{name} {share:.0%}" for name, share in result["profile"].items()))
    write_json(out_path, result)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

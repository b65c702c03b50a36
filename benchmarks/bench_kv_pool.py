"""Pass cost against context length: a batched pass reads every history in place (side by side in one run).

For each context length, through ``ModelRunner.forward_batch`` as the target worker calls it:

  * ``batch of B``: one pass of B sequences x ``--new`` tokens, each after ``context`` cached tokens;
  * ``one sequence``: one pass of one sequence x ``--new`` tokens at the same context;
  * ``B solo passes``: B times the one-sequence pass (what serving them one after another costs);

and the ratios the execution-core issue sets goals on: the batch at the longest context over the batch at
the shortest (goal <= 2.5x: what must remain is attention reading B x context keys and values once), and the
batch over B solo passes (below 1: batching pays at every context). Medians of ``--reps`` passes; each pass
first rolls every sequence back to exactly ``context`` cached tokens (a pointer move).

    python benchmarks/bench_kv_pool.py                         # SmolLM2-135M fp32, contexts 64..4096, B=8
    python benchmarks/bench_kv_pool.py --model gemma-3-270m --num-threads 1
    python benchmarks/bench_kv_pool.py --smoke                 # tiny random model, seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, cpu_info, json_path, print_table, smoke_environment, smoke_models, write_json  # noqa: E402

from specdec.engine.models import load_model  # noqa: E402
from specdec.engine.runner import ModelRunner  # noqa: E402


def pass_ms(runner: ModelRunner, batch: int, context: int, new: int, reps: int) -> float:
    """Median ms of one pass of ``batch`` sequences x ``new`` tokens after ``context`` cached tokens each."""
    g = torch.Generator().manual_seed(context)
    vocab = min(runner.lm.vocab_size, len(runner.lm.tokenizer))
    histories = [torch.randint(0, vocab, (context + new,), generator=g).tolist() for _ in range(batch)]
    seqs = [runner.get_or_create(f"bench-{batch}-{context}-{i}", 0) for i in range(batch)]
    try:
        for seq, ids in zip(seqs, histories):
            runner.forward(seq, runner.sync(seq, ids[:context]))
        times = []
        for _ in range(reps + 2):
            for seq, ids in zip(seqs, histories):
                runner.sync(seq, ids[:context + 1])  # exactly the context stays cached
            t = time.perf_counter()
            out = runner.forward_batch(seqs, [ids[context:] for ids in histories], [new] * batch)
            times.append(time.perf_counter() - t)
            assert not any(isinstance(o, BaseException) for o in out), out
    finally:
        for i in range(batch):
            runner.release(f"bench-{batch}-{context}-{i}")
    return 1000 * statistics.median(times[2:])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--contexts", default="64,512,2048,4096")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=2, help="new tokens per sequence (a verification of k = new - 1)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--num-threads", type=int, default=2)
    add_common_args(ap)
    args = ap.parse_args(argv)
    model = args.model
    if args.smoke:
        root = tempfile.mkdtemp(prefix="specdec-bench-kv-")
        smoke_environment(root)
        model = smoke_models(root).target
        args.contexts, args.batch, args.reps = "16,96", 3, 1
    torch.set_num_threads(args.num_threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    lm = load_model(model, dtype=args.dtype)
    runner = ModelRunner(lm, max(contexts) + args.new + 1, role="target", max_sequences=args.batch + 1)
    rows = []
    for context in contexts:
        batched = pass_ms(runner, args.batch, context, args.new, args.reps)
        one = pass_ms(runner, 1, context, args.new, args.reps)
        rows.append({"context": context, f"batch of {args.batch} ms": batched, "one sequence ms": one,
                     f"{args.batch} solo passes ms": args.batch * one, "batch / one": batched / one,
                     "batch / solo passes": batched / (args.batch * one)})
        print(f"context {context}: batch {batched:.1f} ms, one {one:.1f} ms", flush=True)
    key = f"batch of {args.batch} ms"
    summary = {"longest / shortest batch": rows[-1][key] / rows[0][key],
               "runtime": "lean forward" if runner.paged else "transformers forward"}
    print()
    print_table(rows, ["context", key, "one sequence ms", f"{args.batch} solo passes ms", "batch / one",
                       "batch / solo passes"])
    print(f"\nbatch at context {contexts[-1]} / batch at {contexts[0]}: {summary['longest / shortest batch']:.2f}x "
          f"(goal <= 2.5x); {summary['runtime']}, {args.dtype}, {args.num_threads} thread(s)")
    payload = {"benchmark": "kv_pool", "smoke": args.smoke, "cpu": cpu_info(), "model": args.model, "dtype": args.dtype,
               "num_threads": args.num_threads, "new_tokens": args.new, "rows": rows, "summary": summary}
    write_json(json_path(args, "kv_pool"), payload)
    return payload


if __name__ == "__main__":
    main()

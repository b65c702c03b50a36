"""What batch-invariant passes cost: the default pair and the target alone, ``batch_invariant`` on vs off,
1 and 8 streams, side by side in one run (offline ``LLM``, greedy), plus the pass costs behind them.

    python benchmarks/bench_batch_invariant.py                     # SmolLM2-135M + the embedded draft, fp32
    python benchmarks/bench_batch_invariant.py --dtype bfloat16
    python benchmarks/bench_batch_invariant.py --smoke             # tiny random-weight pair: checks it runs

For each (dtype, mode, streams) the table gives tokens/s with the setting off and on and their ratio, and
whether the outputs match: speculative vs target alone under each setting (on: always, by construction; off:
as rounding falls), and on vs off (may differ in the last bits of near-ties). The pass table times one
``ModelRunner`` pass (1 token, k + 1 tokens, 8 sequences x (k + 1), a 256-token prefill) after a context.
Writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (PROMPTS, SMOKE_PROMPTS, add_common_args, cpu_info, json_path, print_table, ratio,  # noqa: E402
                    smoke_environment, smoke_models, step_ms, write_json)

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.config import DEFAULT_NUM_SPECULATIVE_TOKENS, default_draft_path  # noqa: E402
from specdec.engine.runner import ModelRunner  # noqa: E402

COLUMNS = ["dtype", "mode", "streams", "off tok/s", "on tok/s", "on/off", "spec==alone off", "spec==alone on",
           "on==off"]
PASS_COLUMNS = ["dtype", "pass", "off ms", "on ms", "on/off"]


def generate(llm: LLM, prompts: list[str], max_tokens: int, streams: int) -> tuple[float, list[list[int]]]:
    """Tokens/s of greedy generation of ``streams`` prompts at once (cycled from ``prompts``), and the tokens."""
    batch = [prompts[i % len(prompts)] for i in range(streams)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(batch[:1], params.clone(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / elapsed, tokens


def batched_pass_ms(runner: ModelRunner, seqs: int, n: int, context: int, reps: int) -> float:
    """Median time of one pass of ``seqs`` sequences x ``n`` new tokens after ``context`` cached each."""
    g = torch.Generator().manual_seed(1)
    vocab = min(runner.lm.vocab_size, len(runner.lm.tokenizer))
    hist = [torch.randint(0, vocab, (context + n,), generator=g).tolist() for _ in range(seqs)]
    ss = [runner.get_or_create(f"bench-batch-{i}", 0) for i in range(seqs)]
    times = []
    try:
        for s, h in zip(ss, hist):
            runner.forward(s, runner.sync(s, h[:context]))
        for _ in range(reps + 2):
            for s, h in zip(ss, hist):
                runner.sync(s, h[:context + 1])
            t = time.perf_counter()
            runner.forward_batch(ss, [h[context:] for h in hist], [n] * seqs)
            times.append(time.perf_counter() - t)
    finally:
        for i in range(seqs):
            runner.release(f"bench-batch-{i}")
    times = sorted(times[2:])
    return 1000 * times[len(times) // 2]


def pass_costs(lm, k: int, context: int, reps: int, invariant: bool) -> dict[str, float]:
    runner = ModelRunner(lm, context + 300, role="target", batch_invariant=invariant)
    return {
        "1 token": step_ms(runner, 1, context, reps),
        f"{k + 1} tokens": step_ms(runner, k + 1, context, reps),
        f"8 seqs x {k + 1} tokens": batched_pass_ms(runner, 8, k + 1, context, reps),
        "prefill 256": step_ms(runner, 256, context, max(2, reps // 4)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="default: the embedded default draft")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", action="append", default=None, help="float32 and/or bfloat16 (repeat; default float32)")
    ap.add_argument("--streams", default="1,8", help="comma-separated stream counts (default 1,8)")
    ap.add_argument("--context", type=int, default=512, help="cached tokens before a timed pass (default 512)")
    ap.add_argument("--reps", type=int, default=8)
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "batch_invariant")
    prompts, tmp = PROMPTS, None
    dtypes = args.dtype or ["float32"]
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)
        models = smoke_models(tmp.name)
        args.target, args.draft = models.target, models.draft
        args.num_speculative_tokens, args.max_tokens, args.context, args.reps = 2, 8, 16, 2
        prompts = SMOKE_PROMPTS
    draft = args.draft or (str(default_draft_path()) if default_draft_path() else None)
    if draft is None:
        ap.error("no --draft given and no embedded default draft is shipped")
    k = args.num_speculative_tokens
    streams = [int(s) for s in args.streams.split(",")]
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    rows, pass_rows = [], []
    for dtype in dtypes:
        results: dict = {}
        costs: dict = {}
        for invariant in (False, True):
            alone = LLM(args.target, dtype=dtype, batch_invariant=invariant)
            costs[invariant] = pass_costs(alone.target, k, args.context, args.reps, invariant)
            for n in streams:
                results[("target alone", n, invariant)] = generate(alone, prompts, args.max_tokens, n)
            del alone
            gc.collect()
            llm = LLM(args.target, speculative_config=spec, dtype=dtype, batch_invariant=invariant)
            for n in streams:
                results[(f"specdec k={k}", n, invariant)] = generate(llm, prompts, args.max_tokens, n)
            del llm
            gc.collect()
        for mode in ("target alone", f"specdec k={k}"):
            for n in streams:
                (off, off_tokens), (on, on_tokens) = results[(mode, n, False)], results[(mode, n, True)]
                row = {"dtype": dtype, "mode": mode, "streams": n, "off tok/s": off, "on tok/s": on,
                       "on/off": ratio(on, off), "on==off": on_tokens == off_tokens}
                if mode != "target alone":
                    row["spec==alone off"] = off_tokens == results[("target alone", n, False)][1]
                    row["spec==alone on"] = on_tokens == results[("target alone", n, True)][1]
                rows.append(row)
        for name in costs[False]:
            pass_rows.append({"dtype": dtype, "pass": name, "off ms": costs[False][name], "on ms": costs[True][name],
                              "on/off": ratio(costs[True][name], costs[False][name])})
    cpu = cpu_info()
    print(f"\ntarget {args.target}, draft {draft}, k={k}, {args.max_tokens} tokens a stream, greedy, "
          f"{torch.get_num_threads()} threads; CPU {cpu['model']} ({cpu['cores']} cores; {' '.join(cpu['flags'])})\n")
    print_table(rows, COLUMNS)
    print(f"\npasses after {args.context} cached tokens (median of {args.reps}):\n")
    print_table(pass_rows, PASS_COLUMNS)
    write_json(out_path, {"smoke": args.smoke, "target": args.target, "draft": draft, "k": k,
                          "max_tokens": args.max_tokens, "context": args.context, "cpu": cpu, "rows": rows,
                          "passes": pass_rows})
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What batch-invariant passes cost: the default pair and the target alone, ``--batch-invariant`` on vs off,
1 and 8 concurrent streams through ``specdec serve`` (group scheduling batches the streams' passes), greedy,
side by side in one run, plus the pass costs behind them.

    python benchmarks/bench_batch_invariant.py                     # SmolLM2-135M + the embedded draft, fp32
    python benchmarks/bench_batch_invariant.py --dtype bfloat16
    python benchmarks/bench_batch_invariant.py --smoke             # tiny random-weight pair: checks it runs

For each (dtype, mode, streams) the table gives tokens/s with the setting off and on (best of --repeats, the
four served stacks measured in rotating order) and their ratio, and whether the outputs match: speculative
vs target alone under each setting (on: always, by construction; off: as rounding falls), and on vs off
(near-ties may fall the other way). The pass table times one ``ModelRunner`` pass (1 token, k + 1 tokens,
8 sequences x (k + 1), a 256-token prefill) after a context. Writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_concurrency import measure  # noqa: E402
from bench_serving import ServedStack  # noqa: E402
from common import (PROMPTS, SMOKE_PROMPTS, add_common_args, cpu_info, json_path, print_table, ratio,  # noqa: E402
                    smoke_environment, smoke_models, step_ms, write_json)

import grpc  # noqa: E402

from specdec.config import default_speculative_config  # noqa: E402
from specdec.engine.models import load_model  # noqa: E402
from specdec.engine.runner import ModelRunner  # noqa: E402
from specdec.v1 import generation_service_pb2_grpc  # noqa: E402

COLUMNS = ["dtype", "mode", "streams", "off tok/s", "on tok/s", "on/off", "spec==alone off", "spec==alone on",
           "on==off"]
PASS_COLUMNS = ["dtype", "pass", "off ms", "on ms", "on/off"]


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


def served(dtype: str, target: str, spec: dict, streams: list[int], max_tokens: int, prompts: list[str],
           repeats: int, threads: int) -> dict:
    """(mode, streams, on) -> (tokens/s, outputs) for the four served stacks of one dtype."""
    base = dict(model=target, host="127.0.0.1", grpc_port=0, port=0, dtype=dtype, num_threads=threads,
                max_batch_size=max(16, max(streams)))
    k = spec["num_speculative_tokens"]
    setups = [(mode, on, dict(base, batch_invariant=on, **extra)) for mode, extra in
              (("target alone", {}), (f"specdec k={k}", {"speculative_config": json.dumps(spec), "group_rounds": True}))
              for on in (False, True)]
    best: dict = {}
    with contextlib.ExitStack() as es:
        stacks = [es.enter_context(ServedStack(cfg)) for _, _, cfg in setups]  # all load at once
        stubs = []
        for (mode, on, _), stack in zip(setups, stacks):
            grpc_port, http_port = stack.ports()
            channel = es.enter_context(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
            stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
            measure(stub, http_port, prompts, 2, 1, 4)  # warm-up
            stubs.append((mode, on, stub, http_port))
        for r in range(repeats):
            for n in streams:
                for mode, on, stub, http_port in stubs[r % len(stubs):] + stubs[:r % len(stubs)]:
                    m = measure(stub, http_port, prompts, n, 1, max_tokens)
                    if (mode, n, on) not in best or m["tokens/s"] > best[(mode, n, on)][0]:
                        best[(mode, n, on)] = (m["tokens/s"], sorted(m["outputs"]))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--speculative-config", default=None, help="JSON (default: the embedded default pair's)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2, help="passes over every setup and stream count (best of)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of the served models (0: all cores)")
    ap.add_argument("--dtype", action="append", default=None, help="float32 and/or bfloat16 (repeat; default float32)")
    ap.add_argument("--streams", default="1,8", help="comma-separated stream counts (default 1,8)")
    ap.add_argument("--context", type=int, default=512, help="cached tokens before a timed pass (default 512)")
    ap.add_argument("--reps", type=int, default=8)
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "batch_invariant")
    prompts, tmp = PROMPTS, None
    dtypes = args.dtype or ["float32"]
    streams = [int(s) for s in args.streams.split(",")]
    spec = json.loads(args.speculative_config) if args.speculative_config else default_speculative_config()
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)
        models = smoke_models(tmp.name)
        args.target = models.target
        spec = {"method": "draft_model", "model": str(models.draft), "num_speculative_tokens": 2}
        args.max_tokens, args.context, args.reps, args.repeats, streams, args.threads = 8, 16, 2, 1, [1, 2], 1
        prompts = SMOKE_PROMPTS
    if spec is None:
        ap.error("no --speculative-config given and no embedded default draft is shipped")
    spec = {key: value for key, value in spec.items() if key != "disable_by_batch_size"}  # speculating at any load
    k = spec["num_speculative_tokens"]
    rows, pass_rows = [], []
    for dtype in dtypes:
        results = served(dtype, args.target, spec, streams, args.max_tokens, prompts, args.repeats, args.threads)
        lm = load_model(args.target, dtype=dtype)
        costs = {on: pass_costs(lm, k, args.context, args.reps, on) for on in (False, True)}
        del lm
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
    print(f"\ntarget {args.target}, draft {spec['model']}, k={k}, {args.max_tokens} tokens a stream, greedy, "
          f"{torch.get_num_threads()} threads; CPU {cpu['model']} ({cpu['cores']} cores; {' '.join(cpu['flags'])})\n")
    print_table(rows, COLUMNS)
    print(f"\npasses after {args.context} cached tokens (median of {args.reps}):\n")
    print_table(pass_rows, PASS_COLUMNS)
    write_json(out_path, {"smoke": args.smoke, "target": args.target, "draft": spec["model"], "k": k,
                          "max_tokens": args.max_tokens, "context": args.context, "cpu": cpu, "rows": rows,
                          "passes": pass_rows})
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

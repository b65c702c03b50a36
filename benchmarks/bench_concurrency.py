"""Throughput under concurrency: N concurrent streams through the served stack, side by side in one run.

Setups (each a ``specdec serve`` stack in a child process):
  * target alone (no draft), the same concurrency;
  * the default pair, one loop per request (``--no-group-rounds``: each stream's rounds run on their own);
  * the default pair, grouped (``--group-rounds``, the default: the gateway steps every live sequence
    together and each service batches the phase whole);
  * when the speculative config has ``disable_by_batch_size`` (the default pair's does), grouped with it:
    the rows above leave it out, so that they speculate at every concurrency.

All three stacks load at once and stay up; the setups alternate level by level (best of ``--repeats``).
At each concurrency N (default 1, 4, 8, 16, 32), N threads each send ``--requests-per-stream`` greedy
requests of ``--max-tokens`` tokens back to back (prompts offset per stream). Reported per setup and N:
aggregate tokens/s, its ratio to the same setup at 1 stream, the mean target batch (from the target
service's ``specdec_batch_size`` histogram on the gateway's /metrics) over N, the per-stream gap between
responses (p50/p99: each response carries one round's tokens) and whether every output equals the
1-stream output of the same prompt.

    python benchmarks/bench_concurrency.py                      # the issue's table: 1,4,8,16,32 streams
    python benchmarks/bench_concurrency.py --streams 1,8 --max-tokens 32
    python benchmarks/bench_concurrency.py --smoke              # tiny random-weight pair, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import ServedStack, target_batches  # noqa: E402
from common import (PROMPTS, SMOKE_PROMPTS, add_common_args, json_path, print_table, smoke_environment,  # noqa: E402
                    smoke_models, write_json)

from specdec.config import SpeculativeConfig, default_speculative_config  # noqa: E402
from specdec.v1 import common_pb2, generation_service_pb2 as pb, generation_service_pb2_grpc  # noqa: E402

COLUMNS = ["setup", "streams", "tokens/s", "x 1 stream", "batch/streams", "gap p50 ms", "gap p99 ms", "identical"]


def run_stream(stub, prompt: str, max_tokens: int) -> tuple[list[int], list[float]]:
    """One greedy request: its token ids and the gaps (seconds) between its responses."""
    ids: list[int] = []
    gaps: list[float] = []
    req = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                             sampling_params=common_pb2.SamplingParams(temperature=0))
    last = None
    for resp in stub.Generate(req, timeout=1800):
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
        ids.extend(resp.token_ids)
    return ids, gaps


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def measure(stub, http_port: int, prompts: list[str], streams: int, per_stream: int, max_tokens: int) -> dict:
    outputs: dict[tuple[int, int], tuple[str, list[int]]] = {}
    gaps: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        try:
            for j in range(per_stream):
                prompt = prompts[(i + j) % len(prompts)]
                ids, g = run_stream(stub, prompt, max_tokens)
                with lock:
                    outputs[(i, j)] = (prompt, ids)
                    gaps.extend(g)
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(streams)]
    before = target_batches(http_port)
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    after = target_batches(http_port)
    passes = after[1] - before[1]
    return {"tokens/s": sum(len(ids) for _, ids in outputs.values()) / elapsed,
            "mean_target_batch": (after[0] - before[0]) / passes if passes else None,
            "gap p50 ms": 1000 * percentile(gaps, 50) if gaps else None,
            "gap p99 ms": 1000 * percentile(gaps, 99) if gaps else None,
            "outputs": list(outputs.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target model (default: the embedded default pair's)")
    ap.add_argument("--speculative-config", default=None, help="JSON (default: the embedded default pair's)")
    ap.add_argument("--streams", default="1,4,8,16,32", help="concurrency levels, comma-separated")
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="passes over every level and setup (best of; default 2)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of the served models (0: all cores)")
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "concurrency")
    levels = [int(x) for x in args.streams.split(",")]
    prompts = PROMPTS
    tmp = None
    spec = json.loads(args.speculative_config) if args.speculative_config else default_speculative_config()
    target = args.target
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)
        models = smoke_models(tmp.name)
        target = models.target
        spec = {"method": "draft_model", "model": str(models.draft), "num_speculative_tokens": 2}
        levels, args.requests_per_stream, args.max_tokens, args.threads, args.repeats = [1, 2], 1, 8, 1, 1
        prompts = SMOKE_PROMPTS
    if spec is None:
        ap.error("no --speculative-config given and no embedded default draft is shipped")
    target = target or "smollm2-135m"
    max_batch = max(16, max(levels))
    base = dict(model=target, host="127.0.0.1", grpc_port=0, port=0, dtype=args.dtype, num_threads=args.threads,
                max_batch_size=max_batch)
    if SpeculativeConfig.from_any(spec).uses_suffix and "suffix_decoding_max_cached_requests" not in spec:
        # Every level and repeat (and the warm-up) sends the same prompts: suffix decoding's global tree would
        # replay earlier runs' outputs and measure a cache, not concurrency. Each request drafts from its own tree.
        spec = {**spec, "suffix_decoding_max_cached_requests": 0}
        print("suffix drafting without the global tree (suffix_decoding_max_cached_requests 0): the prompts repeat")
    always = {key: value for key, value in spec.items() if key != "disable_by_batch_size"}  # speculating at any load
    setups = [("target alone", dict(base)),
              ("pair, loop per request", dict(base, speculative_config=json.dumps(always), group_rounds=False)),
              ("pair, grouped", dict(base, speculative_config=json.dumps(always), group_rounds=True))]
    if spec.get("disable_by_batch_size"):  # e.g. the default pair's: drafts off from that many streams
        setups.append((f"pair, grouped, disable_by_batch_size={spec['disable_by_batch_size']}",
                       dict(base, speculative_config=json.dumps(spec), group_rounds=True)))

    reference: dict[str, list[int]] = {}  # prompt -> the first output seen (greedy: every setup's is the same)
    best: dict[tuple[str, int], dict] = {}  # (setup, streams) -> its fastest repeat
    identical: dict[tuple[str, int], bool] = {}
    with contextlib.ExitStack() as es:
        stacks = [es.enter_context(ServedStack(cfg)) for _, cfg in setups]  # all load at once
        stubs = []
        for (name, _), stack in zip(setups, stacks):
            grpc_port, http_port = stack.ports()
            channel = es.enter_context(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
            stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
            measure(stub, http_port, prompts, min(4, max(levels)), 1, min(8, args.max_tokens))  # warm-up
            stubs.append((name, stub, http_port))
        # setups alternate level by level (their order rotating), best of --repeats: this machine's speed drifts
        for r in range(args.repeats):
            for n in levels:
                order = stubs[r % len(stubs):] + stubs[:r % len(stubs)]
                for name, stub, http_port in order:
                    m = measure(stub, http_port, prompts, n, args.requests_per_stream, args.max_tokens)
                    for prompt, ids in m["outputs"]:
                        reference.setdefault(prompt, ids)
                    same = all(reference[p] == ids for p, ids in m["outputs"])
                    identical[(name, n)] = identical.get((name, n), True) and same
                    if (name, n) not in best or m["tokens/s"] > best[(name, n)]["tokens/s"]:
                        best[(name, n)] = m
                    print(f"repeat {r + 1}: {name:24s} {n:3d} streams: {m['tokens/s']:.1f} tokens/s", flush=True)
    rows = []
    for name, _ in setups:
        single = best[(name, levels[0])]["tokens/s"]
        for n in levels:
            m = best[(name, n)]
            rows.append({"setup": name, "streams": n, "tokens/s": m["tokens/s"], "x 1 stream": m["tokens/s"] / single,
                         "batch/streams": None if m["mean_target_batch"] is None else m["mean_target_batch"] / n,
                         "gap p50 ms": m["gap p50 ms"], "gap p99 ms": m["gap p99 ms"],
                         "identical": identical[(name, n)]})

    by = {(r["setup"], r["streams"]): r for r in rows}
    vs_target = {n: by[("pair, grouped", n)]["tokens/s"] / by[("target alone", n)]["tokens/s"] for n in levels}
    vs_loops = {n: by[("pair, grouped", n)]["tokens/s"] / by[("pair, loop per request", n)]["tokens/s"] for n in levels}
    print(f"\ntarget {target} ({args.dtype}), speculative_config {json.dumps(spec)}, greedy, "
          f"{args.requests_per_stream} requests x {args.max_tokens} tokens per stream, best of {args.repeats}\n")
    print_table(rows, COLUMNS)
    print("\ngrouped / loop per request: " + ", ".join(f"{n}: {v:.2f}" for n, v in vs_loops.items()))
    print("grouped / target alone:     " + ", ".join(f"{n}: {v:.2f}" for n, v in vs_target.items()))
    write_json(out_path, {"smoke": args.smoke, "target": str(target), "speculative_config": spec,
                          "dtype": args.dtype, "max_tokens": args.max_tokens, "streams": levels,
                          "requests_per_stream": args.requests_per_stream, "repeats": args.repeats, "prompts": prompts, "rows": rows,
                          "grouped_over_loops": vs_loops, "grouped_over_target_alone": vs_target,
                          "p99_gap_ratio_8_over_1": _gap_ratio(by, 8)})
    if tmp is not None:
        tmp.cleanup()
    return 0


def _gap_ratio(by: dict, n: int) -> float | None:
    """The grouped setup's p99 response gap at n streams over its p99 at 1 stream (None: not measured)."""
    one, many = by.get(("pair, grouped", 1)), by.get(("pair, grouped", n))
    if not one or not many or not one["gap p99 ms"] or many["gap p99 ms"] is None:
        return None
    return many["gap p99 ms"] / one["gap p99 ms"]


if __name__ == "__main__":
    sys.exit(main())

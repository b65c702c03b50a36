"""The served stack (gateway + draft + target over gRPC) vs the in-process engine, and concurrency.

Side by side in one run, same pair, prompts, k and dtype:
  * in-process ``LLM`` (one stream),
  * one stream through ``specdec serve``'s stack (the cost of the split),
  * N concurrent streams through the stack (continuous batching).

The stack runs in a process of its own (``start_stack`` in a child process, as ``specdec serve`` would),
so the in-process ``LLM`` here and the served models each get one OpenMP pool: two pools in one
process slow both (see docs/serving/index.md, "Threads and batching"). In-process and served runs alternate, best of ``--repeats``.
The mean target batch of the concurrent streams comes from the gateway's Prometheus ``/metrics``
(``specdec_batch_size`` of the target service).

    python benchmarks/bench_serving.py --draft PATH -k 4 --streams 8 --max-tokens 64
    python benchmarks/bench_serving.py --smoke   # tiny random-weight pair, seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (PROMPTS, SMOKE_PROMPTS, add_common_args, json_path, print_table, smoke_environment,  # noqa: E402
                    smoke_models, write_json)

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.config import default_draft_path  # noqa: E402
from specdec.v1 import common_pb2, generation_service_pb2 as pb, generation_service_pb2_grpc  # noqa: E402

COLUMNS = ["setup", "tokens/s", "ratio", "identical"]
STARTUP_TIMEOUT_S = 600


def serve_in_child(serve_config: dict, conn) -> None:
    """Child process: ``start_stack(ServeConfig(**serve_config))``, send the gateway's gRPC and HTTP ports,
    serve until the parent sends anything (or goes away)."""
    from specdec.entrypoints.serve import ServeConfig, start_stack

    try:
        stack = start_stack(ServeConfig(**serve_config))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    try:
        conn.send(("ports", (stack.gateway.port, stack.gateway.http_port)))
        conn.recv()
    except EOFError:
        pass
    finally:
        stack.stop(0)


class ServedStack:
    """The served stack in a child process, stopped on exit."""

    def __init__(self, serve_config: dict):
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=serve_in_child, args=(serve_config, child_conn), daemon=True,
                                name="specdec-serve")

    def __enter__(self) -> "ServedStack":
        self.proc.start()
        return self

    def ports(self) -> tuple[int, int]:
        """The gateway's gRPC and HTTP ports, once the stack has started (it loads while the caller works)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise SystemExit(f"the served stack exited during start-up (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise SystemExit(f"the served stack did not start within {STARTUP_TIMEOUT_S} s")
        try:
            kind, value = self.conn.recv()
        except EOFError:  # it died before reporting
            self.proc.join(30)
            raise SystemExit(f"the served stack exited during start-up (exit code {self.proc.exitcode})") from None
        if kind != "ports":
            self.proc.join(30)
            raise SystemExit(f"the served stack failed to start: {value}")
        return value

    def __exit__(self, *exc) -> bool:
        try:
            self.conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)
        return False


def target_batches(http_port: int) -> tuple[float, float]:
    """(sum, count) of the target service's ``specdec_batch_size`` histogram, from the gateway's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    with opener.open(f"http://127.0.0.1:{http_port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    total = count = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        if family.name != "specdec_batch_size":
            continue
        for sample in family.samples:
            if sample.labels.get("service") != "target":
                continue
            found = True
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    if not found:
        raise SystemExit("the gateway's /metrics has no specdec_batch_size series of the target service")
    return total, count


def stream_once(stub, prompt: str, max_tokens: int) -> list[int]:
    ids: list[int] = []
    req = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                             sampling_params=common_pb2.SamplingParams(temperature=0))
    for resp in stub.Generate(req, timeout=600):
        ids.extend(resp.token_ids)
    return ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="default: the embedded default draft")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft-dtype", default=None)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads, in-process and served alike (0: all cores)")
    ap.add_argument("--repeats", type=int, default=2, help="alternating in-process / served runs (best of each)")
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "serving")
    prompts = PROMPTS
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)  # the child process inherits its environment
        models = smoke_models(tmp.name)
        args.target, args.draft = models.target, models.draft
        args.num_speculative_tokens, args.max_tokens, args.streams, args.repeats, args.threads = 2, 8, 2, 1, 1
        prompts = SMOKE_PROMPTS
    if args.threads:
        torch.set_num_threads(args.threads)
    draft = args.draft or (str(default_draft_path()) if default_draft_path() else None)
    if draft is None:
        ap.error("no --draft given and no embedded default draft is shipped")
    k = args.num_speculative_tokens
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    serve_config = dict(model=args.target, speculative_config=json.dumps(spec), host="127.0.0.1", grpc_port=0,
                        port=0, dtype=args.dtype, draft_dtype=args.draft_dtype, num_threads=args.threads,
                        max_batch_size=max(16, args.streams))

    with ServedStack(serve_config) as served_stack:
        llm = LLM(args.target, speculative_config=spec, dtype=args.dtype, draft_dtype=args.draft_dtype)
        llm.generate(prompts[:1], params.clone(max_tokens=min(8, args.max_tokens)))
        grpc_port, http_port = served_stack.ports()
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
            stream_once(stub, prompts[0], min(8, args.max_tokens))

            # In-process and served runs alternate (best of --repeats each): this machine's speed drifts.
            offline_tps = served_tps = 0.0
            for _ in range(args.repeats):
                t = time.perf_counter()
                offline = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
                offline_tps = max(offline_tps, sum(map(len, offline)) / (time.perf_counter() - t))
                t = time.perf_counter()
                served = [stream_once(stub, p, args.max_tokens) for p in prompts]
                served_tps = max(served_tps, sum(map(len, served)) / (time.perf_counter() - t))
            del llm

            # N concurrent streams, each working through the prompt list (offset so they differ).
            results: list[list[list[int]]] = [[] for _ in range(args.streams)]
            errors: list[BaseException] = []

            def worker(i: int) -> None:
                try:
                    for j in range(len(prompts)):
                        results[i].append(stream_once(stub, prompts[(i + j) % len(prompts)], args.max_tokens))
                except BaseException as exc:  # re-raised on the main thread below
                    errors.append(exc)

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.streams)]
            batches_before = target_batches(http_port)
            t = time.perf_counter()
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            conc_elapsed = time.perf_counter() - t
            if errors:
                raise errors[0]
            batches_after = target_batches(http_port)
    batched = batches_after[1] - batches_before[1]
    mean_batch = (batches_after[0] - batches_before[0]) / batched if batched else None
    conc_tps = sum(len(x) for r in results for x in r) / conc_elapsed
    same = all(results[i][j] == served[(i + j) % len(prompts)] for i in range(args.streams) for j in range(len(prompts)))

    rows = [
        {"setup": "in-process LLM, 1 stream", "tokens/s": offline_tps, "ratio": 1.0},
        {"setup": "served stack, 1 stream", "tokens/s": served_tps, "ratio": served_tps / offline_tps,
         "identical": served == offline},
        {"setup": f"served stack, {args.streams} streams", "tokens/s": conc_tps, "ratio": conc_tps / offline_tps,
         "identical": same},
    ]
    print(f"\ntarget {args.target} ({args.dtype}), draft {draft}, k={k}, greedy, {len(prompts)} prompts x "
          f"{args.max_tokens} tokens, {torch.get_num_threads()} threads\n")
    print_table(rows, COLUMNS)
    print(f"\nsplit cost: served / in-process = {served_tps / offline_tps:.3f} (goal >= 0.9)")
    print(f"concurrency: {args.streams} streams / 1 stream = {conc_tps / served_tps:.2f}x (goal >= 3); "
          f"mean target batch {'-' if mean_batch is None else format(mean_batch, '.2f')}")
    write_json(out_path, {"smoke": args.smoke, "target": args.target, "draft": draft, "k": k, "dtype": args.dtype,
                          "draft_dtype": args.draft_dtype, "max_tokens": args.max_tokens, "streams": args.streams,
                          "prompts": prompts, "rows": rows, "served_over_inprocess": served_tps / offline_tps,
                          "concurrent_over_single": conc_tps / served_tps, "mean_target_batch": mean_batch})
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

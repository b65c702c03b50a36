"""The served stack (gateway + draft + target over gRPC) vs the in-process engine, and concurrency.

Side by side in one run, same pair, prompts, k and dtype:
  * in-process ``LLM`` (one stream),
  * one stream through ``specdec serve``'s stack (the cost of the split),
  * N concurrent streams through the stack (continuous batching).

    python benchmarks/bench_serving.py --draft PATH -k 4 --streams 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PROMPTS, print_table, write_json  # noqa: E402

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.config import default_draft_path  # noqa: E402
from specdec.entrypoints.serve import ServeConfig, start_stack  # noqa: E402
from specdec.v1 import common_pb2, generation_service_pb2 as pb, generation_service_pb2_grpc  # noqa: E402


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
    ap.add_argument("--repeats", type=int, default=2, help="alternating in-process / served runs (best of each)")
    ap.add_argument("--json", default="bench_results/serving.json")
    args = ap.parse_args()
    draft = args.draft or (str(default_draft_path()) if default_draft_path() else None)
    if draft is None:
        ap.error("no --draft given and no embedded default draft is shipped")
    k = args.num_speculative_tokens
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    stack = start_stack(ServeConfig(model=args.target, speculative_config=json.dumps(spec), host="127.0.0.1",
                                    grpc_port=0, port=-1, dtype=args.dtype, draft_dtype=args.draft_dtype,
                                    max_batch_size=max(16, args.streams)))
    compute = stack.target.backend.batcher.compute

    def on_compute_thread(fn):
        """Run fn on the stack's compute thread: the in-process engine gets the same thread and
        OpenMP pool as the served models (a second pool would slow both; see specdec.serving.batching)."""
        box: list = []
        done = threading.Event()
        compute.submit(lambda: (box.append(fn()), done.set()))
        done.wait()
        return box[0]

    try:
        llm = on_compute_thread(lambda: LLM(args.target, speculative_config=spec, dtype=args.dtype,
                                            draft_dtype=args.draft_dtype))
        on_compute_thread(lambda: llm.generate(PROMPTS[:1], params.clone(max_tokens=8)))
        stub = generation_service_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(f"127.0.0.1:{stack.gateway.port}"))
        stream_once(stub, PROMPTS[0], 8)

        # In-process and served runs alternate (best of --repeats each): this machine's speed drifts.
        offline_tps = served_tps = 0.0
        for _ in range(args.repeats):
            t = time.perf_counter()
            offline = on_compute_thread(lambda: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)])
            offline_tps = max(offline_tps, sum(map(len, offline)) / (time.perf_counter() - t))
            t = time.perf_counter()
            served = [stream_once(stub, p, args.max_tokens) for p in PROMPTS]
            served_tps = max(served_tps, sum(map(len, served)) / (time.perf_counter() - t))
        del llm

        # N concurrent streams, each working through the prompt list (offset so they differ).
        results: list[list[list[int]]] = [[] for _ in range(args.streams)]

        def worker(i: int) -> None:
            for j in range(len(PROMPTS)):
                results[i].append(stream_once(stub, PROMPTS[(i + j) % len(PROMPTS)], args.max_tokens))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.streams)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        conc_elapsed = time.perf_counter() - t
        conc_tps = sum(len(x) for r in results for x in r) / conc_elapsed
        same = all(results[i][j] == served[(i + j) % len(PROMPTS)] for i in range(args.streams) for j in range(len(PROMPTS)))
        batch_sizes = stack.target.backend.batch_sizes
        mean_batch = sum(batch_sizes) / len(batch_sizes) if batch_sizes else 0.0
    finally:
        stack.stop(0)

    rows = [
        {"setup": "in-process LLM, 1 stream", "tokens/s": offline_tps, "ratio": 1.0},
        {"setup": "served stack, 1 stream", "tokens/s": served_tps, "ratio": served_tps / offline_tps,
         "identical": served == offline},
        {"setup": f"served stack, {args.streams} streams", "tokens/s": conc_tps, "ratio": conc_tps / offline_tps,
         "identical": same},
    ]
    print(f"\ntarget {args.target} ({args.dtype}), draft {draft}, k={k}, greedy, {len(PROMPTS)} prompts x "
          f"{args.max_tokens} tokens, {torch.get_num_threads()} threads\n")
    print_table(rows, ["setup", "tokens/s", "ratio", "identical"])
    print(f"\nsplit cost: served / in-process = {served_tps / offline_tps:.3f} (goal >= 0.9)")
    print(f"concurrency: {args.streams} streams / 1 stream = {conc_tps / served_tps:.2f}x (goal >= 3); "
          f"mean target batch {mean_batch:.2f}")
    write_json(args.json, {"target": args.target, "draft": draft, "k": k, "dtype": args.dtype,
                           "max_tokens": args.max_tokens, "streams": args.streams, "rows": rows,
                           "served_over_inprocess": served_tps / offline_tps,
                           "concurrent_over_single": conc_tps / served_tps, "mean_target_batch": mean_batch})
    return 0


if __name__ == "__main__":
    sys.exit(main())

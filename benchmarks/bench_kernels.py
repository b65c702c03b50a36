"""Verification per batch: the Triton kernels vs the torch reference (and the per-row loop the worker used to run),
for batch x k x vocabulary, side by side in one run; plus the (undispatched) temperature-softmax kernel vs torch.

Each case is a ragged batch of sampled sequences whose drafts came with q (probabilistic drafting: the heaviest
case). "draw ms" is ``RaggedBatch.build`` (every row's random numbers and index tables, the same for both
backends); "torch ms" / "triton ms" is one ``accept_batch`` (torch: vectorised, no host sync inside) + the host
transfer of its results; "per-row ms" is ``accept_rows``, the torch reference row by row with a host sync per row
(what the torch backend runs on a CPU). Goal on a GPU: triton >= 3x torch at batch >= 8.

    python benchmarks/bench_kernels.py                 # on CUDA: batch 1, 8, 64, 256 x k 1..8 x vocab 49k, 152k, 262k
    python benchmarks/bench_kernels.py --smoke         # tiny sizes on any machine (Triton's interpreter on a CPU)

On a CPU without --smoke only the torch paths are timed (the interpreter is a test tool, not a speed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import add_common_args, json_path, print_table, ratio, write_json  # noqa: E402

COLUMNS = ["case", "draw ms", "torch ms", "triton ms", "speedup", "per-row ms", "identical"]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn, device: str, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    times.sort()
    return 1000 * times[len(times) // 2]


def _case(batch: int, k: int, vocab: int, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    p = torch.softmax(torch.randn(batch * (k + 1), vocab, device=device, generator=g) * 4, -1)
    q = torch.softmax(torch.randn(batch * k, vocab, device=device, generator=g) * 4, -1)
    q = 0.7 * p.view(batch, k + 1, vocab)[:, :k].reshape(batch * k, vocab) + 0.3 * q
    drafts = torch.multinomial(q, 1, generator=g)[:, 0].view(batch, k).tolist()
    targets = list(p.view(batch, k + 1, vocab).unbind(0))
    qs = list(q.view(batch, k, vocab).unbind(0))
    return drafts, targets, qs


def run_case(batch, k, vocab, device, reps, with_triton):
    from specdec.rejection import RaggedBatch, accept_batch, accept_rows

    drafts, targets, qs = _case(batch, k, vocab, device)
    gens = [torch.Generator(device=device).manual_seed(i) for i in range(batch)]

    def build():
        return RaggedBatch.build(drafts, targets, qs, [False] * batch, gens, device)

    b = build()
    row = {"case": f"B={batch} k={k} V={vocab}", "draw ms": _time(build, device, reps),
           "torch ms": _time(lambda: accept_batch(b).tolist(), device, reps)}
    row["per-row ms"] = _time(lambda: accept_rows(b).tolist(), device, max(1, reps // 4), warmup=1)
    if with_triton:
        from kernels.rejection import accept_batch as triton_accept

        row["triton ms"] = _time(lambda: triton_accept(b).tolist(), device, reps)
        row["speedup"] = ratio(row["torch ms"], row["triton ms"])
        row["identical"] = triton_accept(b).tolist() == accept_batch(b).tolist()
    return row


def run_softmax(batch, vocab, device, reps, with_triton):
    from kernels.dispatch import resolve

    x = torch.randn(batch, vocab, device=device) * 4
    t = torch.full((batch,), 0.8, device=device)
    row = {"case": f"softmax B={batch} V={vocab}",
           "torch ms": _time(lambda: (x / t[:, None]).softmax(-1), device, reps)}
    if with_triton:
        resolve("triton", device)
        from kernels.logits import temperature_softmax, temperature_softmax_reference

        row["triton ms"] = _time(lambda: temperature_softmax(x, t), device, reps)
        row["speedup"] = ratio(row["torch ms"], row["triton ms"])
        row["identical"] = bool(torch.allclose(temperature_softmax(x, t), temperature_softmax_reference(x, t),
                                               rtol=1e-5, atol=1e-7))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--vocabs", default="49152,151936,262144")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    device = args.device
    on_cuda = device.startswith("cuda")
    if args.smoke:
        batches, ks, vocabs, reps = [1, 3], [1, 2], [1000], 2
    elif on_cuda:
        batches, ks, vocabs = ([int(x) for x in s.split(",")] for s in (args.batches, args.ks, args.vocabs))
        reps = args.reps
    else:  # a CPU: the torch paths only, at the sizes a CPU serves
        batches, ks, vocabs, reps = [1, 8], [1, 2, 3, 4], [49152], args.reps
    with_triton = on_cuda or args.smoke
    if with_triton:
        from kernels.dispatch import resolve

        resolve("triton", device)  # on a CPU (--smoke): the interpreter, set before the kernels load
    rows = []
    for vocab in vocabs:
        for batch in batches:
            for k in ks:
                rows.append(run_case(batch, k, vocab, device, reps, with_triton))
                print(rows[-1], flush=True)
        for batch in batches:
            rows.append(run_softmax(batch, vocab, device, reps, with_triton))
    print()
    print_table(rows, COLUMNS)
    big = [r for r in rows if r.get("speedup") and not r["case"].startswith("softmax") and
           int(r["case"].split()[0][2:]) >= 8]
    summary = {"min_speedup_batch_ge_8": min((r["speedup"] for r in big), default=None)}
    print(f"\nTriton over torch at batch >= 8: min {summary['min_speedup_batch_ge_8']} (goal >= 3)")
    write_json(json_path(args, "bench_kernels"), {
        "smoke": bool(args.smoke), "device": device, "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "gpu": torch.cuda.get_device_name() if on_cuda else None, "rows": rows, **summary})


if __name__ == "__main__":
    main()

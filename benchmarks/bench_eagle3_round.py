"""What an EAGLE-3 round costs, part by part, against the target alone's pass (in-process, one sequence).

The speed-up a head can give is its tokens per target pass times (the target alone's pass / a round), so this
measures both parts of a round at the default pair's shapes, side by side in one run, without the gateway and the
gRPC hops (``bench_eagle3.py`` measures the served whole):

  * the target's pass (``TargetWorker.verify_batch``, its serving defaults: batch-invariant, the lean forward, the
    default dtype) over one row (decoding alone), a chain of k = 3 drafts with the features of the accepted
    positions (EAGLE-3 chains), and a 15-node tree of depth 3 (the default pair's trees: 16 rows, one tile) with
    and without features;
  * the head's round (``Eagle3Worker``, int8 as a draft service runs it): feed the round's 3 new positions'
    features, then draft a chain of 3 or a tree of depth 3 (top 4 per expanded node, 15 nodes).

From them: each shape's round (target pass + head round), its ratio to the one-row pass, and the tokens per pass a
round needs to reach 2x the target alone at that cost (before the hops). Each cell is the median of ``--reps``.

    python benchmarks/bench_eagle3_round.py
    python benchmarks/bench_eagle3_round.py --smoke   # a tiny target and a random head: checks the script runs
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
from bench_eagle3 import DEFAULT_HEAD, _smoke_head  # noqa: E402
from common import add_common_args, cpu_info, json_path, print_table, smoke_environment, smoke_models, write_json  # noqa: E402

from specdec.config import DEFAULT_TARGET  # noqa: E402

TREE = [-1, -1, -1, -1, 1, 0, 1, 0, 1, 3, 0, 0, 5, 7, 1]  # a depth-3 tree of 15 nodes as the head grows them
GOAL = 2.0


def target_ms(worker, context: list[int], drafts: int, tree: bool, layers: tuple[int, ...], reps: int,
              name: str) -> float:
    """Median ms of a verify pass of ``drafts`` rejected drafts (a chain, or ``TREE``'s first nodes) after
    ``context``; the history grows by the bonus token each pass."""
    from specdec.calls import VerifyCall
    from specdec.proposal import Proposal
    from specdec.sampling_params import SamplingParams

    params = SamplingParams(temperature=0)
    history = list(context)
    worker.verify_batch([VerifyCall(name, history, Proposal([]), params, feature_layers=layers)])
    times = []
    for _ in range(reps + 2):
        proposal = (Proposal([history[-1]] * drafts, parents=TREE[:drafts]) if tree
                    else Proposal([history[-1]] * drafts))
        call = VerifyCall(name, history, proposal, params, feature_layers=layers, feature_start=len(history) - 1)
        start = time.perf_counter()
        (result,) = worker.verify_batch([call])
        times.append(time.perf_counter() - start)
        history = history + result.emitted(proposal.draft_token_ids)
    worker.runner.release(name)
    return statistics.median(times[2:]) * 1000


def head_ms(worker, context: list[int], width: int, reps: int, name: str) -> float:
    """Median ms of the head's round: 3 new positions' features fed, then its chain or tree drafted."""
    from specdec.calls import ProposeCall
    from specdec.features import FeatureChunk
    from specdec.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)

    def chunk(a: int, b: int) -> FeatureChunk:
        rows = torch.randn(b - a, width, generator=g).to(torch.bfloat16)
        return FeatureChunk(start=a, rows=b - a, width=width, dtype="bfloat16", data=rows)

    params, tokens = SamplingParams(temperature=0), list(context)
    worker.propose_batch([ProposeCall(name, tokens, 3, params, features=[chunk(0, len(tokens) - 1)])])
    times = []
    for r in range(reps + 2):
        before = len(tokens)
        tokens = tokens + [tokens[-3 - r % 7], tokens[-5], tokens[-2]]
        call = ProposeCall(name, list(tokens), 3, params, features=[chunk(before - 1, len(tokens) - 1)])
        start = time.perf_counter()
        worker.propose_batch([call])
        times.append(time.perf_counter() - start)
    worker.release(name)
    return statistics.median(times[2:]) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--head", default=DEFAULT_HEAD)
    ap.add_argument("--dtype", default="auto", help="the target's dtype (default auto: the target service's default)")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=15)
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "eagle3_round")
    cpu = cpu_info()
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)
        args.target = smoke_models(tmp.name).target
        args.head = _smoke_head(args.target, Path(tmp.name) / "head")
        args.context, args.reps, args.dtype = 24, 2, "float32"
    from specdec.config import TreeShape
    from specdec.engine.eagle3_files import load_head_for_target, quantize_head
    from specdec.engine.eagle3_worker import Eagle3Worker, HeadStore
    from specdec.engine.models import load_model
    from specdec.engine.runner import ModelRunner
    from specdec.engine.workers import TargetWorker
    from specdec.model_files import resolve_model_path

    lm = load_model(args.target, dtype=args.dtype)
    worker = TargetWorker(ModelRunner(lm, args.context + 256, role="target", batch_invariant=True))
    target_path = resolve_model_path(args.target)[0]
    head, layers, _ = load_head_for_target(resolve_model_path(args.head)[0], target_path)
    quantization = quantize_head(head, None)
    width = 3 * head.cfg.target_width
    chain_head = Eagle3Worker(HeadStore(head, args.context + 256))
    tree_head = Eagle3Worker(HeadStore(head, args.context + 256), tree=TreeShape(top_k=4, max_nodes=len(TREE)))
    vocab = min(lm.vocab_size, 1000)
    context = [(7 * i + 3) % (vocab - 10) + 10 for i in range(args.context)]
    layers = tuple(layers)
    parts = {"target, one row (decoding alone)": target_ms(worker, context, 0, False, (), args.reps, "one"),
             "target, chain of 3 + features": target_ms(worker, context, 3, False, layers, args.reps, "chain"),
             "target, tree of 15 nodes": target_ms(worker, context, len(TREE), True, (), args.reps, "tree"),
             "target, tree of 15 nodes + features": target_ms(worker, context, len(TREE), True, layers, args.reps,
                                                              "tree-f"),
             "head, feed 3 + chain of 3": head_ms(chain_head, context, width, args.reps, "head-chain"),
             "head, feed 3 + tree of depth 3": head_ms(tree_head, context, width, args.reps, "head-tree")}
    one = parts["target, one row (decoding alone)"]
    rows = [{"part": name, "ms": ms, "x one row": ms / one} for name, ms in parts.items()]
    rounds = {"chains, k=3": parts["target, chain of 3 + features"] + parts["head, feed 3 + chain of 3"],
              "trees, depth 3": parts["target, tree of 15 nodes + features"] + parts["head, feed 3 + tree of depth 3"]}
    for name, ms in rounds.items():
        rows.append({"part": f"round, {name}", "ms": ms, "x one row": ms / one})
    needed = {name: GOAL * ms / one for name, ms in rounds.items()}
    print(f"\n{args.target} ({lm.dtype}, batch-invariant) with {args.head} ({quantization}), one sequence after "
          f"{args.context} tokens, median of {args.reps}")
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags']) or 'no avx2/avx512/amx'}\n")
    print_table(rows, ["part", "ms", "x one row"])
    for name, t in needed.items():
        print(f"{name}: {GOAL:g}x the target alone needs {t:.2f} tokens per pass at these costs (before the hops)")
    write_json(out_path, {"smoke": args.smoke, "target": args.target, "head": args.head, "dtype": str(lm.dtype),
                          "head_quantization": quantization, "context": args.context, "reps": args.reps, "cpu": cpu,
                          "rows": rows, "tokens_per_pass_for_2x": needed})
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

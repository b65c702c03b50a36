"""Seeded sampling: the coupled rule (draft-invariant) vs rejection sampling, side by side in one run.

The embedded default pair (smollm2-135m + smollm2-135m-draft), the offline ``LLM``, seeded sampled
requests (top_p 1.0 unless asked) at each temperature, probabilistic drafting, k = 3: acceptance rate,
mean acceptance length (tokens per drafting round) and tokens/s of ``seeded_sampling="coupled"`` and
``"rejection"``, and whether each one's output equals speculation off (the target alone, same seeds). The
coupled rule's must, for every request: its text is a function of the seed, not of the draft. Rejection
sampling's differs (it draws other numbers), which the same column shows.

    python benchmarks/bench_coupled.py --temperatures 0.7 1.0 -k 3 --max-tokens 64 --seeds 2
    python benchmarks/bench_coupled.py --smoke   # tiny random-weight pair, seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (PROMPTS, SMOKE_PROMPTS, add_common_args, json_path, print_table, smoke_environment,  # noqa: E402
                    smoke_models, write_json)

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.config import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402
from specdec.sampling import SpecDecodeStats  # noqa: E402

COLUMNS = ["setup", "tokens/s", "acceptance", "mean acceptance length", "tokens/pass", "identical to spec off"]
RULES = ("coupled", "rejection")


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, list[list[int]], SpecDecodeStats]:
    """Every (prompt, seed) request once: (tokens/s, token ids per request, merged stats)."""
    requests = [(p, sp) for p in prompts for sp in params]
    llm.generate(prompts[:1], params[0].clone(max_tokens=min(4, params[0].max_tokens)))  # warm-up
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], [sp for _, sp in requests])
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    stats = SpecDecodeStats()
    for o in outs:
        stats.merge(o.spec_decode_stats)
    return sum(map(len, tokens)) / elapsed, tokens, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft-dtype", default="bfloat16", help="the shipped draft's own dtype")
    ap.add_argument("-k", type=int, default=3, help="draft tokens per round")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=2, help="seeded requests per prompt (seeds 0 .. N-1)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "coupled")
    prompts = PROMPTS
    if args.smoke:
        root = tempfile.mkdtemp(prefix="specdec-bench-coupled-")
        smoke_environment(root)
        models = smoke_models(root)
        args.target, args.draft, args.draft_dtype = models.target, models.draft, "float32"
        args.max_tokens, args.seeds, args.temperatures = 8, 2, [0.7, 1.0]
        prompts = SMOKE_PROMPTS
    if args.k < 1 or args.seeds < 1 or args.max_tokens < 1:
        ap.error("-k, --seeds and --max-tokens must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k,
            "draft_sample_method": "probabilistic"}
    alone = LLM(args.target, dtype=args.dtype)
    spec_llms = {rule: LLM(args.target, speculative_config=spec, dtype=args.dtype, draft_dtype=args.draft_dtype,
                           seeded_sampling=rule) for rule in RULES}
    rows, details = [], {}
    for temperature in args.temperatures:
        params = [SamplingParams(temperature=temperature, top_p=args.top_p, seed=s, max_tokens=args.max_tokens,
                                 ignore_eos=True) for s in range(args.seeds)]
        alone_tps, alone_tokens, alone_stats = run(alone, prompts, params)
        rows.append({"setup": f"spec off, T={temperature}", "tokens/s": alone_tps,
                     "tokens/pass": sum(map(len, alone_tokens)) / max(alone_stats.num_target_passes, 1)})
        for rule in RULES:
            tps, tokens, stats = run(spec_llms[rule], prompts, params)
            same = [t == a for t, a in zip(tokens, alone_tokens)]
            rows.append({"setup": f"{rule} k={args.k}, T={temperature}", "tokens/s": tps,
                         "acceptance": stats.acceptance_rate, "mean acceptance length": stats.mean_acceptance_length,
                         "tokens/pass": sum(map(len, tokens)) / max(stats.num_target_passes, 1),
                         "identical to spec off": all(same)})
            details[rows[-1]["setup"]] = {"spec_stats": stats.as_dict(), "requests_identical": sum(same),
                                          "requests": len(same), "speedup": tps / alone_tps}
    print(f"\n{args.target} + {args.draft}, probabilistic drafting, k={args.k}, top_p={args.top_p}, "
          f"{len(prompts)} prompts x {args.seeds} seeds x {args.max_tokens} tokens, {torch.get_num_threads()} threads\n")
    print_table(rows, COLUMNS)
    write_json(out_path, {"smoke": args.smoke, "target": args.target, "draft": args.draft, "k": args.k,
                          "dtype": args.dtype, "draft_dtype": args.draft_dtype, "top_p": args.top_p,
                          "temperatures": args.temperatures, "max_tokens": args.max_tokens, "seeds": args.seeds,
                          "prompts": prompts, "rows": rows, "details": details})


if __name__ == "__main__":
    main()

"""Offline speculative decoding vs the target alone vs Hugging Face assisted generation.

Same pair, prompts, k and dtype, measured side by side in one run:

    python benchmarks/bench_offline.py --target smollm2-135m --draft PATH -k 4 --max-tokens 96

Reports tokens/s, acceptance rate, the draft/target step-cost ratio c, the verify cost v (scoring
k + 1 tokens, in target decode steps), the analytical speedup bound
E[tokens per round] / (k·c + v), and the fraction of that bound reached. Writes JSON.
Step costs are ``ModelRunner`` passes, as the workers run them (the draft through its lean forward
and draft vocabulary where it has them).

    python benchmarks/bench_offline.py --smoke   # tiny random-weight pair, seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (PROMPTS, SMOKE_PROMPTS, add_common_args, json_path, print_table, ratio, smoke_environment,  # noqa: E402
                    smoke_models, solve_alpha, step_ms, write_json)

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.config import default_draft_path  # noqa: E402
from specdec.engine.runner import ModelRunner  # noqa: E402

COLUMNS = ["method", "tokens/s", "speedup", "acceptance", "tokens/round", "identical"]


def run_specdec(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]], dict]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params.clone(max_tokens=min(8, max_tokens)))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    stats = outs[0].spec_decode_stats
    for o in outs[1:]:
        stats.merge(o.spec_decode_stats)
    return sum(map(len, tokens)) / elapsed, tokens, stats.as_dict()


def run_hf_assisted(target, draft, tokenizer, prompts: list[str], max_tokens: int, k: int) -> tuple[float, list[list[int]]]:
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0

    def gen(prompt: str, n: int) -> list[int]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, do_sample=False,
                              max_new_tokens=n, min_new_tokens=n, pad_token_id=tokenizer.eos_token_id)
        return out[0, ids.shape[1]:].tolist()

    gen(prompts[0], min(8, max_tokens))
    start = time.perf_counter()
    tokens = [gen(p, max_tokens) for p in prompts]
    return sum(map(len, tokens)) / (time.perf_counter() - start), tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="default: the embedded default draft")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32", help="target dtype")
    ap.add_argument("--draft-dtype", default=None, help="draft dtype (default: same as target)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--context", type=int, default=64, help="cached tokens before a timed step (default 64)")
    ap.add_argument("--reps", type=int, default=10, help="timed steps per step cost; the median counts (default 10)")
    ap.add_argument("--no-hf", action="store_true", help="skip HF assisted generation")
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "offline")
    prompts = PROMPTS
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)
        models = smoke_models(tmp.name)
        args.target, args.draft = models.target, models.draft
        args.num_speculative_tokens, args.max_tokens, args.context, args.reps = 2, 8, 8, 2
        prompts = SMOKE_PROMPTS
    if args.threads:
        torch.set_num_threads(args.threads)
    draft_name = args.draft or (str(default_draft_path()) if default_draft_path() else None)
    if draft_name is None:
        ap.error("no --draft given and no embedded default draft is shipped")
    k = args.num_speculative_tokens
    spec = {"method": "draft_model", "model": draft_name, "num_speculative_tokens": k}
    baseline = LLM(args.target, dtype=args.dtype)
    llm = LLM(args.target, speculative_config=spec, dtype=args.dtype, draft_dtype=args.draft_dtype)
    # The speculative LLM's loaded models serve the step costs and HF assisted generation.
    target_lm, draft_lm = llm.target, llm.draft
    context_len = args.context + k + 1
    target_runner = ModelRunner(target_lm, context_len, role="target")
    draft_runner = ModelRunner(draft_lm, context_len, role="draft", logits_vocab_size=target_lm.vocab_size)
    t_step = step_ms(target_runner, 1, args.context, args.reps)
    d_step = step_ms(draft_runner, 1, args.context, args.reps)
    t_verify = step_ms(target_runner, k + 1, args.context, args.reps)
    del target_runner, draft_runner
    c, v = d_step / t_step, t_verify / t_step

    base_tps, base_tokens, _ = run_specdec(baseline, prompts, args.max_tokens)
    spec_tps, spec_tokens, stats = run_specdec(llm, prompts, args.max_tokens)
    rows = [
        {"method": "target alone", "tokens/s": base_tps, "speedup": 1.0},
        {"method": f"specdec k={k}", "tokens/s": spec_tps, "speedup": spec_tps / base_tps,
         "acceptance": stats["acceptance_rate"], "tokens/round": stats["mean_acceptance_length"],
         "identical": spec_tokens == base_tokens},
    ]
    hf_tps = None
    if not args.no_hf:
        hf_tps, hf_tokens = run_hf_assisted(target_lm.model, draft_lm.model, target_lm.tokenizer, prompts,
                                            args.max_tokens, k)
        rows.append({"method": f"HF assisted k={k}", "tokens/s": hf_tps, "speedup": hf_tps / base_tps,
                     "identical": hf_tokens == base_tokens})
    mean_len = stats["mean_acceptance_length"]  # 0 when nothing was drafted
    alpha = solve_alpha(mean_len - 1, k) if mean_len else None
    bound = mean_len / (k * c + v) if mean_len else None
    reached = ratio(spec_tps / base_tps, bound)
    print(f"\ntarget {args.target} ({args.dtype}), draft {draft_name} ({args.draft_dtype or args.dtype}), k={k}, "
          f"{len(prompts)} prompts x {args.max_tokens} tokens, greedy, {torch.get_num_threads()} threads")
    print(f"target step {t_step:.1f} ms, draft step {d_step:.1f} ms (c={c:.3f}), verify {k + 1} tokens "
          f"{t_verify:.1f} ms (v={v:.3f}); alpha={alpha if alpha is None else round(alpha, 3)}\n")
    print_table(rows, COLUMNS)
    if bound is not None:
        print(f"\nanalytical bound E[tokens/round]/(k*c+v) = {bound:.3f}x; specdec reached {reached:.1%} of it")
    if hf_tps:
        print(f"specdec / HF assisted = {spec_tps / hf_tps:.2f}x")
    write_json(out_path, {
        "smoke": args.smoke, "target": args.target, "draft": draft_name, "k": k, "dtype": args.dtype,
        "draft_dtype": args.draft_dtype, "max_tokens": args.max_tokens, "prompts": prompts, "rows": rows,
        "target_step_ms": t_step, "draft_step_ms": d_step, "verify_ms": t_verify, "c": c, "v": v, "alpha": alpha,
        "analytical_bound": bound, "fraction_of_bound": reached, "spec_stats": stats,
        "specdec_over_hf": ratio(spec_tps, hf_tps),
    })
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The target alone: specdec's lean forward against transformers' (side by side in one run).

For each target (SmolLM2-135M: Llama; Gemma-3-270M: sliding-window and global layers) and dtype, three
runtimes of the same loaded weights:

  * ``transformers``: transformers' forward as specdec runs it with ``--no-lean-forward`` (fp32 on CPU:
    its ``nn.Linear`` layers are ``specdec.engine.models.SkinnyLinear``);
  * ``transformers, nn.Linear`` (fp32 only; in bf16 it is the row above): transformers as shipped;
  * ``lean``: ``specdec.engine.lean_decoder`` (the default).

Columns: one pass of 1 and of k+1 new tokens after ``--context`` cached ones (median, through
``ModelRunner`` as the target worker calls it: a verification scores k+1 positions), their ratio (the cost
of verifying k drafts over one decoding step: ideally 1 on a bandwidth-bound CPU), and greedy decoding
through the offline ``LLM`` with no draft (tokens/s over the prompts, best of ``--repeats`` alternated runs),
with its ratio to ``transformers`` and whether the tokens equal ``transformers``'s. The services pin each
model to one core (issue 17's layout), hence ``--num-threads 1`` by default.

    python benchmarks/bench_lean_target.py                     # both targets, fp32 and bf16, 1 thread
    python benchmarks/bench_lean_target.py --num-threads 2 --targets gemma-3-270m
    python benchmarks/bench_lean_target.py --smoke             # tiny random Llama and Gemma-3, seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (PROMPTS, SMOKE_PROMPTS, add_common_args, cpu_info, json_path, plain_linears, print_table,  # noqa: E402
                    smoke_environment, smoke_models, step_ms, write_json)

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.engine.lean_forward import unsupported_reason  # noqa: E402
from specdec.engine.runner import ModelRunner  # noqa: E402

TARGETS = ["smollm2-135m", "gemma-3-270m"]
RUNTIMES = {"float32": ["transformers", "transformers, nn.Linear", "lean"], "bfloat16": ["transformers", "lean"]}


def smoke_gemma3(root: Path, tokenizer_dir: str) -> str:
    """A tiny random Gemma-3 (3 layers: sliding window 8, global, sliding) over the smoke target's tokenizer."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           max_position_embeddings=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
    torch.manual_seed(2)
    folder = root / "gemma3"
    Gemma3ForCausalLM(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def decode(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Greedy tokens/s over ``prompts`` (one at a time, never stopping early) and the tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    return sum(map(len, outs)) / (time.perf_counter() - t), outs


def measure(name: str, dtype: str, args, prompts: list[str]) -> list[dict]:
    """The rows of one target and dtype: per-pass costs, then decoding with the runtimes alternated."""
    llms = {"transformers": LLM(name, dtype=dtype, lean_forward=False), "lean": LLM(name, dtype=dtype)}
    if unsupported_reason(llms["lean"].target.model) is not None:
        raise SystemExit(f"{name}: no lean forward ({unsupported_reason(llms['lean'].target.model)})")
    runtimes = RUNTIMES[dtype]
    if "transformers, nn.Linear" in runtimes:  # the same weights, SkinnyLinear switched back off inside
        llms["transformers, nn.Linear"] = LLM(name, dtype=dtype, lean_forward=False)
    rows = []
    for runtime in runtimes:
        llm = llms[runtime]
        plain = plain_linears(llm.target.model) if runtime.endswith("nn.Linear") else plain_linears()
        with plain:
            runner = ModelRunner(llm.target, args.context + args.k + 1, role="target", lean_forward=runtime == "lean")
            one = step_ms(runner, 1, args.context, args.reps)
            verify = step_ms(runner, args.k + 1, args.context, args.reps)
            decode(llm, prompts[:1], 4)  # warm-up
        rows.append({"model": Path(name).name, "dtype": dtype, "runtime": runtime, "ms/1-token pass": one,
                     f"ms/{args.k + 1}-token pass": verify, f"{args.k + 1} / 1": verify / one})
    best: dict[str, float] = {}
    tokens: dict[str, list] = {}
    for rep in range(args.repeats):
        for runtime in runtimes if rep % 2 == 0 else runtimes[::-1]:  # alternated: drift hits every runtime
            llm = llms[runtime]
            with plain_linears(llm.target.model) if runtime.endswith("nn.Linear") else plain_linears():
                tps, out = decode(llm, prompts, args.max_tokens)
            best[runtime] = max(best.get(runtime, 0.0), tps)
            tokens[runtime] = out
    for row in rows:
        row["tokens/s"] = best[row["runtime"]]
        row["x transformers"] = best[row["runtime"]] / best["transformers"]
        row["identical"] = tokens[row["runtime"]] == tokens["transformers"]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", nargs="+", default=TARGETS)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(RUNTIMES))
    ap.add_argument("--k", type=int, default=4, help="a verification pass scores k+1 tokens (default 4)")
    ap.add_argument("--context", type=int, default=96, help="cached tokens before a timed pass (default 96)")
    ap.add_argument("--reps", type=int, default=20, help="timed passes per row (median)")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--repeats", type=int, default=2, help="decoding runs per runtime, alternated (best counts)")
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads (default 1: a service pinned to a core)")
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "lean_target")
    tmp = None
    prompts = PROMPTS
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)
        target = smoke_models(tmp.name).target
        args.targets = [target, smoke_gemma3(Path(tmp.name), target)]
        args.context, args.reps, args.max_tokens, args.repeats, prompts = 8, 2, 4, 1, SMOKE_PROMPTS
    torch.set_num_threads(args.num_threads)
    cpu = cpu_info()
    rows = [row for name in args.targets for dtype in args.dtypes for row in measure(name, dtype, args, prompts)]
    cpu["load_average_end"] = list(os.getloadavg())
    verify_col = f"ms/{args.k + 1}-token pass"
    cols = ["model", "dtype", "runtime", "ms/1-token pass", verify_col, f"{args.k + 1} / 1", "tokens/s",
            "x transformers", "identical"]
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags']) or '-'}; "
          f"threads={torch.get_num_threads()}, context={args.context}, median of {args.reps} passes; "
          f"{len(prompts)} prompts x {args.max_tokens} greedy tokens, best of {args.repeats}; load average "
          f"{cpu['load_average_start'][0]:.1f} at start, {cpu['load_average_end'][0]:.1f} at end")
    print_table(rows, cols)
    lean_over = {f"{r['model']} {r['dtype']}": r["x transformers"] for r in rows if r["runtime"] == "lean"}
    write_json(out_path, {"smoke": args.smoke, "rows": rows, "cpu": cpu, "args": vars(args),
                          "lean_over_transformers": lean_over})
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

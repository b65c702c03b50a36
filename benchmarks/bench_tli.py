"""Heterogeneous vocabularies: specdec TLI vs transformers' universal assisted generation (UAG).

Real pair: target gemma-3-270m (SentencePiece, 262k), draft smollm2-135m (byte-level BPE, 49k).
Side by side in one run, same prompts and k:

    python benchmarks/bench_tli.py -k 4 --max-tokens 64
    python benchmarks/bench_tli.py --smoke   # tiny random-weight TLI pair, seconds: checks the script runs

Rows: the target alone; specdec TLI with greedy drafting (temperature 0), proposing the drafted text
in target ids (``tli_proposals="text"``, the default) and intersection tokens only
(``"intersection"``), and intersection tokens as token trees; HF UAG (``generate(assistant_model=, tokenizer=, assistant_tokenizer=)``,
greedy); and sampled rows (temperature 0.7) for specdec TLI with greedy and probabilistic drafting.
Each specdec setting is an ``LLM`` of its own (its ``speculative_config``), built when its rows run.
"tokens/pass" counts output tokens per target forward pass (1.0 = no speculation), comparable across
implementations: specdec's from ``spec_decode_stats.num_target_passes``, HF's by counting the target
model's forward calls. "acceptance" is accepted / proposed target tokens; for HF, proposed tokens are
counted at its candidate generator and accepted ones are the output tokens minus one per target pass.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (PROMPTS, SMOKE_PROMPTS, add_common_args, json_path, plain_linears, print_table, ratio,  # noqa: E402
                    smoke_environment, smoke_models, write_json)

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.tli.vocab_mapping import load_or_build_mapping  # noqa: E402

COLUMNS = ["method", "tokens/s", "tokens/pass", "acceptance", "identical"]


@contextlib.contextmanager
def counting_forward_calls(model):
    """Counts a transformers model's forward calls (``box[0]``) inside; the model is unchanged after."""
    box, orig = [0], model.forward
    own = vars(model).get("forward")  # an instance-level forward (e.g. accelerate's hooks), if any

    def counted(*a, **kw):
        box[0] += 1
        return orig(*a, **kw)

    model.forward = counted
    try:
        yield box
    finally:
        if own is None:
            del model.forward  # back to the class's forward
        else:
            model.forward = own


@contextlib.contextmanager
def counting_hf_candidates():
    """Counts the target tokens transformers' assisted generation proposes (all candidate generators)
    inside (``box[0]``); the classes are unchanged after."""
    from transformers.generation import candidate_generator as cg

    total, depth, patched = [0], [0], []
    for cls in (cg.AssistedCandidateGenerator, cg.AssistedCandidateGeneratorDifferentTokenizers,
                getattr(cg, "UniversalSpeculativeDecodingGenerator", None)):
        if cls is None or "get_candidates" not in vars(cls):
            continue
        orig = vars(cls)["get_candidates"]

        def counted(self, input_ids, *a, _orig=orig, **kw):
            depth[0] += 1  # a subclass calling its parent's get_candidates counts once
            try:
                out = _orig(self, input_ids, *a, **kw)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                total[0] += max(0, out[0].shape[1] - input_ids.shape[1])
            return out

        setattr(cls, "get_candidates", counted)
        patched.append((cls, orig))
    try:
        yield total
    finally:
        for cls, orig in patched:
            setattr(cls, "get_candidates", orig)


def run_llm(llm: LLM, prompts: list[str], params: SamplingParams) -> dict:
    llm.generate(prompts[:1], params.clone(max_tokens=min(4, params.max_tokens)))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    tokens = [o.outputs[0].token_ids for o in outs]
    n = sum(map(len, tokens))
    stats = [o.spec_decode_stats for o in outs]
    passes = sum(s.num_target_passes for s in stats)
    drafted = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    return {"tokens/s": n / elapsed, "tokens/pass": ratio(n, passes), "acceptance": ratio(accepted, drafted),
            "_tokens": tokens}


def run_uag(target_lm, draft_lm, prompts: list[str], k: int, max_tokens: int) -> dict:
    """transformers' universal assisted generation, greedy, on the given (specdec-loaded) models."""
    target, draft = target_lm.model, draft_lm.model
    ttok, dtok = target_lm.tokenizer, draft_lm.tokenizer
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0

    def uag(prompt: str, n: int) -> list[int]:
        ids = ttok(prompt, return_tensors="pt").input_ids
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, tokenizer=ttok,
                              assistant_tokenizer=dtok, do_sample=False, max_new_tokens=n, min_new_tokens=n)
        return out[0, ids.shape[1]:].tolist()

    uag(prompts[0], min(4, max_tokens))
    with counting_forward_calls(target) as passes, counting_hf_candidates() as proposed:
        t = time.perf_counter()
        tokens = [uag(p, max_tokens) for p in prompts]
        elapsed = time.perf_counter() - t
    n = sum(map(len, tokens))
    return {"tokens/s": n / elapsed, "tokens/pass": ratio(n, passes[0]),
            "acceptance": ratio(n - passes[0], proposed[0]), "_tokens": tokens}


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="gemma-3-270m")
    ap.add_argument("--draft", default="smollm2-135m")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft-dtype", default=None, help="draft dtype, for specdec and HF alike (default: --dtype)")
    ap.add_argument("--temperature", type=float, default=0.7, help="for the sampled rows")
    ap.add_argument("--no-sampled", action="store_true", help="greedy rows only")
    ap.add_argument("--no-hf-skinny", action="store_true",
                    help="skip the reference row of HF UAG on specdec's fp32 CPU matmuls (SkinnyLinear)")
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "tli")
    prompts = PROMPTS
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)
        models = smoke_models(tmp.name, tli=True)
        args.target, args.draft = models.target, models.tli_draft
        args.num_speculative_tokens, args.max_tokens = 2, 8
        prompts = SMOKE_PROMPTS
    k = args.num_speculative_tokens
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": k, "use_heterogeneous_vocab": True}
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)

    def make(speculative_config: dict | None) -> LLM:
        gc.collect()  # the previous setting's models go before the next load
        return LLM(args.target, speculative_config=speculative_config, dtype=args.dtype, draft_dtype=args.draft_dtype)

    # One LLM at a time (each holds its own copy of the target): its rows, then the next.
    llm = make(None)
    r_base = run_llm(llm, prompts, greedy)
    r_base_s = None if args.no_sampled else run_llm(llm, prompts, sampled)

    llm = make(spec)  # greedy drafting, text proposals (the default)
    r_tli = run_llm(llm, prompts, greedy)
    r_g = None if args.no_sampled else run_llm(llm, prompts, sampled)
    intersection = load_or_build_mapping(llm.draft.tokenizer, llm.target.tokenizer).intersection_size
    # transformers UAG on the same loaded models: as shipped (plain nn.Linear), and on specdec's fp32 CPU
    # matmuls (SkinnyLinear) for reference
    with plain_linears(llm.target.model, llm.draft.model):
        r_hf = run_uag(llm.target, llm.draft, prompts, k, args.max_tokens)
    r_hf_s = None if args.no_hf_skinny else run_uag(llm.target, llm.draft, prompts, k, args.max_tokens)

    llm = make({**spec, "tli_proposals": "intersection"})
    r_int = run_llm(llm, prompts, greedy)
    # the same with token trees (k levels, the draft's top 4 per expanded node, 15 nodes: specdec.engine.tree_drafting)
    llm = make({**spec, "tli_proposals": "intersection", "speculative_token_tree": "dynamic"})
    r_tree = run_llm(llm, prompts, greedy)

    r_p = None
    if not args.no_sampled:
        llm = make({**spec, "draft_sample_method": "probabilistic"})
        r_p = run_llm(llm, prompts, sampled)
    del llm

    def same(r: dict) -> bool:
        return r["_tokens"] == r_base["_tokens"]

    rows = [
        {"method": "target alone (greedy)", **r_base},
        {"method": f"specdec TLI greedy draft, text proposals, k={k} (greedy)", **r_tli, "identical": same(r_tli)},
        {"method": f"specdec TLI greedy draft, intersection proposals, k={k} (greedy)", **r_int, "identical": same(r_int)},
        {"method": f"specdec TLI greedy draft, intersection trees, depth {k} (greedy)", **r_tree,
         "identical": same(r_tree)},
        {"method": f"HF UAG k={k} (greedy)", **r_hf, "identical": same(r_hf)},
    ]
    if r_hf_s is not None:
        rows.append({"method": f"HF UAG k={k} (greedy), specdec's matmuls", **r_hf_s, "identical": same(r_hf_s)})
    if not args.no_sampled:
        rows += [
            {"method": f"target alone (T={args.temperature})", **r_base_s},
            {"method": f"specdec TLI greedy draft (T={args.temperature})", **r_g},
            {"method": f"specdec TLI probabilistic draft (T={args.temperature})", **r_p},
        ]
    for r in rows:
        r.pop("_tokens", None)
    print(f"\ntarget {args.target} ({args.dtype}), draft {args.draft} ({args.draft_dtype or args.dtype}), k={k}, "
          f"{len(prompts)} prompts x {args.max_tokens} tokens, {torch.get_num_threads()} threads, intersection "
          f"{intersection:,} tokens\n")
    print_table(rows, COLUMNS)
    over_hf = ratio(r_tli["tokens/s"], r_hf["tokens/s"])
    over_base = ratio(r_tli["tokens/s"], r_base["tokens/s"])
    print(f"\nspecdec TLI / HF UAG tokens/s = {_fmt(over_hf, '.2f')}x (goal >= 1.5); acceptance "
          f"{_fmt(r_tli['acceptance'])} vs {_fmt(r_hf['acceptance'])} (goal >=); tokens per target pass "
          f"{_fmt(r_tli['tokens/pass'], '.2f')} vs {_fmt(r_hf['tokens/pass'], '.2f')}; specdec TLI / target alone = "
          f"{_fmt(over_base, '.2f')}x")
    write_json(out_path, {"smoke": args.smoke, "target": args.target, "draft": args.draft, "k": k, "dtype": args.dtype,
                          "draft_dtype": args.draft_dtype or args.dtype, "max_tokens": args.max_tokens,
                          "prompts": prompts, "intersection_size": intersection, "rows": rows,
                          "specdec_over_hf_uag": over_hf, "specdec_over_target_alone": over_base})
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

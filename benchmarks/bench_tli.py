"""Heterogeneous vocabularies: specdec TLI vs transformers' universal assisted generation (UAG).

Real pair: target gemma-3-270m (SentencePiece, 262k), draft smollm2-135m (byte-level BPE, 49k).
Side by side in one run, same prompts and k:

    python benchmarks/bench_tli.py -k 4 --max-tokens 64

Rows: the target alone; specdec TLI with greedy drafting (temperature 0), proposing the drafted text
in target ids (``tli_proposals="text"``, the default) and intersection tokens only
(``"intersection"``); HF UAG (``generate(assistant_model=, tokenizer=, assistant_tokenizer=)``,
greedy); and sampled rows (temperature 0.7) for specdec TLI with greedy and probabilistic drafting.
"tokens/pass" counts output tokens per target forward pass (1.0 = no speculation), comparable across
implementations. "acceptance" is accepted / proposed target tokens; for HF, proposed tokens are counted
at its candidate generator and accepted ones are the output tokens minus one per target pass.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PROMPTS, plain_linears, print_table, write_json  # noqa: E402

from specdec import LLM, SamplingParams  # noqa: E402


class PassCounter:
    """Counts forward passes of a module (wraps its forward)."""

    def __init__(self, model):
        self.model, self.count, self._orig = model, 0, model.forward

        def counted(*a, **kw):
            self.count += 1
            return self._orig(*a, **kw)

        model.forward = counted

    def reset(self) -> int:
        n, self.count = self.count, 0
        return n


def count_hf_candidates() -> list[int]:
    """Count the target tokens transformers' assisted generation proposes (all candidate generators)."""
    from transformers.generation import candidate_generator as cg

    total, depth = [0], [0]
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
    return total


def run_llm(llm: LLM, counter: PassCounter, params: SamplingParams) -> dict:
    llm.generate(PROMPTS[:1], params.clone(max_tokens=4))
    counter.reset()
    t = time.perf_counter()
    outs = llm.generate(PROMPTS, params)
    elapsed = time.perf_counter() - t
    passes = counter.reset()
    tokens = [o.outputs[0].token_ids for o in outs]
    n = sum(map(len, tokens))
    drafted = sum(o.spec_decode_stats.num_draft_tokens for o in outs)
    accepted = sum(o.spec_decode_stats.num_accepted_tokens for o in outs)
    return {"tokens/s": n / elapsed, "tokens/pass": n / passes, "acceptance": accepted / drafted if drafted else None,
            "_tokens": tokens}


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
    ap.add_argument("--json", default="bench_results/tli.json")
    args = ap.parse_args()
    k = args.num_speculative_tokens
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": k, "use_heterogeneous_vocab": True}
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)

    llm = LLM(args.target, speculative_config=spec, dtype=args.dtype, draft_dtype=args.draft_dtype)
    llm_prob = LLM(args.target, speculative_config={**spec, "draft_sample_method": "probabilistic"}, dtype=args.dtype,
                   draft_dtype=args.draft_dtype)
    base = LLM(args.target, dtype=args.dtype)
    # One target module for every row (the baseline LLM's), so all count passes on the same weights.
    for other in (llm, llm_prob):
        other.target = base.target
        other._target_worker.runner.lm = base.target
    counter = PassCounter(base.target.model)

    rows = []
    r_base = run_llm(base, counter, greedy)
    rows.append({"method": "target alone (greedy)", **r_base})
    r_tli = run_llm(llm, counter, greedy)
    rows.append({"method": f"specdec TLI greedy draft, text proposals, k={k} (greedy)", **r_tli,
                 "identical": r_tli["_tokens"] == r_base["_tokens"]})
    llm._draft_worker.tli.proposals = "intersection"
    r_int = run_llm(llm, counter, greedy)
    llm._draft_worker.tli.proposals = "text"
    rows.append({"method": f"specdec TLI greedy draft, intersection proposals, k={k} (greedy)", **r_int,
                 "identical": r_int["_tokens"] == r_base["_tokens"]})

    # transformers UAG on the same models
    target, draft = base.target.model, llm.draft.model
    ttok, dtok = base.target.tokenizer, llm.draft.tokenizer
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0

    def uag(prompt: str, n: int) -> list[int]:
        ids = ttok(prompt, return_tensors="pt").input_ids
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, tokenizer=ttok,
                              assistant_tokenizer=dtok, do_sample=False, max_new_tokens=n, min_new_tokens=n)
        return out[0, ids.shape[1]:].tolist()

    proposed = count_hf_candidates()

    def run_uag() -> dict:
        uag(PROMPTS[0], 4)
        counter.reset()
        proposed[0] = 0
        t = time.perf_counter()
        hf_tokens = [uag(p, args.max_tokens) for p in PROMPTS]
        hf_elapsed = time.perf_counter() - t
        n = sum(map(len, hf_tokens))
        passes = counter.reset()
        return {"tokens/s": n / hf_elapsed, "tokens/pass": n / passes,
                "acceptance": (n - passes) / proposed[0] if proposed[0] else None, "_tokens": hf_tokens}

    # transformers as shipped (plain nn.Linear), and on specdec's fp32 CPU matmuls (SkinnyLinear) for reference
    with plain_linears(target, draft):
        r_hf = run_uag()
    rows.append({"method": f"HF UAG k={k} (greedy)", **r_hf, "identical": r_hf["_tokens"] == r_base["_tokens"]})
    if not args.no_hf_skinny:
        r_hf_s = run_uag()
        rows.append({"method": f"HF UAG k={k} (greedy), specdec's matmuls", **r_hf_s,
                     "identical": r_hf_s["_tokens"] == r_base["_tokens"]})

    if not args.no_sampled:
        r_base_s = run_llm(base, counter, sampled)
        rows.append({"method": f"target alone (T={args.temperature})", **r_base_s})
        r_g = run_llm(llm, counter, sampled)
        rows.append({"method": f"specdec TLI greedy draft (T={args.temperature})", **r_g})
        r_p = run_llm(llm_prob, counter, sampled)
        rows.append({"method": f"specdec TLI probabilistic draft (T={args.temperature})", **r_p})

    for r in rows:
        r.pop("_tokens", None)
    print(f"\ntarget {args.target} ({args.dtype}), draft {args.draft} ({args.draft_dtype or args.dtype}), k={k}, {len(PROMPTS)} prompts x "
          f"{args.max_tokens} tokens, {torch.get_num_threads()} threads, intersection "
          f"{llm._draft_worker.tli.mapping.intersection_size:,} tokens\n")
    print_table(rows, ["method", "tokens/s", "tokens/pass", "acceptance", "identical"])
    ratio = r_tli["tokens/s"] / r_hf["tokens/s"]
    print(f"\nspecdec TLI / HF UAG tokens/s = {ratio:.2f}x (goal >= 1.5); acceptance {r_tli['acceptance']:.3f} vs "
          f"{r_hf['acceptance'] or float('nan'):.3f} (goal >=); tokens per target pass {r_tli['tokens/pass']:.2f} vs "
          f"{r_hf['tokens/pass']:.2f}; specdec TLI / target alone = {r_tli['tokens/s'] / r_base['tokens/s']:.2f}x")
    write_json(args.json, {"target": args.target, "draft": args.draft, "k": k, "dtype": args.dtype,
                           "draft_dtype": args.draft_dtype or args.dtype,
                           "max_tokens": args.max_tokens, "rows": rows, "specdec_over_hf_uag": ratio,
                           "specdec_over_target_alone": r_tli["tokens/s"] / r_base["tokens/s"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())

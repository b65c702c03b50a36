"""``specdec generate``: run the offline API once (the quickest end-to-end check of a model pair)."""

from __future__ import annotations

import argparse
import json
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="target model (default: the embedded default)")
    p.add_argument("--speculative-config", default=None, help="JSON, e.g. '{\"model\": DRAFT, \"num_speculative_tokens\": 4}'")
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="float32 or bfloat16 (auto: bfloat16 on CUDA; on CPU the faster of "
                                                   "the two here, measured once and cached)")
    p.add_argument("--max-model-len", type=int, default=None)


def run(args: argparse.Namespace) -> int:
    from specdec.config import DEFAULT_TARGET, default_speculative_config
    from specdec.llm import LLM
    from specdec.sampling_params import SamplingParams

    spec = args.speculative_config
    if spec is None and args.model is None:
        spec = default_speculative_config()
    llm = LLM(args.model or DEFAULT_TARGET, speculative_config=spec, seed=args.seed, dtype=args.dtype,
              max_model_len=args.max_model_len)
    prompts = args.prompt or ["The three primary colors are", "def fibonacci(n):"]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for out in outputs:
        print(f"--- {out.prompt!r}\n{out.outputs[0].text}\n")
        print(json.dumps({"finish_reason": out.outputs[0].finish_reason, **out.spec_decode_stats.as_dict()}))
    print(f"{n_tokens} tokens in {elapsed:.2f} s ({n_tokens / elapsed:.1f} tokens/s)")
    return 0

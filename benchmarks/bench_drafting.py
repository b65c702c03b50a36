"""N-gram, hybrid and model drafting on input-grounded, open-ended and mixed prompts, through the served stack.

Side by side in one run, greedy, the same target (default: the embedded ``smollm2-135m``):

  * the target alone (no draft);
  * the model draft (default: the embedded ``smollm2-135m-draft``) at k = 1, 2, 3;
  * n-gram drafting (``"method": "ngram"``, no model) at k = 2, 4, 6 with prompt_lookup_max 4 / min 2,
    and at one k with another lookup range (``--ngram-alt``);
  * hybrid drafting (``"method": "draft_model"`` with ``prompt_lookup_max`` 3: an n-gram match proposes,
    else the draft model) at k = 1, 2, 3.

Each kind of drafting is one ``specdec serve`` stack (``start_stack(ServeConfig(...))``, gRPC
GenerationService), each in a process of its own (one OpenMP pool per process, see docs/serving/index.md, "Threads and batching";
``--in-process`` for all in this one), all started up front; a row's k is the request's ``num_speculative_tokens``. Requests go one at a time; for
every prompt all rows run back to back (in an order that rotates from prompt to prompt) before the next
prompt, and the whole pass is repeated ``--repeats`` times, so drift on a shared machine hits every row
alike. A row's time for a prompt is its fastest repeat; the "speedup range" column is the spread of the
per-repeat speed-ups.

Prompts (``specdec/assets/prompts/drafting.json``, written for this benchmark) are user messages sent through the
target's chat template (SmolLM2-135M is the Instruct model), answers end at EOS or ``--max-tokens``:
  * input-grounded: each prompt holds the text its answer draws on (quote, summarise, answer from a
    given document, edit or refactor given code, extract fields);
  * open-ended: stories, explanations, code from scratch;
  * mixed: every other prompt of each of the two (half each), aggregated from the same requests.

Per row and set: tokens/s (end to end, prefill included; each prompt's fastest repeat), speed-up over the
target alone (from those fastest repeats, so it may lie outside "speedup range", the speed-ups of the
single repeats), "decode speedup" (the same after the first response: the prompt's prefill left out),
acceptance (accepted / drafted tokens; an n-gram round without a match drafts nothing), tokens per
target pass, and whether every output equals the target alone's (greedy, float32). Goals are reported,
never asserted.

    python benchmarks/bench_drafting.py --max-tokens 48 --repeats 2
    python benchmarks/bench_drafting.py --smoke   # tiny random-weight models, seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import ServedStack  # noqa: E402
from common import (add_common_args, cpu_info, json_path, print_table, ratio, smoke_environment, smoke_models,  # noqa: E402
                    write_json)

from specdec.config import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402
from specdec.model_files import resolve_model_path  # noqa: E402
from specdec.v1 import common_pb2, generation_service_pb2 as pb, generation_service_pb2_grpc  # noqa: E402

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "specdec" / "assets" / "prompts" / "drafting.json"  # also `specdec bench --dataset mixed`
SETS = ("input-grounded", "open-ended", "mixed")
COLUMNS = ["setup", "set", "tokens/s", "speedup", "speedup range", "decode speedup", "acceptance", "tokens/pass",
           "identical"]


@dataclass(frozen=True)
class Setup:
    label: str
    stack: str  # which served stack answers it
    k: int | None  # the request's num_speculative_tokens (None: the target alone)
    kind: str  # "target", "model", "ngram", "hybrid"


def lookup_label(low: int, high: int) -> str:
    return f"lookup {low}-{high}"


def build_setups(args) -> tuple[list[Setup], dict[str, dict | None]]:
    """The rows, and the speculative_config of each stack (None: the target alone)."""
    low, high = args.ngram_lookup
    alt_low, alt_high = args.ngram_alt
    hyb_low = min(2, args.hybrid_lookup_max)  # specdec's default prompt_lookup_min, stated explicitly
    stacks: dict[str, dict | None] = {
        "target": None,
        "model": {"method": "draft_model", "model": args.draft, "num_speculative_tokens": max(args.model_ks)},
        "ngram": {"method": "ngram", "num_speculative_tokens": max(args.ngram_ks), "prompt_lookup_max": high,
                  "prompt_lookup_min": low},
        "ngram-alt": {"method": "ngram", "num_speculative_tokens": args.ngram_alt_k, "prompt_lookup_max": alt_high,
                      "prompt_lookup_min": alt_low},
        "hybrid": {"method": "draft_model", "model": args.draft, "num_speculative_tokens": max(args.hybrid_ks),
                   "prompt_lookup_max": args.hybrid_lookup_max, "prompt_lookup_min": hyb_low},
        # adaptive k (requests leave k unset: each sequence picks its own, up to the stack's k)
        "model-adaptive": {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.adaptive_k_max,
                           "adaptive_k": True},
        "hybrid-adaptive": {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.adaptive_k_max,
                            "prompt_lookup_max": args.hybrid_lookup_max, "prompt_lookup_min": hyb_low,
                            "adaptive_k": True},
    }
    setups = [Setup("target alone", "target", None, "target")]
    setups += [Setup(f"model draft k={k}", "model", k, "model") for k in args.model_ks]
    setups += [Setup(f"n-gram k={k} ({lookup_label(low, high)})", "ngram", k, "ngram") for k in args.ngram_ks]
    setups.append(Setup(f"n-gram k={args.ngram_alt_k} ({lookup_label(alt_low, alt_high)})", "ngram-alt",
                        args.ngram_alt_k, "ngram"))
    setups += [Setup(f"hybrid k={k} (draft + {lookup_label(hyb_low, args.hybrid_lookup_max)})", "hybrid", k, "hybrid")
               for k in args.hybrid_ks]
    setups.append(Setup(f"model draft adaptive k<={args.adaptive_k_max}", "model-adaptive", None, "model-adaptive"))
    setups.append(Setup(f"hybrid adaptive k<={args.adaptive_k_max} (draft + "
                        f"{lookup_label(hyb_low, args.hybrid_lookup_max)})", "hybrid-adaptive", None, "hybrid-adaptive"))
    return setups, stacks


# --------------------------------------------------------------------------------------------------
# prompts


def load_prompts(path: Path, per_set: int | None) -> dict[str, list[str]]:
    data = json.loads(path.read_text())
    grounded, open_ended = data["input_grounded"], data["open_ended"]
    if per_set:
        grounded, open_ended = grounded[:per_set], open_ended[:per_set]
    return {"input-grounded": grounded, "open-ended": open_ended}


def chat_formatter(target: str, use_template: bool):
    """The target's chat template (the prompt text a chat client would send), or the message as is."""
    if not use_template:
        return lambda message: message
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(target)[0])
    if not tok.chat_template:
        print(f"note: {target}'s tokenizer has no chat template: prompts go as plain text", file=sys.stderr)
        return lambda message: message
    return lambda message: tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                   add_generation_prompt=True)


# --------------------------------------------------------------------------------------------------
# machine


# --------------------------------------------------------------------------------------------------
# stacks


class InProcessStack:
    """``start_stack`` in this process (``--in-process``, the default of ``--smoke``): starts in a second
    rather than a child's import time, but every stack adds a compute thread with its own OpenMP pool here,
    which slows them all on a multi-threaded run (see docs/serving/index.md, "Threads and batching")."""

    def __init__(self, serve_config: dict):
        from specdec.entrypoints.serve import ServeConfig

        self.cfg = ServeConfig(**serve_config)
        self.stack = None

    def __enter__(self) -> "InProcessStack":
        from specdec.entrypoints.serve import start_stack

        self.stack = start_stack(self.cfg)
        return self

    def ports(self) -> tuple[int, int | None]:
        return self.stack.gateway.port, self.stack.gateway.http_port

    def __exit__(self, *exc) -> bool:
        self.stack.stop(0)
        return False


# --------------------------------------------------------------------------------------------------
# requests


def generate(stub, prompt: str, k: int | None, max_tokens: int, ignore_eos: bool, temperature: float = 0.0,
             seed: int | None = None) -> dict:
    sampling = common_pb2.SamplingParams(temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    req = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=ignore_eos, sampling_params=sampling)
    if k is not None:
        req.num_speculative_tokens = k
    ids: list[int] = []
    last = None
    first = None
    first_tokens = 0
    start = time.perf_counter()
    for resp in stub.Generate(req, timeout=600):
        if first is None:
            first = time.perf_counter() - start
            first_tokens = len(resp.token_ids)
        ids.extend(resp.token_ids)
        last = resp
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "ttft": first, "first_tokens": first_tokens, "token_ids": ids, "prompt_tokens": last.prompt_tokens,
            "drafted": last.stats.num_draft_tokens, "accepted": last.stats.num_accepted_tokens,
            "passes": last.stats.num_target_passes}


# --------------------------------------------------------------------------------------------------
# aggregation


def aggregate(setups, sets, runs, repeats):
    """runs[(label, prompt_index, repeat)] -> result; sets: name -> prompt indexes. One dict per row."""
    alone = setups[0].label
    rows = []
    for set_name, idx in sets.items():
        def tps(label, r=None):
            if r is None:  # each prompt's fastest repeat
                secs = sum(min(runs[(label, i, q)]["seconds"] for q in range(repeats)) for i in idx)
            else:
                secs = sum(runs[(label, i, r)]["seconds"] for i in idx)
            return sum(len(runs[(label, i, 0)]["token_ids"]) for i in idx) / secs

        def decode_tps(label):  # after the first response: prefill (and its round) left out
            secs = sum(min(runs[(label, i, q)]["seconds"] - runs[(label, i, q)]["ttft"] for q in range(repeats))
                       for i in idx)
            n = sum(len(runs[(label, i, 0)]["token_ids"]) - runs[(label, i, 0)]["first_tokens"] for i in idx)
            return n / secs if secs > 0 else None

        base = tps(alone)
        base_decode = decode_tps(alone)
        base_r = [tps(alone, r) for r in range(repeats)]
        for s in setups:
            v = tps(s.label)
            per_repeat = [tps(s.label, r) / base_r[r] for r in range(repeats)]
            res = [runs[(s.label, i, r)] for i in idx for r in range(repeats)]
            drafted = sum(x["drafted"] for x in res)
            tokens = sum(len(x["token_ids"]) for x in res)
            passes = sum(x["passes"] for x in res)
            identical = all(runs[(s.label, i, r)]["token_ids"] == runs[(alone, i, 0)]["token_ids"]
                            for i in idx for r in range(repeats))
            rows.append({
                "setup": s.label, "set": set_name, "tokens/s": v, "speedup": v / base,
                "speedup range": f"{min(per_repeat):.2f}-{max(per_repeat):.2f}",
                "decode speedup": ratio(decode_tps(s.label), base_decode),
                "acceptance": sum(x["accepted"] for x in res) / drafted if drafted else None,
                "tokens/pass": tokens / passes if passes else None,
                "identical": identical, **({"k": s.k} if s.k is not None else {}),
            })
    return rows


def per_repeat_ratio(runs, idx, a: str, b: str, repeats: int) -> list[float]:
    """tokens/s of row a over row b in each repeat, on the prompts idx."""
    out = []
    for r in range(repeats):
        ta = sum(len(runs[(a, i, r)]["token_ids"]) for i in idx) / sum(runs[(a, i, r)]["seconds"] for i in idx)
        tb = sum(len(runs[(b, i, r)]["token_ids"]) for i in idx) / sum(runs[(b, i, r)]["seconds"] for i in idx)
        out.append(ta / tb)
    return out


def best_fixed_k(rows, setups, kind: str, choose_on: str = "mixed") -> Setup | None:
    """The setup of a kind whose speed-up on ``choose_on`` is highest (one k for every set)."""
    cands = [s for s in setups if s.kind == kind]
    if not cands:
        return None
    sp = {(r["setup"], r["set"]): r["speedup"] for r in rows}
    return max(cands, key=lambda s: sp[(s.label, choose_on)])


def first_mismatch(runs, setups, sets, repeats) -> list[dict]:
    """Evidence for every output that differs from the target alone's: where it first diverges."""
    alone = setups[0].label
    out = []
    for s in setups[1:]:
        for i in sorted({i for idx in sets.values() for i in idx}):
            ref = runs[(alone, i, 0)]["token_ids"]
            for r in range(repeats):
                got = runs[(s.label, i, r)]["token_ids"]
                if got != ref:
                    pos = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                    out.append({"setup": s.label, "prompt": i, "repeat": r, "first_diff_at": pos,
                                "target_alone": ref[pos:pos + 8], "got": got[pos:pos + 8],
                                "len_target_alone": len(ref), "len_got": len(got)})
    return out


# --------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET, help=f"the target (default: {DEFAULT_TARGET})")
    ap.add_argument("--draft", default=DEFAULT_DRAFT, help=f"the draft model (default: the embedded {DEFAULT_DRAFT})")
    ap.add_argument("--dtype", default="float32", help="target and draft dtype (default float32: exact)")
    ap.add_argument("--model-ks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--ngram-ks", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--ngram-lookup", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"),
                    help="prompt_lookup_min / max of the n-gram rows (default 2 4)")
    ap.add_argument("--ngram-alt", type=int, nargs=2, default=[1, 3], metavar=("MIN", "MAX"),
                    help="the other lookup range, one row (default 1 3)")
    ap.add_argument("--ngram-alt-k", type=int, default=4, help="k of the other lookup range's row (default 4)")
    ap.add_argument("--hybrid-ks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--hybrid-lookup-max", type=int, default=3, help="the hybrid's prompt_lookup_max (default 3)")
    ap.add_argument("--adaptive-k-max", type=int, default=3, help="the adaptive rows' upper bound on k (default 3)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens (default: stop at EOS)")
    ap.add_argument("--prompts-per-set", type=int, default=None, help="the first N prompts of each set")
    ap.add_argument("--prompts", default=str(PROMPTS_FILE), help="the prompts JSON (default: specdec/assets/prompts/drafting.json)")
    ap.add_argument("--no-chat-template", action="store_true", help="send the messages as plain text")
    ap.add_argument("--repeats", type=int, default=2, help="passes over every prompt and row (default 2)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of each served stack (0: all cores)")
    ap.add_argument("--in-process", action="store_true",
                    help="run the stacks in this process rather than one child process each (default with --smoke)")
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "drafting")
    cpu = cpu_info()
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)  # the child processes inherit its environment
        models = smoke_models(tmp.name)
        args.target, args.draft = models.target, models.draft
        args.max_tokens, args.repeats, args.threads, args.prompts_per_set = 8, 1, 1, 2
        args.in_process = True
    setups, stack_specs = build_setups(args)
    prompt_sets = load_prompts(Path(args.prompts), args.prompts_per_set)
    fmt = chat_formatter(args.target, not args.no_chat_template)
    messages = prompt_sets["input-grounded"] + prompt_sets["open-ended"]
    prompts = [fmt(m) for m in messages]
    n_in = len(prompt_sets["input-grounded"])
    sets = {"input-grounded": list(range(n_in)), "open-ended": list(range(n_in, len(prompts)))}
    sets["mixed"] = sets["input-grounded"][::2] + sets["open-ended"][::2]

    runs: dict[tuple[str, int, int], dict] = {}
    started = time.perf_counter()
    with contextlib.ExitStack() as es:
        stacks = {}
        for name, spec in stack_specs.items():  # all load at once, each in its own process
            cfg = dict(model=args.target, speculative_config=json.dumps(spec) if spec else None, host="127.0.0.1",
                       grpc_port=0, port=-1, dtype=args.dtype, draft_dtype=args.dtype, num_threads=args.threads)
            stacks[name] = es.enter_context(InProcessStack(cfg) if args.in_process else ServedStack(cfg))
        stubs = {}
        for name, st in stacks.items():
            grpc_port, _ = st.ports()
            channel = es.enter_context(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
            stubs[name] = generation_service_pb2_grpc.GenerationServiceStub(channel)
        for s in setups:  # warm-up: every row once, on one prompt of each set
            for i in (0, n_in):
                generate(stubs[s.stack], prompts[i], s.k, min(8, args.max_tokens), args.ignore_eos)
        print(f"{len(stacks)} stacks up and warm in {time.perf_counter() - started:.0f} s; "
              f"{len(prompts)} prompts x {len(setups)} rows x {args.repeats} repeats", file=sys.stderr)
        measure_start = time.perf_counter()
        for r in range(args.repeats):
            for i, prompt in enumerate(prompts):
                shift = (r * len(prompts) + i) % len(setups)  # rotate which row goes first
                for s in setups[shift:] + setups[:shift]:
                    runs[(s.label, i, r)] = generate(stubs[s.stack], prompt, s.k, args.max_tokens, args.ignore_eos)
            print(f"repeat {r + 1}/{args.repeats} done at {time.perf_counter() - measure_start:.0f} s", file=sys.stderr)
        measured_s = time.perf_counter() - measure_start
    cpu["load_average_end"] = list(os.getloadavg())

    rows = aggregate(setups, sets, runs, args.repeats)
    by = {(r["setup"], r["set"]): r for r in rows}
    alone = setups[0].label

    # noise: the target alone's tokens/s per repeat, and each request's spread over its repeats
    def set_tps(label, idx, r):
        return (sum(len(runs[(label, i, r)]["token_ids"]) for i in idx)
                / sum(runs[(label, i, r)]["seconds"] for i in idx))

    alone_per_repeat = {name: [set_tps(alone, idx, r) for r in range(args.repeats)] for name, idx in sets.items()}
    spreads = sorted(max(runs[(s.label, i, r)]["seconds"] for r in range(args.repeats))
                     / min(runs[(s.label, i, r)]["seconds"] for r in range(args.repeats)) - 1
                     for s in setups for i in range(len(prompts)))
    noise = {"target_alone_tokens_per_s_per_repeat": alone_per_repeat,
             "request_spread_over_repeats_median": spreads[len(spreads) // 2],
             "request_spread_over_repeats_p90": spreads[int(0.9 * (len(spreads) - 1))],
             "load_average_start": cpu["load_average_start"], "load_average_end": cpu["load_average_end"]}

    # goals (reported, never asserted) and the comparisons the brief asks for
    model_best = best_fixed_k(rows, setups, "model")
    hybrid_best = best_fixed_k(rows, setups, "hybrid")
    ngram_rows = [s for s in setups if s.kind == "ngram"]
    ngram_best_grounded = max(ngram_rows, key=lambda s: by[(s.label, "input-grounded")]["speedup"])
    ngram_best_mixed = best_fixed_k(rows, setups, "ngram")
    best_mixed = max(setups[1:], key=lambda s: by[(s.label, "mixed")]["speedup"])
    open_idx, mixed_idx = sets["open-ended"], sets["mixed"]

    def vs_model(s: Setup, set_name: str) -> dict:
        idx = sets[set_name]
        ratios = per_repeat_ratio(runs, idx, s.label, model_best.label, args.repeats)
        return {"setup": s.label, "set": set_name, "vs": model_best.label,
                "ratio": by[(s.label, set_name)]["tokens/s"] / by[(model_best.label, set_name)]["tokens/s"],
                "ratio_per_repeat": ratios}

    goals = {
        "ngram_input_grounded_ge_2x": {"setup": ngram_best_grounded.label,
                                       "value": by[(ngram_best_grounded.label, "input-grounded")]["speedup"], "goal": 2.0,
                                       "decode_speedup": by[(ngram_best_grounded.label, "input-grounded")]["decode speedup"]},
        "best_mixed_ge_1.5x": {"setup": best_mixed.label, "value": by[(best_mixed.label, "mixed")]["speedup"],
                               "goal": 1.5},
        "open_ended_ngram_not_worse_than_model_draft": {**vs_model(ngram_best_mixed, "open-ended"), "goal": 1.0},
        "open_ended_hybrid_not_worse_than_model_draft": {**vs_model(hybrid_best, "open-ended"), "goal": 1.0},
    }
    for kind, fixed in (("hybrid-adaptive", "hybrid"), ("model-adaptive", "model")):
        adaptive = next(s for s in setups if s.kind == kind)
        for set_name in SETS:  # adaptive k, not told the set, vs the best fixed k OF THAT SET
            best = max((s for s in setups if s.kind == fixed), key=lambda s: by[(s.label, set_name)]["tokens/s"])
            goals[f"{kind}_within_5pct_of_best_fixed_k_{set_name}"] = {
                "setup": adaptive.label, "set": set_name, "vs": best.label, "goal": 0.95,
                "ratio": by[(adaptive.label, set_name)]["tokens/s"] / by[(best.label, set_name)]["tokens/s"],
                "ratio_per_repeat": per_repeat_ratio(runs, sets[set_name], adaptive.label, best.label, args.repeats)}
    for g in goals.values():
        g["met"] = (g["value"] if "value" in g else g["ratio"]) >= g["goal"]
    hybrid_vs_model_mixed = vs_model(hybrid_best, "mixed")
    hybrid_vs_model_mixed["hybrid_beats_model_draft"] = (hybrid_vs_model_mixed["ratio"] > 1.0
                                                         and min(hybrid_vs_model_mixed["ratio_per_repeat"]) > 1.0)
    mismatches = first_mismatch(runs, setups, sets, args.repeats)

    out_tokens = {name: sum(len(runs[(alone, i, 0)]["token_ids"]) for i in idx) / len(idx) for name, idx in sets.items()}
    prompt_tokens = {name: sum(runs[(alone, i, 0)]["prompt_tokens"] for i in idx) / len(idx) for name, idx in sets.items()}
    print(f"\n{args.target} (draft {args.draft}), greedy, {args.dtype}, served (gRPC, one stream), "
          f"{len(prompts)} prompts (mixed = {len(mixed_idx)} of them), chat template "
          f"{'off' if args.no_chat_template else 'on'}, up to {args.max_tokens} tokens "
          f"({'ignore EOS' if args.ignore_eos else 'stop at EOS'}), best of {args.repeats} repeats; "
          f"speedup = vs the target alone on the same set, in the same run")
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags']) or 'no avx2/avx512/amx'}; "
          f"load average {cpu['load_average_start'][0]:.1f} at start, {cpu['load_average_end'][0]:.1f} at end; "
          f"measured {measured_s:.0f} s")
    print("mean prompt / output tokens: " + ", ".join(f"{n} {prompt_tokens[n]:.0f} / {out_tokens[n]:.0f}" for n in sets)
          + "\n")
    print_table(rows, COLUMNS)
    print("\nnoise: target alone tokens/s per repeat: " + "; ".join(
        f"{n} " + " / ".join(f"{v:.1f}" for v in vals) for n, vals in alone_per_repeat.items())
        + f"; one request's spread over its repeats: median {noise['request_spread_over_repeats_median']:.0%}, "
          f"p90 {noise['request_spread_over_repeats_p90']:.0%}")
    print(f"model draft alone, best fixed k (chosen on mixed): {model_best.label}: "
          + ", ".join(f"{n} {by[(model_best.label, n)]['speedup']:.2f}x" for n in SETS))
    print(f"hybrid, best fixed k (chosen on mixed): {hybrid_best.label}: "
          + ", ".join(f"{n} {by[(hybrid_best.label, n)]['speedup']:.2f}x" for n in SETS))
    for name, g in goals.items():
        value = g.get("value", g.get("ratio"))
        print(f"goal {name}: {g['setup']}: {value:.2f} (goal >= {g['goal']}) -> {'MET' if g['met'] else 'NOT MET'}"
              + (f" [per repeat {' / '.join(f'{x:.2f}' for x in g['ratio_per_repeat'])}]" if "ratio_per_repeat" in g else "")
              + (f" [decode only {g['decode_speedup']:.2f}]" if g.get("decode_speedup") is not None else ""))
    h = hybrid_vs_model_mixed
    print(f"hybrid vs model draft alone on mixed: {h['setup']} / {h['vs']} = {h['ratio']:.2f}x "
          f"[per repeat {' / '.join(f'{x:.2f}' for x in h['ratio_per_repeat'])}] -> "
          + ("HYBRID BEATS THE MODEL DRAFT ALONE (every repeat)" if h["hybrid_beats_model_draft"]
             else "hybrid does not beat the model draft alone in every repeat"))
    if mismatches:
        print(f"OUTPUT DIFFERS FROM THE TARGET ALONE in {len(mismatches)} request(s); first: {mismatches[0]}")
    else:
        print("every output is identical to the target alone's")

    measurements = [{"setup": label, "prompt": i, "repeat": r, "seconds": x["seconds"], "ttft": x["ttft"],
                     "first_tokens": x["first_tokens"],
                     "prompt_tokens": x["prompt_tokens"], "tokens": len(x["token_ids"]), "drafted": x["drafted"],
                     "accepted": x["accepted"], "passes": x["passes"]}
                    for (label, i, r), x in sorted(runs.items(), key=lambda kv: (kv[0][2], kv[0][1]))]
    outputs = {i: runs[(alone, i, 0)]["token_ids"] for i in range(len(prompts))}
    write_json(out_path, {
        "smoke": args.smoke, "target": args.target, "draft": args.draft, "dtype": args.dtype,
        "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "repeats": args.repeats,
        "chat_template": not args.no_chat_template, "cpu": cpu, "stacks": stack_specs,
        "prompts": {"input-grounded": prompt_sets["input-grounded"], "open-ended": prompt_sets["open-ended"],
                    "mixed": [messages[i] for i in mixed_idx]},
        "mean_prompt_tokens": prompt_tokens, "mean_output_tokens": out_tokens,
        "rows": rows, "model_draft_best_k": model_best.k, "hybrid_best_k": hybrid_best.k, "goals": goals,
        "hybrid_vs_model_draft_mixed": hybrid_vs_model_mixed, "noise": noise, "measured_seconds": measured_s,
        "mismatches": mismatches, "target_alone_output_ids": outputs, "measurements": measurements,
    })
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

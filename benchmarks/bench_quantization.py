"""Quantized execution: speed per mode, speculation on top, llama.cpp on the same GGUF, perplexity per mode.

Side by side in one run, greedy, on the embedded target (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized):

1. **Served rows** (``specdec serve`` stacks, each in a process of its own, gRPC, one stream; the prompts of
   ``specdec/assets/prompts/drafting.json`` through the chat template, every row back to back per prompt,
   rotating, best of ``--repeats``):
     * the target alone in float32, bfloat16 and int8 (``--quantization int8``);
     * the target as ``specdec serve`` runs it (``--dtype auto``: the faster of float32 and bfloat16 here,
       measured), alone, with the default pair (hybrid drafting, the draft int8 by default) and with the same
       pair's draft unquantized (``"quantization": "none"``): the draft default's before/after;
     * the int8 target with n-gram drafting (k=4, lookup 2-4) and with the default hybrid draft.
   "identical" compares each row with the target alone in the same mode (what lossless means for it).
2. **llama.cpp** (``llamacpp_peer``: llama-cpp-python on the same GGUF file, same messages through the
   GGUF's chat template, same thread count, greedy): alone and with its own prompt lookup.
3. **Passes** (in process): one pass of 1, 4 and 16 new tokens after 256 cached, per mode.
4. **Perplexity** of each mode on ``specdec/assets/text/heldout.txt`` (never the calibration text), per model
   (``--ppl-models``; Gemma-3-270M when its pip packages are installed).

Goals (issue "Quantized execution"), reported, never asserted: int8 target alone >= 0.5x llama.cpp alone;
the default pair >= 1.5x the target alone on the mixed set; the int8 target with n-gram drafting >= 2.5x the
int8 target alone on input-grounded prompts; int8 perplexity within 2% of float32.

    python benchmarks/bench_quantization.py --repeats 2 --max-tokens 48
    python benchmarks/bench_quantization.py --smoke   # tiny random-weight models, seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_drafting import PROMPTS_FILE, InProcessStack, chat_formatter, generate, load_prompts  # noqa: E402
from bench_serving import ServedStack  # noqa: E402
from common import add_common_args, cpu_info, json_path, print_table, smoke_environment, smoke_models, step_ms, write_json  # noqa: E402

from specdec.config import DEFAULT_TARGET, default_speculative_config  # noqa: E402
from specdec.v1 import generation_service_pb2_grpc  # noqa: E402

SETS = ("input-grounded", "open-ended", "mixed")
MODES = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
         "int8": dict(dtype="float32", quantization="int8")}


def stacks_of(args) -> dict[str, dict]:
    """name -> (serve config, reference row: the target alone in the same mode)."""
    pair = default_speculative_config() if not args.smoke else {
        "method": "draft_model", "model": args.draft, "num_speculative_tokens": 1, "prompt_lookup_max": 3}
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    out = {f"target {m}": (dict(kw), None) for m, kw in MODES.items()}
    out["target auto"] = (dict(dtype="auto"), None)  # what `specdec serve` runs: the measured dtype
    out["default pair (draft int8)"] = (dict(dtype="auto", speculative_config=pair), "target auto")
    out["default pair, draft unquantized"] = (dict(dtype="auto", speculative_config={**pair, "quantization": "none"}),
                                             "target auto")
    out["int8 target + n-gram k=4"] = (dict(MODES["int8"], speculative_config=ngram), "target int8")
    out["int8 target + default draft"] = (dict(MODES["int8"], speculative_config=pair), "target int8")
    return out


def served_rows(args, prompts, sets) -> tuple[dict, dict]:
    stacks = stacks_of(args)
    runs: dict = {}
    with contextlib.ExitStack() as es:
        stubs = {}
        live = {}
        for name, (kw, _) in stacks.items():  # all load at once, each in its own process
            spec = kw.pop("speculative_config", None)
            cfg = dict(model=args.target, speculative_config=json.dumps(spec) if spec else None, host="127.0.0.1",
                       grpc_port=0, port=-1, num_threads=args.threads, **kw)
            live[name] = es.enter_context(InProcessStack(cfg) if args.in_process else ServedStack(cfg))
        for name, st in live.items():
            channel = es.enter_context(grpc.insecure_channel(f"127.0.0.1:{st.ports()[0]}"))
            stubs[name] = generation_service_pb2_grpc.GenerationServiceStub(channel)
        names = list(stacks)
        for name in names:  # warm-up
            generate(stubs[name], prompts[0], None, min(8, args.max_tokens), False)
        for r in range(args.repeats):
            for i, prompt in enumerate(prompts):
                shift = (r * len(prompts) + i) % len(names)
                for name in names[shift:] + names[:shift]:
                    runs[(name, i, r)] = generate(stubs[name], prompt, None, args.max_tokens, False)
            print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)
    return stacks, runs


def aggregate(stacks, runs, sets, repeats) -> list[dict]:
    rows = []
    for set_name, idx in sets.items():
        def tps(name):
            secs = sum(min(runs[(name, i, r)]["seconds"] for r in range(repeats)) for i in idx)
            return sum(len(runs[(name, i, 0)]["token_ids"]) for i in idx) / secs

        for name, (_, ref) in stacks.items():
            res = [runs[(name, i, r)] for i in idx for r in range(repeats)]
            drafted = sum(x["drafted"] for x in res)
            ref_name = ref or name
            rows.append({
                "setup": name, "set": set_name, "tokens/s": tps(name),
                "vs fp32 alone": tps(name) / tps("target float32"),
                "vs its target alone": tps(name) / tps(ref_name) if ref else None,
                "acceptance": sum(x["accepted"] for x in res) / drafted if drafted else None,
                "identical": None if not ref else all(runs[(name, i, r)]["token_ids"] == runs[(ref, i, 0)]["token_ids"]
                                                      for i in idx for r in range(repeats)),
            })
    return rows


def llama_rows(args, messages, sets, gguf) -> list[dict]:
    from llamacpp_peer import ensure_llama_cpp, measure

    reason = ensure_llama_cpp(install=not args.smoke)
    if reason is not None:
        print(f"llama.cpp: unavailable ({reason})", file=sys.stderr)
        return [{"setup": "llama.cpp", "set": "all", "note": f"unavailable: {reason}"}]
    rows = []
    threads = args.threads or len(os.sched_getaffinity(0))
    for lookup in (False, True):
        for set_name, idx in sets.items():
            m = measure(gguf, [messages[i] for i in idx], args.max_tokens, threads, prompt_lookup=lookup,
                        num_pred_tokens=4, repeats=args.repeats)  # k=4: specdec's n-gram row's
            rows.append({"setup": "llama.cpp" + (" + prompt lookup k=4" if lookup else ""), "set": set_name,
                         "tokens/s": m["tokens_per_s"], "tokens": m["tokens"]})
    return rows


def pass_rows(args) -> list[dict]:
    from specdec.engine.models import load_model
    from specdec.engine.runner import ModelRunner

    rows = []
    for mode, kw in MODES.items():
        lm = load_model(args.target, dtype=kw["dtype"])
        runner = ModelRunner(lm, 1024, role="target", quantization=kw.get("quantization", "none"))
        row = {"mode": mode}
        for n in (1, 4, 16):
            row[f"{n} token ms"] = step_ms(runner, n, 256 if not args.smoke else 16, args.pass_reps)
        rows.append(row)
    return rows


def perplexity_rows(args) -> list[dict]:
    from specdec.engine.lean_forward import lean_decoder
    from specdec.engine.models import load_model
    from specdec.engine.perplexity import shipped_text, text_perplexity
    from specdec.engine.quant_calibration import build_plan

    rows = []
    text = shipped_text("heldout")
    for model in args.ppl_models:
        try:
            base = None
            for mode, kw in MODES.items():
                lm = load_model(model, dtype=kw["dtype"])
                plan = build_plan(lm, "int8")[0] if kw.get("quantization") else None  # as a target's
                net = lean_decoder(lm.model, quant=plan)
                res = text_perplexity(net, lm.tokenizer, text, max_tokens=args.ppl_tokens)
                base = base or res["perplexity"]
                rows.append({"model": model, "mode": mode, "perplexity": res["perplexity"], "tokens": res["tokens"],
                             "vs float32": res["perplexity"] / base - 1,
                             "note": plan.describe().strip(" ()") if plan is not None else None})
                del net, lm
        except Exception as exc:  # e.g. Gemma's pip packages missing
            rows.append({"model": model, "mode": "-", "note": f"{type(exc).__name__}: {exc}"[:200]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=None, help="(smoke only) the draft; the default pair's otherwise")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts-per-set", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of each stack and of llama.cpp (0: all cores)")
    ap.add_argument("--pass-reps", type=int, default=15)
    ap.add_argument("--ppl-models", nargs="*", default=[DEFAULT_TARGET, "gemma-3-270m"])
    ap.add_argument("--ppl-tokens", type=int, default=None, help="score at most this many held-out tokens")
    ap.add_argument("--skip", nargs="*", default=[], choices=["served", "llama", "passes", "perplexity"])
    ap.add_argument("--in-process", action="store_true")
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "quantization")
    cpu = cpu_info()
    tmp = None
    gguf = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)
        models = smoke_models(tmp.name)
        args.target, args.draft = models.target, models.draft
        args.max_tokens, args.repeats, args.threads, args.prompts_per_set, args.pass_reps = 6, 1, 1, 1, 2
        args.in_process, args.ppl_models, args.ppl_tokens = True, [models.target], 64
    else:
        from specdec.model_files import BUILTIN_MODELS

        gguf = BUILTIN_MODELS[args.target].gguf() if args.target in BUILTIN_MODELS else None
    prompt_sets = load_prompts(Path(PROMPTS_FILE), args.prompts_per_set)
    messages = prompt_sets["input-grounded"] + prompt_sets["open-ended"]
    fmt = chat_formatter(args.target, True)
    prompts = [fmt(m) for m in messages]
    n_in = len(prompt_sets["input-grounded"])
    sets = {"input-grounded": list(range(n_in)), "open-ended": list(range(n_in, len(prompts)))}
    sets["mixed"] = sets["input-grounded"][::2] + sets["open-ended"][::2]
    result: dict = {"cpu": cpu, "target": args.target, "max_tokens": args.max_tokens, "repeats": args.repeats}

    if "perplexity" not in args.skip:
        result["perplexity"] = perplexity_rows(args)
        print("\nPerplexity on specdec/assets/text/heldout.txt (windows of 512 tokens):")
        print_table(result["perplexity"], ["model", "mode", "perplexity", "vs float32", "tokens", "note"])
    if "passes" not in args.skip:
        result["passes"] = pass_rows(args)
        print("\nOne pass (ModelRunner.forward, lean forward), median ms, after 256 cached tokens:")
        print_table(result["passes"], ["mode", "1 token ms", "4 token ms", "16 token ms"])
    started = time.perf_counter()
    if "served" not in args.skip:
        stacks, runs = served_rows(args, prompts, sets)
        result["served"] = aggregate(stacks, runs, sets, args.repeats)
        print(f"\nServed (gRPC, one stream, greedy, up to {args.max_tokens} tokens, chat template, best of "
              f"{args.repeats}; {len(prompts)} prompts, mixed = every other of each set):")
        print_table(result["served"], ["setup", "set", "tokens/s", "vs fp32 alone", "vs its target alone",
                                       "acceptance", "identical"])
    if "llama" not in args.skip and gguf is not None:
        result["llama_cpp"] = llama_rows(args, messages, sets, gguf)
        print("\nllama.cpp on the same GGUF (in process, same messages and threads):")
        print_table(result["llama_cpp"], ["setup", "set", "tokens/s", "tokens", "note"])
    result["goals"] = goals(result)
    result["seconds"] = time.perf_counter() - started
    cpu["load_average_end"] = list(os.getloadavg())
    print(f"\nCPU: {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags'])}; load average "
          f"{cpu['load_average_start']} -> {cpu['load_average_end']}")
    print("Goals (reported, not asserted):", json.dumps(result["goals"], indent=1))
    write_json(out_path, result)
    if tmp is not None:
        tmp.cleanup()
    return 0


def goals(result: dict) -> dict:
    out: dict = {}
    served = {(r["setup"], r["set"]): r for r in result.get("served", [])}
    llama = {(r["setup"], r["set"]): r for r in result.get("llama_cpp", []) if "tokens/s" in r}
    if served and ("llama.cpp", "mixed") in llama:
        out["int8_target_alone_ge_0.5x_llama_cpp"] = {
            "value": served[("target int8", "mixed")]["tokens/s"] / llama[("llama.cpp", "mixed")]["tokens/s"], "goal": 0.5}
    if served:
        out["default_pair_ge_1.5x_target_alone_mixed"] = {
            "value": served[("default pair (draft int8)", "mixed")]["vs its target alone"], "goal": 1.5}
        out["int8_target_ngram_ge_2.5x_int8_alone_input_grounded"] = {
            "value": served[("int8 target + n-gram k=4", "input-grounded")]["vs its target alone"], "goal": 2.5}
    for r in result.get("perplexity", []):
        if r.get("mode") == "int8":
            out[f"int8_perplexity_within_2pct_{r['model']}"] = {"value": r["vs float32"], "goal": 0.02,
                                                                "met": r["vs float32"] <= 0.02}
    for g in out.values():
        g.setdefault("met", g["value"] >= g["goal"])
    return out


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    sys.exit(main())

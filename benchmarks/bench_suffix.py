"""Suffix decoding against the target alone, n-gram drafting and the suffix/draft-model pair, through the served stack.

Side by side in one run, greedy, the same target (default: the embedded ``smollm2-135m``), each setup a
``specdec serve`` stack in a process of its own (``--in-process``: all in this one):

  * the target alone;
  * suffix decoding (``"method": "suffix"``, no model), k up to ``--suffix-k`` (15), drafts up to
    ``--suffix-factor`` (4) x the matched length, vLLM's defaults otherwise;
  * the suffix/draft-model pair (``specdec.config.draft_model_pair_config``, the shipped default before the EAGLE-3
    head, with ``--draft``): suffix drafts first, the draft model where suffix has no confident match;
  * n-gram drafting, k = 4, lookup 2-4;
  * the n-gram hybrid that was the default before (lookup 3-2, else the draft model, k = 1).

Workloads, in this order (the draft service's global tree carries what earlier requests taught it, as in
service; every request runs once per setup, so nothing is ever a literal repeat of a measured request):
  (a) agent: ``--agent-requests`` (50) requests made deterministically from a few templates: tool calls
      answered with a JSON object, code edits of this repository's own functions, fixed-format status
      reports, field extraction into JSON;
  (b) input-grounded chats: the input-grounded prompts of ``bench_drafting.py``;
  (c) open prose: its open-ended prompts;
  and "mixed": (b) and (c) together (where bench_drafting.py chose the shipped default).
All prompts go through the target's chat template. For each request every setup runs back to back (the
order rotating from request to request), so drift on a shared machine hits every setup alike.

Per setup and workload: tokens/s (end to end), speed-up over the target alone, mean accepted tokens per
verify pass (vLLM's mean acceptance length: emitted tokens / target passes), mean draft length (drafted tokens
/ rounds that drafted), acceptance, and whether every output equals the target alone's. Goals (against the
target alone): agent >= 3x, input-grounded >= 2x, open prose >= 0.97x; reported, a miss fails only with --strict.

    python benchmarks/bench_suffix.py
    python benchmarks/bench_suffix.py --smoke   # tiny random-weight models, seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_drafting import PROMPTS_FILE, InProcessStack, chat_formatter, load_prompts  # noqa: E402
from bench_serving import ServedStack  # noqa: E402
from common import (add_common_args, add_strict_arg, cpu_info, json_path, print_table, report_checks,  # noqa: E402
                    smoke_environment, smoke_models, write_json)

from specdec.config import DEFAULT_DRAFT, DEFAULT_TARGET, draft_model_pair_config  # noqa: E402
from specdec.v1 import common_pb2, generation_service_pb2 as pb, generation_service_pb2_grpc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("agent", "input-grounded", "open prose")  # run in this order; "mixed" = the last two, aggregated
GOALS = {"agent": 3.0, "input-grounded": 2.0, "open prose": 0.97}
COLUMNS = ["setup", "workload", "tokens/s", "speedup", "decode speedup", "tokens/pass", "mean draft", "acceptance", "identical"]


# --------------------------------------------------------------------------------------------------
# the agent workload


TOOLS = """You can call these tools:
- get_weather(city: string, unit: "celsius" | "fahrenheit")
- search_files(pattern: string, path: string)
- create_ticket(title: string, priority: "low" | "medium" | "high")
Answer with exactly one JSON object of the form {"tool": "<name>", "arguments": {...}} and nothing else."""
CITIES = ["Paris", "Berlin", "Tokyo", "Lima", "Cairo", "Oslo", "Denver", "Madrid", "Seoul", "Nairobi"]
TICKETS = ["the login page times out", "exports are missing a column", "the nightly build is red",
           "disk usage alert on db-2", "typo on the pricing page"]
SERVICES = ["gateway", "draft-service", "target-service", "billing", "search"]
PEOPLE = [("Ada Lovelace", "ada@example.com", "engineer"), ("Alan Turing", "alan@example.com", "researcher"),
          ("Grace Hopper", "grace@example.com", "admiral"), ("Linus Torvalds", "linus@example.com", "maintainer"),
          ("Barbara Liskov", "barbara@example.com", "professor")]


def project_functions(limit_lines: int = 14, root: str = "specdec") -> list[tuple[str, str, str]]:
    """(source, function name, a local variable) of short functions in this repository's ``root`` package."""
    found = []
    for path in sorted((ROOT / root).glob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.FunctionDef) or not 4 <= node.end_lineno - node.lineno + 1 <= limit_lines:
                continue
            names = sorted({a.arg for a in node.args.args if a.arg != "self"})
            if names:
                found.append((ast.get_source_segment(text, node), node.name, names[0]))
    return found


def agent_requests(n: int, seed: int = 0) -> list[str]:
    """n user messages from the templates, deterministic for a seed."""
    rng = random.Random(seed)
    functions = project_functions()
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            ask = rng.choice([f"What is the weather in {rng.choice(CITIES)} in {rng.choice(['celsius', 'fahrenheit'])}?",
                              f"Find the Python files matching '{rng.choice(['test_*', '*_service', 'conf*'])}' under "
                              f"'{rng.choice(['src', 'tests', 'deploy'])}'.",
                              f"Open a {rng.choice(['low', 'medium', 'high'])} priority ticket: {rng.choice(TICKETS)}."])
            out.append(f"{TOOLS}\n\nRequest: {ask}")
        elif kind == 1:
            source, name, var = functions[rng.randrange(len(functions))]
            new = f"{var}_value"
            out.append(f"Rename the parameter `{var}` to `{new}` in the function `{name}` below. Reply with the full "
                       f"updated function only.\n\n```python\n{source}\n```")
        elif kind == 2:
            service = rng.choice(SERVICES)
            out.append("Write a status report in exactly this format, filling in the values:\n"
                       "Service: <name>\nStatus: <OK or DEGRADED>\nRequests: <number>\nErrors: <number>\n"
                       "Summary: <one sentence>\n\n"
                       f"Data: service={service}, requests={rng.randrange(1000, 99999)}, "
                       f"errors={rng.randrange(0, 300)}, p99_latency_ms={rng.randrange(20, 900)}")
        else:
            name, email, role = rng.choice(PEOPLE)
            out.append("Extract the fields name, email and role from the text below. Answer with a JSON object with "
                       "the keys \"name\", \"email\" and \"role\" only.\n\n"
                       f"Text: Please welcome {name}, our new {role}. You can reach them at {email}.")
    return out


# --------------------------------------------------------------------------------------------------
# setups and requests


def setups(args) -> dict[str, dict | None]:
    """label -> the stack's speculative_config (None: the target alone; "default": serve's default)."""
    extra = {f"suffix k<={k:g} factor {f:g} p>={p:g}": {
        "method": "suffix", "num_speculative_tokens": int(k), "suffix_decoding_max_spec_factor": f,
        "suffix_decoding_min_token_prob": p} for k, f, p in args.suffix_variants}
    if args.only_variants:
        return {"target alone": None, **extra}
    return {
        "target alone": None,
        f"suffix k<={args.suffix_k} factor {args.suffix_factor:g}": {
            "method": "suffix", "num_speculative_tokens": args.suffix_k, "suffix_decoding_max_spec_factor": args.suffix_factor},
        "suffix/draft-model pair": "default",
        "n-gram k=4 (lookup 2-4)": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                    "prompt_lookup_min": 2},
        "n-gram hybrid (the default before)": {"method": "draft_model", "model": args.draft, "num_speculative_tokens": 1,
                                               "prompt_lookup_max": 3, "prompt_lookup_min": 2, "disable_by_batch_size": 3},
        **extra,
    }


def generate(stub, prompt: str, max_tokens: int) -> dict:
    req = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, sampling_params=common_pb2.SamplingParams(temperature=0))
    ids: list[int] = []
    last = first = None
    start = time.perf_counter()
    for resp in stub.Generate(req, timeout=900):
        if first is None:  # the first response: the prefill's token (its round's, with speculation)
            first, first_tokens = time.perf_counter() - start, len(resp.token_ids)
        ids.extend(resp.token_ids)
        last = resp
    return {"seconds": time.perf_counter() - start, "ttft": first, "first_tokens": first_tokens, "token_ids": ids, "drafts": last.stats.num_drafts,
            "drafted": last.stats.num_draft_tokens, "accepted": last.stats.num_accepted_tokens,
            "passes": last.stats.num_target_passes}


def start_stacks(es: contextlib.ExitStack, specs: dict, args, fmt, requests: int,
                 serve_options: dict[str, dict] | None = None) -> dict:
    """Each setup's ``specdec serve`` stack (in this process with ``--in-process``) on ``args.target``, entered on
    ``es``, and a warmed-up gRPC stub per setup (a "default" spec: the suffix/draft-model pair with ``args.draft``);
    ``serve_options``: a setup's further serve settings (by label)."""
    started = time.perf_counter()
    stacks, stubs = {}, {}
    for label, spec in specs.items():
        if spec == "default":  # the suffix/draft-model pair (draft_model_pair_config), for this target
            spec = specs[label] = {**draft_model_pair_config(), "model": args.draft}
        cfg = dict(model=args.target, host="127.0.0.1", grpc_port=0, port=-1, dtype=args.dtype,
                   draft_dtype=args.dtype, num_threads=args.threads,
                   speculative_config=None if spec is None else json.dumps(spec), **(serve_options or {}).get(label, {}))
        stacks[label] = es.enter_context(InProcessStack(cfg) if args.in_process else ServedStack(cfg))
    for label, st in stacks.items():
        channel = es.enter_context(grpc.insecure_channel(f"127.0.0.1:{st.ports()[0]}"))
        stubs[label] = generation_service_pb2_grpc.GenerationServiceStub(channel)
        generate(stubs[label], fmt("Hello!"), 4)  # warm-up (outside every workload)
    print(f"{len(stacks)} stacks up in {time.perf_counter() - started:.0f} s; {requests} requests x "
          f"{len(stacks)} setups", file=sys.stderr)
    return stubs


def measure_rotating(stubs: dict, prompts: list[str], max_tokens: int) -> dict:
    """Every prompt through every setup back to back, the order rotating from prompt to prompt (drift on a shared
    machine hits every setup alike): (setup, prompt index) -> generate()'s result."""
    labels, runs = list(stubs), {}
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        shift = i % len(labels)
        for label in labels[shift:] + labels[:shift]:
            runs[(label, i)] = generate(stubs[label], prompt, max_tokens)
        if i % 10 == 9:
            print(f"{i + 1}/{len(prompts)} requests at {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return runs


def aggregate(labels: list[str], runs: dict, workloads: dict[str, list[int]]) -> list[dict]:
    alone = labels[0]
    rows = []
    for name, idx in workloads.items():
        base = sum(len(runs[(alone, i)]["token_ids"]) for i in idx) / sum(runs[(alone, i)]["seconds"] for i in idx)

        def decode_tps(label):  # after the first response: the prompt's prefill left out
            n = sum(len(runs[(label, i)]["token_ids"]) - runs[(label, i)]["first_tokens"] for i in idx)
            return n / sum(runs[(label, i)]["seconds"] - runs[(label, i)]["ttft"] for i in idx)

        base_decode = decode_tps(alone)
        for label in labels:
            res = [runs[(label, i)] for i in idx]
            tokens = sum(len(r["token_ids"]) for r in res)
            tps = tokens / sum(r["seconds"] for r in res)
            drafts, drafted, passes = (sum(r[key] for r in res) for key in ("drafts", "drafted", "passes"))
            rows.append({"setup": label, "workload": name, "tokens/s": tps, "speedup": tps / base,
                         "decode speedup": decode_tps(label) / base_decode,
                         "tokens/pass": tokens / passes if passes else None,
                         "mean draft": drafted / drafts if drafts else None,
                         "acceptance": sum(r["accepted"] for r in res) / drafted if drafted else None,
                         "identical": all(runs[(label, i)]["token_ids"] == runs[(alone, i)]["token_ids"] for i in idx)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT, help="the suffix hybrid's draft model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--suffix-k", type=int, default=15, help="num_speculative_tokens of the suffix-alone row (the cap)")
    ap.add_argument("--suffix-factor", type=float, default=4.0, help="its suffix_decoding_max_spec_factor")
    ap.add_argument("--suffix-variants", type=float, nargs=3, action="append", default=[], metavar=("K", "FACTOR", "MIN_P"),
                    help="an extra suffix row with this num_speculative_tokens, suffix_decoding_max_spec_factor and "
                         "min_token_prob (repeatable)")
    ap.add_argument("--only-variants", action="store_true", help="the target alone and the --suffix-variants rows only")
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--agent-requests", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=64, help="per request (answers also end at EOS)")
    ap.add_argument("--prompts-per-set", type=int, default=None, help="the first N prompts of (b) and (c)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of each served stack (0: all cores)")
    ap.add_argument("--in-process", action="store_true", help="all stacks in this process (default with --smoke)")
    add_common_args(ap)
    add_strict_arg(ap)
    args = ap.parse_args()
    out_path = json_path(args, "suffix")
    cpu = cpu_info()
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)
        models = smoke_models(tmp.name)
        args.target, args.draft = models.target, models.draft
        args.agent_requests, args.max_tokens, args.prompts_per_set, args.threads = 4, 8, 1, 1
        args.suffix_k = min(args.suffix_k, 8)
        args.in_process = True
    fmt = chat_formatter(args.target, True)
    sets = load_prompts(PROMPTS_FILE, args.prompts_per_set)
    messages = {"agent": agent_requests(args.agent_requests), "input-grounded": sets["input-grounded"],
                "open prose": sets["open-ended"]}
    prompts, workloads = [], {}
    for name in WORKLOADS:
        if name in args.workloads:
            workloads[name] = list(range(len(prompts), len(prompts) + len(messages[name])))
            prompts += [fmt(m) for m in messages[name]]
    if "input-grounded" in workloads and "open prose" in workloads:
        workloads["mixed"] = workloads["input-grounded"] + workloads["open prose"]
    specs = setups(args)
    labels = list(specs)
    with contextlib.ExitStack() as es:
        stubs = start_stacks(es, specs, args, fmt, len(prompts))
        measure_start = time.perf_counter()
        runs = measure_rotating(stubs, prompts, args.max_tokens)
        measured_s = time.perf_counter() - measure_start
    cpu["load_average_end"] = list(os.getloadavg())
    rows = aggregate(labels, runs, workloads)
    by = {(r["setup"], r["workload"]): r for r in rows}
    print(f"\n{args.target}, greedy, {args.dtype}, served (gRPC, one stream), up to {args.max_tokens} tokens (or EOS); "
          f"{', '.join(f'{n} {len(idx)}' for n, idx in workloads.items())} requests; speedup = vs the target alone")
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags']) or 'no avx2/avx512/amx'}; load "
          f"average {cpu['load_average_start'][0]:.1f} -> {cpu['load_average_end'][0]:.1f}; measured {measured_s:.0f} s\n")
    print_table(rows, COLUMNS)
    goals = {}
    for label in labels[1:3] if not args.only_variants else labels[1:2]:
        for w, g in GOALS.items():
            if w in workloads:
                goals[f"{label}: {w} >= {g}x the target alone ({by[(label, w)]['speedup']:.2f}x)"] = \
                    by[(label, w)]["speedup"] >= g
    checks = {f"{label}: every output identical to the target alone's": all(
        by[(label, w)]["identical"] for w in workloads) for label in labels[1:]}
    # the default's choice: the suffix hybrid had to beat the n-gram hybrid on mixed and not lose on open prose
    verdict = {}
    if not args.only_variants and "mixed" in workloads:
        hybrid, before = labels[2], labels[4]
        verdict = {f"suffix/draft-model pair over the n-gram hybrid before, {w}": by[(hybrid, w)]["tokens/s"] / by[(before, w)]["tokens/s"]
                   for w in ("agent", "mixed", "open prose") if w in workloads}
    for name, value in verdict.items():
        print(f"{name}: {value:.2f}x")
    write_json(out_path, {"smoke": args.smoke, "target": args.target, "draft": args.draft, "dtype": args.dtype,
                          "max_tokens": args.max_tokens, "cpu": cpu, "setups": specs, "rows": rows, "goals": goals,
                          "checks": checks, "default_verdict": verdict, "measured_seconds": measured_s, "messages": messages,
                          "measurements": [{"setup": label, "request": i, **{k: v for k, v in r.items() if k != "token_ids"},
                                            "tokens": len(r["token_ids"])} for (label, i), r in runs.items()]})
    if tmp is not None:
        tmp.cleanup()
    return report_checks(checks, goals, args.strict)


if __name__ == "__main__":
    sys.exit(main())

"""Token trees against chains, through the served stack (``speculative_token_tree: "dynamic"``, specdec.trees).

Side by side in one run, greedy, the same target (default: the embedded ``smollm2-135m``), each setup a
``specdec serve`` stack in a process of its own (``--in-process``: all in this one):

  * the target alone;
  * suffix decoding as chains (``"method": "suffix"``, no model, k up to ``--k`` (15), factor ``--factor`` (4));
  * the same with token trees (every branch the suffix trees hold above min_token_prob, up to k nodes);
  * the shipped default (suffix decoding before the EAGLE-3 head ``--eagle3-head``: a suffix match expecting 1.5+
    accepted tokens, else the head, depth 3), as chains and with token trees (suffix rounds: the suffix trees'
    branches, merged with the head's tree where the match expects fewer than 6 tokens; the head's rounds: EAGLE-2's
    dynamic tree; 15 nodes at most);
  * the shipped draft model alone at k = ``--model-k`` (3), as chains and as trees;
  * n-gram lookup, as chains and as trees;
  * the default before the EAGLE-3 head (suffix decoding before the draft model: ``draft_model_pair_config``), as
    chains and with trees (the draft model's rounds: its top-4 candidates per expanded node);
  * the shipped default with unmerged trees (``suffix_decoding_merge_score`` 0: a suffix tree proposes alone, as
    before 2026-12-07, where the default merges a suffix tree expecting fewer than 6 tokens with the head's);
  * the shipped default with its head's top 4 per level (``speculative_eagle_topk`` 4, the default before
    2026-12-07; now 6).

Workloads, in this order:
  (a) agent-like traffic that no benchmark or setting here was tuned on (``--agent-requests``, 40): tool calls
      answered with JSON (another tool set than bench_suffix.py's), edits of this repository's gateway code,
      incident reports in a fixed format, and every request re-issued with one small change (another city, another
      name, another number): where earlier answers diverge, a chain bets on one branch, a tree carries several;
  (b) open-ended chat: the open-ended prompts of ``specdec/assets/prompts/chat.json``.
Then (c) concurrency: ``--streams`` (8) streams at once over agent requests, each setup named in
``--stream-setups`` (default: the suffix chains and trees, the shipped default with trees and the suffix/draft-model
pair with trees).

Per setup and workload: tokens/s, speed-up over the target alone, tokens per target pass, mean nodes per drafted
round, acceptance (accepted / drafted nodes) and whether every output equals the target alone's. Goals (the
issue's): agent with trees >= 2.5x the target alone; open chat, default with trees >= 1.3x the tokens per pass of
the default with chains; 8 streams with trees no slower than with chains. Reported; a miss fails only with --strict.

    python benchmarks/bench_trees.py
    python benchmarks/bench_trees.py --smoke   # tiny random-weight models, seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_drafting import chat_formatter, load_prompts  # noqa: E402
from bench_suffix import aggregate, generate, measure_rotating, project_functions, start_stacks  # noqa: E402
from common import (add_common_args, add_strict_arg, cpu_info, json_path, print_table, report_checks,  # noqa: E402
                    smoke_environment, smoke_models, write_json)

from specdec.config import (DEFAULT_DRAFT, DEFAULT_EAGLE3_HEAD, DEFAULT_TARGET, default_speculative_config,  # noqa: E402
                            draft_model_pair_config)

ROOT = Path(__file__).resolve().parents[1]
CHAT_FILE = ROOT / "specdec" / "assets" / "prompts" / "chat.json"
COLUMNS = ["setup", "workload", "tokens/s", "speedup", "decode speedup", "tokens/pass", "mean draft", "acceptance", "identical"]

TOOLS = """Tools you may call:
- book_flight(origin: string, destination: string, date: "YYYY-MM-DD")
- send_email(to: string, subject: string)
- query_orders(customer_id: integer, status: "open" | "shipped" | "returned")
Reply with one JSON object {"name": "<tool>", "parameters": {...}} and nothing else."""
AIRPORTS = ["Lisbon", "Warsaw", "Austin", "Kyoto", "Dakar", "Perth", "Quito", "Bergen"]
NAMES = ["Maria Silva", "Tomasz Nowak", "Kenji Sato", "Aisha Diallo", "Liam Walsh", "Sofia Rossi"]
INCIDENTS = ["checkout latency", "failed backups", "certificate expiry", "queue backlog", "5xx spike"]


def gateway_functions() -> list[tuple[str, str, str]]:
    """Short functions of this repository's gateway/ (bench_suffix.py edits specdec/'s)."""
    return project_functions(root="gateway")


def agent_requests(n: int, seed: int = 1) -> list[str]:
    """n user messages: n // 2 from the templates, each followed by itself with one small change."""
    rng = random.Random(seed)
    functions = gateway_functions()
    out: list[str] = []
    while len(out) < n:
        kind = len(out) // 2 % 4
        if kind == 0:
            a, b = rng.sample(AIRPORTS, 2)
            day = rng.randrange(1, 28)
            pair = [f"{TOOLS}\n\nRequest: book a flight from {a} to {b} on 2027-03-{day:02d}.",
                    f"{TOOLS}\n\nRequest: book a flight from {a} to {rng.choice([x for x in AIRPORTS if x not in (a, b)])} "
                    f"on 2027-03-{day:02d}."]
        elif kind == 1:
            source, name, var = functions[rng.randrange(len(functions))]
            pair = [f"Add a one-line docstring to the function `{name}` below. Reply with the full function only."
                    f"\n\n```python\n{source}\n```",
                    f"Rename the function `{name}` to `{name}_v2` below. Reply with the full function only."
                    f"\n\n```python\n{source}\n```"]
        elif kind == 2:
            incident = rng.choice(INCIDENTS)
            minutes = rng.randrange(5, 240)
            form = ("Write an incident report in exactly this format:\nIncident: <title>\nSeverity: <SEV1-SEV3>\n"
                    "Duration: <minutes> minutes\nCause: <one sentence>\nAction: <one sentence>\n\n")
            pair = [f"{form}Facts: {incident}, lasted {minutes} minutes, owner {rng.choice(NAMES)}.",
                    f"{form}Facts: {incident}, lasted {minutes + rng.randrange(1, 30)} minutes, owner "
                    f"{rng.choice(NAMES)}."]
        else:
            name = rng.choice(NAMES)
            pair = [f"{TOOLS}\n\nRequest: email {name} that the order {rng.randrange(1000, 9999)} has shipped.",
                    f"{TOOLS}\n\nRequest: email {rng.choice([x for x in NAMES if x != name])} that the order "
                    f"{rng.randrange(1000, 9999)} has shipped."]
        out += pair
    return out[:n]


def setups(args) -> dict[str, dict | None]:
    suffix = {"method": "suffix", "num_speculative_tokens": args.k, "suffix_decoding_max_spec_factor": args.factor}
    default = {**default_speculative_config(), "model": args.eagle3_head}
    default.pop("speculative_token_tree", None)  # the chains row; the trees row adds it back
    pair = {**draft_model_pair_config(), "model": args.draft}
    pair.pop("speculative_token_tree", None)
    model = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.model_k}
    ngram = {"method": "ngram", "num_speculative_tokens": args.ngram_k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    every = {"target alone": None, f"suffix k<={args.k} chains": suffix,
             f"suffix k<={args.k} trees": {**suffix, "speculative_token_tree": "dynamic"},
             "shipped default (chains)": default,
             "shipped default with trees": {**default, "speculative_token_tree": "dynamic"},
             f"draft model k={args.model_k} chains": model,
             f"draft model k={args.model_k} trees": {**model, "speculative_token_tree": "dynamic"},
             f"n-gram k={args.ngram_k} chains": ngram,
             f"n-gram k={args.ngram_k} trees": {**ngram, "speculative_token_tree": "dynamic"},
             "suffix + draft model (chains)": pair,
             "suffix + draft model trees": {**pair, "speculative_token_tree": "dynamic"},
             "shipped default, unmerged trees": {**default, "speculative_token_tree": "dynamic",
                                                 "suffix_decoding_merge_score": 0.0},
             "shipped default, head top 4": {**default, "speculative_token_tree": "dynamic",
                                             "speculative_eagle_topk": 4}}
    if not args.setups:
        return every
    wanted = [w.strip() for w in args.setups.split(",") if w.strip()]
    return {name: spec for name, spec in every.items() if name == "target alone" or any(w in name for w in wanted)}


def run_streams(stub, prompts: list[str], streams: int, max_tokens: int) -> tuple[float, list[dict]]:
    """Every prompt, ``streams`` at a time: (tokens/s over the whole run, each prompt's result in order)."""
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda p: generate(stub, p, max_tokens), prompts))
    return sum(len(r["token_ids"]) for r in results) / (time.perf_counter() - started), results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT, help="the shipped default's draft model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=15, help="num_speculative_tokens of the suffix rows (a tree's node budget)")
    ap.add_argument("--factor", type=float, default=4.0, help="their suffix_decoding_max_spec_factor")
    ap.add_argument("--model-k", type=int, default=3, help="num_speculative_tokens of the draft-model rows (a tree's depth)")
    ap.add_argument("--ngram-k", type=int, default=8, help="num_speculative_tokens of the n-gram rows (a tree's node "
                    "budget)")
    ap.add_argument("--eagle3-head", default=DEFAULT_EAGLE3_HEAD, help="the shipped default's EAGLE-3 head")
    ap.add_argument("--stream-setups", default="suffix k,shipped default with trees,suffix + draft model trees",
                    help="comma-separated parts of the row names the concurrency phase runs")
    ap.add_argument("--setups", default="", help="comma-separated parts of row names to run (the target alone always "
                    "runs; default: every row)")
    ap.add_argument("--agent-requests", type=int, default=40)
    ap.add_argument("--chat-prompts", type=int, default=16)
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams of the concurrency phase (0: skip)")
    ap.add_argument("--max-tokens", type=int, default=64, help="per request (answers also end at EOS)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of each served stack (0: all cores)")
    ap.add_argument("--in-process", action="store_true", help="all stacks in this process (default with --smoke)")
    add_common_args(ap)
    add_strict_arg(ap)
    args = ap.parse_args()
    out_path = json_path(args, "trees")
    cpu = cpu_info()
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)
        models = smoke_models(tmp.name)
        args.target, args.draft = models.target, models.draft
        from bench_eagle3 import _smoke_head
        args.eagle3_head = _smoke_head(args.target, Path(tmp.name) / "head")
        args.agent_requests, args.chat_prompts, args.max_tokens, args.threads, args.streams = 4, 1, 8, 1, 2
        args.k, args.in_process = 8, True
    fmt = chat_formatter(args.target, True)
    messages = {"agent": agent_requests(args.agent_requests),
                "open chat": load_prompts(CHAT_FILE, args.chat_prompts)["open-ended"]}
    prompts, workloads = [], {}
    for name, msgs in messages.items():
        workloads[name] = list(range(len(prompts), len(prompts) + len(msgs)))
        prompts += [fmt(m) for m in msgs]
    specs = setups(args)
    labels = list(specs)
    concurrency: dict[str, float] = {}
    with contextlib.ExitStack() as es:
        stubs = start_stacks(es, specs, args, fmt, len(prompts))
        measure_start = time.perf_counter()
        runs = measure_rotating(stubs, prompts, args.max_tokens)
        if args.streams:
            batch = [fmt(m) for m in agent_requests(2 * args.streams, seed=2)]
            wanted = [w.strip() for w in args.stream_setups.split(",") if w.strip()]
            streamed = [label for label in labels[1:] if any(w in label for w in wanted)]
            for label in streamed + streamed:  # twice each, alternating
                tps, _ = run_streams(stubs[label], batch, args.streams, args.max_tokens)
                concurrency[label] = max(concurrency.get(label, 0.0), tps)
        measured_s = time.perf_counter() - measure_start
    cpu["load_average_end"] = list(os.getloadavg())
    rows = aggregate(labels, runs, workloads)
    by = {(r["setup"], r["workload"]): r for r in rows}
    print(f"\n{args.target}, greedy, {args.dtype}, served (gRPC, one stream), up to {args.max_tokens} tokens (or EOS); "
          f"{', '.join(f'{n} {len(idx)}' for n, idx in workloads.items())} requests; speedup = vs the target alone")
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags']) or 'no avx2/avx512/amx'}; load "
          f"average {cpu['load_average_start'][0]:.1f} -> {cpu['load_average_end'][0]:.1f}; measured {measured_s:.0f} s\n")
    print_table(rows, COLUMNS)
    for label, tps in concurrency.items():
        print(f"{args.streams} streams, {label}: {tps:.1f} tokens/s (the better of two runs)")
    chain, tree = (labels + [None, None])[1:3]  # (a --setups subset may hold one row: then no goals are read)
    goals = {} if args.setups else {  # the goals read the whole set of rows
        f"{tree}: agent >= 2.5x the target alone ({by[(tree, 'agent')]['speedup']:.2f}x)":
            by[(tree, "agent")]["speedup"] >= 2.5,
        f"shipped default with trees: open chat tokens/pass >= 1.3x the chains' "
        f"({(by[(labels[4], 'open chat')]['tokens/pass'] or 0):.2f} vs {(by[(labels[3], 'open chat')]['tokens/pass'] or 0):.2f})":
            (by[(labels[4], "open chat")]["tokens/pass"] or 0) >= 1.3 * (by[(labels[3], "open chat")]["tokens/pass"] or 0),
        f"shipped default with trees: open chat faster end to end than with chains "
        f"({by[(labels[4], 'open chat')]['tokens/s']:.1f} vs {by[(labels[3], 'open chat')]['tokens/s']:.1f} tokens/s)":
            by[(labels[4], "open chat")]["tokens/s"] > by[(labels[3], "open chat")]["tokens/s"],
        f"{labels[6]}: open chat tokens/pass >= 1.3x the chains' ({(by[(labels[6], 'open chat')]['tokens/pass'] or 0):.2f} "
        f"vs {(by[(labels[5], 'open chat')]['tokens/pass'] or 0):.2f})":
            (by[(labels[6], "open chat")]["tokens/pass"] or 0) >= 1.3 * (by[(labels[5], "open chat")]["tokens/pass"] or 0),
    }
    if not args.setups and chain in concurrency and tree in concurrency:
        goals[f"{args.streams} streams: trees no slower than chains ({concurrency[tree]:.1f} vs "
              f"{concurrency[chain]:.1f} tokens/s)"] = concurrency[tree] >= 0.97 * concurrency[chain]
    checks = {f"{label}: every output identical to the target alone's": all(
        by[(label, w)]["identical"] for w in workloads) for label in labels[1:]}
    write_json(out_path, {"smoke": args.smoke, "target": args.target, "draft": args.draft, "dtype": args.dtype,
                          "max_tokens": args.max_tokens, "cpu": cpu, "setups": specs, "rows": rows, "goals": goals,
                          "checks": checks, "concurrency_tokens_per_s": concurrency, "streams": args.streams,
                          "measured_seconds": measured_s, "messages": messages,
                          "measurements": [{"setup": label, "request": i, **{k: v for k, v in r.items() if k != "token_ids"},
                                            "tokens": len(r["token_ids"])} for (label, i), r in runs.items()]})
    if tmp is not None:
        tmp.cleanup()
    return report_checks(checks, goals, args.strict)


if __name__ == "__main__":
    sys.exit(main())

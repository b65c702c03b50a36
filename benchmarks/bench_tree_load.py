"""Token trees under load: one pass's trees cut to the rows one tree has alone (``--tree-tile-rows``,
``specdec.trees.fit_trees``) against trees never cut, served.

A CPU target's batch-invariant pass costs by 16-row tiles (``bench_verify_rows.py``: 1-16 rows cost about one
row, 17 about 1.5x). A draft model's tree at its defaults is 15 nodes (SGLang's ``speculative_num_draft_tokens``):
one tree and its history row fill a tile, two sequences' trees fill two. Cut to the tile, each of two trees keeps
its 7 likeliest nodes. Side by side in one run, greedy, open-ended chat (``specdec/assets/prompts/chat.json``),
each setup a ``specdec serve`` stack in a process of its own:

  * the target alone;
  * the draft model at k = ``--model-k`` (3) as chains;
  * the same with trees (what the embedded default pair drafts without ArcticInference), cut to the pass's tiles
    (the default, ``--tree-tile-rows 0``: 16 on a CPU);
  * the same trees, never cut (``--tree-tile-rows -1``).

(The shipped default, the suffix hybrid, is left out: its model rounds are depth-1 trees of 4 nodes, which two
sequences fit in one tile, so nothing of them is cut; and a repeated prompt is copied from its suffix trees, which
would make the repeats measure the cache.)

For each of ``--streams`` (1 and 2: the default pair stops drafting at 3, its ``disable_by_batch_size``), every
prompt runs in that many concurrent streams, ``--repeats`` times per setup, alternating; the better run counts.
Per setup and stream count: tokens/s, speed-up over the target alone, tokens per target pass, identical output.

    python benchmarks/bench_tree_load.py
    python benchmarks/bench_tree_load.py --smoke   # tiny random-weight models, seconds: checks the script runs
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_drafting import chat_formatter, load_prompts  # noqa: E402
from bench_suffix import start_stacks  # noqa: E402
from bench_trees import run_streams  # noqa: E402
from common import (add_common_args, add_strict_arg, cpu_info, json_path, print_table, report_checks,  # noqa: E402
                    smoke_environment, smoke_models, write_json)

from specdec.config import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHAT_FILE = ROOT / "specdec" / "assets" / "prompts" / "chat.json"
COLUMNS = ["setup", "streams", "tokens/s", "speedup", "tokens/pass", "identical"]
CUT, WHOLE = "draft model trees, cut to the tile", "draft model trees, never cut"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model-k", type=int, default=3, help="the draft-model rows' depth")
    ap.add_argument("--streams", default="1,2", help="comma-separated stream counts")
    ap.add_argument("--chat-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs per setup and stream count (the best counts)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of each served stack (0: all cores)")
    ap.add_argument("--in-process", action="store_true", help="all stacks in this process (default with --smoke)")
    add_common_args(ap)
    add_strict_arg(ap)
    args = ap.parse_args()
    out_path = json_path(args, "tree_load")
    cpu = cpu_info()
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)
        models = smoke_models(tmp.name)
        args.target, args.draft = models.target, models.draft
        args.chat_prompts, args.max_tokens, args.threads, args.repeats, args.in_process = 2, 8, 1, 1, True
    fmt = chat_formatter(args.target, True)
    prompts = [fmt(m) for m in load_prompts(CHAT_FILE, args.chat_prompts)["open-ended"]]
    chains = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.model_k}
    trees = {**chains, "speculative_token_tree": "dynamic"}
    specs = {"target alone": None, "draft model chains": chains, CUT: trees, WHOLE: trees}
    counts = [int(s) for s in args.streams.split(",") if s.strip()]
    best: dict[tuple[str, int], float] = {}
    outputs: dict[tuple[str, int], list[dict]] = {}
    with contextlib.ExitStack() as es:
        stubs = start_stacks(es, specs, args, fmt, len(prompts), serve_options={
            CUT: {"tree_tile_rows": 0}, WHOLE: {"tree_tile_rows": -1}})
        measure_start = time.perf_counter()
        for streams in counts:
            for rep in range(args.repeats):
                order = list(specs) if rep % 2 == 0 else list(specs)[::-1]
                for label in order:
                    tps, results = run_streams(stubs[label], prompts, streams, args.max_tokens)
                    if tps > best.get((label, streams), 0.0):
                        best[(label, streams)], outputs[(label, streams)] = tps, results
                print(f"{streams} streams, run {rep + 1}: " + ", ".join(
                    f"{label} {best[(label, streams)]:.1f}" for label in specs), file=sys.stderr)
        measured_s = time.perf_counter() - measure_start
    cpu["load_average_end"] = list(os.getloadavg())
    rows = []
    for streams in counts:
        alone = outputs[("target alone", streams)]
        for label in specs:
            res = outputs[(label, streams)]
            passes = sum(r["passes"] for r in res)
            rows.append({"setup": label, "streams": streams, "tokens/s": round(best[(label, streams)], 1),
                         "speedup": round(best[(label, streams)] / best[("target alone", streams)], 2),
                         "tokens/pass": round(sum(len(r["token_ids"]) for r in res) / passes, 2) if passes else None,
                         "identical": all(r["token_ids"] == a["token_ids"] for r, a in zip(res, alone))})
    by = {(r["setup"], r["streams"]): r for r in rows}
    print(f"\n{args.target}, greedy, {args.dtype}, served (gRPC), open-ended chat, {len(prompts)} prompts, up to "
          f"{args.max_tokens} tokens (or EOS); the best of {args.repeats} runs; speedup = vs the target alone")
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags']) or 'no avx2/avx512/amx'}; load "
          f"average {cpu['load_average_start'][0]:.1f} -> {cpu['load_average_end'][0]:.1f}; measured {measured_s:.0f} s\n")
    print_table(rows, COLUMNS)
    checks = {f"{label}, {s} streams: every output identical to the target alone's": by[(label, s)]["identical"]
              for label in list(specs)[1:] for s in counts}
    goals = {f"{s} streams: trees cut to the tile no slower than never cut ({by[(CUT, s)]['tokens/s']:.1f} vs "
             f"{by[(WHOLE, s)]['tokens/s']:.1f} tokens/s)": by[(CUT, s)]["tokens/s"] >= 0.97 * by[(WHOLE, s)]["tokens/s"]
             for s in counts}
    write_json(out_path, {"smoke": args.smoke, "target": args.target, "draft": args.draft, "dtype": args.dtype,
                          "max_tokens": args.max_tokens, "cpu": cpu, "setups": specs, "rows": rows, "goals": goals,
                          "checks": checks, "measured_seconds": measured_s})
    if tmp is not None:
        tmp.cleanup()
    return report_checks(checks, goals, args.strict)


if __name__ == "__main__":
    sys.exit(main())

"""EAGLE-3 across services against the target alone and the embedded default pair, through the served stack.

Side by side in one run, the same target (default: the embedded ``smollm2-135m``) at its default dtype, each kind of
drafting one ``specdec serve`` stack in a process of its own:

  * the target alone;
  * the embedded default pair (``specdec.config.default_speculative_config()``: suffix decoding before the head,
    with ``--head``);
  * EAGLE-3 (``{"method": "eagle3", "model": HEAD}``; default: the shipped ``smollm2-135m-eagle3``) at each
    ``--ks`` (the request's ``num_speculative_tokens``);
  * the head's token trees (``"speculative_token_tree": "dynamic"``: its top 4 per expanded candidate, 15 nodes)
    at each ``--tree-ks`` depth, a stack of their own;
  * with ``--head-quantization`` (default), the first tree depth again with the head unquantized (``"quantization":
    "none"``; the default is int8, a draft's default);
  * suffix decoding before the head (``"enable_suffix_decoding": true``, ``--hybrid-k`` the head's tree depth; 0: no
    such row), with the default pair's suffix settings (up to 15 drafts, factor 4, trees, disable_by_batch_size), a
    row for each ``--hybrid-min-scores`` (``suffix_decoding_min_score``: a weaker suffix match leaves the round to the
    head).
  * with ``--compare-head HEAD2``: the default pair and the head's trees (the first ``--tree-ks`` depth) again with
    the other head, so that two heads (a retrained one against the shipped one) are measured side by side.

Prompts: ``specdec/assets/prompts/chat.json`` (16 open-ended chat requests, 8 input-grounded; none is among the
prompts the head was trained on), through the target's chat template, answers to EOS or ``--max-tokens``.
Sets: open-ended, input-grounded, mixed (every other of each). Greedy rows: every prompt, every row back to back
in a rotating order, ``--repeats`` passes; a row's time on a prompt is its fastest repeat. Reported per row and
set: tokens/s, speed-up over the target alone, acceptance, tokens per target pass, identical output. Sampled rows
(``--temperatures``, seeded): the target alone, EAGLE-3 at ``--sampled-k`` and the default pair, acceptance and
tokens/s, the text equal to the target alone's (the coupled rule of seeded requests).

Wire: the features a round moves (the target's Verify response, the draft's Propose request: rows x width bf16)
per round, and their cost, measured on a target service started here after the rows: the same Verify (a 200-token
context, k drafts) with and without ``feature_layers``, alternated, median of ``--wire-reps``; their share of an EAGLE-3
round's time (the open-ended rows' mean round).

    python benchmarks/bench_eagle3.py --max-tokens 96 --repeats 2
    python benchmarks/bench_eagle3.py --head /path/to/head --ks 2 3 4 5
    python benchmarks/bench_eagle3.py --smoke   # tiny random models and a random head, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_drafting import (InProcessStack, Setup, aggregate, chat_formatter, first_mismatch, generate,  # noqa: E402
                            load_prompts)
from bench_serving import ServedStack  # noqa: E402
from common import add_common_args, cpu_info, json_path, print_table, smoke_environment, smoke_models, write_json  # noqa: E402

from specdec.config import DEFAULT_TARGET, default_speculative_config  # noqa: E402
from specdec.model_files import resolve_model_path  # noqa: E402
from specdec.v1 import common_pb2, generation_service_pb2_grpc  # noqa: E402

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "specdec" / "assets" / "prompts" / "chat.json"
DEFAULT_HEAD = "smollm2-135m-eagle3"
COLUMNS = ["setup", "set", "tokens/s", "speedup", "speedup range", "decode speedup", "acceptance", "tokens/pass",
           "identical"]


def wire_cost(target: str, dtype: str, layers: list[int], k: int, reps: int) -> dict:
    """Verify with and without features on a target service started here (nothing else runs now), the two
    alternated rep by rep (a drifting machine then moves both alike)."""
    from specdec.v1 import target_service_pb2, target_service_pb2_grpc
    from target_service.config import TargetServiceConfig
    from target_service.server import create_server

    handle = create_server(TargetServiceConfig(model=target, dtype=dtype, host="127.0.0.1", port=0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            stub = target_service_pb2_grpc.TargetServiceStub(channel)
            context = [(7 * i) % 5000 + 100 for i in range(200)]
            kinds = (("without", []), ("with", layers))
            times: dict[str, list[float]] = {name: [] for name, _ in kinds}
            sizes: dict[str, int] = {}
            for r in range(reps + 3):
                for name, asked in (kinds if r % 2 else kinds[::-1]):
                    sid = f"wire-{name}-{r}"
                    stub.Verify(target_service_pb2.VerifyRequest(sequence_id=sid, new_token_ids=context,
                                                                 feature_layers=asked), timeout=60)
                    began = time.perf_counter()
                    resp = stub.Verify(target_service_pb2.VerifyRequest(
                        sequence_id=sid, start_position=len(context), new_token_ids=[11],
                        draft_token_ids=[12] * k, feature_layers=asked, feature_start=len(context)), timeout=60)
                    if r >= 3:
                        times[name].append(time.perf_counter() - began)
                    sizes[name] = resp.ByteSize()
                    stub.ReleaseSequence(common_pb2.ReleaseSequenceRequest(sequence_id=sid), timeout=10)
            out = {name: {"verify_ms_median": 1000 * statistics.median(times[name]), "response_bytes": sizes[name]}
                   for name, _ in kinds}
            out["features_ms"] = out["with"]["verify_ms_median"] - out["without"]["verify_ms_median"]
            return out
    finally:
        handle.stop(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--head", default=DEFAULT_HEAD, help=f"the EAGLE-3 head (default: the shipped {DEFAULT_HEAD})")
    ap.add_argument("--dtype", default="auto", help="both sides' dtype (default auto: each service's default)")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--tree-ks", type=int, nargs="*", default=[3], help="depths of the head's token-tree rows "
                    "(speculative_token_tree dynamic, SGLang's defaults: top 4, 15 nodes); none: no tree rows")
    ap.add_argument("--hybrid-k", type=int, default=3, help="the suffix/EAGLE-3 hybrid row's head depth (0: no row)")
    ap.add_argument("--hybrid-min-scores", type=float, nargs="+", default=[0.0, 1.0],
                    help="a hybrid row for each suffix_decoding_min_score (a weaker suffix match leaves the round to "
                         "the head)")
    ap.add_argument("--head-quantization", action=argparse.BooleanOptionalAction, default=True,
                    help="a row of the head's trees unquantized (\"quantization\": \"none\") beside the default "
                         "int8 head (the first --tree-ks depth)")
    ap.add_argument("--compare-head", default=None, metavar="HEAD2",
                    help="rows of the default pair and of the head's trees with this head too, beside --head's")
    ap.add_argument("--sampled-k", type=int, default=3)
    ap.add_argument("--temperatures", type=float, nargs="*", default=[0.7, 1.0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", default=str(PROMPTS_FILE))
    ap.add_argument("--prompts-per-set", type=int, default=None)
    ap.add_argument("--wire-reps", type=int, default=30)
    ap.add_argument("--in-process", action="store_true", help="the stacks in this process (default with --smoke)")
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "eagle3")
    cpu = cpu_info()
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)
        args.target = smoke_models(tmp.name).target
        args.head = _smoke_head(args.target, Path(tmp.name) / "head")
        args.max_tokens, args.repeats, args.prompts_per_set, args.wire_reps = 8, 1, 2, 2
        args.temperatures, args.in_process, args.dtype = [0.7], True, "float32"
    specs = {"target": None, "default": {**default_speculative_config(), "model": args.head},  # the head: --head's
             "eagle3": {"method": "eagle3", "model": args.head, "num_speculative_tokens": max(args.ks + [args.sampled_k])}}
    if args.tree_ks:
        specs["eagle3 trees"] = {**specs["eagle3"], "num_speculative_tokens": max(args.tree_ks),
                                 "speculative_token_tree": "dynamic"}
    if args.hybrid_k:
        pair = specs["default"] or {}
        for score in args.hybrid_min_scores:
            specs[f"eagle3 hybrid {score:g}"] = {
                **specs["eagle3"], "enable_suffix_decoding": True,
                "num_speculative_tokens": pair.get("num_speculative_tokens", 15),
                "draft_model_num_speculative_tokens": args.hybrid_k, "speculative_token_tree": "dynamic",
                "suffix_decoding_min_score": score,
                **{key: pair[key] for key in ("suffix_decoding_max_spec_factor", "disable_by_batch_size") if key in pair}}
    setups = [Setup("target alone", "target", None, "target"),
              Setup("default pair (suffix hybrid)", "default", None, "default")]
    setups += [Setup(f"eagle3 k={k}", "eagle3", k, "eagle3") for k in args.ks]
    setups += [Setup(f"eagle3 trees, depth {k}", "eagle3 trees", k, "eagle3") for k in args.tree_ks]
    if args.head_quantization and args.tree_ks:
        specs["eagle3 trees fp"] = {**specs["eagle3 trees"], "quantization": "none"}
        setups.append(Setup(f"eagle3 trees, depth {args.tree_ks[0]}, unquantized head", "eagle3 trees fp",
                            args.tree_ks[0], "eagle3"))
    if args.hybrid_k:
        setups += [Setup(f"suffix + eagle3 trees, depth {args.hybrid_k}" + (f", min score {score:g}" if score else ""),
                         f"eagle3 hybrid {score:g}", None, "eagle3") for score in args.hybrid_min_scores]
    if args.compare_head:
        other = Path(args.compare_head).name
        specs["default 2"] = {**specs["default"], "model": args.compare_head}
        setups.append(Setup(f"default pair, head {other}", "default 2", None, "default, other head"))
        if args.tree_ks:
            specs["eagle3 trees 2"] = {**specs["eagle3 trees"], "model": args.compare_head}
            setups.append(Setup(f"eagle3 trees, depth {args.tree_ks[0]}, head {other}", "eagle3 trees 2",
                                args.tree_ks[0], "eagle3, other head"))  # (not a row of --head's goals)
    sets_prompts = load_prompts(Path(args.prompts), args.prompts_per_set)
    fmt = chat_formatter(args.target, True)
    messages = sets_prompts["open-ended"] + sets_prompts["input-grounded"]
    prompts = [fmt(m) for m in messages]
    n_open = len(sets_prompts["open-ended"])
    sets = {"open-ended": list(range(n_open)), "input-grounded": list(range(n_open, len(prompts)))}
    sets["mixed"] = sets["open-ended"][::2] + sets["input-grounded"][::2]
    runs, sampled = {}, {}
    with contextlib.ExitStack() as es:
        stubs = {}
        for name, spec in specs.items():
            cfg = dict(model=args.target, speculative_config=json.dumps(spec) if spec else None, host="127.0.0.1",
                       grpc_port=0, port=-1, dtype=args.dtype)
            stack = es.enter_context(InProcessStack(cfg) if args.in_process else ServedStack(cfg))
            stubs[name] = stack
        for name, stack in list(stubs.items()):
            channel = es.enter_context(grpc.insecure_channel(f"127.0.0.1:{stack.ports()[0]}"))
            stubs[name] = generation_service_pb2_grpc.GenerationServiceStub(channel)
        info = stubs["eagle3"].GetInfo(common_pb2.GetInfoRequest(), timeout=30)
        for s in setups:  # warm-up
            generate(stubs[s.stack], prompts[0], s.k, 8, False)
        began = time.perf_counter()
        for r in range(args.repeats):
            for i, prompt in enumerate(prompts):
                shift = (r * len(prompts) + i) % len(setups)
                for s in setups[shift:] + setups[:shift]:
                    runs[(s.label, i, r)] = generate(stubs[s.stack], prompt, s.k, args.max_tokens, False)
            print(f"repeat {r + 1}/{args.repeats} at {time.perf_counter() - began:.0f} s", file=sys.stderr)
        for t in args.temperatures:  # sampled: open-ended prompts, seeded, one pass
            for i in sets["open-ended"]:
                for label, stack, k in (("target alone", "target", None), (f"eagle3 k={args.sampled_k}", "eagle3",
                                                                            args.sampled_k), ("default pair", "default", None)):
                    sampled[(t, label, i)] = generate(stubs[stack], prompts[i], k, args.max_tokens, False, t,
                                                       seed=1000 + i)
        measured = time.perf_counter() - began
    rows = aggregate(setups, sets, runs, args.repeats)
    sampled_rows = []
    for t in args.temperatures:
        idx = sets["open-ended"]
        base = sum(len(sampled[(t, "target alone", i)]["token_ids"]) for i in idx) / sum(
            sampled[(t, "target alone", i)]["seconds"] for i in idx)
        for label in (f"eagle3 k={args.sampled_k}", "default pair"):
            res = [sampled[(t, label, i)] for i in idx]
            tps = sum(len(x["token_ids"]) for x in res) / sum(x["seconds"] for x in res)
            drafted = sum(x["drafted"] for x in res)
            sampled_rows.append({"temperature": t, "setup": label, "tokens/s": tps, "speedup": tps / base,
                                 "acceptance": sum(x["accepted"] for x in res) / drafted if drafted else None,
                                 "tokens/pass": sum(len(x["token_ids"]) for x in res) / sum(x["passes"] for x in res),
                                 "identical": all(sampled[(t, label, i)]["token_ids"] == sampled[(t, "target alone", i)][
                                     "token_ids"] for i in idx)})
    target_cfg = json.loads((Path(resolve_model_path(args.target)[0]) / "config.json").read_text())
    hidden = (target_cfg.get("text_config") or target_cfg)["hidden_size"]
    layers = list(info.draft.feature_layers)
    width = len(layers) * hidden
    wire = wire_cost(args.target, args.dtype, layers, max(args.ks), args.wire_reps)
    k_best = max((s for s in setups if s.kind == "eagle3"), key=lambda s: next(
        r["speedup"] for r in rows if r["setup"] == s.label and r["set"] == "open-ended"))
    ek = [runs[(k_best.label, i, 0)] for i in sets["open-ended"]]
    rounds = sum(x["passes"] for x in ek)
    fed = sum(x["prompt_tokens"] + len(x["token_ids"]) - 1 for x in ek)
    round_ms = 1000 * sum(x["seconds"] for x in ek) / rounds
    wire.update({"width": width, "layers": layers, "bytes_per_round": 2 * width * fed / rounds,
                 "bytes_per_round_decode": 2 * width * (sum(len(x["token_ids"]) for x in ek) - len(ek)) / rounds,
                 "round_ms": round_ms, "share_of_round": wire["features_ms"] / round_ms})
    by = {(r["setup"], r["set"]): r for r in rows}
    # the goals, for the default pair (its drafter since 2026-12-06) and the head's best row alone
    default = "default pair (suffix hybrid)"
    goals = {}
    for label, suffix in ((default, ", default pair"), (k_best.label, ", the head alone")):
        goals[f"open_ended_2x{suffix}"] = {"setup": label, "value": by[(label, "open-ended")]["speedup"], "goal": 2.0}
        goals[f"open_ended_2.5_tokens_per_pass{suffix}"] = {"setup": label, "goal": 2.5,
                                                           "value": by[(label, "open-ended")]["tokens/pass"]}
    goals["mixed_default_not_worse_than_the_head_alone"] = {
        "setup": default, "goal": 1.0, "value": by[(default, "mixed")]["tokens/s"] / by[(k_best.label, "mixed")]["tokens/s"]}
    for g in goals.values():
        g["met"] = g["value"] >= g["goal"]
    mismatches = first_mismatch(runs, setups, sets, args.repeats)
    print(f"\n{args.target} with {args.head} (features of layers {layers}), {args.dtype}, served, greedy, "
          f"{len(prompts)} prompts, up to {args.max_tokens} tokens, best of {args.repeats}; measured {measured:.0f} s")
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags'])}\n")
    print_table(rows, COLUMNS)
    print()
    print_table(sampled_rows, ["temperature", "setup", "tokens/s", "speedup", "acceptance", "tokens/pass", "identical"])
    print(f"\nwire ({k_best.label}, open-ended): {wire['bytes_per_round']:.0f} bytes of features per round "
          f"({wire['bytes_per_round_decode']:.0f} after the prompt's), Verify {wire['without']['verify_ms_median']:.2f} ms "
          f"without / {wire['with']['verify_ms_median']:.2f} ms with features (+{wire['features_ms']:.2f} ms), "
          f"{100 * wire['share_of_round']:.1f}% of a {round_ms:.1f} ms round")
    for name, g in goals.items():
        print(f"goal {name}: {g['setup']}: {g['value']:.2f} (goal >= {g['goal']}) -> {'MET' if g['met'] else 'NOT MET'}")
    print("every greedy output is identical to the target alone's" if not mismatches
          else f"OUTPUT DIFFERS in {len(mismatches)} request(s): {mismatches[0]}")
    write_json(out_path, {"smoke": args.smoke, "target": args.target, "head": args.head, "dtype": args.dtype,
                          "cpu": cpu, "stacks": specs, "max_tokens": args.max_tokens, "repeats": args.repeats,
                          "rows": rows, "sampled": sampled_rows, "wire": wire, "goals": goals,
                          "mismatches": mismatches, "measured_seconds": measured,
                          "prompts": {"open-ended": sets_prompts["open-ended"],
                                      "input-grounded": sets_prompts["input-grounded"]}})
    if tmp is not None:
        tmp.cleanup()
    return 0


def _smoke_head(target: str, out: Path) -> str:
    """A random-weight head for the smoke target, in the published layout."""
    from specdec.engine.eagle3 import Eagle3Config, Eagle3Head
    from specdec.engine.eagle3_files import save_head

    cfg = json.loads((Path(target) / "config.json").read_text())
    head = Eagle3Head(Eagle3Config(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                                   num_attention_heads=cfg["num_attention_heads"],
                                   num_key_value_heads=cfg["num_key_value_heads"], vocab_size=cfg["vocab_size"],
                                   draft_vocab_size=cfg["vocab_size"]))
    save_head(head, out, with_embedding=False)
    return str(out)


if __name__ == "__main__":
    sys.exit(main())

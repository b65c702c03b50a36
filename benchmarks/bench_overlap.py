"""Overlapped drafting in the real disaggregated layout: does drafting during verification pay?

The services run as separate processes, each pinned to its own core with one thread (``taskset``,
``--num-threads 1``): the target on ``--target-cpu``, the draft on ``--draft-cpu``, the gateways beside
the draft (their work is light and the draft's core idles while the target verifies). Rows, side by
side in one run (setups alternate prompt by prompt, their order rotating, over ``--repeats`` passes):

  * target alone (a gateway without a draft: the same gRPC path, one token per pass);
  * per speculative config: sequential speculation (``--no-overlap``) and overlapped (``--overlap``),
    two gateways on the same target and draft services.

Greedy, one stream, prose + code + input-grounded prompts, ``ignore_eos``. Every output must equal the
target alone's. From the gateways' /metrics: acceptance, mean Propose / Verify call times as the
gateway sees them, and the share of lookaheads won. The analytical bounds:

  * speculation over the target alone: tokens per round x (one target pass) / (Propose + Verify);
  * overlap over sequential: a round's time falls by the Propose it skips when its bet wins:
    t_round / (t_round - won x Propose), with t_round measured in the sequential run, and with every
    bet won (the PEARL limit, when drafting is entirely hidden): t_round / (t_round - Propose).

Each measured ratio is reported as a fraction of its bound.

    python benchmarks/bench_overlap.py                          # suffix/draft-model pair + model draft k=3
    python benchmarks/bench_overlap.py --max-tokens 96 --repeats 3
    python benchmarks/bench_overlap.py --target gemma-3-270m --speculative-config \
        '{"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 1, "use_heterogeneous_vocab": true}'
                                                                # a draft half the target's cost (TLI)
    python benchmarks/bench_overlap.py --smoke                  # tiny random-weight pair, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (PROMPTS, SMOKE_PROMPTS, add_common_args, cpu_info, json_path, print_table,  # noqa: E402
                    smoke_environment, smoke_models, write_json)

from specdec.config import DEFAULT_DRAFT, DEFAULT_TARGET, draft_model_pair_config  # noqa: E402
from specdec.v1 import common_pb2, generation_service_pb2 as pb, generation_service_pb2_grpc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DRAFTING_PROMPTS = ROOT / "specdec/assets/prompts/drafting.json"
COLUMNS = ["setup", "tokens/s", "x target alone", "x sequential", "identical", "acceptance", "tokens/round",
           "propose ms", "verify ms", "lookaheads won", "bound", "of bound"]
DRAFT_FLAGS = {"model": "--model", "method": "--method", "prompt_lookup_max": "--prompt-lookup-max",
               "prompt_lookup_min": "--prompt-lookup-min", "draft_sample_method": "--draft-sample-method"}


def prompts_by_kind(smoke: bool) -> dict[str, list[str]]:
    if smoke:
        return {"prose": SMOKE_PROMPTS[:1], "code": SMOKE_PROMPTS[1:]}
    grounded = json.loads(DRAFTING_PROMPTS.read_text())["input_grounded"]
    code = [p for p in PROMPTS if "def " in p or "import " in p or "{" in p] or PROMPTS[2:3]
    prose = [p for p in PROMPTS if p not in code]
    return {"prose": prose[:3], "code": code[:3], "input-grounded": grounded[:3]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A service in a child process, pinned to ``cpu`` with taskset (where the machine has it)."""

    def __init__(self, module: str, args: list[str], cpu: str | None, log: Path):
        pin = ["taskset", "-c", cpu] if cpu is not None and shutil.which("taskset") else []
        self.log = log
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(log, "w") as out:
            self.proc = subprocess.Popen([*pin, sys.executable, "-m", module, *args], stdout=out,
                                         stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.log.name} exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Gateway:
    def __init__(self, name: str, proc: Process, port: int, metrics_port: int):
        self.name, self.proc, self.port, self.metrics_port = name, proc, port, metrics_port
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = generation_service_pb2_grpc.GenerationServiceStub(self.channel)

    def wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while True:
            self.proc.check()
            try:
                grpc.channel_ready_future(self.channel).result(timeout=2)
                return
            except grpc.FutureTimeoutError:
                if time.monotonic() > end:
                    raise RuntimeError(f"gateway {self.name} not ready after {timeout} s") from None

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = s.name + "".join(f"|{v}" for k, v in sorted(s.labels.items()) if k in ("phase", "outcome"))
                out[key] = out.get(key, 0.0) + s.value
        return out


def generate(stub, prompt: str, max_tokens: int) -> tuple[list[int], float]:
    req = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                             sampling_params=common_pb2.SamplingParams(temperature=0))
    start = time.perf_counter()
    ids: list[int] = []
    for resp in stub.Generate(req, timeout=1800):
        ids.extend(resp.token_ids)
    return ids, time.perf_counter() - start


def draft_args(spec: dict) -> list[str]:
    args = []
    for key, flag in DRAFT_FLAGS.items():
        if spec.get(key) is not None:
            args += [flag, str(spec[key])]
    return args


def summarise(name: str, tokens: int, seconds: float, before: dict, after: dict) -> dict:
    d = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    drafts, draft_tokens = d.get("specdec_spec_decode_num_drafts_total", 0), d.get(
        "specdec_spec_decode_num_draft_tokens_total", 0)
    accepted = d.get("specdec_spec_decode_num_accepted_tokens_total", 0)
    calls = {ph: (d.get(f"specdec_backend_call_duration_seconds_sum|{ph}", 0.0),
                  d.get(f"specdec_backend_call_duration_seconds_count|{ph}", 0.0)) for ph in ("propose", "verify")}
    won, lost = (d.get(f"specdec_spec_decode_lookaheads_total|{o}", 0) for o in ("used", "dropped"))
    rounds = calls["verify"][1]
    return {"setup": name, "tokens": tokens, "seconds": seconds, "tokens/s": tokens / seconds,
            "acceptance": accepted / draft_tokens if draft_tokens else None,
            "tokens/round": tokens / rounds if rounds else None, "rounds": rounds, "drafting rounds": drafts,
            "propose ms": 1000 * calls["propose"][0] / calls["propose"][1] if calls["propose"][1] else None,
            "propose calls": calls["propose"][1],
            "verify ms": 1000 * calls["verify"][0] / calls["verify"][1] if calls["verify"][1] else None,
            "lookaheads won": won / (won + lost) if won + lost else None, "lookaheads": won + lost}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--speculative-config", action="append", default=None,
                    help="JSON, repeatable (default: the suffix/draft-model pair (an EAGLE head cannot overlap), "
                    "and its draft model alone at k=3)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--target-cpu", default="0")
    ap.add_argument("--draft-cpu", default="1")
    ap.add_argument("--gateway-cpu", default=None, help="where the gateways run (default: the draft's core)")
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "overlap")
    tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-overlap-")
    target = args.target
    specs = [json.loads(s) for s in args.speculative_config] if args.speculative_config else [
        draft_model_pair_config(), {"method": "draft_model", "model": DEFAULT_DRAFT, "num_speculative_tokens": 3}]
    if args.smoke:
        smoke_environment(tmp.name)
        models = smoke_models(tmp.name)
        target = str(models.target)
        specs = [{"method": "draft_model", "model": str(models.draft), "num_speculative_tokens": 2}]
        args.max_tokens, args.repeats = 12, 1
    prompts = prompts_by_kind(args.smoke)
    gateway_cpu = args.gateway_cpu or args.draft_cpu
    cpu = cpu_info()
    logs = Path(tmp.name)
    common = ["--dtype", args.dtype, "--num-threads", "1", "--host", "127.0.0.1"]
    processes: list[Process] = []
    gateways: list[Gateway] = []
    labels: list[tuple[str, dict | None, bool]] = []  # (setup, spec, overlap)

    def start_gateway(name: str, target_port: int, draft_port: int | None, extra: list[str]) -> None:
        port, metrics_port = free_port(), free_port()
        proc = Process("gateway", ["--target-addr", f"127.0.0.1:{target_port}", "--draft-addr",
                                   f"127.0.0.1:{draft_port}" if draft_port else "none", "--host", "127.0.0.1",
                                   "--port", str(port), "--metrics-port", str(metrics_port), *extra],
                       gateway_cpu, logs / f"gateway-{len(gateways)}.log")
        processes.append(proc)
        gateways.append(Gateway(name, proc, port, metrics_port))

    try:
        target_port = free_port()
        processes.append(Process("target_service", ["--model", target, "--port", str(target_port), *common],
                                 args.target_cpu, logs / "target.log"))
        start_gateway("target alone", target_port, None, [])
        labels.append(("target alone", None, False))
        for i, spec in enumerate(specs):
            draft_port = free_port()
            tli = ["--target-tokenizer", target] if spec.get("use_heterogeneous_vocab") else []
            processes.append(Process("draft_service", ["--port", str(draft_port), *common, *draft_args(spec), *tli],
                                     args.draft_cpu, logs / f"draft-{i}.log"))
            k = ["--num-speculative-tokens", str(spec.get("num_speculative_tokens", 1))]
            if spec.get("use_heterogeneous_vocab"):  # TLI: the draft maps its proposals to the target's ids
                k.append("--use-heterogeneous-vocab")
            short = spec_label(spec)
            for overlap in (False, True):
                name = f"{short}, {'overlapped' if overlap else 'sequential'}"
                start_gateway(name, target_port, draft_port, [*k, "--overlap" if overlap else "--no-overlap"])
                labels.append((name, spec, overlap))
        for gw in gateways:
            gw.wait_ready(900)
        flat = [(kind, p) for kind, ps in prompts.items() for p in ps]
        for gw in gateways:  # warm-up: first passes, allocator, the draft's first calls
            generate(gw.stub, flat[0][1], 8)
        reference: dict[str, list[int]] = {}
        totals = {gw.name: [0, 0.0] for gw in gateways}
        identical = {gw.name: True for gw in gateways}
        before = {gw.name: gw.metrics() for gw in gateways}
        for r in range(args.repeats):
            for j, (kind, prompt) in enumerate(flat):
                shift = r * len(flat) + j
                for gw in [gateways[0]] + rotate(gateways[1:], shift):  # the reference first
                    ids, seconds = generate(gw.stub, prompt, args.max_tokens)
                    if gw.name == "target alone":
                        reference[prompt] = ids
                    totals[gw.name][0] += len(ids)
                    totals[gw.name][1] += seconds
                    if gw.name != "target alone" and reference.get(prompt) not in (None, ids):
                        identical[gw.name] = False
                print(f"repeat {r + 1}, {kind} prompt {j + 1}/{len(flat)} done", flush=True)
        rows = [summarise(gw.name, *totals[gw.name], before[gw.name], gw.metrics()) for gw in gateways]
    finally:
        for gw in gateways:
            gw.channel.close()
        for proc in processes:
            proc.stop()

    base = rows[0]
    base["x target alone"] = 1.0
    target_pass_ms = 1000 * base["seconds"] / base["tokens"]  # a round of the target alone: one token
    for row in rows:
        row["identical"] = identical[row["setup"]]
    for i in range(1, len(rows), 2):
        seq, ovl = rows[i], rows[i + 1]
        for row in (seq, ovl):
            row["x target alone"] = row["tokens/s"] / base["tokens/s"]
        # speculation's bound: each round's tokens for one Propose + one Verify, against one target pass a token
        seq["bound"] = (seq["tokens/round"] * target_pass_ms / (seq["propose ms"] + seq["verify ms"])
                        if seq["propose ms"] and seq["verify ms"] else None)
        seq["of bound"] = seq["x target alone"] / seq["bound"] if seq["bound"] else None
        ovl["x sequential"] = ovl["tokens/s"] / seq["tokens/s"]
        t_round = 1000 * seq["seconds"] / seq["rounds"] if seq["rounds"] else None
        # the Propose calls a sequential round makes, per round (hybrid: lookup rounds cost ~nothing)
        propose_per_round = (seq["propose ms"] or 0.0) * seq["propose calls"] / seq["rounds"] if seq["rounds"] else 0.0
        won = ovl["lookaheads won"] or 0.0
        ovl["bound"] = t_round / (t_round - won * propose_per_round) if t_round else None
        ovl["bound if every bet won"] = t_round / (t_round - propose_per_round) if t_round else None
        ovl["of bound"] = ovl["x sequential"] / ovl["bound"] if ovl["bound"] else None
        seq["round ms"] = t_round
    print(f"\ntarget {target} ({args.dtype}) on cpu {args.target_cpu}, drafts on cpu {args.draft_cpu}, one thread "
          f"each; greedy, {args.max_tokens} tokens, {sum(map(len, prompts.values()))} prompts "
          f"({', '.join(prompts)}), {args.repeats} repeats; CPU {cpu['model']} flags {' '.join(cpu['flags'])}\n")
    print_table(rows, COLUMNS)
    for i in range(2, len(rows), 2):
        print(f"{rows[i]['setup']}: {rows[i]['x sequential']:.3f}x sequential; bound {rows[i]['bound']:.3f}x "
              f"(lookaheads won {100 * (rows[i]['lookaheads won'] or 0):.0f}%), "
              f"{rows[i]['bound if every bet won']:.3f}x if every bet won")
    # the table's columns as rows; the counts and times behind them per setup
    details = {r["setup"]: {key: v for key, v in r.items() if key not in COLUMNS} for r in rows}
    rows = [{key: r.get(key) for key in COLUMNS} for r in rows]
    write_json(out_path, {"smoke": args.smoke, "details": details, "target": target, "speculative_configs": specs, "dtype": args.dtype,
                          "max_tokens": args.max_tokens, "repeats": args.repeats, "prompts": prompts, "cpu": cpu,
                          "pinning": {"target": args.target_cpu, "draft": args.draft_cpu, "gateways": gateway_cpu},
                          "rows": rows, "goal_overlap_over_sequential_ge_1_3": {
                              r["setup"]: r["x sequential"] >= 1.3 for r in rows[2::2]}})
    ok = all(r["identical"] for r in rows)
    if not ok:
        print("OUTPUTS DIFFER from the target alone", file=sys.stderr)
    tmp.cleanup()
    return 0 if ok else 1


def rotate(items: list, shift: int) -> list:
    shift %= max(1, len(items))
    return items[shift:] + items[:shift]


def spec_label(spec: dict) -> str:
    k = spec.get("num_speculative_tokens", 1)
    if spec.get("method") == "ngram":
        return f"n-gram k={k}"
    kind = "hybrid" if spec.get("prompt_lookup_max") else "model draft"
    return f"{kind}{' (TLI)' if spec.get('use_heterogeneous_vocab') else ''} k={k}"


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())

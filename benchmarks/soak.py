"""Soak: N concurrent clients for M minutes against the stack run as three processes, the draft killed
(SIGKILL) and restarted mid-run.

The target service, the draft service and the gateway (gRPC + OpenAI HTTP) each run as a process of
their own, started with ``specdec target-service`` / ``draft-service`` / ``gateway`` (new sessions, as
containers would be), each logging to a file. The clients mix four kinds of request, each client
cycling through all of them, over both protocols:

  * greedy:             HTTP ``/v1/completions``, temperature 0 (or a gRPC ``Generate`` stream, greedy);
                        every greedy answer is compared with the first answer to the same request
  * sampled:            HTTP ``/v1/chat/completions``, temperature 0.8, top_p 0.95, a seed
  * streamed:           HTTP SSE ``/v1/completions`` (sampled) or a gRPC ``Generate`` stream (greedy)
  * cancelled half-way: an HTTP SSE chat stream or a gRPC stream the client closes once half of its
                        ``max_tokens`` have arrived

After a warm-up with the same load, the measured run starts; at ``--kill-draft-at`` of it the draft
process is SIGKILLed, and ``--draft-down-seconds`` later started again on the same port. With the
gateway's draft fallback on (the default) rounds verify without drafts meanwhile, so no request should
fail: every error is unexpected. With ``--no-draft-fallback``, rounds wait for the draft instead (the
gateway retries an unavailable backend up to its ``--backend-timeout-seconds``), so requests in flight
during the outage stall, and may fail with UNAVAILABLE / 503 past that; those errors count as expected.

Reported: requests by outcome (completed, cancelled by the client, errors by kind and status, expected or
not), p50/p99 latency (end to end; time to first token for streams), tokens/s, the rounds the gateway ran
without a draft (``specdec_rounds_without_draft_total`` from its ``/metrics``), and each process's RSS after
the warm-up and at the end. Checks, printed PASS/FAIL, a FAIL exits 1: zero unexpected errors, greedy answers
identical on every repeat, drafting again after the draft's restart, nothing left running at the end. The goal
RSS growth under 5% after the warm-up prints PASS/MISS, informational unless ``--strict``.

    python benchmarks/soak.py --clients 4 --minutes 3 --kill-draft-at 0.4 --draft-down-seconds 10
    python benchmarks/soak.py --smoke   # tiny random-weight pair, ~1 minute with start-up: checks the script runs

The processes and clients it drives live in ``served.py`` (``bench_metrics.py`` and ``bench_kv_serving.py`` use them too).
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (PROMPTS, SMOKE_PROMPTS, add_common_args, add_strict_arg, json_path, print_table,  # noqa: E402
                    report_checks, smoke_environment, smoke_models, write_json)

from served import (HOST, ProcessStack, RequestError, Result, cpu_info, grpc_stream, http_request,  # noqa: E402
                    http_stream, metric, scrape)

from specdec.config import DEFAULT_TARGET, default_draft_path, default_speculative_config  # noqa: E402
from specdec.v1 import common_pb2, generation_service_pb2 as pb, generation_service_pb2_grpc  # noqa: E402

KINDS = ["greedy", "sampled", "streamed", "cancelled half-way"]
COLUMNS = ["kind", "requests", "completed", "cancelled", "errors", "e2e p50 s", "e2e p99 s", "TTFT p50 s",
           "TTFT p99 s", "tokens/s"]
RSS_GROWTH_GOAL_PCT = 5.0
# Errors a run expects, by kind, and when: with the draft fallback on (the default) a draft outage costs
# no request, so nothing is expected. Without it, requests in flight while the draft is down may fail.
EXPECTED_WITHOUT_FALLBACK = {"gRPC UNAVAILABLE", "HTTP 503", "HTTP stream error (backend_unavailable)"}
OUTAGE_SLACK_S = 15.0  # an error this long after the draft serves again still counts as "during the outage"


# --------------------------------------------------------------------------------------------------
# the stack as three processes


@dataclass
class Load:
    """What the clients send."""

    http_port: int
    grpc_port: int
    model_id: str
    prompts: list[str]
    max_tokens: list[int]
    timeout: float
    count_tokens: object  # text -> number of tokens (the target's tokenizer)
    seed: int


def one_request(load: Load, stub, kind: str, variant: int, rng: random.Random) -> Result:
    prompt = rng.choice(load.prompts)
    max_tokens = rng.choice(load.max_tokens)
    half = max(1, max_tokens // 2)
    seed = rng.randrange(2**31)
    common = {"model": load.model_id, "max_tokens": max_tokens, "ignore_eos": True}
    chat = {**common, "messages": [{"role": "user", "content": prompt}]}
    greedy_grpc = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                                      sampling_params=common_pb2.SamplingParams(temperature=0))
    res = Result(kind, "", time.monotonic())
    try:
        if kind == "greedy" and variant == 0:
            res.protocol, res.greedy_key = "HTTP completion", (prompt, max_tokens)
            http_request(load.http_port, "/v1/completions", {**common, "prompt": prompt, "temperature": 0},
                         load.timeout, res)
        elif kind == "greedy":
            res.protocol, res.greedy_key = "gRPC stream", (prompt, max_tokens)
            grpc_stream(stub, greedy_grpc, load.timeout, res)
        elif kind == "sampled":
            res.protocol = "HTTP chat"
            http_request(load.http_port, "/v1/chat/completions",
                         {**chat, "temperature": 0.8, "top_p": 0.95, "seed": seed}, load.timeout, res)
        elif kind == "streamed" and variant == 0:
            res.protocol = "HTTP SSE completion"
            http_stream(load.http_port, "/v1/completions",
                        {**common, "prompt": prompt, "temperature": 0.7, "seed": seed, "stream": True,
                         "stream_options": {"include_usage": True}}, load.timeout, res, count_tokens=load.count_tokens)
        elif kind == "streamed":
            res.protocol, res.greedy_key = "gRPC stream", (prompt, max_tokens)
            grpc_stream(stub, greedy_grpc, load.timeout, res)
        elif variant == 0:  # cancelled half-way
            res.protocol = "HTTP SSE chat"
            http_stream(load.http_port, "/v1/chat/completions", {**chat, "temperature": 0.7, "seed": seed, "stream": True},
                        load.timeout, res, cancel_at=half, count_tokens=load.count_tokens)
        else:
            res.protocol = "gRPC stream"
            req = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                                     sampling_params=common_pb2.SamplingParams(temperature=0.7, seed=seed))
            grpc_stream(stub, req, load.timeout, res, cancel_at=half)
    except RequestError as exc:
        res.outcome, res.error, res.detail = "error", exc.kind, exc.detail
        res.e2e = time.monotonic() - res.began
    except Exception as exc:  # noqa: BLE001 - a client-side surprise is an outcome too, reported
        res.outcome, res.error, res.detail = "error", f"client exception {type(exc).__name__}", str(exc)[:300]
        res.e2e = time.monotonic() - res.began
    return res


def run_clients(load: Load, clients: int, seconds: float, phase: str, min_requests: int = 0) -> tuple[list[Result], float]:
    """``clients`` threads send requests back to back for ``seconds``, and each at least ``min_requests``
    (requests in flight then finish); each client cycles through every kind and variant. The results and
    the wall time to the last one."""
    results: list[Result] = []
    lock = threading.Lock()
    began = time.monotonic()
    stop_at = began + seconds

    def client(i: int) -> None:
        rng = random.Random(f"{load.seed}-{phase}-{i}")
        with grpc.insecure_channel(f"{HOST}:{load.grpc_port}") as channel:
            stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
            n = first = rng.randrange(2 * len(KINDS))
            while time.monotonic() < stop_at or n - first < min_requests:
                kind, variant = KINDS[(i + n) % len(KINDS)], (n // len(KINDS)) % 2
                res = one_request(load, stub, kind, variant, rng)
                with lock:
                    results.append(res)
                n += 1

    threads = [threading.Thread(target=client, args=(i,), name=f"client-{i}", daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.monotonic() - began


# --------------------------------------------------------------------------------------------------
# the draft outage, RSS sampling


@dataclass
class Outage:
    kill_at_s: float
    down_s: float
    killed_at: float | None = None  # seconds into the measured run
    restarted_at: float | None = None  # the new process launched
    serving_at: float | None = None  # its health said SERVING
    drafting_again_at: float | None = None  # the gateway's breaker closed and rounds drafted again
    killed_pid: int | None = None
    exit_code: int | None = None
    error: str | None = None
    drafts_at_serving: float = 0.0  # the gateway's drafted rounds when the restarted draft served
    drafting_again_after_run: bool = False  # seen only by probe requests after the measured run

    def window(self) -> tuple[float, float] | None:
        if self.killed_at is None:
            return None
        end = self.drafting_again_at or self.serving_at
        return self.killed_at, (end + OUTAGE_SLACK_S) if end is not None else float("inf")


def draft_outage(stack: ProcessStack, outage: Outage, t0: float, stop: threading.Event) -> None:
    try:
        if stop.wait(max(0.0, t0 + outage.kill_at_s - time.monotonic())):
            return
        outage.killed_pid = stack.draft.pid
        outage.killed_at = time.monotonic() - t0
        outage.exit_code = stack.draft.kill(signal.SIGKILL)
        print(f"[{outage.killed_at:7.1f} s] draft (pid {outage.killed_pid}) SIGKILLed, exit code {outage.exit_code}",
              flush=True)
        stop.wait(max(0.0, t0 + outage.killed_at + outage.down_s - time.monotonic()))
        stack.draft.launch()
        outage.restarted_at = time.monotonic() - t0
        print(f"[{outage.restarted_at:7.1f} s] draft restarted (pid {stack.draft.pid})", flush=True)
        stack.draft.wait_ready(600)
        outage.serving_at = time.monotonic() - t0
        print(f"[{outage.serving_at:7.1f} s] draft serving again", flush=True)
        outage.drafts_at_serving = metric(scrape(stack.gateway.http_port), "specdec_spec_decode_num_drafts_total")
        while not stop.is_set() and not drafting_again(stack, outage, t0):
            stop.wait(0.5)
    except BaseException as exc:  # noqa: BLE001 - reported, and the run goes on
        outage.error = f"{type(exc).__name__}: {exc}"[:2000]
        print(f"draft outage: {outage.error}", flush=True)


def drafting_again(stack: ProcessStack, outage: Outage, t0: float, note: str = "") -> bool:
    """Whether the gateway's breaker is closed and rounds drafted since the draft served again (noted)."""
    now = scrape(stack.gateway.http_port)
    if (metric(now, "specdec_draft_breaker_state") == 0
            and metric(now, "specdec_spec_decode_num_drafts_total") > outage.drafts_at_serving):
        outage.drafting_again_at = time.monotonic() - t0
        print(f"[{outage.drafting_again_at:7.1f} s] the gateway drafts again{note}", flush=True)
        return True
    return False


def probe_until_drafting(stack: ProcessStack, outage: Outage, t0: float, load: "Load", timeout: float = 60.0) -> None:
    """After a run that ended before speculation resumed: one greedy request at a time until it does."""
    outage.drafting_again_after_run = True
    give_up = time.monotonic() + timeout
    with grpc.insecure_channel(f"{HOST}:{load.grpc_port}") as channel:
        stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
        while time.monotonic() < give_up:
            req = pb.GenerateRequest(prompt=load.prompts[0], max_tokens=8, ignore_eos=True,
                                     sampling_params=common_pb2.SamplingParams(temperature=0))
            try:
                for _ in stub.Generate(req, timeout=60):
                    pass
            except grpc.RpcError as exc:
                print(f"probe request failed: {exc.code().name} {exc.details()}", flush=True)
            if drafting_again(stack, outage, t0, " (probe requests after the measured run)"):
                return
            time.sleep(0.5)


class RssSampler(threading.Thread):
    """Samples every process's RSS every ``interval`` seconds (a timeline for the JSON)."""

    def __init__(self, stack: ProcessStack, interval: float, t0: float):
        super().__init__(name="rss", daemon=True)
        self.stack, self.interval, self.t0 = stack, interval, t0
        self.samples: list[dict] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.samples.append({"t": round(time.monotonic() - self.t0, 2),
                                 **{p.name: _mb(p.rss()) for p in self.stack.procs}})
            self.halt.wait(self.interval)


def _mb(n: int | None) -> float | None:
    return None if n is None else round(n / 2**20, 2)


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no data)."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(-(-q * len(xs) // 100)) - 1))]


def log_problems(path: Path, limit: int = 5) -> dict:
    """ERROR / CRITICAL lines and tracebacks in a service's log (evidence for a report)."""
    if not path.exists():
        return {"errors": 0, "tracebacks": 0, "examples": []}
    lines = path.read_text(errors="replace").splitlines()
    bad = [ln for ln in lines if " ERROR " in ln or " CRITICAL " in ln or '"level": "ERROR"' in ln]
    tracebacks = sum(ln.startswith("Traceback") for ln in lines)
    return {"errors": len(bad), "tracebacks": tracebacks, "examples": bad[:limit]}


# --------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=None, help="default: the embedded default draft")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=None,
                    help="default: the default pair's k")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=3.0, help="the measured run (after the warm-up)")
    ap.add_argument("--warmup-seconds", type=float, default=30.0, help="the same load before RSS is first read")
    ap.add_argument("--warmup-requests", type=int, default=2 * len(KINDS),
                    help="... and at least this many requests per client (default: every kind over both protocols once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-draft-at", type=float, default=0.4, help="fraction of the measured run (negative: never)")
    ap.add_argument("--draft-down-seconds", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=48, help="each request asks for this or half of it")
    ap.add_argument("--timeout", type=float, default=180.0, help="a client's deadline per request")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft-dtype", default=None)
    ap.add_argument("--target-threads", type=int, default=1,
                    help="target service --num-threads (0: all cores). 1 by default: on a small machine the target's "
                         "OpenMP pool shares the cores with the draft, the gateway and the clients, and a pool whose "
                         "threads get descheduled stalls at every barrier (seen: 0.4 tok/s with 2 threads on 2 busy "
                         "cores, 11 tok/s with 1)")
    ap.add_argument("--draft-threads", type=int, default=1, help="draft service --num-threads")
    ap.add_argument("--no-draft-fallback", action="store_true",
                    help="start the gateway with --no-draft-fallback (requests in flight during the outage stall, "
                         "and may fail: expected)")
    ap.add_argument("--gateway-arg", action="append", default=[], help="extra gateway flag (repeatable), e.g. "
                    "--gateway-arg=--draft-breaker-reset-seconds=2")
    ap.add_argument("--log-dir", default=None, help="the services' logs (default: a temporary folder, kept)")
    add_strict_arg(ap)
    add_common_args(ap)
    args = ap.parse_args()
    out_path = json_path(args, "soak")
    prompts = PROMPTS
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)  # the service processes inherit its environment
        models = smoke_models(tmp.name)
        args.target, args.draft = models.target, models.draft
        args.num_speculative_tokens = 2
        args.clients, args.minutes, args.warmup_seconds, args.max_tokens = 3, 0.3, 4.0, 12
        args.kill_draft_at, args.draft_down_seconds, args.timeout = 0.15, 2.0, 120.0
        args.target_threads = args.draft_threads = 1
        args.gateway_arg = [*args.gateway_arg, "--draft-breaker-reset-seconds=1"]
        prompts = SMOKE_PROMPTS
    draft = args.draft or (str(default_draft_path()) if default_draft_path() else None)
    if draft is None:
        ap.error("no --draft given and no embedded default draft is shipped")
    k = args.num_speculative_tokens or (default_speculative_config() or {}).get("num_speculative_tokens", 1)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="specdec-soak-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    gateway_args = tuple(args.gateway_arg) + (("--no-draft-fallback",) if args.no_draft_fallback else ())
    duration = 60.0 * args.minutes
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(draft)  # same vocabulary as the target (a draft_model pair)

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    print(f"soak: target {args.target}, draft {draft}, k={k}, {args.clients} clients, {args.minutes:g} min "
          f"(+ warm-up: {args.warmup_seconds:g} s and {args.warmup_requests} requests per client), draft killed at "
          f"{args.kill_draft_at:g} for {args.draft_down_seconds:g} s; "
          f"logs in {log_dir}", flush=True)
    stack = ProcessStack(args.target, draft, k=k, log_dir=log_dir, dtype=args.dtype, draft_dtype=args.draft_dtype,
                         target_threads=args.target_threads, draft_threads=args.draft_threads,
                         max_batch_size=max(16, args.clients), gateway_args=gateway_args)
    t_start = time.monotonic()
    with stack:
        print(f"stack ready in {time.monotonic() - t_start:.1f} s (pids: target {stack.target.pid}, draft "
              f"{stack.draft.pid}, gateway {stack.gateway.pid})", flush=True)
        load = Load(stack.gateway.http_port, stack.gateway.port, stack.model_id(), prompts,
                    sorted({max(2, args.max_tokens // 2), args.max_tokens}), args.timeout, count_tokens, args.seed)
        sampler = RssSampler(stack, 1.0 if args.smoke else 5.0, t_start)
        sampler.start()
        warm, _ = run_clients(load, args.clients, args.warmup_seconds, "warmup", min_requests=args.warmup_requests)
        time.sleep(1.0)
        rss_start = {p.name: (p.pid, p.rss()) for p in stack.procs}
        before = scrape(stack.gateway.http_port)
        print(f"warm-up: {len(warm)} requests ({sum(r.outcome == 'error' for r in warm)} errors); RSS "
              + ", ".join(f"{n} {_mb(r)} MB" for n, (_, r) in rss_start.items()), flush=True)

        outage = Outage(args.kill_draft_at * duration, args.draft_down_seconds)
        stop = threading.Event()
        t0 = time.monotonic()
        killer = None
        if args.kill_draft_at >= 0:
            killer = threading.Thread(target=draft_outage, args=(stack, outage, t0, stop), name="outage", daemon=True)
            killer.start()
        results, wall = run_clients(load, args.clients, duration, "run")
        stop.set()
        if killer is not None:
            killer.join(600)
        if stack.draft.proc.poll() is not None:  # the outage thread failed: bring the draft back for the end state
            stack.draft.launch().wait_ready(600)
        if killer is not None and outage.serving_at is not None and outage.drafting_again_at is None:
            probe_until_drafting(stack, outage, t0, load)
        time.sleep(1.0)
        rss_end = {p.name: (p.pid, p.rss()) for p in stack.procs}
        after = scrape(stack.gateway.http_port)
        backend_end = {name: scrape(p.metrics_port) for name, p in (("target", stack.target), ("draft", stack.draft))}
        sampler.halt.set()
        sampler.join(10)
    problems = {p.name: log_problems(p.log_path) for p in stack.procs}

    # ---- requests
    window = outage.window()

    def in_outage(r: Result) -> bool:
        t = r.began - t0
        return window is not None and window[0] - (r.e2e or 0) <= t <= window[1]

    rows = []
    for kind in [*KINDS, "all"]:
        rs = [r for r in results if kind in ("all", r.kind)]
        done = [r for r in rs if r.outcome == "completed"]
        ttfts = [r.ttft for r in rs if r.ttft is not None and r.outcome != "error"]
        rows.append({"kind": kind, "requests": len(rs), "completed": len(done),
                     "cancelled": sum(r.outcome == "cancelled" for r in rs),
                     "errors": sum(r.outcome == "error" for r in rs),
                     "e2e p50 s": percentile([r.e2e for r in done], 50), "e2e p99 s": percentile([r.e2e for r in done], 99),
                     "TTFT p50 s": percentile(ttfts, 50), "TTFT p99 s": percentile(ttfts, 99),
                     "tokens/s": sum(r.tokens for r in rs if r.outcome != "error") / wall})

    errors = []
    by_kind: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        if r.outcome == "error":
            by_kind[r.error].append(r)
    for kind, rs in sorted(by_kind.items(), key=lambda kv: -len(kv[1])):
        during = [r for r in rs if in_outage(r)]
        expected = args.no_draft_fallback and kind in EXPECTED_WITHOUT_FALLBACK
        n_expected = len(during) if expected else 0
        errors.append({"kind": kind, "count": len(rs), "expected": n_expected, "unexpected": len(rs) - n_expected,
                       "during_outage": len(during), "protocols": dict(Counter(r.protocol for r in rs)),
                       "request_kinds": dict(Counter(r.kind for r in rs)),
                       "at_s": [round(r.began - t0, 1) for r in rs][:20], "example": rs[0].detail})
    unexpected = sum(e["unexpected"] for e in errors)

    # greedy answers: every repeat of a request identical to its first answer
    first: dict[tuple, str] = {}
    mismatches = []
    for r in sorted(warm + results, key=lambda r: r.began):
        if r.greedy_key is None or r.outcome != "completed":
            continue
        if r.greedy_key in first and first[r.greedy_key] != r.text:
            mismatches.append({"prompt": r.greedy_key[0][:40], "max_tokens": r.greedy_key[1], "protocol": r.protocol,
                               "at_s": round(r.began - t0, 1), "first": first[r.greedy_key][:80], "this": r.text[:80]})
        first.setdefault(r.greedy_key, r.text)
    greedy_checked = sum(1 for r in warm + results if r.greedy_key is not None and r.outcome == "completed")

    # ---- gateway metrics over the measured run
    without = {reason: after_v - metric(before, "specdec_rounds_without_draft_total", reason=reason)
               for reason, after_v in metric(after, "specdec_rounds_without_draft_total", by="reason").items()}
    with_drafts = metric(after, "specdec_spec_decode_num_drafts_total") - metric(before, "specdec_spec_decode_num_drafts_total")
    gw_errors = {code: v - metric(before, "specdec_request_errors_total", code=code)
                 for code, v in metric(after, "specdec_request_errors_total", by="code").items()}
    gw_errors = {c: v for c, v in gw_errors.items() if v}
    end_state = {"gateway_requests_running": metric(after, "specdec_num_requests_running"),
                 "gateway_requests_waiting": metric(after, "specdec_num_requests_waiting"),
                 "target_sequences_cached": metric(backend_end["target"], "specdec_sequences_cached"),
                 "draft_sequences_cached": metric(backend_end["draft"], "specdec_sequences_cached"),
                 "draft_breaker_state": metric(after, "specdec_draft_breaker_state")}

    # ---- processes
    processes = []
    for name in ("target", "draft", "gateway"):
        (pid0, r0), (pid1, r1) = rss_start[name], rss_end[name]
        restarted = pid0 != pid1
        growth = 100.0 * (r1 - r0) / r0 if r0 and r1 else None
        processes.append({"process": name, "pid": pid1 if not restarted else f"{pid0}->{pid1}",
                          "RSS start MB": _mb(r0), "RSS end MB": _mb(r1), "growth %": growth,
                          "note": "restarted mid-run: end is the new process" if restarted else "",
                          "restarted": restarted})
    lived = [p for p in processes if not p["restarted"] and p["growth %"] is not None]
    rss_ok = all(p["growth %"] < RSS_GROWTH_GOAL_PCT for p in lived)
    goals = {f"RSS growth under {RSS_GROWTH_GOAL_PCT:g}% after warm-up (processes that ran throughout)": rss_ok}
    checks = {
        "zero unexpected errors": unexpected == 0,
        "greedy answers identical on every repeat": not mismatches,
        "the gateway drafts again after the draft restart": args.kill_draft_at < 0 or outage.drafting_again_at is not None,
        "nothing left running at the gateway at the end": end_state["gateway_requests_running"] == 0
                                                          and end_state["gateway_requests_waiting"] == 0,
    }

    # ---- report
    cpu = cpu_info()
    print(f"\ntarget {args.target} ({args.dtype}), draft {draft}, k={k}; {args.clients} clients for {wall:.0f} s "
          f"(measured, after {args.warmup_seconds:g} s warm-up); CPU {cpu['model']}, {cpu['cores']} cores, "
          f"{' '.join(cpu['flags']) or 'no avx2/avx512/amx'}\n")
    print_table(rows, COLUMNS)
    print(f"\nerrors: {sum(e['count'] for e in errors)} ({unexpected} unexpected)"
          + ("" if args.no_draft_fallback else "; with the draft fallback on, none is expected"))
    for e in errors:
        tag = "UNEXPECTED" if e["unexpected"] else "expected"
        print(f"  {tag:10s} {e['kind']}: {e['count']} ({e['during_outage']} during the draft outage), "
              f"{e['protocols']}, began at {e['at_s']} s; e.g. {e['example']!r}")
    print(f"\ndraft outage: killed at {_s(outage.killed_at)}, restarted at {_s(outage.restarted_at)}, serving at "
          f"{_s(outage.serving_at)}, the gateway drafting again at {_s(outage.drafting_again_at)}"
          + (" (after the measured run, with probe requests)" if outage.drafting_again_after_run else "")
          + (f"; error: {outage.error}" if outage.error else ""))
    total_rounds = with_drafts + sum(without.values())
    print(f"rounds without draft: {sum(without.values()):.0f} of {total_rounds:.0f} "
          f"({', '.join(f'{k2} {v:.0f}' for k2, v in without.items()) or 'none'}); rounds with drafts {with_drafts:.0f}")
    print(f"gateway request errors (its /metrics, by code): {gw_errors or 'none'}; end state: {end_state}")
    print(f"greedy answers checked: {greedy_checked}, differing from the first answer: {len(mismatches)}")
    for m in mismatches[:3]:
        print(f"  {m}")
    print()
    print_table(processes, ["process", "pid", "RSS start MB", "RSS end MB", "growth %", "note"])
    for name, p in problems.items():
        if p["errors"] or p["tracebacks"]:
            print(f"{name} log: {p['errors']} ERROR lines, {p['tracebacks']} tracebacks; e.g. {p['examples'][:2]}")
    print()
    status = report_checks(checks, goals, args.strict)
    growths = ", ".join(f"{p['process']} {p['growth %']:+.1f}%" for p in processes if p["growth %"] is not None)
    print(f"  (RSS growth: {growths})")

    write_json(out_path, {
        "smoke": args.smoke, "cpu": cpu, "target": args.target, "draft": draft, "k": k, "dtype": args.dtype,
        "draft_dtype": args.draft_dtype or args.dtype, "clients": args.clients, "minutes": args.minutes,
        "seed": args.seed, "warmup_seconds": args.warmup_seconds, "warmup_requests_per_client": args.warmup_requests,
        "kill_draft_at": args.kill_draft_at,
        "draft_down_seconds": args.draft_down_seconds, "draft_fallback": not args.no_draft_fallback,
        "max_tokens": load.max_tokens, "measured_seconds": wall, "rows": rows, "errors": errors,
        "unexpected_errors": unexpected, "draft_outage": outage.__dict__,
        "rounds_without_draft": without, "rounds_with_drafts": with_drafts, "gateway_request_errors": gw_errors,
        "end_state": end_state, "greedy_checked": greedy_checked, "greedy_mismatches": mismatches,
        "processes": processes, "rss_timeline_mb": sampler.samples, "log_problems": problems,
        "log_dir": str(log_dir), "warmup_requests": len(warm), "checks": checks, "goals": goals})
    if args.smoke and not args.log_dir and status == 0:
        shutil.rmtree(log_dir, ignore_errors=True)
    if tmp is not None:
        tmp.cleanup()
    return status


def _s(t: float | None) -> str:
    return "-" if t is None else f"{t:.1f} s"


if __name__ == "__main__":
    sys.exit(main())

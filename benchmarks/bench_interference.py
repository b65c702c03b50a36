"""What one user's long prompt does to everyone else's stream, through ``specdec serve`` (a subprocess).

Greedy gRPC streams (temperature 0, ``ignore_eos``) on the embedded default pair unless told otherwise; prompts
are token slices of the repository's text, a different slice for every request (no prefix-cache help).

  interference  A stream decodes alone (its solo rate: tokens/s once it runs), then another stream (another prompt:
                suffix drafting would speed a repeat up) while a ``--long-prompt-tokens`` prompt arrives after
                ``--lead-seconds``. That stream's tokens/s over the prefill window (arrival -> the long prompt's first
                token) / its own rate before the arrival (goal >= 0.5; its text, hence its speed under suffix
                drafting, changes less between adjacent stretches than between prompts; the rate of a stream alone,
                another prompt, is shown too), and the long prompt's time to first token / its TTFT alone
                (goal <= 1.3). The stream's tokens must be the ones it makes alone (run again; exit 1 if not).
  mixed         ``--streams`` streams decode; then ``--arrivals`` requests with ``--mixed-prompt-tokens`` prompts
                arrive one every ``--arrival-interval`` seconds. The decoding streams' gaps between responses
                (inter-token latency as a client sees it): p99 with arrivals / median without (goal <= 3); the
                total tokens/s of the run.

    python benchmarks/bench_interference.py                          # both sections
    python benchmarks/bench_interference.py --sections interference
    python benchmarks/bench_interference.py --serve-args="--max-num-batched-tokens 512"   # an A/B of a flag
    python benchmarks/bench_interference.py --smoke                  # tiny random-weight pair, seconds
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_common_args, add_strict_arg, cpu_info, json_path, print_table, ratio,  # noqa: E402
                    report_checks, sections_of, served_pair, smoke_environment, smoke_models, write_json)
from served import HOST, ServiceProc, free_port  # noqa: E402

from specdec.v1 import common_pb2, generation_service_pb2 as pb, generation_service_pb2_grpc  # noqa: E402

SECTIONS = ("interference", "mixed")
SIZES = {  # flag: (default, under --smoke)
    "long_prompt_tokens": (3500, 200), "stream_prompt_tokens": (32, 16), "solo_seconds": (6.0, 2.0),
    "lead_seconds": (5.0, 1.0), "streams": (8, 2), "arrivals": (8, 2), "mixed_prompt_tokens": (4000, 200),
    "arrival_interval": (1.0, 0.3), "quiet_seconds": (8.0, 1.0), "stream_max_tokens": (4000, 280)}
TIMEOUT_S, STARTUP_S = 3600.0, 900.0
INTERFERENCE_COLUMNS = ["run", "stream tokens/s", "x before", "x solo", "median gap ms", "long TTFT s", "x solo TTFT"]
MIXED_COLUMNS = ["phase", "gaps", "median gap ms", "p90 gap ms", "p99 gap ms", "max gap ms", "p99 / quiet median",
                 "tokens/s"]


class Stream:
    """One greedy gRPC stream in a thread: each response's (arrival time, tokens); ``stop()`` cancels it."""

    def __init__(self, stub, prompt: list[int], max_tokens: int):
        self.req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                                      sampling_params=common_pb2.SamplingParams(temperature=0))
        self.stub, self.events, self.ids = stub, [], []
        self.began = self.first = self.end = None
        self.error: str | None = None
        self._call = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Stream":
        self.began = time.monotonic()
        self._call = self.stub.Generate(self.req, timeout=TIMEOUT_S)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for resp in self._call:
                if resp.token_ids:
                    now = time.monotonic()
                    self.first = self.first or now
                    self.events.append((now, len(resp.token_ids)))
                    self.ids += resp.token_ids
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = f"gRPC {exc.code().name}: {exc.details()}"
        self.end = time.monotonic()

    def stop(self) -> "Stream":
        if self._call is not None:
            self._call.cancel()
        self._thread.join(TIMEOUT_S)
        return self

    def wait(self) -> "Stream":
        self._thread.join(TIMEOUT_S)
        return self

    def rate(self, a: float, b: float) -> float:
        """Tokens/s that arrived in [a, b]."""
        return sum(n for t, n in self.events if a <= t <= b) / (b - a) if b > a else 0.0

    def gaps(self, a: float, b: float) -> list[float]:
        """Seconds between consecutive responses, for the responses that arrived in (a, b]."""
        times = [t for t, _ in self.events]
        return [t - s for s, t in zip(times, times[1:]) if a < t <= b]


def first_token_time(stub, prompt: list[int]) -> float:
    s = Stream(stub, prompt, 2).start().wait()
    if s.error or s.first is None:
        raise SystemExit(f"a long prompt failed: {s.error}")
    return s.first - s.began


def interference(a, stub, ids: list[int]) -> dict:
    n, m = a.long_prompt_tokens, a.stream_prompt_tokens
    long_solo, long_mixed = ids[:n], ids[n:2 * n]
    # two stream prompts: a second run of the same prompt would draft from the first one's output (suffix
    # decoding's cache holds every request's tokens) and run faster for it
    solo_prompt, stream_prompt = ids[2 * n:2 * n + m], ids[2 * n + m:2 * n + 2 * m]
    ttft_solo = first_token_time(stub, long_solo)
    print(f"interference: the long prompt alone: first token after {ttft_solo:.2f} s", flush=True)
    big = a.stream_max_tokens  # the stream is cancelled before it finishes (at full size)
    solo = Stream(stub, solo_prompt, big).start()
    time.sleep(max(a.solo_seconds, a.lead_seconds + ttft_solo))  # as long as the other run's stream, roughly
    solo.stop()
    if solo.error or solo.first is None:
        raise SystemExit(f"the stream failed: {solo.error}")
    solo_rate = solo.rate(solo.first + 0.5, solo.end)  # its own prefill and first rounds are not the decode rate
    solo_gap = statistics.median(solo.gaps(solo.first + 0.5, solo.end))
    print(f"interference: a stream alone: {solo_rate:.1f} tokens/s", flush=True)
    stream = Stream(stub, stream_prompt, big).start()
    time.sleep(a.lead_seconds)
    arrived = time.monotonic()
    long = Stream(stub, long_mixed, 2).start().wait()
    time.sleep(0.5)
    stream.stop()
    if long.error or long.first is None or stream.error:
        raise SystemExit(f"a request failed: {long.error or stream.error}")
    # the stream's tokens are the ones it makes alone (run again now: suffix drafting makes this run fast)
    again = Stream(stub, stream_prompt, len(stream.ids)).start().wait()
    ttft = long.first - long.began
    window_rate = stream.rate(arrived, long.first)
    before_rate = stream.rate(stream.first + 0.5, arrived)
    window_gaps = stream.gaps(arrived, long.first)
    rows = [{"run": "a stream alone", "stream tokens/s": solo_rate, "x solo": 1.0,
             "median gap ms": 1e3 * solo_gap},
            {"run": "the stream, before the arrival", "stream tokens/s": before_rate,
             "x solo": ratio(before_rate, solo_rate), "median gap ms": 1e3 * statistics.median(
                 stream.gaps(stream.first + 0.5, arrived))},
            {"run": "the long prompt alone", "long TTFT s": ttft_solo, "x solo TTFT": 1.0},
            {"run": "the stream + the long prompt (prefill window)", "stream tokens/s": window_rate,
             "x before": ratio(window_rate, before_rate), "x solo": ratio(window_rate, solo_rate), "long TTFT s": ttft, "x solo TTFT": ratio(ttft, ttft_solo),
             "median gap ms": 1e3 * statistics.median(window_gaps) if window_gaps else None}]
    return {"rows": rows, "solo_rate": solo_rate, "window_rate": window_rate, "window_s": long.first - arrived,
            "stream_kept": ratio(window_rate, before_rate), "stream_kept_vs_solo": ratio(window_rate, solo_rate), "ttft_solo_s": ttft_solo, "ttft_s": ttft,
            "ttft_ratio": ratio(ttft, ttft_solo), "longest_gap_in_window_s": max(window_gaps, default=None),
            "identical": again.ids == stream.ids and bool(stream.ids), "compared_tokens": len(stream.ids)}


def gap_row(phase: str, gaps: list[float], quiet_median: float | None, tokens_per_s: float) -> dict:
    q = statistics.quantiles(gaps, n=100, method="inclusive") if len(gaps) >= 2 else gaps * 99
    return {"phase": phase, "gaps": len(gaps), "median gap ms": 1e3 * statistics.median(gaps) if gaps else None,
            "p90 gap ms": 1e3 * q[89] if q else None, "p99 gap ms": 1e3 * q[98] if q else None,
            "max gap ms": 1e3 * max(gaps) if gaps else None,
            "p99 / quiet median": ratio(q[98], quiet_median) if q else None, "tokens/s": tokens_per_s}


def mixed(a, stub, ids: list[int]) -> dict:
    m, n = a.stream_prompt_tokens, a.mixed_prompt_tokens
    base = 2 * a.long_prompt_tokens + 2 * m  # after the interference section's slices
    prompts = [ids[base + i * m: base + (i + 1) * m] for i in range(a.streams)]
    longs = [ids[base + a.streams * m + i * n: base + a.streams * m + (i + 1) * n] for i in range(a.arrivals)]
    streams = [Stream(stub, p, a.stream_max_tokens).start() for p in prompts]
    while any(s.first is None and s.error is None for s in streams):
        time.sleep(0.05)
    quiet_from = time.monotonic() + 0.5
    time.sleep(0.5 + a.quiet_seconds)
    quiet_to = time.monotonic()
    arrivals = []
    for i, p in enumerate(longs):
        arrivals.append(Stream(stub, p, 16).start())
        time.sleep(a.arrival_interval)
    for r in arrivals:
        r.wait()
    busy_to = time.monotonic()
    for s in streams:
        s.stop()
    errors = [s.error for s in streams + arrivals if s.error]
    if errors:
        raise SystemExit(f"a request failed: {errors[0]}")
    quiet = [g for s in streams for g in s.gaps(quiet_from, quiet_to)]
    busy = [g for s in streams for g in s.gaps(quiet_to, busy_to)]
    quiet_median = statistics.median(quiet) if quiet else None
    every = streams + arrivals
    rate = lambda a_, b_: sum(s.rate(a_, b_) for s in every)  # noqa: E731
    rows = [gap_row("no arrivals", quiet, quiet_median, rate(quiet_from, quiet_to)),
            gap_row(f"{a.arrivals} long prompts arriving", busy, quiet_median, rate(quiet_to, busy_to))]
    return {"rows": rows, "p99_over_quiet_median": rows[1]["p99 / quiet median"],
            "ttfts_s": [r.first - r.began for r in arrivals], "busy_s": busy_to - quiet_to,
            "tokens_per_s_quiet": rows[0]["tokens/s"], "tokens_per_s_busy": rows[1]["tokens/s"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--target", default=None, help="target model (default: the embedded default pair's)")
    ap.add_argument("--speculative-config", default=None, help="JSON (default: the embedded default pair's)")
    ap.add_argument("--serve-args", default="", help="more flags for specdec serve (one string, shell-split)")
    for name, (default, _) in SIZES.items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=f"default {default}")
    add_common_args(ap)
    add_strict_arg(ap)
    a = ap.parse_args()
    sections = sections_of(ap, a.sections, SECTIONS)
    out_path = json_path(a, "interference")
    target, spec = served_pair(a)
    tmp = Path(tempfile.mkdtemp(prefix="specdec-bench-interference-"))
    extra = shlex.split(a.serve_args)
    if a.smoke:
        smoke_environment(tmp)  # the server inherits its environment
        tiny = smoke_models(tmp)
        target, spec = tiny.target, {"method": "draft_model", "model": tiny.draft, "num_speculative_tokens": 2}
        extra += ["--num-threads", "1"]
        for name, (_, small) in SIZES.items():
            setattr(a, name, small)
    from specdec.model_files import load_tokenizer
    from bench_kv_serving import corpus_ids

    tok = load_tokenizer(target)
    ids = corpus_ids(tok, 3 * a.long_prompt_tokens + 2 * a.stream_prompt_tokens + 64 + a.streams * a.stream_prompt_tokens
                     + a.arrivals * a.mixed_prompt_tokens + 64)
    log_dir = tmp / "logs"
    log_dir.mkdir()
    cpu = cpu_info()
    argv = ["serve", target, "--host", HOST, *(["--speculative-config", json.dumps(spec)] if spec else []), *extra]
    print(f"specdec {' '.join(argv[:2])} {' '.join(argv[4:])}, greedy; CPU {cpu['model']}, {cpu['cores']} cores, "
          f"flags {' '.join(cpu['flags'])}; logs in {log_dir}", flush=True)
    gp, hp = free_port(), free_port()
    proc = ServiceProc("serve", [*argv, "--port", str(hp), "--grpc-port", str(gp)], log_dir, gp, http_port=hp)
    results: dict[str, dict] = {}
    checks: dict[str, bool] = {}
    goals: dict[str, bool] = {}
    try:
        proc.launch().wait_ready(STARTUP_S)
        with grpc.insecure_channel(proc.address) as channel:
            stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
            first_token_time(stub, ids[-64:])  # warm-up: kernels, caches
            first_token_time(stub, ids[-a.long_prompt_tokens - 64:-64])  # a long one too
            if "interference" in sections:
                r = results["interference"] = interference(a, stub, ids)
                print(f"\ninterference: one stream, then a {a.long_prompt_tokens}-token prompt after "
                      f"{a.lead_seconds:.0f} s; prefill window {r['window_s']:.2f} s, longest gap in it "
                      f"{r['longest_gap_in_window_s'] or 0:.2f} s\n")
                print_table(r["rows"], INTERFERENCE_COLUMNS)
                checks["interference: the stream's tokens are the same alone and beside the long prompt"] = r["identical"]
                goals["interference: the stream keeps >= 1/2 of its solo tokens/s over the prefill window"] = (
                    (r["stream_kept"] or 0) >= 0.5)
                goals["interference: the long prompt's TTFT <= 1.3x its TTFT alone"] = (r["ttft_ratio"] or 9) <= 1.3
            if "mixed" in sections:
                r = results["mixed"] = mixed(a, stub, ids)
                print(f"\nmixed: {a.streams} streams decoding, then {a.arrivals} requests of {a.mixed_prompt_tokens} "
                      f"prompt tokens arriving one every {a.arrival_interval:g} s\n")
                print_table(r["rows"], MIXED_COLUMNS)
                print(f"\nthe arrivals' TTFT: {', '.join(f'{t:.2f}' for t in r['ttfts_s'])} s")
                goals["mixed: p99 gap with arrivals <= 3x the median gap without"] = (
                    (r["p99_over_quiet_median"] or 99) <= 3)
    finally:
        proc.stop()
    print()
    status = report_checks(checks, goals, a.strict)
    write_json(out_path, {"smoke": a.smoke, "cpu": cpu, "target": str(target), "speculative_config": spec,
                          "serve_args": extra, "args": vars(a), "sections": results, "checks": checks, "goals": goals})
    if status:
        print(f"the server's log: {log_dir}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

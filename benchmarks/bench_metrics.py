"""Metrics overhead: do the ``/metrics`` endpoints answer under concurrent generation without slowing it?

The stack runs as three processes (``specdec target-service`` / ``draft-service`` with ``--metrics-port``,
``specdec gateway`` with ``--http-port``; see ``soak.py``'s ``ProcessStack``). The same load, N concurrent
greedy streams each asking for ``--requests-per-stream`` completions of ``--max-tokens`` tokens, runs
alternately without (A) and with (B) a scraper that GETs every ``/metrics`` endpoint (the gateway's HTTP
port, the target's and the draft's metrics ports) every ``--interval-ms`` (100 ms), one thread per
endpoint, as Prometheus would with a very short scrape interval: A B A B ... (``--pairs``), after a
warm-up run. The gateway serves ``/metrics`` on the same event loop as the OpenAI streams, so the load
goes over HTTP SSE by default (``--protocol grpc`` for the gRPC API).

Reported: tokens/s of every run, each run against the mean of the runs without the scraper (so the
spread of the A runs shows the noise), the with/without ratio, and per endpoint the scrape latency
p50/p99/max, failures and the exposition's size (bytes, samples).

    python benchmarks/bench_metrics.py --streams 8 --max-tokens 64 --pairs 3
    python benchmarks/bench_metrics.py --smoke   # tiny random-weight pair: checks the script runs

Checks (every scrape answered 200, no generation request failed) print PASS/FAIL, and a FAIL exits 1; the
speed goal prints PASS/MISS, informational unless ``--strict``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (PROMPTS, SMOKE_PROMPTS, add_common_args, add_strict_arg, json_path, print_table,  # noqa: E402
                    report_checks, smoke_environment, smoke_models, write_json)
from served import HOST, ProcessStack, RequestError, Result, cpu_info, get, grpc_stream, http_stream  # noqa: E402
from soak import percentile  # noqa: E402

from specdec.config import DEFAULT_TARGET, default_draft_path, default_speculative_config  # noqa: E402
from specdec.v1 import common_pb2, generation_service_pb2 as pb, generation_service_pb2_grpc  # noqa: E402

COLUMNS = ["run", "tokens/s", "vs mean without", "scrapes", "scrape p50 ms", "scrape p99 ms"]
ENDPOINT_COLUMNS = ["endpoint", "scrapes", "failed", "p50 ms", "p99 ms", "max ms", "bytes", "samples"]
NOISE_FLOOR = 0.03  # a slow-down smaller than this (or than the A runs' own spread) is not measurable here


class Scraper:
    """One thread per endpoint, each GETting its ``/metrics`` every ``interval`` seconds (a tick missed
    while a scrape runs is skipped, as Prometheus does)."""

    def __init__(self, endpoints: dict[str, int], interval: float):
        self.endpoints = endpoints
        self.interval = interval
        self.latencies: dict[str, list[float]] = {name: [] for name in endpoints}
        self.failures: dict[str, list[str]] = {name: [] for name in endpoints}
        self.sizes: dict[str, int] = {}
        self._halt = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> "Scraper":
        self._halt.clear()
        self._threads = [threading.Thread(target=self._loop, args=(n, p), name=f"scrape-{n}", daemon=True)
                         for n, p in self.endpoints.items()]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> bool:
        self._halt.set()
        for t in self._threads:
            t.join(30)
        return False

    def _loop(self, name: str, port: int) -> None:
        start = time.monotonic()
        tick = 0
        while not self._halt.is_set():
            t = time.perf_counter()
            try:
                status, body = get(port, "/metrics", timeout=10)
                if status == 200:
                    self.latencies[name].append(time.perf_counter() - t)
                    self.sizes[name] = len(body)
                else:
                    self.failures[name].append(f"HTTP {status}")
            except OSError as exc:
                self.failures[name].append(f"{type(exc).__name__}: {exc}")
            now = time.monotonic()
            tick = max(tick + 1, int((now - start) / self.interval) + 1)
            self._halt.wait(max(0.0, start + tick * self.interval - now))

    def count(self) -> int:
        return sum(map(len, self.latencies.values()))


def run_load(http_port: int, grpc_port: int, model_id: str, prompts: list[str], streams: int, requests: int,
             max_tokens: int, protocol: str, timeout: float, count_tokens) -> tuple[int, float, list[str]]:
    """``streams`` concurrent greedy streams, each ``requests`` completions in turn: (tokens, seconds, errors)."""
    tokens = [0] * streams
    errors: list[str] = []

    def stream(i: int) -> None:
        with grpc.insecure_channel(f"{HOST}:{grpc_port}") as channel:
            stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
            for j in range(requests):
                prompt = prompts[(i + j) % len(prompts)]
                res = Result("streamed", protocol, time.monotonic())
                try:
                    if protocol == "http":
                        http_stream(http_port, "/v1/completions",
                                    {"model": model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                     "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}},
                                    timeout, res, count_tokens=count_tokens)
                    else:
                        grpc_stream(stub, pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                                                             sampling_params=common_pb2.SamplingParams(temperature=0)),
                                    timeout, res)
                    tokens[i] += res.tokens
                except RequestError as exc:
                    errors.append(f"{exc.kind}: {exc.detail}")

    threads = [threading.Thread(target=stream, args=(i,), name=f"stream-{i}", daemon=True) for i in range(streams)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens), time.perf_counter() - began, errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=None, help="default: the embedded default draft")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=None, help="default: the default pair's k")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=3, help="A (no scraper) B (scraper) pairs, alternating")
    ap.add_argument("--interval-ms", type=float, default=100.0, help="scrape interval per endpoint")
    ap.add_argument("--protocol", choices=["http", "grpc"], default="http", help="how the load reaches the gateway")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--draft-dtype", default=None)
    ap.add_argument("--target-threads", type=int, default=1,
                    help="target service --num-threads (0: all cores). 1 by default: on a small machine the target's "
                         "OpenMP pool shares the cores with the draft, the gateway and the clients, and a pool whose "
                         "threads get descheduled stalls at every barrier (seen: 0.4 tok/s with 2 threads on 2 busy "
                         "cores, 11 tok/s with 1)")
    ap.add_argument("--draft-threads", type=int, default=1, help="draft service --num-threads")
    ap.add_argument("--timeout", type=float, default=600.0, help="a stream's deadline")
    add_common_args(ap)
    add_strict_arg(ap)
    args = ap.parse_args()
    out_path = json_path(args, "metrics")
    prompts = PROMPTS
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="specdec-bench-smoke-")
        smoke_environment(tmp.name)  # the service processes inherit its environment
        models = smoke_models(tmp.name)
        args.target, args.draft = models.target, models.draft
        args.num_speculative_tokens, args.streams, args.requests_per_stream, args.max_tokens = 2, 2, 2, 32
        args.pairs, args.target_threads, args.draft_threads, args.timeout = 1, 1, 1, 120.0
        prompts = SMOKE_PROMPTS
    draft = args.draft or (str(default_draft_path()) if default_draft_path() else None)
    if draft is None:
        ap.error("no --draft given and no embedded default draft is shipped")
    k = args.num_speculative_tokens or (default_speculative_config() or {}).get("num_speculative_tokens", 1)
    from prometheus_client.parser import text_string_to_metric_families
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(draft)  # only if a stream reports no usage

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    log_dir = Path(tmp.name if tmp else tempfile.mkdtemp(prefix="specdec-bench-metrics-logs-")) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = ProcessStack(args.target, draft, k=k, log_dir=log_dir, dtype=args.dtype, draft_dtype=args.draft_dtype,
                         target_threads=args.target_threads, draft_threads=args.draft_threads,
                         max_batch_size=max(16, args.streams))
    runs: list[dict] = []
    with stack:
        endpoints = {name: port for name, (port, _) in stack.metrics_urls().items()}
        model_id = stack.model_id()

        def load(requests: int = args.requests_per_stream) -> tuple[int, float, list[str]]:
            return run_load(stack.gateway.http_port, stack.gateway.port, model_id, prompts, args.streams, requests,
                            args.max_tokens, args.protocol, args.timeout, count_tokens)

        load(1)  # warm-up: every stream once
        scraper = Scraper(endpoints, args.interval_ms / 1000)
        for i in range(1, args.pairs + 1):
            for scraped in (False, True):
                before = {n: len(v) for n, v in scraper.latencies.items()}
                if scraped:
                    with scraper:
                        tokens, seconds, errors = load()
                else:
                    tokens, seconds, errors = load()
                lat = [x for n, xs in scraper.latencies.items() for x in xs[before[n]:]]
                runs.append({"run": f"{'with' if scraped else 'without'} scraper #{i}", "scraped": scraped,
                             "tokens": tokens, "seconds": seconds, "tokens/s": tokens / seconds, "errors": errors,
                             "scrapes": len(lat), "latencies": lat})
                print(f"{runs[-1]['run']}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.2f} tok/s"
                      + (f", {runs[-1]['scrapes']} scrapes" if scraped else "")
                      + (f", {len(errors)} errors" if errors else ""), flush=True)
        samples = {}
        for name, port in endpoints.items():
            _, body = get(port, "/metrics", timeout=30)
            samples[name] = sum(len(f.samples) for f in text_string_to_metric_families(body.decode()))

    without = [r["tokens/s"] for r in runs if not r["scraped"]]
    with_ = [r["tokens/s"] for r in runs if r["scraped"]]
    mean_without, mean_with = statistics.mean(without), statistics.mean(with_)
    rows = []
    for r in runs:
        lat = sorted(r["latencies"])
        rows.append({"run": r["run"], "tokens/s": r["tokens/s"], "vs mean without": r["tokens/s"] / mean_without,
                     "scrapes": r["scrapes"],
                     "scrape p50 ms": 1000 * percentile(lat, 50) if lat else None,
                     "scrape p99 ms": 1000 * percentile(lat, 99) if lat else None})
    endpoint_rows = []
    for name in endpoints:
        lat = scraper.latencies[name]
        endpoint_rows.append({"endpoint": f"{name} :{endpoints[name]}/metrics", "scrapes": len(lat),
                              "failed": len(scraper.failures[name]),
                              "p50 ms": 1000 * percentile(lat, 50) if lat else None,
                              "p99 ms": 1000 * percentile(lat, 99) if lat else None,
                              "max ms": 1000 * max(lat) if lat else None,
                              "bytes": scraper.sizes.get(name), "samples": samples[name]})
    ratio = mean_with / mean_without
    pairwise = [b / a for a, b in zip(without, with_)]
    spread = (min(without) / mean_without, max(without) / mean_without)
    load_errors = [e for r in runs for e in r["errors"]]
    failed_scrapes = sum(len(v) for v in scraper.failures.values())
    tolerance = max(NOISE_FLOOR, 1.0 - spread[0])
    checks = {"every scrape answered 200": failed_scrapes == 0,
              "no generation request failed": not load_errors}
    goals = {f"with / without >= {1 - tolerance:.3f} (the larger of {NOISE_FLOOR:g} and the A runs' spread)":
             ratio >= 1 - tolerance}

    cpu = cpu_info()
    print(f"\ntarget {args.target} ({args.dtype}), draft {draft}, k={k}; {args.streams} concurrent greedy streams "
          f"over {args.protocol.upper()}, {args.requests_per_stream} x {args.max_tokens} tokens each per run; scraper "
          f"every {args.interval_ms:g} ms on {len(endpoints)} endpoints; CPU {cpu['model']}, {cpu['cores']} cores, "
          f"{' '.join(cpu['flags']) or 'no avx2/avx512/amx'}\n")
    print_table(rows, COLUMNS)
    print()
    print_table(endpoint_rows, ENDPOINT_COLUMNS)
    print(f"\ntokens/s without scraper {mean_without:.2f} (runs {', '.join(f'{x:.2f}' for x in without)}; spread "
          f"{spread[0]:.3f}-{spread[1]:.3f} of their mean), with {mean_with:.2f} (runs {', '.join(f'{x:.2f}' for x in with_)})")
    print(f"with / without = {ratio:.3f} (pairwise {', '.join(f'{x:.3f}' for x in pairwise)})")
    if load_errors:
        print(f"generation errors: {len(load_errors)}; e.g. {load_errors[:3]}")
    if failed_scrapes:
        print(f"failed scrapes: {[(n, f[:3]) for n, f in scraper.failures.items() if f]}")
    status = report_checks(checks, goals, args.strict)
    write_json(out_path, {
        "smoke": args.smoke, "cpu": cpu, "target": args.target, "draft": draft, "k": k, "dtype": args.dtype,
        "draft_dtype": args.draft_dtype or args.dtype, "protocol": args.protocol, "streams": args.streams,
        "requests_per_stream": args.requests_per_stream, "max_tokens": args.max_tokens, "pairs": args.pairs,
        "interval_ms": args.interval_ms, "rows": rows, "endpoints": endpoint_rows,
        "tokens_per_s_without": without, "tokens_per_s_with": with_, "with_over_without": ratio,
        "pairwise_ratios": pairwise, "without_spread": list(spread), "load_errors": load_errors,
        "failed_scrapes": {n: f[:10] for n, f in scraper.failures.items() if f}, "checks": checks,
        "goals": goals, "log_dir": str(log_dir)})
    if tmp is not None:
        tmp.cleanup()
    return status


if __name__ == "__main__":
    sys.exit(main())

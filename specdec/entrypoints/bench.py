"""``specdec bench``: load a running server's OpenAI HTTP API and report what a user sees (like
``vllm bench serve``).

Requests stream (SSE) with ``stream_options.include_usage``; arrivals follow a Poisson process at
``--request-rate`` (inf: all at once), at most ``--concurrency`` in flight. It reports throughput
(requests/s, output tokens/s), TTFT, TPOT, ITL (between a stream's chunks: a round's accepted tokens
arrive together) and end-to-end latency percentiles, and speculation: the deltas of the gateway's
``/metrics`` counters ``specdec_spec_decode_*`` over the run, or else the sum of the responses'
``usage.spec_decode``, with the acceptance rate at each draft position. ``--out`` writes the JSON result and,
beside it, a PNG of the latency percentiles and the acceptance per position (matplotlib: ``specdec[bench]``).
Standard library only (no torch): it runs anywhere the ``specdec`` CLI does.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import math
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from specdec.config import DEFAULT_HTTP_PORT
from specdec.entrypoints.bench_result import SPEC_COUNTERS, RequestResult
from specdec.serving import settings

ENV_PREFIX = "SPECDEC_BENCH"
PROMPTS_DIR = Path(__file__).resolve().parents[1] / "assets" / "prompts"
# name -> (file, key or keys, endpoint): the built-in prompt sets
DATASETS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "short": ("short.json", ("prompts",), "completions"),
    "input-grounded": ("drafting.json", ("input_grounded",), "chat"),
    "open-ended": ("drafting.json", ("open_ended",), "chat"),
    "mixed": ("drafting.json", ("input_grounded", "open_ended"), "chat"),  # every other prompt of each
}
PER_POS = "num_accepted_tokens_per_pos"  # usage.spec_decode's list; /metrics' counter with a position label
PERCENTILES = (50, 90, 99)
logger = logging.getLogger(__name__)


@dataclass
class BenchConfig:
    base_url: str = field(default=f"http://localhost:{DEFAULT_HTTP_PORT}", metadata={
        "help": "the server (`specdec serve` / `specdec gateway --http-port`)"})
    endpoint: str | None = field(default=None, metadata={
        "help": "completions, chat (the OpenAI API at --base-url) or grpc (GenerationService at --grpc-addr; "
                "prompts sent as they are) (default: the dataset's: chat for the drafting sets, else completions)"})
    grpc_addr: str | None = field(default=None, metadata={
        "help": "the gateway's gRPC host:port for --endpoint grpc (default: --base-url's host, port 50050)"})
    model: str | None = field(default=None, metadata={"help": "model id (default: the first of /v1/models)"})
    api_key: str | None = field(default=None, metadata={"help": "sent as 'Authorization: Bearer KEY'",
                                                         "secret": True})
    dataset: str = field(default="short", metadata={
        "help": f"a built-in prompt set ({', '.join(DATASETS)}) or a JSONL file with a 'prompt' field per line"})
    num_prompts: int = field(default=16, metadata={"help": "requests to send (the dataset is cycled)"})
    max_tokens: int = field(default=64, metadata={"help": "max_tokens of each request"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature (0: greedy)"})
    ignore_eos: bool = field(default=False, metadata={"help": "generate max_tokens whatever the model says (vLLM's "
                                                              "extension)"})
    request_rate: float = field(default=math.inf, metadata={"help": "requests per second, Poisson arrivals (inf: all "
                                                                    "at once)"})
    concurrency: int | None = field(default=None, metadata={"help": "most requests in flight (none: no limit)"})
    seed: int = field(default=0, metadata={"help": "seed of the arrival times"})
    timeout_seconds: float = field(default=600.0, metadata={"help": "deadline of one request"})
    metrics: bool = field(default=True, metadata={"help": "read acceptance from the server's /metrics (else from "
                                                          "the responses' usage.spec_decode)"})
    progress: bool = field(default=True, metadata={"help": "a progress bar on stderr"})
    json: bool = field(default=False, metadata={"help": "print the result as one JSON object instead of a table"})
    out: str | None = field(default=None, metadata={"help": "also write the JSON result to this file"})
    plot: bool = field(default=True, metadata={"help": "with --out, also write a PNG beside it (same stem): latency "
                                                       "percentiles, acceptance per draft position"})


def load_dataset(name: str) -> tuple[list[str], str]:
    """(prompts, the endpoint they are meant for)."""
    if name in DATASETS:
        file, keys, endpoint = DATASETS[name]
        data = json.loads((PROMPTS_DIR / file).read_text())
        sets = [data[k] for k in keys]
        return ([p for s in sets for p in s[::2]] if len(sets) > 1 else sets[0]), endpoint
    path = Path(name)
    if not path.is_file():
        raise SystemExit(f"specdec bench: --dataset {name!r} is neither a built-in set ({', '.join(DATASETS)}) nor a "
                         "file")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise SystemExit(f"specdec bench: {path}:{number}: each line needs a string 'prompt' field")
            prompts.append(row["prompt"])
    if not prompts:
        raise SystemExit(f"specdec bench: {path} holds no prompts")
    return prompts, "completions"


class Client:
    """HTTP(S) requests to one server, a connection per call (threads share nothing)."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SystemExit(f"specdec bench: --base-url must be http(s)://HOST[:PORT], got {base_url!r}")
        self.https, self.host = parts.scheme == "https", parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/").removesuffix("/v1")
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self.timeout = timeout

    def _connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def get(self, path: str) -> str:
        conn = self._connection()
        try:
            conn.request("GET", self.prefix + path, headers=self.headers)
            resp = conn.getresponse()
            body = resp.read().decode()
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {resp.status}: {body[:200]}")
            return body
        finally:
            conn.close()

    def stream(self, path: str, payload: dict) -> RequestResult:
        """One streamed request, timed from just before it is sent."""
        result = RequestResult()
        conn = self._connection()
        start = last = time.perf_counter()
        chunks = 0
        try:
            conn.request("POST", self.prefix + path, body=json.dumps(payload), headers=self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:200]}"
                return result
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message", event["error"]))[:200]
                    return result
                if event.get("usage"):
                    usage = event["usage"]
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.spec_decode = usage.get("spec_decode")
                for choice in event.get("choices", []):
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if not text:
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
            result.e2e = time.perf_counter() - start
            result.output_tokens = result.output_tokens or chunks
            result.ok = True
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()
        return result


def spec_counters(metrics_text: str) -> dict[str, float]:
    """The ``specdec_spec_decode_*_total`` counters of a /metrics page, summed over their labels."""
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for line in metrics_text.splitlines():
        for name in SPEC_COUNTERS:
            series = f"specdec_spec_decode_{name}_total"
            if line.startswith(series) and line[len(series)] in "{ ":
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def accepted_per_pos(metrics_text: str) -> list[float]:
    """``specdec_spec_decode_num_accepted_tokens_per_pos_total`` of a /metrics page, summed over its other labels,
    by position (0-based)."""
    totals: dict[int, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith(f"specdec_spec_decode_{PER_POS}_total{{") and 'position="' in line:
            pos = int(line.split('position="', 1)[1].split('"', 1)[0])
            totals[pos] = totals.get(pos, 0.0) + float(line.rsplit(" ", 1)[1])
    return [totals.get(i, 0.0) for i in range(max(totals) + 1)] if totals else []


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean and p50/p90/p99 (linear interpolation), in ms by default; zeros when there are none."""
    out = {"mean": 0.0, **{f"p{q}": 0.0 for q in PERCENTILES}}
    if not values:
        return out
    ordered = sorted(values)
    out["mean"] = sum(ordered) / len(ordered) * scale
    for q in PERCENTILES:
        pos = (len(ordered) - 1) * q / 100
        low = int(pos)
        high = min(low + 1, len(ordered) - 1)
        out[f"p{q}"] = (ordered[low] + (ordered[high] - ordered[low]) * (pos - low)) * scale
    return out


def _acceptance(counts: dict[str, float], per_pos: list[float], source: str) -> dict[str, Any]:
    drafts, drafted, accepted = (counts[n] for n in SPEC_COUNTERS)
    return {"source": source, **{n: int(counts[n]) for n in SPEC_COUNTERS},
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            PER_POS: [int(a) for a in per_pos],  # accepted at each draft position; over num_drafts, its rate:
            "acceptance_rate_per_pos": [a / drafts for a in per_pos] if drafts else []}


def _sum_lists(lists: list[list[float]]) -> list[float]:
    return [sum(column) for column in zip_longest(*lists, fillvalue=0)]


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Send the requests, return the result (what ``--json`` prints)."""
    if cfg.num_prompts < 1 or cfg.max_tokens < 1 or cfg.request_rate <= 0 or (cfg.concurrency or 1) < 1:
        raise SystemExit("specdec bench: --num-prompts, --max-tokens, --request-rate and --concurrency must be > 0")
    prompts, endpoint = load_dataset(cfg.dataset)
    endpoint = cfg.endpoint or endpoint
    if endpoint not in ("completions", "chat", "grpc"):
        raise SystemExit(f"specdec bench: --endpoint must be completions, chat or grpc, got {endpoint!r}")
    client = Client(cfg.base_url, cfg.api_key, cfg.timeout_seconds)
    if endpoint == "grpc":
        return _run_grpc(cfg, client, prompts)
    try:
        model = cfg.model or json.loads(client.get("/v1/models"))["data"][0]["id"]
    except (OSError, RuntimeError, http.client.HTTPException, KeyError, IndexError, ValueError) as exc:
        raise SystemExit(f"specdec bench: cannot list the models of {cfg.base_url} ({type(exc).__name__}: {exc}); "
                         "is the server up (--base-url), and the key right (--api-key)?") from None
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"

    def payload(prompt: str) -> dict:
        body = {"model": model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": cfg.ignore_eos}
        if endpoint == "chat":
            return {**body, "messages": [{"role": "user", "content": prompt}]}
        return {**body, "prompt": prompt}

    return _load(cfg, client, model, endpoint, prompts, lambda prompt: client.stream(path, payload(prompt)))


def _run_grpc(cfg: BenchConfig, client: Client, prompts: list[str]) -> dict[str, Any]:
    from gateway.config import GatewayConfig
    from specdec.entrypoints.bench_grpc import GrpcClient

    rpc = GrpcClient(cfg.grpc_addr or f"{client.host}:{GatewayConfig().port}", cfg.api_key, cfg.timeout_seconds)
    try:
        try:
            model = cfg.model or rpc.model()
        except Exception as exc:  # grpc.RpcError
            raise SystemExit(f"specdec bench: the gateway's gRPC port does not answer ({exc})") from None
        return _load(cfg, client, model, "grpc", prompts,
                     lambda prompt: rpc.stream(prompt, cfg.max_tokens, cfg.temperature, cfg.ignore_eos))
    finally:
        rpc.close()


def _load(cfg: BenchConfig, client: Client, model: str, endpoint: str, prompts: list[str], send) -> dict[str, Any]:
    """Send ``cfg.num_prompts`` requests (``send(prompt) -> RequestResult``) on the arrival schedule."""

    def scrape() -> dict[str, Any] | None:
        try:
            text = client.get("/metrics") if cfg.metrics else None
            return None if text is None else {**spec_counters(text), PER_POS: accepted_per_pos(text)}
        except (OSError, RuntimeError, http.client.HTTPException):
            return None

    before = scrape()
    rng = random.Random(cfg.seed)
    limit = threading.BoundedSemaphore(cfg.concurrency) if cfg.concurrency else None
    results: list[RequestResult] = []
    bar = _progress(cfg.num_prompts, cfg.progress)

    def one(prompt: str) -> None:
        try:
            result = send(prompt)
        finally:
            if limit is not None:
                limit.release()
        results.append(result)
        bar.update(1)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(cfg.concurrency or cfg.num_prompts, cfg.num_prompts),
                            thread_name_prefix="bench") as pool:
        arrival = start
        for i in range(cfg.num_prompts):
            if math.isfinite(cfg.request_rate):
                arrival += rng.expovariate(cfg.request_rate)
                time.sleep(max(0.0, arrival - time.perf_counter()))
            if limit is not None:
                limit.acquire()
            pool.submit(one, prompts[i % len(prompts)])
    duration = time.perf_counter() - start
    bar.close()
    after = scrape()
    return summarize(cfg, model, endpoint, results, duration, before, after)


def summarize(cfg: BenchConfig, model: str, endpoint: str, results: list[RequestResult], duration: float,
              before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    if before is not None and after is not None:
        per_pos = [a - b for a, b in zip_longest(after.get(PER_POS, []), before.get(PER_POS, []), fillvalue=0.0)]
        while per_pos and per_pos[-1] <= 0:  # positions the server counted before this run (a longer k) only
            per_pos.pop()
        acceptance = _acceptance({n: after[n] - before[n] for n in SPEC_COUNTERS}, per_pos, "metrics")
    else:
        usage = [r.spec_decode for r in ok if r.spec_decode]
        acceptance = _acceptance({n: sum(u.get(n, 0) for u in usage) for n in SPEC_COUNTERS},
                                 _sum_lists([u.get(PER_POS) or [] for u in usage]), "usage")
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "config": {**{k: v for k, v in asdict(cfg).items() if k != "api_key"}, "model": model, "endpoint": endpoint,
                   "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf"},
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": percentiles([r.ttft for r in ok]), "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles([x for r in ok for x in r.itl]), "e2e_ms": percentiles([r.e2e for r in ok]),
        "spec_decode": acceptance,
    }


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr)


def format_result(result: dict[str, Any]) -> str:
    """vLLM-style text report."""
    spec = result["spec_decode"]
    rows = [
        ("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
        ("Benchmark duration (s)", f"{result['duration_s']:.2f}"),
        ("Total input tokens", result["total_input_tokens"]), ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}"),
    ]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        rows.append((f"-- {title} --", ""))
        rows += [(f"{stat.capitalize() if stat == 'mean' else stat.upper()} (ms)", f"{value:.2f}")
                 for stat, value in result[key].items()]
    rows.append((f"-- Speculative decoding (from {spec['source']}) --", ""))
    rate, length = spec["acceptance_rate"], spec["mean_acceptance_length"]
    rows += [("Drafts", spec["num_drafts"]), ("Draft tokens", spec["num_draft_tokens"]),
             ("Accepted tokens", spec["num_accepted_tokens"]),
             ("Acceptance rate", "-" if rate is None else f"{rate:.3f}"),
             ("Mean acceptance length", "-" if length is None else f"{length:.2f}")]
    rows += [(f"Acceptance rate, position {i}", f"{r:.3f}") for i, r in enumerate(spec["acceptance_rate_per_pos"], 1)]
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]
    lines += [f"{name:<44}{value:>16}" if value != "" else "{:-^60}".format(f" {name.strip('- ')} ")
              for name, value in rows]
    if result["errors"]:
        lines.append("errors: " + "; ".join(result["errors"]))
    lines.append("=" * 60)
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    settings.add_arguments(p, BenchConfig, ENV_PREFIX)


def run(args: argparse.Namespace) -> int:
    cfg = settings.from_args(BenchConfig, args)
    result = run_bench(cfg)
    text = json.dumps(result, indent=2)
    if cfg.out:
        Path(cfg.out).write_text(text + "\n")
        if cfg.plot:
            write_plot(result, Path(cfg.out).with_suffix(".png"))
    print(text if cfg.json else format_result(result))
    return 0 if result["completed"] else 1


def write_plot(result: dict[str, Any], path: Path) -> Path | None:
    """The PNG beside the JSON (:func:`specdec.plots.serving_benchmark`); without matplotlib (or on any plotting
    error) a warning and no PNG: the benchmark's result stands without it."""
    from specdec import plots

    try:
        return plots.serving_benchmark(result, path)
    except Exception as exc:  # noqa: BLE001 -- PlotsUnavailable's message says how to install matplotlib
        logger.warning("specdec bench: no plot written (%s: %s)", type(exc).__name__, exc)
        return None

"""Fault injection: what a client sees when a part of the stack fails, what is lost, and whether the
service answers correctly afterwards (issue 29's proof run).

Every part runs as a real process of its own (``specdec target-service`` / ``draft-service`` /
``gateway``, as containers would), every fault is a real signal or a real change of the name the
gateway resolves. The scenarios:

  * ``sigstop``:  8 greedy streams in flight, the target SIGSTOPped for ``--stop-seconds`` (30), then
                  SIGCONT; one more request is sent while it is stopped.
  * ``draft-kill``: 8 greedy streams in flight, the draft SIGKILLed (the gateway's draft fallback on).
  * ``admission``: 200 concurrent gRPC ``Generate`` calls against ``--max-concurrent-requests 8
                  --max-queue-len 16``.
  * ``prompt-logprobs``: one request for ``prompt_logprobs`` of a 16k-token prompt (Gemma-3-270M, whose
                  262,144-token vocabulary makes the [prompt, vocabulary] fp32 logits ~17 GB).
  * ``dns``:      two target replicas behind ``dns:///NAME:PORT`` (127.0.0.1 and 127.0.0.2, one port);
                  one address leaves the name's answer under 8 streams, then its process stops.
                  The gateway resolves NAME through a ``sitecustomize`` shim that reads the answer from a
                  file (the only stand-in here: no DNS server can be changed on this machine).

For each: what the clients saw (status: count, and the slowest answer), what was lost (a request that
got neither its answer nor a clear error), each process's peak RSS, and whether a greedy probe
afterwards equals the probe before. A FAIL line (and exit status 1) for any check that fails.

    python benchmarks/fault_injection.py                      # all scenarios, the embedded default pair
    python benchmarks/fault_injection.py --only sigstop,dns
    python benchmarks/fault_injection.py --smoke              # tiny random-weight models, short faults
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PROMPTS, add_common_args, json_path, print_table, smoke_environment, smoke_models, write_json  # noqa: E402

from served import HOST, ProcessStack, RequestError, Result, ServiceProc, cpu_info, free_port, grpc_stream  # noqa: E402

from specdec.config import DEFAULT_TARGET, default_draft_path  # noqa: E402
from specdec.v1 import common_pb2, generation_service_pb2 as pb, generation_service_pb2_grpc  # noqa: E402

SCENARIOS = ("sigstop", "draft-kill", "admission", "prompt-logprobs", "dns")
COLUMNS = ["scenario", "client saw", "slowest s", "lost", "peak RSS MiB", "correct after", "verdict"]


class PeakRss:
    """Samples each process's RSS every 0.2 s while running; ``peaks`` in MiB."""

    def __init__(self, procs: list[ServiceProc]):
        self.procs, self.peaks, self._stop = procs, {p.name: 0.0 for p in procs}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.wait(0.2):
            for p in self.procs:
                rss = p.rss()
                if rss:
                    self.peaks[p.name] = max(self.peaks[p.name], rss / 2**20)

    def text(self) -> str:
        return ", ".join(f"{n} {v:.0f}" for n, v in self.peaks.items())


def greedy(prompt: str, max_tokens: int, **extra) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                              sampling_params=common_pb2.SamplingParams(temperature=0), **extra)


def run_stream(port: int, req: pb.GenerateRequest, timeout: float) -> Result:
    res = Result("greedy", "grpc", time.monotonic())
    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        try:
            grpc_stream(generation_service_pb2_grpc.GenerationServiceStub(channel), req, timeout, res)
        except RequestError as exc:
            res.outcome, res.error, res.detail = "error", exc.kind, exc.detail
    res.e2e = time.monotonic() - res.began
    return res


def probe(port: int, prompt: str, max_tokens: int, within: float = 60.0) -> str | None:
    """The greedy text, asked again each second while the gateway answers UNAVAILABLE (a backend it marked
    down is health-checked back in), for up to ``within`` seconds; None if it never answers."""
    deadline = time.monotonic() + within
    while True:
        res = run_stream(port, greedy(prompt, max_tokens), 300)
        if res.outcome == "completed":
            return res.text
        if "UNAVAILABLE" not in res.error or time.monotonic() > deadline:
            return None
        time.sleep(1.0)


def summary(results: list[Result]) -> tuple[str, float, int]:
    """'status: count' of the answers, the slowest answer's time, and how many were lost: a client that
    gave up waiting (its own timeout) or a stream that ended with neither a finish nor an error code."""
    seen = Counter("OK" if r.outcome == "completed" else r.error for r in results)
    lost = sum(1 for r in results if r.outcome != "completed" and not r.error.startswith(("gRPC ", "HTTP ")))
    return ", ".join(f"{k}: {v}" for k, v in seen.most_common()), max((r.e2e or 0) for r in results), lost


def under_load(port: int, prompts: list[str], n: int, max_tokens: int, timeout: float, fault, settle: float):
    """n greedy streams; ``fault()`` runs ``settle`` seconds after they start; the streams' results."""
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(run_stream, port, greedy(prompts[i % len(prompts)], max_tokens), timeout)
                   for i in range(n)]
        time.sleep(settle)
        fault()
        return [f.result() for f in futures]


def row(name: str, results: list[Result], peaks: PeakRss, correct: bool, checks: dict[str, bool], **extra) -> dict:
    saw, slowest, lost = summary(results)
    failed = [k for k, ok in checks.items() if not ok] + (["lost requests"] if lost else []) + \
        ([] if correct else ["wrong answer afterwards"])
    return {"scenario": name, "client saw": saw, "slowest s": round(slowest, 1), "lost": lost,
            "peak RSS MiB": peaks.text(), "correct after": correct, "verdict": "FAIL: " + "; ".join(failed) if failed
            else "PASS", **extra}


def scenario_sigstop(args, models, logs) -> dict:
    with ProcessStack(models.target, models.draft, k=4, log_dir=logs / "sigstop", target_threads=1,
                      draft_threads=1, gateway_args=tuple(args.gateway_arg)) as stack, PeakRss(stack.procs) as peaks:
        before = probe(stack.gateway.port, PROMPTS[0], args.max_tokens)
        during: list[Result] = []

        def fault():
            stack.target.proc.send_signal(signal.SIGSTOP)
            time.sleep(1.0)
            during.append(run_stream(stack.gateway.port, greedy(PROMPTS[1], 8), args.stop_seconds + 60))
            time.sleep(max(0.0, args.stop_seconds - 1.0 - during[0].e2e))
            stack.target.proc.send_signal(signal.SIGCONT)

        results = under_load(stack.gateway.port, PROMPTS, 8, args.max_tokens, args.stop_seconds + 120, fault, 2.0)
        stack.gateway.wait_ready(120)
        resumed = time.monotonic()
        after = probe(stack.gateway.port, PROMPTS[0], args.max_tokens)
        answering_again = time.monotonic() - resumed
        # a stream either finished or was told UNAVAILABLE well before the target came back
        quick = all(r.outcome == "completed" or r.e2e < args.stop_seconds for r in results + during)
        return row("target SIGSTOP %.0f s, 8 streams" % args.stop_seconds, results + during, peaks,
                   before is not None and after == before,
                   {"answered before SIGCONT": quick, "new request refused while stopped": during[0].outcome != "completed"
                    or during[0].e2e < args.stop_seconds},
                   **{"answering again s": round(answering_again, 1)})


def scenario_draft_kill(args, models, logs) -> dict:
    with ProcessStack(models.target, models.draft, k=4, log_dir=logs / "draft-kill", target_threads=1,
                      draft_threads=1, gateway_args=tuple(args.gateway_arg)) as stack, PeakRss(stack.procs) as peaks:
        expected = {p: probe(stack.gateway.port, p, args.max_tokens) for p in PROMPTS}
        results = under_load(stack.gateway.port, PROMPTS, 8, args.max_tokens, 300,
                             lambda: stack.draft.kill(signal.SIGKILL), 1.5)
        identical = all(r.text == expected[PROMPTS[i % len(PROMPTS)]] for i, r in enumerate(results))
        after = probe(stack.gateway.port, PROMPTS[0], args.max_tokens)
        return row("draft SIGKILL, 8 streams", results, peaks, after == expected[PROMPTS[0]],
                   {"all completed": all(r.outcome == "completed" for r in results),
                    "identical to before": identical})


def scenario_admission(args, models, logs) -> dict:
    limits = ("--max-concurrent-requests", "8", "--max-queue-len", "16")
    with ProcessStack(models.target, models.draft, k=4, log_dir=logs / "admission", target_threads=1,
                      draft_threads=1, gateway_args=(*limits, *args.gateway_arg)) as stack, \
            PeakRss(stack.procs) as peaks:
        before = probe(stack.gateway.port, PROMPTS[0], 8)
        n = args.admission_calls
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(lambda i: run_stream(stack.gateway.port, greedy(PROMPTS[i % 4], 8), 600), range(n)))
        refused = [r for r in results if r.error == "gRPC RESOURCE_EXHAUSTED"]
        served = [r for r in results if r.outcome == "completed"]
        after = probe(stack.gateway.port, PROMPTS[0], 8)
        return row(f"{n} concurrent gRPC calls, limits 8 + 16", results, peaks, before is not None and after == before,
                   {"some refused": bool(refused), "at least 8 + 16 served": len(served) >= 24,
                    "refusals are quick": all(r.e2e < 10 for r in refused),
                    "nothing else": len(refused) + len(served) == n},
                   refused_max_s=round(max((r.e2e for r in refused), default=0), 2))


def scenario_prompt_logprobs(args, models, logs) -> dict:
    from specdec.model_files import load_tokenizer

    tp, gp = free_port(), free_port()
    target = ServiceProc("target", ["target-service", "--model", models.long_target, "--host", HOST, "--port",
                                    str(tp), "--num-threads", "0"], logs / "prompt-logprobs", tp)
    gateway = ServiceProc("gateway", ["gateway", "--target-addr", target.address, "--draft-addr", "none",
                                      "--host", HOST, "--port", str(gp), *args.gateway_arg], logs / "prompt-logprobs", gp)
    (logs / "prompt-logprobs").mkdir(parents=True, exist_ok=True)
    try:
        target.launch().wait_ready(1800)
        gateway.launch().wait_ready(900)
        tok = load_tokenizer(models.long_target_tokenizer)  # a built-in name (gemma-3-270m) or a folder
        text = (Path(__file__).resolve().parents[1] / "specdec/assets/text/calibration.txt").read_text()
        ids = tok(text, add_special_tokens=False)["input_ids"]
        prompt_ids = (ids * (args.long_prompt_tokens // len(ids) + 1))[:args.long_prompt_tokens]
        with PeakRss([target, gateway]) as peaks:
            before = probe(gp, PROMPTS[0], 8)
            req = pb.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=1, prompt_logprobs=1,
                                     sampling_params=common_pb2.SamplingParams(temperature=0))
            res, got = Result("prompt_logprobs", "grpc", time.monotonic()), 0
            with grpc.insecure_channel(f"{HOST}:{gp}", options=[("grpc.max_receive_message_length", 256 << 20)]) as ch:
                try:
                    for resp in generation_service_pb2_grpc.GenerationServiceStub(ch).Generate(req, timeout=3600):
                        got += len(resp.prompt_logprobs)
                    res.outcome = "completed"
                except grpc.RpcError as exc:
                    res.error, res.detail = f"gRPC {exc.code().name}", exc.details()
            res.e2e = time.monotonic() - res.began
            after = probe(gp, PROMPTS[0], 8)
        ok = res.outcome == "completed" and got == len(prompt_ids) - 1
        clear_refusal = res.error == "gRPC INVALID_ARGUMENT"
        return row(f"prompt_logprobs of {len(prompt_ids)} tokens", [res], peaks, before is not None and after == before,
                   {"answered in full or refused with INVALID_ARGUMENT": ok or clear_refusal},
                   prompt_logprobs_returned=got, detail=res.detail)
    finally:
        gateway.stop()
        target.stop()


SHIM = '''import os, socket
_orig = socket.getaddrinfo
def getaddrinfo(host, port, *a, **kw):
    if host == os.environ.get("FAULT_DNS_NAME"):
        addrs = open(os.environ["FAULT_DNS_FILE"]).read().split()
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, int(port))) for ip in addrs]
    return _orig(host, port, *a, **kw)
socket.getaddrinfo = getaddrinfo
'''


def scenario_dns(args, models, logs) -> dict:
    import os

    folder = logs / "dns"
    shim = folder / "shim"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "sitecustomize.py").write_text(SHIM)
    answer = folder / "answer.txt"
    answer.write_text("127.0.0.1 127.0.0.2\n")
    port = free_port()
    replicas = [ServiceProc(f"target-{ip}", ["target-service", "--model", models.target, "--host", ip, "--port",
                                              str(port), "--num-threads", "1"], folder, port) for ip in ("127.0.0.1", "127.0.0.2")]
    dp, gp = free_port(), free_port()
    draft = ServiceProc("draft", ["draft-service", "--model", models.draft, "--host", HOST, "--port", str(dp),
                                  "--num-threads", "1"], folder, dp)
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "FAULT_DNS_NAME", "FAULT_DNS_FILE")}
    os.environ.update(FAULT_DNS_NAME="targets.specdec.test", FAULT_DNS_FILE=str(answer),
                      PYTHONPATH=os.pathsep.join(filter(None, [str(shim), saved["PYTHONPATH"]])))
    gateway = ServiceProc("gateway", ["gateway", "--target-addr", f"dns:///targets.specdec.test:{port}",
                                      "--draft-addr", draft.address, "--host", HOST, "--port", str(gp),
                                      "--dns-refresh-seconds", str(args.dns_refresh_seconds), *args.dns_gateway_arg, *args.gateway_arg], folder, gp)
    procs = [*replicas, draft, gateway]
    try:
        for p in replicas + [draft]:
            p.launch()
        for p, ip in zip(replicas, ("127.0.0.1", "127.0.0.2")):
            wait_grpc_serving(p, f"{ip}:{port}")
        draft.wait_ready(900)
        gateway.launch().wait_ready(900)
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        with PeakRss(procs) as peaks:
            before = probe(gp, PROMPTS[0], args.max_tokens)

            def fault():
                answer.write_text("127.0.0.1\n")  # the second replica leaves the name's answer ...
                time.sleep(args.dns_refresh_wait)
                replicas[1].stop()  # ... and its pod ends (SIGTERM: it drains what it still holds)

            results = under_load(gp, PROMPTS, 8, args.max_tokens, 600, fault, 1.0)
            after = probe(gp, PROMPTS[0], args.max_tokens)
        log = gateway.log_tail(50000)
        pruned = "left the name's addresses" in log and "dropped: it left" in log
        return row("a target replica leaves DNS, 8 streams", results, peaks, before is not None and after == before,
                   {"all completed": all(r.outcome == "completed" for r in results),
                    "gateway dropped the departed replica": pruned})
    finally:
        for p in reversed(procs):
            p.stop()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def wait_grpc_serving(proc: ServiceProc, address: str, timeout: float = 900) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if proc.proc.poll() is not None:
            raise SystemExit(f"{proc.name} exited during start-up:\n{proc.log_tail()}")
        with grpc.insecure_channel(address) as ch:
            try:
                if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.3)
    raise SystemExit(f"{proc.name} did not serve within {timeout} s:\n{proc.log_tail()}")


class Models:
    def __init__(self, target: str, draft: str, long_target: str, long_target_tokenizer: str):
        self.target, self.draft, self.long_target, self.long_target_tokenizer = target, draft, long_target, long_target_tokenizer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios: " + ", ".join(SCENARIOS))
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=None, help="default: the embedded default draft")
    ap.add_argument("--long-target", default="gemma-3-270m", help="the prompt-logprobs scenario's target")
    ap.add_argument("--long-prompt-tokens", type=int, default=16384)
    ap.add_argument("--stop-seconds", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--admission-calls", type=int, default=200)
    ap.add_argument("--dns-refresh-seconds", type=float, default=2.0, help="the dns scenario gateway's "
                    "--dns-refresh-seconds")
    ap.add_argument("--dns-refresh-wait", type=float, default=5.0, help="seconds between the DNS change and the "
                    "replica's SIGTERM (longer than --dns-refresh-seconds: the gateway sees the change first)")
    ap.add_argument("--dns-gateway-arg", action="append", default=[], help="gateway flags of the dns scenario")
    ap.add_argument("--gateway-arg", action="append", default=[], help="extra gateway flag (repeatable)")
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if unknown := set(only) - set(SCENARIOS):
        ap.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    tmp = tempfile.TemporaryDirectory(prefix="specdec-faults-")
    logs = Path(args.log_dir or tmp.name) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        smoke_environment(tmp.name)
        tiny = smoke_models(tmp.name)
        models = Models(tiny.target, tiny.draft, tiny.target, tiny.target)
        # the stop outlasts the backend deadline's 10 s floor; streams long enough to be in flight at the fault
        args.stop_seconds, args.max_tokens = min(args.stop_seconds, 20.0), max(args.max_tokens, 128)
        args.admission_calls, args.long_prompt_tokens = min(args.admission_calls, 40), min(args.long_prompt_tokens, 400)
    else:
        draft = args.draft or str(default_draft_path())
        models = Models(args.target, draft, args.long_target, args.long_target)
    runs = {"sigstop": scenario_sigstop, "draft-kill": scenario_draft_kill, "admission": scenario_admission,
            "prompt-logprobs": scenario_prompt_logprobs, "dns": scenario_dns}
    rows = []
    for name in only:
        began = time.monotonic()
        (logs / name).mkdir(parents=True, exist_ok=True)
        rows.append({**runs[name](args, models, logs), "scenario seconds": round(time.monotonic() - began, 1)})
        print(f"{name}: {rows[-1]['verdict']}", flush=True)
    print_table(rows, COLUMNS)
    for r in rows:
        print(("PASS" if r["verdict"] == "PASS" else "FAIL") + f": {r['scenario']}: {r['verdict']}")
    write_json(json_path(args, "fault_injection"), {"cpu": cpu_info(), "smoke": args.smoke, "rows": rows,
                                                    "logs": str(logs)})
    print(f"service logs: {logs}")
    return 0 if all(r["verdict"] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

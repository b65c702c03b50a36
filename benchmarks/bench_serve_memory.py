"""Where ``specdec serve``'s resident memory goes: one server (a subprocess) on the embedded default pair, three chat
requests, then its resident set by kind of mapping (/proc/PID/smaps) beside the weights the services report.

    python benchmarks/bench_serve_memory.py                 # goal: resident <= 900 MiB after the requests
    python benchmarks/bench_serve_memory.py --smoke         # tiny random-weight pair, seconds

Rows: anonymous memory (weights, KV pages written, Python objects; each big block its own mapping), the C heap
(tokenizers, protobuf, gRPC), the shared libraries (torch, Triton: imported by transformers through
torch._dynamo) and mapped model files, and the weights as the services hold them (their ready log lines:
packed copies included, each storage once).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_common_args, add_strict_arg, cpu_info, json_path, print_table, report_checks,  # noqa: E402
                    smoke_environment, smoke_models, write_json)
from served import HOST, ServiceProc, free_port, http_json  # noqa: E402

GOAL_MIB = 900
PROMPTS = ["Tell me a story about a dragon.", "How do I bake bread?", "Explain gravity to a child."]
COLUMNS = ["part", "MiB"]
MiB = 2**20


def mappings(pid: int) -> dict[str, float]:
    """Resident MiB per mapping name (anonymous ones as [anon])."""
    out: dict[str, float] = {}
    name = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            parts = line.split()
            name = parts[5] if len(parts) > 5 else "[anon]"
        elif line.startswith("Rss:") and name is not None:
            out[name] = out.get(name, 0.0) + int(line.split()[1]) / 1024
    return out


def weights_logged(log: str) -> dict[str, float]:
    """Each backend's weights (MiB) from its ready line."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"(target|draft) backend ready .*?weights (\d+) MiB", log)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve-args", default="", help="more flags for specdec serve (one string, shell-split)")
    ap.add_argument("--max-tokens", type=int, default=64)
    add_common_args(ap)
    add_strict_arg(ap)
    a = ap.parse_args()
    import shlex

    import psutil

    tmp = Path(tempfile.mkdtemp(prefix="specdec-bench-memory-"))
    argv = ["serve", "--host", HOST, *shlex.split(a.serve_args)]
    if a.smoke:
        smoke_environment(tmp)
        tiny = smoke_models(tmp)
        argv[1:1] = [tiny.target, "--speculative-config", json.dumps(
            {"method": "draft_model", "model": tiny.draft, "num_speculative_tokens": 2}), "--num-threads", "1"]
        a.max_tokens = 8
    gp, hp = free_port(), free_port()
    proc = ServiceProc("serve", [*argv, "--port", str(hp), "--grpc-port", str(gp)], tmp, gp, http_port=hp)
    cpu = cpu_info()
    print(f"specdec {' '.join(argv)}; CPU {cpu['model']}, {cpu['cores']} cores, flags {' '.join(cpu['flags'])}",
          flush=True)
    try:
        proc.launch().wait_ready(900)
        started = psutil.Process(proc.pid).memory_info().rss / MiB
        answered = 0
        for prompt in PROMPTS:
            status, body = http_json(hp, "POST", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": prompt}], "max_tokens": a.max_tokens}, 600)
            answered += status == 200 and bool(body["choices"][0]["message"]["content"])
            if status != 200:
                print(f"a request failed: {status} {body}", flush=True)
        time.sleep(1)
        rss = psutil.Process(proc.pid).memory_info().rss / MiB
        maps = mappings(proc.pid)
    finally:
        proc.stop()
    weights = weights_logged(proc.log_path.read_text(errors="replace"))
    libs = {k: v for k, v in maps.items() if k.startswith("/") and ".so" in k}
    files = {k: v for k, v in maps.items() if k.startswith("/") and k not in libs}
    rows = [{"part": "resident after the requests", "MiB": rss},
            {"part": "resident when ready", "MiB": started},
            {"part": "anonymous (weights, KV written, Python objects)", "MiB": maps.get("[anon]", 0.0)},
            {"part": "C heap (tokenizers, protobuf, gRPC)", "MiB": maps.get("[heap]", 0.0)},
            {"part": "shared libraries", "MiB": sum(libs.values())},
            *({"part": f"  {Path(k).name}", "MiB": v} for k, v in sorted(libs.items(), key=lambda kv: -kv[1])[:4]),
            {"part": "mapped files (model weights read in place)", "MiB": sum(files.values())},
            *({"part": f"  weights held by the {role}", "MiB": mib} for role, mib in weights.items())]
    print()
    print_table(rows, COLUMNS)
    goals = {f"resident after three requests <= {GOAL_MIB} MiB": rss <= GOAL_MIB}
    checks = {"three requests answered 200 with text": answered == len(PROMPTS)}
    status = report_checks(checks, goals, a.strict and not a.smoke)
    write_json(json_path(a, "serve_memory"), {"smoke": a.smoke, "cpu": cpu, "argv": argv, "rows": rows,
                                              "resident_mib": rss, "weights_mib": weights, "answered": answered,
                                              "libraries_mib": libs, "checks": checks, "goals": goals})
    shutil.rmtree(tmp, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

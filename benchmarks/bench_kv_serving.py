"""The KV block pool as served: long prompts, prefix caching, memory under a budget, through ``specdec serve``.

Each section starts its own ``specdec serve`` (a subprocess: ``soak.ServiceProc``) on the embedded default
pair and sends greedy requests (temperature 0, ``ignore_eos``); prompts are token slices of the repository's
text (README.md, the packages' ``.py`` files), different for every request. The KV pools' /metrics series
(``specdec_prefix_cache_{hits,queries}_total``, ``specdec_num_preemptions_total``, ``specdec_kv_cache_usage_ratio``)
and serve's KV flags are used where they exist (else a note says so).

  long    N long prompts (gRPC streams), one after another and all at once on one server (alternating, best
          of ``--repeats``), prefix caching off. Decode tokens/s: tokens after each stream's first response
          over the union of the [first, last response] intervals; e2e tokens/s; time to first token (TTFT);
          each stream's tokens must be the same in both modes (exit 1 if not).
  prefix  one long chat system message, different short questions one after another (HTTP SSE): TTFT of
          request 1 vs the median of the rest (goal <= 1/5), the target's prefix-cache hit rate.
  memory  ``--kv-cache-memory`` (``--draft-kv-cache-memory``) = ``--budget-fraction`` of the offered load's KV bytes
          (requests x (prompt + max_tokens) x 2 x layers x kv heads x head dim x dtype size; SmolLM2-135M fp32:
          46,080 per token). All requests at once (HTTP, no queue-time limit): each must answer 200, and
          ``--alone`` of them, sent alone afterwards, must answer the same (exit 1 if not). Peak RSS of serve's
          processes during the burst (psutil samples; /proc VmHWM, reset through clear_refs) vs 1.25 x
          (weights + KV) and 1.25 x (start-up RSS + KV), KV = each pool's budget capped by the load. Weights =
          parameters x dtype size (the lean forward's packed copies and the runtime show in start-up RSS only).

Checks (answers right and answered) print PASS/FAIL, and a FAIL exits 1; goals (TTFT, RSS) print PASS/MISS,
informational unless ``--strict``.

    python benchmarks/bench_kv_serving.py                      # all three sections at full size
    python benchmarks/bench_kv_serving.py --sections long      # one section (long, prefix, memory)
    python benchmarks/bench_kv_serving.py --sections memory --memory-requests 64 --alone 64
    python benchmarks/bench_kv_serving.py --smoke              # tiny random-weight pair, tiny sizes
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_common_args, add_strict_arg, cpu_info, json_path, print_table, ratio,  # noqa: E402
                    report_checks, sections_of, served_pair, smoke_environment, smoke_models, write_json)
from served import HOST, ROOT, Result, ServiceProc, free_port, http_json, http_stream, scrape  # noqa: E402

from specdec.v1 import common_pb2, generation_service_pb2 as pb, generation_service_pb2_grpc  # noqa: E402

SECTIONS = ("long", "prefix", "memory")
SIZES = {  # flag: (default, under --smoke)
    "long_streams": (8, 2), "long_prompt_tokens": (4000, 96), "long_max_tokens": (32, 8), "repeats": (1, 1),
    "system_tokens": (1000, 64), "questions": (16, 4), "prefix_max_tokens": (8, 4),
    "memory_requests": (64, 12), "memory_prompt_tokens": (1000, 56), "memory_max_tokens": (16, 8)}
LONG_COLUMNS = ["mode", "streams", "decode tokens/s", "x sequential", "e2e tokens/s", "TTFT p50 s", "TTFT max s",
                "prefix hits", "identical"]
PREFIX_COLUMNS = ["requests", "TTFT s", "x request 1", "e2e s", "prefix hit rate"]
MEMORY_COLUMNS = ["quantity", "MiB", "peak / it", "peak within"]
HITS, QUERIES = "specdec_prefix_cache_hits_total", "specdec_prefix_cache_queries_total"
PREEMPTIONS, USAGE = "specdec_num_preemptions_total", "specdec_kv_cache_usage_ratio"
TIMEOUT_S, STARTUP_S, MiB = 3600.0, 900.0, 2**20
QUESTIONS = [f"{ask} the {topic} above?" for ask in ("In one sentence, what is", "Name one risk of", "Who calls",
                                                    "Give an example of") for topic in ("main class", "error handling",
                                                                                        "first function", "tests")]


# --------------------------------------------------------------------------------------------------
# prompts, models, the server, requests


def corpus_ids(tok, tokens: int) -> list[int]:
    """At least ``tokens`` token ids of the repository's text: README.md, then the packages' .py files, sorted."""
    files = [ROOT / "README.md"] + sorted(p for d in ("specdec", "gateway", "draft_service", "target_service",
                                                       "kernels") for p in (ROOT / d).rglob("*.py"))
    ids = tok.encode("".join(f"\n# {f.relative_to(ROOT)}\n{f.read_text(errors='replace')}" for f in files),
                     add_special_tokens=False)
    return ids * (tokens // len(ids) + 1)  # a small repository: around again


def model_facts(name: str | None, dtype: str) -> dict | None:
    """A model's folder, KV bytes per token and weight bytes (parameters x the served dtype's size)."""
    if not name:
        return None
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig

    from specdec.model_files import resolve_model_path

    folder = Path(resolve_model_path(name)[0])
    cfg = AutoConfig.from_pretrained(folder).get_text_config()
    if dtype == "auto":  # what the services load on CPU: the dtype measured faster here (cached)
        from specdec.engine.dtype_choice import cpu_auto_dtype

        inter = getattr(cfg, "intermediate_size", None)
        size = (cpu_auto_dtype(cfg.hidden_size, inter) if inter else torch.float32).itemsize
    else:
        size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    params = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as sf:
            params += sum(math.prod(sf.get_slice(k).get_shape()) for k in sf.keys())
    return {"folder": str(folder), "kv_bytes_per_token": 2 * cfg.num_hidden_layers * kv_heads * head_dim * size,
            "weight_bytes": params * size}


def serve_help() -> str:
    """``specdec serve --help`` of the code the servers run (ServiceProc puts the repository first on PYTHONPATH)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "specdec.entrypoints.cli", "serve", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300).stdout


@contextlib.contextmanager
def serve(name: str, base: list[str], extra: list[str], log_dir: Path):
    gp, hp = free_port(), free_port()
    proc = ServiceProc(name, ["serve", *base, "--port", str(hp), "--grpc-port", str(gp), *extra], log_dir, gp,
                       http_port=hp)
    try:
        yield proc.launch().wait_ready(STARTUP_S)
    finally:
        proc.stop()


def generate(stub, prompt: list[int], max_tokens: int) -> dict:
    """One greedy gRPC stream: when it began, its first response (time, tokens) and last, its tokens and text."""
    req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                             sampling_params=common_pb2.SamplingParams(temperature=0))
    out = {"began": time.monotonic(), "first": None, "first_tokens": 0, "ids": [], "text": ""}
    for resp in stub.Generate(req, timeout=TIMEOUT_S):
        if resp.token_ids and out["first"] is None:
            out["first"], out["first_tokens"] = time.monotonic(), len(resp.token_ids)
        out["ids"] += resp.token_ids
        out["text"] += resp.text
    out["end"] = time.monotonic()
    return out


def chat(port: int, system: str, question: str, max_tokens: int, count_tokens) -> Result:
    """One greedy chat completion, streamed (SSE): its TTFT (first text) and end."""
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    res = Result("greedy", "http", time.monotonic())
    http_stream(port, "/v1/chat/completions", body, TIMEOUT_S, res, count_tokens=count_tokens)
    res.ttft = res.e2e if res.ttft is None else res.ttft  # no text at all (special tokens only): the end
    return res


def counters(port: int) -> dict[str, dict[str, float] | None]:
    """The KV pools' series on /metrics: name -> {service: value} (None: not exposed)."""
    out: dict[str, dict[str, float] | None] = {name: None for name in (HITS, QUERIES, PREEMPTIONS, USAGE)}
    for (name, labels), value in scrape(port).items():
        if name in out:
            service = dict(labels).get("service", "")
            out[name] = {**(out[name] or {}), service: (out[name] or {}).get(service, 0.0) + value}
    return out


def delta(after: dict, before: dict, name: str) -> dict[str, float] | None:
    if after[name] is None:
        return None
    return {s: v - (before[name] or {}).get(s, 0.0) for s, v in after[name].items()}


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total, end = total + b - max(a, end), b
    return total


def in_threads(fn, items: list) -> list:
    """fn(item) for every item at once, one thread each; results in order (the first error re-raised)."""
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        return list(pool.map(fn, items))


# --------------------------------------------------------------------------------------------------
# the sections


def long_prompts(a, base, flags: str, ids: list[int], log_dir, notes: list[str]) -> dict:
    n, length = a.long_streams, a.long_prompt_tokens
    prompts = [ids[i * length:(i + 1) * length] for i in range(n + 1)]  # the last one warms up
    extra = ["--no-enable-prefix-caching"] if "--no-enable-prefix-caching" in flags else []
    if not extra:
        notes.append("long: serve has no --no-enable-prefix-caching: the second mode may find its prompts cached")
    runs: dict[str, list[dict]] = {"sequential": [], "concurrent": []}
    with serve("serve-long", base, extra, log_dir) as srv, grpc.insecure_channel(srv.address) as channel:
        stub = generation_service_pb2_grpc.GenerationServiceStub(channel)
        generate(stub, prompts.pop(), 4)
        for r in range(a.repeats):
            for mode in (("sequential", "concurrent") if r % 2 == 0 else ("concurrent", "sequential")):
                before, t = counters(srv.http_port), time.monotonic()
                fn = (lambda p: generate(stub, p, a.long_max_tokens))
                outs = in_threads(fn, prompts) if mode == "concurrent" else [fn(p) for p in prompts]
                wall, after = time.monotonic() - t, counters(srv.http_port)
                ttfts = [o["first"] - o["began"] for o in outs]
                decode = union_seconds([(o["first"], o["end"]) for o in outs])
                decode_tokens = sum(len(o["ids"]) - o["first_tokens"] for o in outs)
                runs[mode].append({"decode tokens/s": ratio(decode_tokens, decode),
                                   "e2e tokens/s": sum(len(o["ids"]) for o in outs) / wall, "wall_s": wall,
                                   "TTFT p50 s": statistics.median(ttfts), "TTFT max s": max(ttfts), "ttfts": ttfts,
                                   "prefix_hits": delta(after, before, HITS), "ids": [o["ids"] for o in outs],
                                   "texts": [o["text"] for o in outs]})
                print(f"long, repeat {r + 1}, {mode}: {runs[mode][-1]['decode tokens/s'] or 0:.2f} decode tokens/s, "
                      f"{wall:.1f} s", flush=True)
    reference = runs["sequential"][0]["ids"]
    same = {m: [all(run["ids"][i] == reference[i] for run in rs) for i in range(n)] for m, rs in runs.items()}
    best = {m: max(rs, key=lambda x: x["decode tokens/s"] or 0) for m, rs in runs.items()}
    rows = [{"mode": m, "streams": n, **{c: best[m][c] for c in LONG_COLUMNS[2:] if c in best[m]},
             "x sequential": ratio(best[m]["decode tokens/s"], best["sequential"]["decode tokens/s"]),
             "prefix hits": (best[m]["prefix_hits"] or {}).get("target"), "identical": all(same[m])} for m in runs]
    mismatched = [i for i in range(n) if not (same["concurrent"][i] and same["sequential"][i])]
    return {"rows": rows, "runs": runs, "mismatched_streams": mismatched, "prompt_tokens": length,
            "decode_concurrent_over_sequential": rows[1]["x sequential"], "prefix_caching_off": bool(extra)}


def prefix_caching(a, base, tok, ids: list[int], count, log_dir) -> dict:
    system = tok.decode(ids[:a.system_tokens])
    questions = [QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" ({i})") for i in range(a.questions)]
    results = []
    with serve("serve-prefix", base, [], log_dir) as srv:
        chat(srv.http_port, "Be brief.", "Say hello.", 4, count)  # warm-up, another system message
        for q in questions:
            before = counters(srv.http_port)
            res = chat(srv.http_port, system, q, a.prefix_max_tokens, count)
            after = counters(srv.http_port)
            results.append({"question": q, "ttft": res.ttft, "e2e": res.e2e, "tokens": res.tokens, "text": res.text,
                            "hits": delta(after, before, HITS), "queries": delta(after, before, QUERIES)})

    def hit_rate(rs: list[dict]) -> float | None:  # the target's
        if any(r["hits"] is None or r["queries"] is None for r in rs):
            return None
        return ratio(sum(r["hits"].get("target", 0) for r in rs), sum(r["queries"].get("target", 0) for r in rs))

    first, rest = results[0], results[1:]
    median = statistics.median(r["ttft"] for r in rest)
    rows = [{"requests": "request 1 (cold)", "TTFT s": first["ttft"], "x request 1": 1.0, "e2e s": first["e2e"],
             "prefix hit rate": hit_rate([first])},
            {"requests": f"requests 2-{len(results)} (median)", "TTFT s": median, "x request 1": median / first["ttft"],
             "e2e s": statistics.median(r["e2e"] for r in rest), "prefix hit rate": hit_rate(rest)}]
    return {"rows": rows, "requests": results, "system_tokens": a.system_tokens,
            "ttft_rest_over_first": median / first["ttft"]}


@contextlib.contextmanager
def watch_rss(pid: int, port: int):
    """While inside: the RSS of serve's process and its children every 0.25 s, and the KV usage gauge. On entry
    each process's VmHWM is reset to its RSS (``clear_refs``, where the kernel allows), so that on exit VmHWM
    also covers what happened between samples. Yields a dict that is filled in on exit."""
    import psutil

    root, out, halt = psutil.Process(pid), {"processes": [], "kv_usage_peak": None}, threading.Event()
    procs = {p.pid: {"pid": p.pid, "cmdline": " ".join(p.cmdline()[:5]), "rss_start": p.memory_info().rss,
                     "peak_sampled": 0, "hwm_reset": True} for p in [root, *root.children(recursive=True)]}
    for rec in procs.values():
        try:
            Path(f"/proc/{rec['pid']}/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
        except OSError:
            rec["hwm_reset"] = False

    def loop() -> None:
        for tick in itertools.count():
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    rec = procs.setdefault(p.pid, {"pid": p.pid, "rss_start": 0, "peak_sampled": 0,
                                                   "hwm_reset": False})
                    rec["peak_sampled"] = max(rec["peak_sampled"], p.memory_info().rss)
            with contextlib.suppress(Exception):
                for service, u in ((counters(port)[USAGE] or {}).items() if tick % 2 == 0 else ()):
                    peaks = out["kv_usage_peak"] = out["kv_usage_peak"] or {}
                    peaks[service] = max(u, peaks.get(service, 0.0))
            if halt.wait(0.25):
                return

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        halt.set()
        thread.join(30)
        for rec in procs.values():
            with contextlib.suppress(OSError, StopIteration):
                status = Path(f"/proc/{rec['pid']}/status").read_text().splitlines()
                rec["vmhwm"] = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
            rec["peak"] = max(rec["peak_sampled"], rec.get("vmhwm", 0)) if rec["hwm_reset"] else rec["peak_sampled"]
        out["processes"] = list(procs.values())


def memory(a, base, flags: str, ids: list[int], models: dict, log_dir, notes: list[str]) -> dict:
    from specdec.engine.kv_cache import DEFAULT_BLOCK_SIZE, DEFAULT_KV_CACHE_MEMORY

    n, length, new = a.memory_requests, a.memory_prompt_tokens, a.memory_max_tokens
    offered = {role: n * (length + new) * m["kv_bytes_per_token"] for role, m in models.items() if m}
    bs = a.block_size or DEFAULT_BLOCK_SIZE  # at least two requests' whole blocks (+ a round's drafts), or none fits
    two = {role: 2 * bs * -(-(length + new + 8) // bs) * m["kv_bytes_per_token"] for role, m in models.items() if m}
    budgets = {role: max(int(a.budget_fraction * b), two[role]) for role, b in offered.items()}
    if any(budgets[role] == two[role] for role in budgets):
        notes.append(f"memory: --budget-fraction of {n} requests holds fewer than two: budgets raised to two")
    extra = ["--max-queue-time-seconds", str(TIMEOUT_S)]  # requests wait for KV room: never refused for the wait
    if "--kv-cache-memory" not in flags:
        notes.append(f"memory: serve has no --kv-cache-memory: both pools keep the default {DEFAULT_KV_CACHE_MEMORY} "
                     "bytes")
        budgets = {role: DEFAULT_KV_CACHE_MEMORY for role in budgets}
    elif "--draft-kv-cache-memory" in flags and "draft" in budgets:
        extra += ["--kv-cache-memory", str(budgets["target"]), "--draft-kv-cache-memory", str(budgets["draft"])]
    else:
        extra += ["--kv-cache-memory", str(budgets["target"])]
        budgets = {role: budgets["target"] for role in budgets}  # one flag, both pools
    kv = {role: min(budgets[role], offered[role]) for role in budgets}  # what each pool can hold of this load
    prompts = [ids[i * length:(i + 1) * length] for i in range(n)]

    def send(prompt: list[int]) -> dict:
        body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
        try:
            status, out = http_json(srv.http_port, "POST", "/v1/completions", body, TIMEOUT_S)
        except OSError as exc:
            return {"status": None, "text": None, "error": f"{type(exc).__name__}: {exc}"}
        ok = status == 200
        return {"status": status, "text": out["choices"][0]["text"] if ok else None, "error": None if ok else out}

    with serve("serve-memory", base, extra, log_dir) as srv:
        send(ids[-48:])  # warm-up
        before, t = counters(srv.http_port), time.monotonic()
        with watch_rss(srv.pid, srv.http_port) as rss:
            burst = in_threads(send, prompts)
        wall, after, procs = time.monotonic() - t, counters(srv.http_port), rss["processes"]
        spread = sorted({round(i * (n - 1) / max(1, a.alone - 1)) for i in range(a.alone)})
        alone = {i: send(prompts[i]) for i in spread}
    peak, start = sum(p["peak"] for p in procs), sum(p["rss_start"] for p in procs)
    weights, kv_total = sum(m["weight_bytes"] for m in models.values() if m), sum(kv.values())
    limits = {"1.25 x (weights + KV)": 1.25 * (weights + kv_total),
              "1.25 x (start-up RSS + KV)": 1.25 * (start + kv_total)}
    rows = [{"quantity": "peak RSS during the burst", "MiB": peak / MiB},
            {"quantity": "start-up RSS (after warm-up)", "MiB": start / MiB, "peak / it": peak / start},
            {"quantity": "weights (target + draft)", "MiB": weights / MiB},
            {"quantity": "KV (budgets, capped by the load)", "MiB": kv_total / MiB}]
    rows += [{"quantity": k, "MiB": v / MiB, "peak / it": peak / v, "peak within": peak <= v}
             for k, v in limits.items()]
    same = {i: r["status"] == 200 and r["text"] == burst[i]["text"] for i, r in alone.items()}
    return {"rows": rows, "requests": n, "prompt_tokens": length, "max_tokens": new, "wall_s": wall,
            "answered_200": sum(r["status"] == 200 for r in burst), "statuses": [r["status"] for r in burst],
            "errors": [r["error"] for r in burst if r["error"]][:5], "alone_checked": len(same),
            "alone_identical": sum(same.values()), "mismatched_requests": [i for i, s in same.items() if not s],
            "offered_kv_bytes": offered, "kv_budget_bytes": budgets, "kv_bytes": kv, "serve_flags": extra,
            "processes": procs, "peak_rss_bytes": peak, "startup_rss_bytes": start, "weight_bytes": weights,
            "limits_bytes": limits, "preemptions": delta(after, before, PREEMPTIONS),
            "kv_usage_peak": rss["kv_usage_peak"], "prefix_hits": delta(after, before, HITS)}


# --------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--target", default=None, help="target model (default: the embedded default pair's)")
    ap.add_argument("--speculative-config", default=None, help="JSON (default: the embedded default pair's)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of the served models (0: all cores)")
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=None, help="serve's --block-size, where it has it")
    for name, (default, _) in SIZES.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=default, help=f"default {default}")
    ap.add_argument("--budget-fraction", type=float, default=0.25, help="memory: KV budget / the load's KV bytes")
    ap.add_argument("--alone", type=int, default=16, help="memory: requests re-sent alone to compare, spread evenly "
                                                         "over the burst (default 16; --smoke: all)")
    add_common_args(ap)
    add_strict_arg(ap)
    a = ap.parse_args()
    sections = sections_of(ap, a.sections, SECTIONS)
    out_path = json_path(a, "kv_serving")
    target, spec = served_pair(a)
    tmp = Path(tempfile.mkdtemp(prefix="specdec-bench-kv-"))  # the servers' logs (kept unless all went right)
    if a.smoke:
        smoke_environment(tmp)  # the servers inherit its environment
        tiny = smoke_models(tmp)
        target, spec = tiny.target, {"method": "draft_model", "model": tiny.draft, "num_speculative_tokens": 2}
        a.threads, a.alone = 1, SIZES["memory_requests"][1]
        for name, (_, small) in SIZES.items():
            setattr(a, name, small)
    a.alone = max(1, min(a.alone, a.memory_requests))
    models = {"target": model_facts(target, a.dtype), "draft": model_facts((spec or {}).get("model"), a.dtype)}
    from specdec.model_files import load_tokenizer

    tok = load_tokenizer(target)
    count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    ids = corpus_ids(tok, 64 + max((a.long_streams + 1) * a.long_prompt_tokens, a.system_tokens,
                                   a.memory_requests * a.memory_prompt_tokens))
    flags, notes = serve_help(), []
    base = [target, "--host", HOST, "--dtype", a.dtype, "--num-threads", str(a.threads), "--max-batch-size",
            str(a.max_batch_size)] + (["--speculative-config", json.dumps(spec)] if spec else [])
    if a.block_size is not None and "--block-size" in flags:
        base += ["--block-size", str(a.block_size)]
    elif a.block_size is not None:
        notes.append("serve has no --block-size: the default block size is used")
    log_dir = tmp / "logs"
    log_dir.mkdir()
    cpu = cpu_info()
    print(f"target {target} ({a.dtype}), speculative_config {json.dumps(spec)}, greedy; CPU {cpu['model']}, "
          f"{cpu['cores']} cores; logs in {log_dir}", flush=True)
    results: dict[str, dict] = {}
    checks: dict[str, tuple[bool, bool]] = {}  # name -> (passed, a correctness check: exit 1 when it fails)
    if "long" in sections:
        r = results["long"] = long_prompts(a, base, flags, ids, log_dir, notes)
        print(f"\nlong prompts: {a.long_streams} streams x {a.long_prompt_tokens} prompt tokens x {a.long_max_tokens} "
              f"new tokens, best of {a.repeats}\n")
        print_table(r["rows"], LONG_COLUMNS)
        print(f"\nconcurrent / sequential decode tokens/s: {r['decode_concurrent_over_sequential'] or 0:.2f}")
        checks["long: every stream's tokens are the same concurrently and sequentially"] = (
            not r["mismatched_streams"], True)
    if "prefix" in sections:
        r = results["prefix"] = prefix_caching(a, base, tok, ids, count, log_dir)
        print(f"\nprefix caching: a {a.system_tokens}-token system message, {a.questions} questions one after "
              f"another, {a.prefix_max_tokens} tokens each\n")
        print_table(r["rows"], PREFIX_COLUMNS)
        checks["prefix: median TTFT of requests 2-N <= 1/5 of request 1's"] = (r["ttft_rest_over_first"] <= 0.2, False)
    if "memory" in sections:
        r = results["memory"] = memory(a, base, flags, ids, models, log_dir, notes)
        print(f"\nmemory under a budget: {a.memory_requests} concurrent requests x {a.memory_prompt_tokens} prompt "
              f"tokens x {a.memory_max_tokens} new tokens; KV budgets {r['kv_budget_bytes']} bytes, the load's "
              f"{r['offered_kv_bytes']}\n")
        print_table(r["rows"], MEMORY_COLUMNS)
        print(f"\n{r['answered_200']}/{r['requests']} answered 200 in {r['wall_s']:.1f} s; {r['alone_identical']}/"
              f"{r['alone_checked']} identical to the request alone; preemptions {r['preemptions']}; "
              f"peak KV usage {r['kv_usage_peak']}")
        checks["memory: every request answered 200"] = (r["answered_200"] == r["requests"], True)
        checks["memory: every output checked equals the request alone"] = (not r["mismatched_requests"], True)
        for name, v in r["limits_bytes"].items():
            checks[f"memory: peak RSS <= {name}"] = (r["peak_rss_bytes"] <= v, False)
    print()
    for note in notes:
        print(f"note: {note}")
    status = report_checks({n: ok for n, (ok, correctness) in checks.items() if correctness},
                           {n: ok for n, (ok, correctness) in checks.items() if not correctness}, a.strict)
    write_json(out_path, {"smoke": a.smoke, "cpu": cpu, "target": str(target), "speculative_config": spec,
                          "dtype": a.dtype, "args": vars(a), "models": models, "notes": notes,
                          "serve_flags": {f: f in flags for f in ("--kv-cache-memory", "--draft-kv-cache-memory",
                                                                   "--block-size", "--no-enable-prefix-caching")},
                          "sections": results, "checks": {n: ok for n, (ok, c) in checks.items() if c},
                          "goals": {n: ok for n, (ok, c) in checks.items() if not c}})
    if status:
        print(f"the servers' logs: {log_dir}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

"""Shared helpers for the benchmark scripts: prompts, timing, tables, JSON, and ``--smoke`` models.

The benchmarks use specdec's public API only (``LLM``, ``SamplingParams``, outputs'
``spec_decode_stats``, ``start_stack(ServeConfig(...))`` and its gRPC endpoints, and library names
without a leading underscore), so they keep running as the internals change. Every script has a
``--smoke`` mode (tiny sizes, seconds on 2 cores) that ``tests/benchmarks/test_smoke.py`` runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# two prose, two code prompts: kept once, in the package (`specdec bench --dataset short` sends them too)
PROMPTS = json.loads((Path(__file__).resolve().parents[1] / "specdec/assets/prompts/short.json").read_text())["prompts"]
SMOKE_PROMPTS = [PROMPTS[0], PROMPTS[2]]  # one prose, one code


def cpu_info() -> dict:
    """CPU model, cores and the SIMD / matrix flags (lscpu) that decide a forward pass's speed."""
    info: dict = {"model": None, "cores": len(os.sched_getaffinity(0)), "flags": []}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    flags: set[str] = set()
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name" and info["model"] is None:
            info["model"] = value.strip()
        elif key.strip() == "Flags":
            flags = set(value.split())
    info["flags"] = sorted(f for f in flags if f == "avx2" or f.startswith("avx512") or f.startswith("amx"))
    info["amx"] = any(f.startswith("amx") for f in flags)
    info["load_average_start"] = list(os.getloadavg())
    return info


# --------------------------------------------------------------------------------------------------
# command line


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes (tiny random-weight models unless the script says otherwise) that finish in "
                         "seconds: checks that the script runs, not how fast anything is")
    ap.add_argument("--out", "--json", dest="json", default=None,
                    help="where to write the JSON (default: bench_results/NAME.json; with --smoke, a temporary folder)")


def sections_of(ap: argparse.ArgumentParser, value: str, known: tuple[str, ...]) -> list[str]:
    """The sections a comma-separated ``--sections`` names (a usage error for none or an unknown one)."""
    sections = [s.strip() for s in value.split(",") if s.strip()]
    if not sections or set(sections) - set(known):
        ap.error(f"--sections takes {', '.join(known)}")
    return sections


def served_pair(a: argparse.Namespace) -> tuple[str, dict | None]:
    """(target, speculative_config) of a served benchmark: ``--target`` and ``--speculative-config`` (JSON), else
    the embedded default pair's."""
    from specdec.config import DEFAULT_TARGET, default_speculative_config

    spec = json.loads(a.speculative_config) if a.speculative_config else default_speculative_config()
    return a.target or DEFAULT_TARGET, spec


def json_path(args: argparse.Namespace, name: str) -> Path:
    if args.json:
        return Path(args.json)
    if args.smoke:
        return Path(tempfile.mkdtemp(prefix="specdec-bench-smoke-")) / f"{name}.json"
    return Path("bench_results") / f"{name}.json"


# --------------------------------------------------------------------------------------------------
# timing


def step_ms(runner, n: int, context: int, reps: int, warmup: int = 3) -> float:
    """Median wall time of one ``ModelRunner.forward`` pass of ``n`` new tokens after ``context`` cached
    ones, exactly as the workers call it (KV cache, logits of the ``n`` positions out). The cache is rolled
    back to the context before each pass by ``ModelRunner.sync``."""
    g = torch.Generator().manual_seed(0)
    vocab = min(runner.lm.vocab_size, len(runner.lm.tokenizer))
    ids = torch.randint(0, vocab, (context + n,), generator=g).tolist()
    sid = f"bench-step-{n}-{context}"
    seq = runner.get_or_create(sid, 0)
    try:
        runner.forward(seq, runner.sync(seq, ids[:context]))
        times = []
        for _ in range(reps + warmup):
            runner.sync(seq, ids[:context + 1])  # keeps exactly the context cached
            t = time.perf_counter()
            runner.forward(seq, ids[context:], num_logits=n)
            times.append(time.perf_counter() - t)
    finally:
        runner.release(sid)
    times = sorted(times[warmup:])
    return 1000 * times[len(times) // 2]


def solve_alpha(mean_accepted: float, k: int) -> float:
    """Per-token acceptance α such that E[accepted] = α(1-α^k)/(1-α) equals the measured mean."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        e = sum(mid**i for i in range(1, k + 1))
        lo, hi = (mid, hi) if e < mean_accepted else (lo, mid)
    return (lo + hi) / 2


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing or b is 0 (a smoke run may draft nothing)."""
    return a / b if a is not None and b else None


# --------------------------------------------------------------------------------------------------
# output


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max([len(c)] + [len(_fmt(r.get(c))) for r in rows]) for c in columns}  # (no rows: the header)
    print("  ".join(c.ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if not math.isnan(v) else "nan"
    return str(v)


def add_strict_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--strict", action="store_true", help="a missed goal (speed, memory) fails the run too")


def report_checks(checks: dict[str, bool], goals: dict[str, bool] | None = None, strict: bool = False) -> int:
    """Print a line per check and per goal; return the exit status (1 when a line says FAIL, else 0).

    A check is a property the run must have (every request answered, answers identical, no error): ``PASS: name``
    or ``FAIL: name``. A goal is a speed or size target, informational on a small shared machine: ``PASS: name``
    or ``MISS: name (a goal; --strict fails on it)``, and under ``strict`` a missed goal is a ``FAIL``."""
    failed = False
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
        failed |= not ok
    for name, ok in (goals or {}).items():
        print(f"PASS: {name}" if ok else f"FAIL: {name} (a goal, --strict)" if strict
              else f"MISS: {name} (a goal; --strict fails on it)")
        failed |= strict and not ok
    return 1 if failed else 0


def write_json(path: str | Path, payload: dict) -> None:
    """The JSON result, and beside it (same stem) a PNG of what it holds that plots well: see :func:`plot_panels`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": {"platform": platform.platform(), "threads": torch.get_num_threads(),
                           "torch": torch.__version__}, **payload}
    path.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {path}")
    write_plot(path.with_suffix(".png"), payload)


# --------------------------------------------------------------------------------------------------
# plots (specdec.plots): found by the result's shape, so every script gets its PNG from write_json alone


def plot_panels(payload: dict) -> list[tuple[str, object]]:
    """The panels a result's PNG shows: tokens/s vs concurrency where its rows sweep ``streams``, acceptance per
    draft position where it holds speculation stats with ``accepted_per_position``. None: no PNG."""
    panels: list[tuple[str, object]] = []
    sweep = sweep_rows(payload.get("rows") or [])
    if sweep:
        panels.append(("throughput", sweep))
    rates = position_rates(payload)
    if rates:
        panels.append(("acceptance", rates))
    return panels


def sweep_rows(rows: list) -> list[dict]:
    """Rows over two or more ``streams`` levels as ``{"setup", "streams", "tokens/s"}``: a line per setup (the
    row's text columns: setup, dtype, mode...) and per throughput column (``tokens/s``, ``on tok/s``...)."""
    rows = [r for r in rows if isinstance(r, dict) and isinstance(r.get("streams"), int)]
    if len({r["streams"] for r in rows}) < 2:
        return []
    out = []
    for r in rows:
        name = " ".join(v for v in r.values() if isinstance(v, str))
        columns = [c for c, v in r.items() if c.endswith(("tokens/s", "tok/s")) and isinstance(v, (int, float))]
        out += [{"setup": name if len(columns) == 1 else f"{name}, {c}", "streams": r["streams"], "tokens/s": r[c]}
                for c in columns]
    return out


def position_rates(payload: dict, limit: int = 8) -> dict[str, list[float]]:
    """Acceptance rate per draft position of each speculation stats dict in the payload (``SpecDecodeStats.as_dict()``
    with drafts: ``spec_stats``, ``details[setup]["spec_stats"]``...), labelled by the keys leading to it."""
    from specdec.plots import per_position_rates

    found: dict[str, list[float]] = {}

    def walk(node: dict, keys: list[str]) -> None:
        if node.get("accepted_per_position") and node.get("num_drafts"):
            found[" / ".join(keys) or "specdec"] = per_position_rates(node["accepted_per_position"], node["num_drafts"])
            return
        for key, value in node.items():
            if isinstance(value, dict) and len(found) < limit:
                walk(value, keys if key in ("spec_stats", "details") else [*keys, str(key)])

    walk(payload, [])
    return found


def write_plot(path: Path, payload: dict) -> Path | None:
    """Draw :func:`plot_panels` into ``path``; without matplotlib (or on any plotting error) a warning, no PNG."""
    panels = plot_panels(payload)
    if not panels:
        return None
    from specdec import plots

    title = f"benchmarks/{Path(sys.argv[0]).name}"
    if isinstance(payload.get("target"), str):
        title += f", target {Path(payload['target']).name}"
    if payload.get("smoke"):
        title += " (--smoke: tiny random-weight models, not a measurement)"
    cpu = payload["cpu"] if isinstance(payload.get("cpu"), dict) and "model" in payload["cpu"] else cpu_info()
    try:
        plots.save_figure(path, panels, title=title, caption=plots.machine_caption(cpu, torch.__version__))
    except Exception as exc:  # noqa: BLE001 -- PlotsUnavailable's message says how to install matplotlib
        logging.getLogger(__name__).warning("no plot written (%s: %s)", type(exc).__name__, exc)
        return None
    print(f"wrote {path}")
    return path


class plain_linears:
    """Context manager: a specdec-loaded model's SkinnyLinear layers run as plain ``nn.Linear`` inside
    (transformers as shipped), for baselines that should not get specdec's fp32 CPU matmul path."""

    def __init__(self, *models):
        from specdec.engine.lean_linear import SkinnyLinear

        self.modules = [m for model in models for m in model.modules() if type(m) is SkinnyLinear]
        self.cls = SkinnyLinear

    def __enter__(self):
        for m in self.modules:
            m.__class__ = torch.nn.Linear
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            m.__class__ = self.cls
        return False


# --------------------------------------------------------------------------------------------------
# --smoke: tiny random-weight models, built on the fly (as tests/conftest.py builds its fixtures)

SMOKE_TLI_DRAFT_VOCAB = 8192  # ids kept in the TLI draft's smaller tokenizer
SMOKE_DRAFT_VOCAB_ROWS = 16384  # the tiny draft's draft_vocab.json, when asked for


@dataclass
class SmokeModels:
    target: str  # Llama, 2 layers, hidden 64, SmolLM2's tokenizer (49,152 ids)
    draft: str  # the target + small noise: same tokenizer, high acceptance
    tli_draft: str | None = None  # the target's layers over a different, smaller byte-level BPE vocabulary


def smoke_models(root: str | Path, *, draft_vocab: bool = False, tli: bool = False) -> SmokeModels:
    """Write tiny random-weight Hugging Face folders under ``root`` (a few seconds, nothing downloaded).

    The tokenizer is SmolLM2's, read from the embedded default draft's folder inside the package.
    ``draft_vocab``: the draft folder gets a ``draft_vocab.json`` (as the shipped draft has).
    ``tli``: also a draft whose tokenizer is SmolLM2's cut to its first 8,192 ids (a different
    vocabulary: a real Token-Level Intersection pair with the target, sharing ~8k tokens).
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specdec.config import default_draft_path
    from specdec.engine.models import DRAFT_VOCAB_FILE

    src = default_draft_path()
    if src is None:
        raise SystemExit("--smoke builds its models over SmolLM2's tokenizer, read from the embedded default "
                         "draft (specdec/assets/smollm2-135m-draft), which is missing")
    root = Path(root)
    tok = AutoTokenizer.from_pretrained(src)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.02, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(45.0)  # peaky next-token distributions, as in tests/conftest.py
        # mostly predicting ids the TLI draft's vocabulary shares, so its proposals get accepted too
        target.lm_head.weight[SMOKE_TLI_DRAFT_VOCAB:].mul_(0.5)
    out = SmokeModels(target=str(_save(target, tok, root / "target")), draft="")

    g = torch.Generator().manual_seed(1)
    noisy = {k: (v + 0.05 * v.std() * torch.randn(v.shape, generator=g) if v.dim() >= 2 else v).clone()
             for k, v in target.state_dict().items()}
    draft = LlamaForCausalLM(cfg).eval()
    draft.load_state_dict(noisy)
    draft_dir = _save(draft, tok, root / "draft")
    if draft_vocab:
        (draft_dir / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": list(range(SMOKE_DRAFT_VOCAB_ROWS))}))
    out.draft = str(draft_dir)

    if tli:
        small_tok = _truncated_tokenizer(src, root / "tli-tokenizer", SMOKE_TLI_DRAFT_VOCAB)
        small_cfg = LlamaConfig.from_dict({**cfg.to_dict(), "vocab_size": len(small_tok)})
        small = LlamaForCausalLM(small_cfg).eval()
        n = len(small_tok)  # ids below n stand for the same tokens in both tokenizers
        small.load_state_dict({k: v[:n].clone() if k in ("model.embed_tokens.weight", "lm_head.weight") else v
                               for k, v in target.state_dict().items()})
        out.tli_draft = str(_save(small, small_tok, root / "tli-draft"))
    return out


def _save(model, tokenizer, folder: Path) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _truncated_tokenizer(src: Path, folder: Path, n: int):
    """SmolLM2's byte-level BPE restricted to its first ``n`` ids (and the merges among them)."""
    from transformers import AutoTokenizer

    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = {piece: i for piece, i in spec["model"]["vocab"].items() if i < n}
    merges = []
    for m in spec["model"]["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ")
        if a in vocab and b in vocab and a + b in vocab:
            merges.append([a, b])
    spec["model"]["vocab"], spec["model"]["merges"] = vocab, merges
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < n]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "tokenizer_config.json").write_text((src / "tokenizer_config.json").read_text())
    return AutoTokenizer.from_pretrained(folder)


def smoke_environment(root: str | Path) -> None:
    """Keep a smoke run's caches (e.g. TLI vocabulary mappings of its throwaway tokenizers) out of the
    user's ``~/.cache/specdec``, and give tiny models one thread (2 fighting threads make them 10x slower)."""
    from transformers.utils import logging as hf_logging

    os.environ["SPECDEC_CACHE"] = str(Path(root) / "cache")
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars

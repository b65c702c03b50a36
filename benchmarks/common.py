"""Shared helpers for the benchmark scripts: prompts, timing, tables, JSON."""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path

import torch

PROMPTS = [
    # prose
    "The history of the printing press begins",
    "Photosynthesis is the process by which plants",
    # code
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "import json\n\ndef load_config(path):\n",
]


def step_cost_ms(model, n_tokens: int, context: int = 64, reps: int = 10) -> float:
    """Median wall time of one forward pass scoring n_tokens after `context` cached tokens."""
    from specdec.kv_cache import SequenceKVCache

    cfg = model.config.get_text_config()
    vocab = cfg.vocab_size
    ids = torch.randint(0, vocab, (1, context + n_tokens))
    kwarg = "cache" if "cache" in model.forward.__code__.co_varnames else "past_key_values"
    times = []
    with torch.inference_mode():
        for _ in range(reps + 2):
            cache = SequenceKVCache(cfg.num_hidden_layers, context + n_tokens)
            model(input_ids=ids[:, :context], position_ids=torch.arange(context)[None], use_cache=True,
                  logits_to_keep=1, **{kwarg: cache})
            t = time.perf_counter()
            model(input_ids=ids[:, context:], position_ids=torch.arange(context, context + n_tokens)[None],
                  use_cache=True, logits_to_keep=n_tokens, **{kwarg: cache})
            times.append(time.perf_counter() - t)
    times = sorted(times[2:])
    return 1000 * times[len(times) // 2]


def solve_alpha(mean_accepted: float, k: int) -> float:
    """Per-token acceptance α such that E[accepted] = α(1-α^k)/(1-α) equals the measured mean."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        e = sum(mid**i for i in range(1, k + 1))
        lo, hi = (mid, hi) if e < mean_accepted else (lo, mid)
    return (lo + hi) / 2


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
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


def write_json(path: str | Path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": {"platform": platform.platform(), "threads": torch.get_num_threads(),
                           "torch": torch.__version__}, **payload}
    path.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {path}")


class plain_linears:
    """Context manager: a specdec-loaded model's SkinnyLinear layers run as plain ``nn.Linear`` inside
    (transformers as shipped), for baselines that should not get specdec's fp32 CPU matmul path."""

    def __init__(self, *models):
        from specdec.models import SkinnyLinear

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

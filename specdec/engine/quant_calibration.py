"""Calibrating a quantization plan (``specdec.engine.quant_plan``) on a model, once, and caching it on disk.

The quantized weights, scales and smoothing vectors are cached as one safetensors file under
``$SPECDEC_CACHE/quantized`` keyed by the model's files, dtype, mode and draft vocabulary, so a later start
reads int8 tensors instead of calibrating (and skips the oneDNN weight packing of the float products).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from specdec.engine.cache_files import cache_root
from specdec.engine.lean_forward import lean_decoder
from specdec.engine.perplexity import perplexity, shipped_text
from specdec.engine.quant_plan import (_FORMAT, CALIBRATION_TOKENS, CANDIDATES, EVALUATION_TOKENS, PERPLEXITY_BUDGET,
                                       PRODUCTS, QUANTIZE_LM_HEAD, QuantPlan, activation_peaks, smoothing)

logger = logging.getLogger(__name__)


def calibration_tokens(tokenizer: Any, limit: int = CALIBRATION_TOKENS) -> list[int]:
    text = shipped_text("calibration")
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])[:limit]


def cache_path(source: str, dtype: torch.dtype, kind: str, vocab_subset: torch.Tensor | None,
               candidates: tuple, evaluate: bool) -> Path:
    """Where the plan of this model and mode is cached (keyed by its weight files' names, sizes and times)."""
    folder = Path(source)
    files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")) if folder.is_dir() else []
    key = {"format": _FORMAT, "source": str(folder.resolve()) if folder.exists() else source,
           "files": [(f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in files], "dtype": str(dtype),
           "kind": kind, "candidates": [list(c) for c in candidates], "evaluate": evaluate,
           "budget": PERPLEXITY_BUDGET if evaluate else None,
           "vocab": None if vocab_subset is None else hashlib.sha256(vocab_subset.cpu().numpy().tobytes()).hexdigest()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "quantized" / f"{folder.name}-{kind}-{digest}.safetensors"


def build_plan(lm: Any, kind: str, vocab_subset: torch.Tensor | None = None, alpha: float | None | str = "auto",
               quantize_head: bool | None = None, use_cache: bool = True,
               evaluate: bool | None = None) -> tuple[QuantPlan, Path | None]:
    """The plan for ``lm`` (a LoadedModel): from the cache if there, else calibrated now. Returns (plan,
    the cache file to write once the decoder is built, or None when it was read from there / not cached).

    By default (``alpha="auto"``) the settings of :data:`CANDIDATES` are tried in order and the first whose
    perplexity on the calibration text stays within :data:`PERPLEXITY_BUDGET` of the float model's is kept
    (``evaluate``; default: for a model with its whole vocabulary, i.e. not a draft restricted to a draft
    vocabulary, whose numerics change only the acceptance: it takes the first). Where none stays within it,
    the closest is kept and a warning says the mode is lossy for this model. An explicit ``alpha`` (None: no
    smoothing) and ``quantize_head`` make one candidate, not evaluated unless asked."""
    if alpha == "auto":
        candidates = CANDIDATES if quantize_head is None else tuple((a, quantize_head) for a, _ in CANDIDATES)
    else:
        candidates = ((alpha, QUANTIZE_LM_HEAD if quantize_head is None else quantize_head),)
    if evaluate is None:
        evaluate = alpha == "auto" and vocab_subset is None and len(candidates) > 1
    path = cache_path(lm.source, lm.dtype, kind, vocab_subset, candidates, evaluate) if use_cache else None
    if path is not None and path.is_file():
        try:
            plan = read_plan(kind, path)
            logger.info("%s: %s weights read from %s%s", lm.name, kind, path, plan.describe())
            if plan.rise is not None and plan.rise > PERPLEXITY_BUDGET:
                logger.warning("%s: %s is lossy for this model%s", lm.name, kind, plan.describe())
            return plan, None
        except Exception as exc:  # a truncated or foreign file: calibrate again and overwrite it
            logger.warning("%s: ignoring the unreadable quantization cache %s (%s)", lm.name, path, exc)
    if lm.tokenizer is None:
        logger.info("%s: no tokenizer to read the calibration text; %s products without smoothing", lm.name, kind)
        return QuantPlan(kind=kind, quantize_head=candidates[0][1]), path
    t0 = time.perf_counter()
    tokens = calibration_tokens(lm.tokenizer)
    ref = lean_decoder(lm.model, vocab_subset, use_onednn=False)  # plain weights kept (no packed copies)
    peaks, ref_nll = activation_peaks(ref, tokens, evaluate)
    weights = {f"{i}.{p}": getattr(layer, p).weight for i, layer in enumerate(ref.layers) for p in PRODUCTS}
    del ref
    tried: list[tuple[float, QuantPlan]] = []
    for a, head in candidates:
        plan = QuantPlan(kind=kind, smooth=smoothing(peaks, weights, a) if a is not None else {}, quantize_head=head,
                         alpha=a)
        if not evaluate:
            break
        net = lean_decoder(lm.model, vocab_subset, quant=plan)
        plan.rise = math.exp(perplexity(net, tokens[:EVALUATION_TOKENS])["nll"] - ref_nll) - 1
        plan.cached = {name: (lin.q, lin.scale.view(-1)) for name, lin in plan.built.items()}
        plan.built = {}
        del net
        tried.append((plan.rise, plan))
        if plan.rise <= PERPLEXITY_BUDGET:
            break
    else:
        plan = min(tried, key=lambda t: t[0])[1]
        logger.warning("%s: %s raises perplexity on the calibration text by %.1f%% at best (> %.0f%%): lossy for "
                       "this model%s", lm.name, kind, 100 * plan.rise, 100 * PERPLEXITY_BUDGET, plan.describe())
    logger.info("%s: %s products calibrated in %.1f s%s", lm.name, kind, time.perf_counter() - t0, plan.describe())
    return plan, path


def read_plan(kind: str, path: Path) -> QuantPlan:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    plan = QuantPlan.from_tensors(kind, load_file(str(path)))
    plan.alpha = None if meta.get("alpha") in (None, "None") else float(meta["alpha"])
    plan.rise = None if meta.get("rise") in (None, "None") else float(meta["rise"])
    return plan


def save_plan(plan: QuantPlan, path: Path | None) -> None:
    """Write the built plan to ``path`` (atomically; a failure is logged, never raised)."""
    if path is None:
        return
    from safetensors.torch import save_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(plan.tensors(), str(tmp), metadata={"alpha": str(plan.alpha), "rise": str(plan.rise)})
        tmp.replace(path)
    except OSError as exc:
        logger.warning("could not cache the quantized weights at %s (%s)", path, exc)

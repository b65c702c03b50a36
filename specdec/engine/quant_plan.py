"""Which products of a model run quantized, with what SmoothQuant vectors: calibrated once, cached on disk.

``--quantization int8`` (and ``fp8`` on CUDA) runs the lean forward's decoder products as
:class:`specdec.engine.quant.QuantLinear`. Per-token int8 activations lose precision where a few input
channels carry outliers (measured on SmolLM2-135M in the quantization issue: naive W8A8 raises held-out
perplexity by 7-10%). SmoothQuant (Xiao et al., 2023) divides each input channel ``j`` of a product by

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)        (alpha = 0.5)

and multiplies the weight's column ``j`` by it: the same product, with the outliers moved into the weight,
where the per-output-channel scales absorb them. ``max|X_j|`` is calibrated once, on text shipped in the
package (``specdec/assets/text/calibration.txt``, never the held-out text the docs' perplexities use), by a
float pass of the model. The division by ``s`` happens where the activations are quantized (one multiply
in that step), not folded into the preceding norm, so every product can be smoothed: Gemma's ``1 + w`` norms,
the attention output and the MLP's inner activations alike.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.engine.quant import QuantLinear, quantize_weight

logger = logging.getLogger(__name__)

SMOOTH_ALPHA = 0.5
CALIBRATION_TOKENS = 2048  # of the shipped calibration text, in windows of CALIBRATION_WINDOW
CALIBRATION_WINDOW = 512
EVALUATION_TOKENS = 1024  # of the same text, scored by each candidate (and the float model)
QUANTIZE_LM_HEAD = True  # the vocabulary projection too: measured within the perplexity budget, and most of a pass (docs/quantization.md)
PERPLEXITY_BUDGET = 0.02  # an int8 model's perplexity may exceed the float model's by this much (else: lossy)
# (alpha, quantize the LM head), tried in order at calibration until one stays within the budget
CANDIDATES: tuple[tuple[float | None, bool], ...] = ((SMOOTH_ALPHA, True), (0.75, True), (SMOOTH_ALPHA, False), (0.75, False))
_FORMAT = 1  # bump when the cache's layout or the scheme changes


@dataclass
class QuantPlan:
    """What ``LeanDecoder.linear`` builds for each named product (``"lm_head"``, ``"<layer>.qkv"``, ...)."""

    kind: str = "int8"
    smooth: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> s [in] (absent: not smoothed)
    cached: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # name -> (q, scale)
    quantize_head: bool = QUANTIZE_LM_HEAD
    built: dict[str, QuantLinear] = field(default_factory=dict)
    alpha: float | None = None  # the smoothing's alpha (None: none)
    rise: float | None = None  # measured: perplexity on the calibration text / the float model's - 1

    def describe(self) -> str:
        rise = "" if self.rise is None else f", perplexity {100 * self.rise:+.2f}% vs float on the calibration text"
        return f" (SmoothQuant alpha {self.alpha}, LM head {'int8' if self.quantize_head else 'float'}{rise})"

    def covers(self, name: str) -> bool:
        return name != "lm_head" or self.quantize_head

    def linear(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear:
        smooth = self.smooth.get(name)
        if smooth is not None:
            smooth = smooth.to(weight.device)
        if name in self.cached:
            q, scale = self.cached[name]
            out = QuantLinear(bias=bias, smooth=smooth, kind=self.kind, q=q.to(weight.device),
                              scale=scale.to(weight.device))
        else:
            out = QuantLinear(weight, bias, smooth=smooth, kind=self.kind)
        self.built[name] = out
        return out

    def release(self) -> None:
        """After the cache is written: the products keep only what they compute with (their packed copies);
        the plan lets go of the unpacked weights it read or made (one copy of the weights)."""
        for lin in self.built.values():
            lin.drop_unpacked()
        self.built, self.cached = {}, {}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The built products as a flat dict for safetensors."""
        out = {}
        for name, lin in self.built.items():
            out[f"{name}.q"] = lin.q.cpu()
            out[f"{name}.scale"] = lin.scale.view(-1).cpu()
            if lin.smooth is not None:
                out[f"{name}.smooth"] = lin.smooth.cpu()
        return out

    @classmethod
    def from_tensors(cls, kind: str, tensors: dict[str, torch.Tensor]) -> QuantPlan:
        plan = cls(kind=kind)
        names = {k.rsplit(".", 1)[0] for k in tensors}
        for name in names:
            plan.cached[name] = (tensors[f"{name}.q"], tensors[f"{name}.scale"])
            if f"{name}.smooth" in tensors:
                plan.smooth[name] = tensors[f"{name}.smooth"]
        plan.quantize_head = "lm_head" in names
        return plan


class _Recorder:
    """A product that records the largest |x| of each input channel it sees, then computes as before."""

    def __init__(self, inner: Any, peaks: dict[str, torch.Tensor], name: str):
        self.inner, self.peaks, self.name = inner, peaks, name
        self.out_features = inner.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        peak = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        old = self.peaks.get(self.name)
        self.peaks[self.name] = peak if old is None else torch.maximum(old, peak)
        return self.inner(x)


PRODUCTS = ("qkv", "o", "gate_up", "down")


def activation_peaks(decoder: Any, token_ids: list[int], score: bool = False,
                     window: int = CALIBRATION_WINDOW) -> tuple[dict[str, torch.Tensor], float | None]:
    """Per product of ``decoder`` (a float LeanDecoder): max |x| per input channel over ``token_ids``; and
    with ``score``, the mean NLL of the first EVALUATION_TOKENS of them (else None)."""
    from specdec.engine.kv_cache import SequenceKVCache
    from specdec.engine.perplexity import perplexity

    nll = None
    peaks: dict[str, torch.Tensor] = {}
    originals = []
    for i, layer in enumerate(decoder.layers):
        for p in PRODUCTS:
            originals.append((layer, p, getattr(layer, p)))
            setattr(layer, p, _Recorder(getattr(layer, p), peaks, f"{i}.{p}"))
    try:
        device = decoder.embed.device
        first = 0
        if score:  # these windows scored and recorded at once
            first = min(EVALUATION_TOKENS, len(token_ids))
            nll = perplexity(decoder, token_ids[:first], window=window)["nll"]
        for start in range(first, len(token_ids) - 1, window):
            ids = torch.tensor(token_ids[start:start + window], device=device)[None]
            decoder(ids, torch.arange(ids.shape[1], device=device)[None], cache=SequenceKVCache(len(decoder.layers), window),
                    logits_to_keep=1)
    finally:
        for layer, p, inner in originals:
            setattr(layer, p, inner)
    return peaks, nll


def smoothing(peaks: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
              alpha: float = SMOOTH_ALPHA) -> dict[str, torch.Tensor]:
    """SmoothQuant's s per product: ``max|X_j| ** alpha / max|W_j| ** (1 - alpha)`` (see the module)."""
    out = {}
    for name, x_peak in peaks.items():
        w_peak = weights[name].detach().float().abs().amax(dim=0).to(x_peak.device)
        s = x_peak.clamp_min(1e-5).pow(alpha) / w_peak.clamp_min(1e-5).pow(1 - alpha)
        out[name] = s.clamp(1e-3, 1e3)
    return out


def calibration_tokens(tokenizer: Any, limit: int = CALIBRATION_TOKENS) -> list[int]:
    from specdec.engine.perplexity import shipped_text

    text = shipped_text("calibration")
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])[:limit]


def cache_path(source: str, dtype: torch.dtype, kind: str, vocab_subset: torch.Tensor | None,
               candidates: tuple, evaluate: bool) -> Path:
    """Where the plan of this model and mode is cached (keyed by its weight files' names, sizes and times)."""
    from specdec.engine.cache_files import cache_root

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
    from specdec.engine.lean_decoder import lean_decoder
    from specdec.engine.perplexity import perplexity

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


__all__ = ["QuantPlan", "activation_peaks", "build_plan", "calibration_tokens", "quantize_weight", "save_plan",
           "smoothing"]

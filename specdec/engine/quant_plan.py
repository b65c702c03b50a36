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

Calibrating a plan on a model, evaluating it and caching it on disk: ``specdec.engine.quant_calibration``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
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


__all__ = ["QuantPlan", "activation_peaks", "quantize_weight", "smoothing"]

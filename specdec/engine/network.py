"""The network a runner's passes go through, and how: the lean forward (``specdec.engine.lean_decoder``) where
the architecture allows, else transformers' model; batch-invariant products or not; quantized products or not.

Chosen once per model by ``build_network``; the runner (``specdec.engine.runner``) only executes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from specdec.config import AUTO_QUANTIZATION
from specdec.engine.lean_forward import lean_decoder, unsupported_reason
from specdec.engine.memory import release_unread
from specdec.engine.models import LoadedModel
from specdec.engine.quant import quantization_unavailable
from specdec.engine.quant_calibration import build_plan, save_plan
from specdec.errors import ConfigError

logger = logging.getLogger(__name__)

# Run passes through specdec.engine.lean_decoder where the architecture allows (drafts and targets; see
# ModelRunner). The one default of the services' --lean-forward / --no-lean-forward and LLM(lean_forward=).
DEFAULT_LEAN_FORWARD = True
# Batch-invariant passes (--batch-invariant): a position's logits the same bits in any pass (docs/exactness.md: "Exact by
# construction"). None: on for a target on CPU, where benchmarks/bench_batch_invariant.py measured what they
# cost; off on CUDA until its Triton products are measured there, and off for drafts.
DEFAULT_BATCH_INVARIANT: bool | None = None
# --quantization (vLLM's name; specdec.engine.quant): "auto" (or None) picks by role. A draft's products run int8 (W8A8,
# SmoothQuant-calibrated): its numerics change only how often its tokens are accepted, never the output, and
# benchmarks/bench_quantization.py measured the pair faster with it. A target runs in its --dtype unless told.
DEFAULT_QUANTIZATION = AUTO_QUANTIZATION
DEFAULT_QUANTIZATION_BY_ROLE = {"draft": "int8", "target": "none"}


@dataclass
class Network:
    net: Any  # a lean decoder, or the transformers model itself
    paged: bool  # the lean forward: ragged passes over the KV pool in place
    batch_invariant: bool
    quantization: str  # "none", "int8", ...
    vocab_subset: torch.Tensor | None  # a draft's draft vocabulary (its folder's), or None: every id


def build_network(lm: LoadedModel, role: str, lean_forward: bool | None, batch_invariant: bool | None,
                  quantization: str | None, release_unread_weights: bool = False) -> Network:
    """The network for ``lm`` in ``role``, each choice resolved from its default where None."""
    # The lean forward is the default for every role: it runs a ragged pass over the pool in place; transformers'
    # forward runs one sequence at a time over a copy of its history (benchmarks/bench_lean_target.py,
    # benchmarks/bench_kv_pool.py).
    if lean_forward is None:
        lean_forward = DEFAULT_LEAN_FORWARD
    # A draft proposes only from its draft vocabulary, if its folder has one (the lean forward computes
    # just those logits; the transformers forward is masked to the same ids).
    vocab_subset = lm.draft_vocab if role == "draft" else None
    net: Any = lm.model
    # Batch-invariant passes (see docs/exactness.md): the lean forward with fixed-shape
    # products and, on CPU, the C attention kernel; where either is missing the passes are not invariant.
    requested = batch_invariant is not None
    if not requested:  # the default: a CPU target's (a draft's numerics never change the output)
        batch_invariant = lm.device.type == "cpu" and role == "target"
    why_not = batch_invariance_unavailable(lm, lean_forward) if batch_invariant else None
    if why_not:  # a warning where asked for or where the kernel is missing (a C compiler); a note for a model
        # the lean forward cannot run (its own log line says so)
        missing_kernel = not why_not.startswith("the lean forward")
        logger.log(logging.WARNING if requested or missing_kernel else logging.INFO,
                   "%s %s: batch-invariant passes are unavailable (%s); a position's logits may differ in the "
                   "last bits with the shape of the pass", role, lm.name, why_not)
    batch_invariant = bool(batch_invariant and not why_not)
    quantization = resolve_quantization(quantization, role, lm.name, lm.device,
                                        lambda: _lean_forward_blocks(lm, lean_forward))
    if lean_forward:
        reason = unsupported_reason(lm.model)
        if reason is None:
            # a target's settings are chosen by the perplexity they keep; a draft's change only its acceptance
            plan, cache_file = (None, None) if quantization == "none" else build_plan(
                lm, quantization, vocab_subset, evaluate=role == "target" and vocab_subset is None)
            net = lean_decoder(lm.model, vocab_subset, batch_invariant=batch_invariant, quant=plan)
            save_plan(plan, cache_file)
            if plan is not None:
                plan.release()
            if release_unread_weights:  # a service's own model: one copy of each weight (specdec.engine.memory)
                freed = release_unread(lm.model, net)
                logger.info("%s %s: let go of %.0f MiB of weights the lean forward holds packed", role, lm.name,
                            freed / 2**20)
        else:
            logger.info("%s %s: keeping transformers' forward, the lean forward does not support this model: %s",
                        role, lm.name, reason)
    return Network(net, net is not lm.model, batch_invariant, quantization, vocab_subset)


def resolve_quantization(requested: str | None, role: str, name: str, device: torch.device | str,
                         blocked: Callable[[], str | None] = lambda: None) -> str:
    """The quantization a runner (or an EAGLE head) uses: ``requested``, else its role's default (int8 for a draft:
    its numerics change only the acceptance, never the output; none for a target). ``blocked``: why a quantized
    mode cannot run for this model beyond the device (None: it can). A requested mode that cannot run here raises
    ConfigError saying why; a default that cannot falls back to none (logged)."""
    if requested == AUTO_QUANTIZATION:
        requested = None
    quantization = requested if requested is not None else DEFAULT_QUANTIZATION_BY_ROLE[role]
    why = quantization_unavailable(quantization, device)
    if why is None and quantization != "none":
        why = blocked()
    if why is None:
        return quantization
    if requested is not None:
        raise ConfigError(f"{role} {name}: --quantization {quantization} is unavailable: {why}")
    logger.info("%s %s: %s products unavailable (%s); running unquantized", role, name, quantization, why)
    return "none"


def _lean_forward_blocks(lm: LoadedModel, lean_forward: bool | None) -> str | None:
    """Why the lean forward cannot run ``lm``'s quantized products (None: it can)."""
    if lean_forward is False:
        return "the lean forward is off (--no-lean-forward); quantized products run in the lean forward only"
    reason = unsupported_reason(lm.model)
    return f"the lean forward does not support this model: {reason}" if reason else None


def batch_invariance_unavailable(lm: LoadedModel, lean_forward: bool | None) -> str | None:
    """Why this model's passes cannot be batch-invariant here (None: they can)."""
    if lean_forward is False:
        return "the lean forward is off"
    reason = unsupported_reason(lm.model)
    if reason:
        return f"the lean forward does not support this model: {reason}"
    if lm.device.type == "cpu":
        from kernels.cpu_attention import available

        ok, why = available()
        return None if ok else why
    if lm.device.type != "cuda":
        return f"no batch-invariant kernels for {lm.device.type}"
    return None

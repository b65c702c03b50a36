"""The lean forward of Gemma-3 text models (``Gemma3ForCausalLM``, e.g. the built-in ``gemma-3-270m``).

What differs from the Llama family (:mod:`specdec.engine.lean_decoder` holds the shared skeleton), each as
transformers' ``modeling_gemma3`` computes it:

* the embedding is scaled by sqrt(hidden_size), rounded to the model's dtype (the model's own
  ``embed_scale`` buffer);
* every RMSNorm computes ``x * (1 + w)`` in fp32 and then rounds to the model's dtype; besides the input
  norm each layer has a post-attention norm, pre- and post-feedforward norms, and per-head q/k norms;
* layers are sliding-window (``sliding_window`` keys) or global (``layer_types``), each kind with its own
  rotary base (the model's rotary embedding takes the layer type; the local base is
  ``rope_local_base_freq`` in older configs);
* attention scores are scaled by ``query_pre_attn_scalar ** -0.5``; the MLP is gelu (tanh) gated;
* final logits are soft-capped when ``final_logit_softcapping`` is set.

``attn_logit_softcapping`` is refused: transformers' Gemma-3 attention never applies it (its attention
call does not receive it), so no forward here could be said to equal transformers' and the model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specdec.engine.lean_decoder import FULL, SLIDING, LeanDecoder, LeanLinear, fused, rope_reason


@dataclass
class _Gemma3Layer:
    kind: str
    ln_in: torch.Tensor  # every norm weight here is (1 + w) in fp32
    qkv: LeanLinear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: LeanLinear
    post_attn: torch.Tensor
    pre_ff: torch.Tensor
    gate_up: LeanLinear
    down: LeanLinear
    post_ff: torch.Tensor


class LeanGemma3Decoder(LeanDecoder):
    """The forward pass of ``Gemma3ForCausalLM``, callable like the model for cached inference."""

    @classmethod
    def unsupported_reason(cls, model: Any) -> str | None:
        cfg = model.config
        if getattr(cfg, "model_type", None) != "gemma3_text" or type(model).__name__ != "Gemma3ForCausalLM":
            return f"{type(model).__name__} (model_type {getattr(cfg, 'model_type', None)!r}) is not Gemma3ForCausalLM"
        if getattr(cfg, "hidden_activation", None) != "gelu_pytorch_tanh":
            return f"hidden_activation {getattr(cfg, 'hidden_activation', None)!r} is not gelu_pytorch_tanh"
        if getattr(cfg, "use_bidirectional_attention", False):
            return "bidirectional attention"
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            return "attn_logit_softcapping (transformers' Gemma-3 attention does not apply it)"
        kinds = set(cfg.layer_types)
        if not kinds <= {FULL, SLIDING}:
            return f"layer types {sorted(kinds - {FULL, SLIDING})}"
        reason = rope_reason(model.model.rotary_emb)
        if reason:
            return reason
        for layer in model.model.layers:
            names = (type(layer).__name__, type(layer.self_attn).__name__, type(layer.mlp).__name__)
            if names != ("Gemma3DecoderLayer", "Gemma3Attention", "Gemma3MLP"):
                return f"layer modules {'/'.join(names)} are not the standard ones"
        return None

    def __init__(self, model: Any, vocab_subset: torch.Tensor | None = None, use_onednn: bool = True,
                 batch_invariant: bool = False, quant: Any = None):
        self.kinds = list(model.config.layer_types)
        super().__init__(model, vocab_subset, use_onednn, batch_invariant, quant)
        cfg = model.config
        self.window = cfg.sliding_window
        self.softcap = cfg.final_logit_softcapping
        self.embed_scale = model.model.embed_tokens.embed_scale.to(self.dtype)

    def _build_layer(self, layer: Any) -> _Gemma3Layer:
        a, mlp, i = layer.self_attn, layer.mlp, layer.self_attn.layer_idx
        return _Gemma3Layer(
            kind=self.kinds[a.layer_idx],
            ln_in=self._norm_weight(layer.input_layernorm.weight),
            qkv=self.linear(*fused(a.q_proj, a.k_proj, a.v_proj), name=f"{i}.qkv",
                            parts=(a.q_proj, a.k_proj, a.v_proj)),
            q_norm=self._norm_weight(a.q_norm.weight),
            k_norm=self._norm_weight(a.k_norm.weight),
            o=self.linear(a.o_proj.weight, a.o_proj.bias, name=f"{i}.o"),
            post_attn=self._norm_weight(layer.post_attention_layernorm.weight),
            pre_ff=self._norm_weight(layer.pre_feedforward_layernorm.weight),
            gate_up=self.linear(fused(mlp.gate_proj, mlp.up_proj)[0], name=f"{i}.gate_up",
                                parts=(mlp.gate_proj, mlp.up_proj)),
            down=self.linear(mlp.down_proj.weight, name=f"{i}.down"),
            post_ff=self._norm_weight(layer.post_feedforward_layernorm.weight),
        )

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return 1.0 + weight.float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # as Gemma3RMSNorm: normalise and scale by (1 + w) in fp32, then round to the model's dtype
        return self._normalised(x, weight).to(x.dtype)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed) * self.embed_scale

    def _rope(self, x: torch.Tensor, position_ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {kind: self._rope_of(x, position_ids, kind) for kind in set(self.kinds)}

    def _rotary(self, x: torch.Tensor, position_ids: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(x, position_ids, kind)

    def _block(self, i: int, layer: _Gemma3Layer, x: torch.Tensor, rope: dict, masks: dict,
               cache: Any) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = layer.qkv(self._norm(x, layer.ln_in)).split(self.split, dim=-1)
        q = self._norm(q.view(b, n, self.heads, self.head_dim), layer.q_norm).transpose(1, 2)
        k = self._norm(k.view(b, n, self.kv_heads, self.head_dim), layer.k_norm).transpose(1, 2)
        v = v.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        attn = layer.o(self._attend(i, layer.kind, q, k, v, rope, masks, cache))
        x = x + self._norm(attn, layer.post_attn)
        gate, up = layer.gate_up(self._norm(x, layer.pre_ff)).split(self.intermediate, dim=-1)
        return x + self._norm(layer.down(F.gelu(gate, approximate="tanh") * up), layer.post_ff)

"""A lean forward pass for Llama-family decoders, for drafts whose cost is mostly Python overhead.

A draft is small: SmolLM2's shipped draft (4 layers, hidden 256) does ~16M multiply-adds per token,
yet transformers' forward takes ~5.6 ms per token on 2 CPU cores, ~12% of the 135M target's step,
because each of its ~40 modules per layer, its mask construction and its output objects cost Python
time. ``LeanDecoder`` computes the same function with fused projections (q|k|v and gate|up), one
scaled-dot-product-attention call per layer and no masks for one-token steps.

It reads the model's own parameters (fused copies of the projection weights are made once), speaks the
same call as the transformers model (``input_ids``, ``position_ids``, a ``Cache`` whose layers have
``update``, an optional additive ``attention_mask``, ``logits_to_keep``), and returns an object with
``.logits``, so :class:`specdec.runner.ModelRunner` uses it in place of the model. Anything it does not
support (another architecture, sliding windows, MLP biases, tensor-parallel splits) makes
:func:`lean_decoder` return ``None`` with the reason, and the runner keeps the transformers forward.

Its logits equal transformers' up to rounding (tests compare them); a draft's numbers never affect the
output's correctness anyway, only its speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from specdec.models import skinny_linear

# model_type -> the transformers class-name prefix its modules use
_SUPPORTED = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    ln2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def unsupported_reason(model: Any) -> str | None:
    """Why :class:`LeanDecoder` cannot run ``model`` (None: it can)."""
    cfg = model.config
    prefix = _SUPPORTED.get(getattr(cfg, "model_type", None))
    if prefix is None:
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {sorted(_SUPPORTED)}"
    if type(model).__name__ != f"{prefix}ForCausalLM":
        return f"{type(model).__name__} is not {prefix}ForCausalLM"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True) and (getattr(cfg, "layer_types", None) is None or any(
            t != "full_attention" for t in cfg.layer_types)):
        return "sliding-window attention"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if "dynamic" in rope or rope == "longrope":
        return f"rope_type {rope!r} changes its frequencies with the length"
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        if type(mlp).__name__ != f"{prefix}MLP" or type(a).__name__ != f"{prefix}Attention":
            return f"layer modules {type(a).__name__}/{type(mlp).__name__} are not the standard ones"
        if getattr(a, "sliding_window", None):
            return "sliding-window attention"
    return None


class LeanDecoder:
    """The forward pass of a Llama-family causal LM, callable like the model for cached inference."""

    def __init__(self, model: Any, vocab_subset: torch.Tensor | None = None):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"LeanDecoder cannot run this model: {reason}")
        cfg = model.config
        self.dtype = model.dtype
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.embed = model.model.embed_tokens.weight
        self.rotary = model.model.rotary_emb
        self.norm = model.model.norm.weight
        self.lm_head = model.lm_head.weight
        self.vocab_size = int(self.lm_head.shape[0])
        # A draft vocabulary (ids the draft may propose): only these rows of the LM head are computed;
        # the other logits are -inf. On SmolLM2's 49,152-token head this is most of a small draft's step.
        self.vocab_subset = None
        if vocab_subset is not None:
            self.vocab_subset = vocab_subset.to(device=self.lm_head.device, dtype=torch.long)
            self.lm_head = self.lm_head[self.vocab_subset].contiguous()
        self.layers = []
        with torch.no_grad():
            for layer in model.model.layers:
                a, mlp = layer.self_attn, layer.mlp
                biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
                qkv_bias = None
                if any(b is not None for b in biases):
                    qkv_bias = torch.cat([b if b is not None else p.weight.new_zeros(p.weight.shape[0])
                                          for b, p in zip(biases, (a.q_proj, a.k_proj, a.v_proj))])
                self.layers.append(_Layer(
                    ln1=layer.input_layernorm.weight,
                    qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous(),
                    qkv_bias=qkv_bias,
                    o=a.o_proj.weight,
                    o_bias=a.o_proj.bias,
                    ln2=layer.post_attention_layernorm.weight,
                    gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous(),
                    down=mlp.down_proj.weight,
                ))
        self.scaling = model.model.layers[0].self_attn.scaling if self.layers else 1.0
        self.split = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        self.intermediate = self.layers[0].gate_up.shape[0] // 2 if self.layers else 0

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # as transformers' RMSNorm: normalise in fp32, scale in the model's dtype
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Any = None,
                 attention_mask: Any = None, logits_to_keep: int = 0, past_key_values: Any = None,
                 use_cache: bool = True) -> SimpleNamespace:
        cache = cache if cache is not None else past_key_values
        if cache is None:
            raise ValueError("LeanDecoder needs a cache (it serves cached inference only)")
        if isinstance(attention_mask, dict):  # per-layer-type masks: every layer here is full attention
            attention_mask = attention_mask["full_attention"]
        b, n = input_ids.shape
        # fp32 on CPU: few-row products as SkinnyLinear computes them (much faster there)
        linear = skinny_linear if self.dtype == torch.float32 and input_ids.device.type == "cpu" else F.linear
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(x, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, n, head_dim]
        mask = attention_mask
        if mask is None and n > 1:  # one sequence: new tokens see the cache and the new tokens before them
            past = cache.get_seq_length()
            kv_pos = torch.arange(past + n, device=x.device)
            mask = kv_pos[None, :] <= (past + torch.arange(n, device=x.device))[:, None]  # [n, past + n] bool
        for i, layer in enumerate(self.layers):
            h = self._rms(x, layer.ln1)
            qkv = linear(h, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split(self.split, dim=-1)
            q = self._rope(q.view(b, n, self.heads, self.head_dim).transpose(1, 2), cos, sin)
            k = self._rope(k.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
            v = v.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
            k, v = cache.layers[i].update(k, v)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                                  enable_gqa=self.kv_heads != self.heads)
            x = x + linear(attn.transpose(1, 2).reshape(b, n, self.heads * self.head_dim), layer.o, layer.o_bias)
            h = self._rms(x, layer.ln2)
            gate, up = linear(h, layer.gate_up, None).split(self.intermediate, dim=-1)
            x = x + linear(F.silu(gate) * up, layer.down, None)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = linear(self._rms(x, self.norm), self.lm_head, None)
        if self.vocab_subset is not None:
            full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
            full[..., self.vocab_subset] = logits
            logits = full
        return SimpleNamespace(logits=logits)


def lean_decoder(model: Any, vocab_subset: torch.Tensor | None = None) -> LeanDecoder | None:
    """A :class:`LeanDecoder` for ``model``, or None where it is unsupported."""
    return LeanDecoder(model, vocab_subset) if unsupported_reason(model) is None else None

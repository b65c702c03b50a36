"""An EAGLE-3 head: a one-layer draft that reads the target's features (pure torch).

EAGLE-3 (Li et al., 2025; vLLM's ``llama_eagle3``) drafts from the target's hidden states. At position ``p`` its
input is the target's feature there (the input of three decoder layers, low, middle and high, concatenated:
3 x the target's hidden size), projected by ``fc`` to the head's width, beside the embedding of token ``p + 1``;
one Llama decoder layer whose attention reads both (its q/k/v take 2 x hidden), a final norm and an LM head over
a reduced draft vocabulary predict token ``p + 2``. Drafting the next token, the head feeds its own output
before the final norm (``prenorm``) in place of a target feature. ``d2t`` maps a draft id to its target id
(``target = draft + d2t[draft]``); ``t2d`` marks the target ids the draft vocabulary holds.

The layout is the published one (SpecForge, vLLM, EAGLE's repository): parameters ``fc``, ``midlayer.*`` (with
``hidden_norm``), ``norm``, ``lm_head``, buffers ``d2t`` and ``t2d``, and the target's ``embed_tokens``, which a
checkpoint may carry or share with the target (``specdec.engine.eagle3_files`` reads and writes it).

The module serves both inference (:meth:`Eagle3Head.step`, one sequence over its own key/value cache) and
training (:meth:`Eagle3Head.train_steps`: EAGLE-3's training-time test, several steps unrolled on the head's own
predictions, as it drafts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Eagle3Config:
    """The head's shape (config.json of the published layout) and the target it reads."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int | None = None  # None: the head's hidden_size
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    feature_layers: tuple[int, ...] | None = None  # the target layers read (None: vLLM's default for the target)
    extra: dict = field(default_factory=dict)  # other config.json keys, written back as they were

    @property
    def target_width(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' LlamaRMSNorm: normalise in fp32, scale in the input's dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class Eagle3Head(nn.Module):
    """fc + one decoder layer over [embedding | feature] + norm + LM head over the draft vocabulary."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.dim
        self.fc = nn.Linear(3 * cfg.target_width, h, bias=False)
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self._fused_sizes: dict[str, list[int]] = {}  # quantize's fused products: their parts' output sizes
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)  # the target's (frozen in training)
        self.embed_tokens.weight.requires_grad_(False)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", self._scaled(inv), persistent=False)

    def _scaled(self, inv: torch.Tensor) -> torch.Tensor:
        """Llama-3's rope scaling of the frequencies (the one published heads for Llama-3.x targets use)."""
        rs = self.cfg.rope_scaling or {}
        if rs.get("rope_type", rs.get("type")) != "llama3":
            return inv
        factor, low, high = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        return torch.where((wavelen >= old / high) & (wavelen <= old / low), mid, scaled)

    LINEARS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def quantize(self, kind: str = "int8") -> "Eagle3Head":
        """Inference only: every product as a W8A8 ``QuantLinear`` (``specdec.engine.quant``; int8, or fp8 on CUDA).
        A one-row drafting step reads each weight once, so its cost follows their bytes: int8 reads a quarter of
        fp32's (``benchmarks/bench_eagle3.py --head-quantization``). The drafts may differ from the float head's
        where two candidates nearly tie; the target's verification keeps the output exact either way.

        The products that read the same input become one (``FUSED``: q, k and v; gate and up): each output column
        keeps its own weight scale and the input its one scale, so with int8 on the CPU the outputs are bitwise those
        of the separate products (on CUDA, cuBLASLt may pick another algorithm for the wider product: drafts only),
        for one call in place of three (two). A drafting step's products are a few rows each, so a call's fixed
        cost is most of theirs."""
        from specdec.engine.quant import QuantLinear

        for fused, parts in self.FUSED.items():
            linears = [getattr(self, name) for name in parts]
            if all(isinstance(linear, nn.Linear) for linear in linears):
                weight = torch.cat([linear.weight.detach() for linear in linears])
                object.__setattr__(self, fused, QuantLinear(weight, kind=kind))
                self._fused_sizes[fused] = [linear.out_features for linear in linears]
                for name in parts:
                    del self._modules[name]
                    object.__setattr__(self, name, None)  # (read through the fused product only)
        for name in self.LINEARS:
            linear = getattr(self, name)
            if isinstance(linear, nn.Linear):
                del self._modules[name]
                object.__setattr__(self, name, QuantLinear(linear.weight.detach(), kind=kind))
        return self

    def _products(self, name: str, x: torch.Tensor) -> list[torch.Tensor]:
        """The outputs of ``FUSED[name]``'s products of x: by the fused product where ``quantize`` made one."""
        fused = self.__dict__.get(name)
        if fused is None:
            return [getattr(self, part)(x) for part in self.FUSED[name]]
        return list(fused(x).split(self._fused_sizes[name], dim=-1))

    # -- vocabulary -------------------------------------------------------------------------------
    def target_ids(self) -> torch.Tensor:
        """Each draft id's target id [draft_vocab]."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., draft_vocab] -> target logits [..., vocab] (-inf outside the draft vocabulary)."""
        if self.cfg.draft_vocab_size == self.cfg.vocab_size and not bool(self.d2t.any()):
            return logits
        out = logits.new_full((*logits.shape[:-1], self.cfg.vocab_size), float("-inf"))
        out[..., self.target_ids()] = logits
        return out

    # -- the layer --------------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None]  # [n, d/2]
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """A target feature [..., 3 x target hidden] through ``fc``; the head's own [..., hidden] as it is."""
        return self.fc(features) if features.shape[-1] == 3 * self.cfg.target_width else features

    def _qkv(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """The attention's q [heads, n, d], k and v [kv_heads, n, d] (rotated) of [n] tokens beside [n, hidden]."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        x = torch.cat([_rms(self.embed_tokens(ids).to(hidden.dtype), self.input_layernorm, eps),
                       _rms(hidden, self.hidden_norm, eps)], dim=-1)
        n, d = ids.shape[0], cfg.dim
        q, k, v = self._products("qkv_proj", x)
        q = q.reshape(n, cfg.num_attention_heads, d).transpose(0, 1)
        k = k.reshape(n, cfg.num_key_value_heads, d).transpose(0, 1)
        v = v.reshape(n, cfg.num_key_value_heads, d).transpose(0, 1)
        cos, sin = self._rope(positions, q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v

    def _finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [n, heads x d] after the residual ``hidden``: (draft logits [n, draft_vocab], prenorm [n, hidden])."""
        eps = self.cfg.rms_norm_eps
        h = hidden + self.o_proj(attn)
        x = _rms(h, self.post_attention_layernorm, eps)
        gate, up = self._products("gate_up_proj", x)
        h = h + self.down_proj(F.silu(gate) * up)
        return self.lm_head(_rms(h, self.norm, eps)), h

    def step(self, ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
             cache: "HeadCache", mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's pass: tokens ``ids`` [n] at ``positions`` [n] (consecutive, from ``cache.length``), each
        beside the feature of the position before it [n, 3 x target hidden or hidden]. Appends to ``cache``;
        returns (draft logits [n, draft_vocab] fp32, prenorm [n, hidden]). ``mask`` [n, cache entries after the
        append] (True: attends): a token tree's nodes, each attending to the history and its own path; default
        causal."""
        hidden = self.combine(features.to(self.norm.dtype))
        q, k, v = self._qkv(ids, hidden, positions)
        keys, values = cache.append(k, v)
        n, past = ids.shape[0], cache.length - ids.shape[0]
        if mask is None and n > 1:
            mask = torch.arange(past + n, device=ids.device)[None] <= (past + torch.arange(n, device=ids.device))[:, None]
        attn = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                              enable_gqa=self.cfg.num_key_value_heads != self.cfg.num_attention_heads)
        logits, prenorm = self._finish(hidden, attn[0].transpose(0, 1).reshape(n, -1))
        return logits.float(), prenorm

    def train_steps(self, ids: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """EAGLE-3's training-time test over one sequence: ``ids`` [n + 1] the tokens, ``features`` [n + 1, 3 x
        target hidden] the target's (row p: the feature at position p). Step 0 predicts token p + 2 at position p
        from (feature p, token p + 1); step s from the head's own step-(s - 1) output at position p - 1 beside
        token p + 1, attending as when drafting: to step 0's keys up to position p - s and to step i's key at
        position p - s + i (i = 1..s). Returns each step's draft logits [n, draft_vocab]: row p predicts token
        p + 2 (rows p < s of step s have no drafting counterpart, and the last row no label: the caller masks)."""
        cfg = self.cfg
        n = ids.shape[0] - 1
        tokens, positions = ids[1:], torch.arange(n, device=ids.device)
        hidden = self.combine(features[:n])
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        scale = cfg.dim ** -0.5
        keys, values, outs = [], [], []
        prenorm = hidden
        for s in range(steps):
            if s:  # the head's own output at the position before takes the target feature's place
                hidden = torch.cat([torch.zeros_like(prenorm[:1]), prenorm[:-1]], dim=0)
            q, k, v = self._qkv(tokens, hidden, positions)
            keys.append(k.repeat_interleave(group, 0))
            values.append(v.repeat_interleave(group, 0))
            allowed = positions[None] <= (positions - s)[:, None]  # step 0's keys up to p - s  [q, key]
            scores = [(q @ keys[0].transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))]
            diagonal = [(positions - s + i).clamp(min=0) for i in range(1, s + 1)]
            for i, at in enumerate(diagonal, start=1):
                scores.append((q * keys[i][:, at]).sum(-1, keepdim=True) * scale)
            weights = torch.cat(scores, dim=-1).softmax(-1).nan_to_num(0.0)
            attn = weights[..., :n] @ values[0]
            for i, at in enumerate(diagonal, start=1):
                attn = attn + weights[..., n + i - 1: n + i] * values[i][:, at]
            logits, prenorm = self._finish(hidden, attn.transpose(0, 1).reshape(n, -1))
            outs.append(logits)
        return outs


class HeadCache:
    """One sequence's keys and values in the head's one layer, [kv_heads, positions, dim], grown in place."""

    def __init__(self, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device, capacity: int = 256):
        self.keys = torch.empty(kv_heads, capacity, dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[1]
        if end > self.keys.shape[1]:
            grown = max(end, 2 * self.keys.shape[1])
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_empty(old.shape[0], grown, old.shape[2])
                new[:, : self.length] = old[:, : self.length]
                setattr(self, name, new)
        self.keys[:, self.length:end] = k
        self.values[:, self.length:end] = v
        self.length = end
        return self.keys[:, :end], self.values[:, :end]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

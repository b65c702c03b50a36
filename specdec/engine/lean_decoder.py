"""A lean forward pass for decoder-only causal LMs: Llama-family models here, Gemma-3 in ``lean_gemma3``.

transformers' forward spends Python time in each of its ~40 modules per layer, in its mask construction
and in its output objects. A small draft's step is mostly that overhead; a target's pass of a few tokens is
mostly reading the weights, where its matmuls take slow paths for few rows on CPU. ``LeanDecoder`` computes
the same function with fused projections (q|k|v and gate|up), one scaled-dot-product-attention call per
layer, masks only where a pass needs them, and :class:`specdec.engine.lean_linear.LeanLinear` products (the
fastest formulation per row count: a pass of 3-5 tokens costs little more than one).

It reads the model's own parameters (fused copies of the projection weights, and oneDNN-reordered copies
on CPU, are made once). The runner calls :meth:`LeanDecoder.forward_paged`: the new tokens of many sequences
as one flat batch over its KV pool (``specdec.engine.attention``). Called like the transformers model for one
sequence (``input_ids``, ``position_ids``, a ``Cache`` whose layers have ``update``, ``logits_to_keep``), it
returns an object with ``.logits`` (the tests compare the two forwards that way). Anything it
does not support (another architecture, MLP biases, tensor-parallel splits, rope that rescales with the
length) makes :func:`specdec.engine.lean_forward.unsupported_reason` say why and ``lean_forward.lean_decoder`` return None; the runner then logs
the reason and keeps the transformers forward.

Its logits equal transformers' up to rounding (tests compare them on tiny and real models, fp32 and bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from specdec.engine.attention import PagedPass
from specdec.engine.lean_linear import INVARIANT_TILE_ROWS, LeanLinear
from specdec.engine.quant import QuantLinear
from specdec.engine.quant_plan import QuantPlan

FULL, SLIDING = "full_attention", "sliding_attention"
# model_type -> the transformers class-name prefix its modules use
_SUPPORTED = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: LeanLinear
    o: LeanLinear
    ln2: torch.Tensor
    gate_up: LeanLinear
    down: LeanLinear
    kind: str = FULL


def fused(*modules: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights of ``modules`` (nn.Linear) stacked by output row, and their biases (zeros where one has none).

    Where the modules' weights already lie one after another (:func:`share_rows` made them views of one matrix)
    that matrix is returned as it is: no copy."""
    weight = _adjacent([m.weight for m in modules])
    if weight is None:
        with torch.no_grad(), torch.inference_mode(False):  # a normal tensor: it may become the modules' .data
            weight = torch.cat([m.weight.detach() for m in modules]).contiguous()
    if all(m.bias is None for m in modules):
        return weight, None
    return weight, torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in modules])


def share_rows(modules: tuple[Any, ...], weight: torch.Tensor) -> None:
    """Make the modules' weights views of their rows in ``weight`` (what :func:`fused` stacked): one copy of the
    weights where the lean forward keeps the fused matrix (transformers' forward, and anything else reading
    the modules, sees the same numbers)."""
    if _adjacent([m.weight for m in modules]) is not None:
        return
    with torch.no_grad():
        first = 0
        for m in modules:
            rows = m.weight.shape[0]
            m.weight.data = weight[first: first + rows]
            first += rows


def _adjacent(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The rows of ``weights`` as one [sum of rows, in] view where they lie one after another in one storage."""
    first = weights[0]
    if first.is_mkldnn or not all(w.is_contiguous() and w.dim() == 2 for w in weights):
        return None
    end = first.storage_offset()
    for w in weights:
        if (w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or w.storage_offset() != end
                or w.shape[1] != first.shape[1] or w.dtype != first.dtype):
            return None
        end += w.numel()
    if len(weights) == 1:
        return first.detach()
    return first.detach().as_strided((sum(w.shape[0] for w in weights), first.shape[1]), (first.shape[1], 1))


def rope_reason(rotary: Any) -> str | None:
    """Why the model's rotary embedding cannot be evaluated once per pass (None: it can)."""
    types = getattr(rotary, "rope_type", "default")
    for rope in types.values() if isinstance(types, dict) else [types]:
        if "dynamic" in rope or rope == "longrope":
            return f"rope_type {rope!r} changes its frequencies with the length"
    return None


class LeanDecoder:
    """The forward pass of a Llama-family causal LM, callable like the model for cached inference.

    The skeleton (embedding, rotary tables, masks, attention over the cache, final norm and LM head) is
    shared with the Gemma-3 subclass, which overrides the per-architecture hooks ``_embed``, ``_norm``,
    ``_build_layer``, ``_block`` and ``_rope``.
    """

    @classmethod
    def unsupported_reason(cls, model: Any) -> str | None:
        """Why this class cannot run ``model`` (None: it can)."""
        cfg = model.config
        prefix = _SUPPORTED.get(getattr(cfg, "model_type", None))
        if prefix is None:
            return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {sorted([*_SUPPORTED, 'gemma3_text'])}"
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
                t != FULL for t in cfg.layer_types)):
            return "sliding-window attention"
        reason = rope_reason(model.model.rotary_emb)
        if reason:
            return reason
        for layer in model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            if type(mlp).__name__ != f"{prefix}MLP" or type(a).__name__ != f"{prefix}Attention":
                return f"layer modules {type(a).__name__}/{type(mlp).__name__} are not the standard ones"
            if getattr(a, "sliding_window", None):
                return "sliding-window attention"
        return None

    def __init__(self, model: Any, vocab_subset: torch.Tensor | None = None, use_onednn: bool = True,
                 batch_invariant: bool = False, quant: QuantPlan | None = None):
        reason = type(self).unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"{type(self).__name__} cannot run this model: {reason}")
        cfg = model.config
        self.dtype = model.dtype
        self.use_onednn = use_onednn
        # every position's logits the same bits whatever else the pass holds (fixed-shape products, per-row
        # norms, the rotary table, attention by kernels.cpu_attention / the Triton kernel): see docs/exactness.md
        self.batch_invariant = batch_invariant
        self.quant = quant  # the products it covers run as int8/fp8 QuantLinear (specdec.engine.quant_plan)
        self._rope_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.window: int | None = None  # the sliding window of SLIDING layers (subclasses)
        self.softcap: float | None = None  # final logit softcapping (subclasses)
        self.embed = model.model.embed_tokens.weight
        self.rotary = model.model.rotary_emb
        self.vocab_size = int(model.lm_head.weight.shape[0])
        # A draft vocabulary (ids the draft may propose): only these rows of the LM head are computed;
        # the other logits are -inf. On SmolLM2's 49,152-token head this is most of a small draft's step.
        self.vocab_subset = None
        head = model.lm_head.weight
        if vocab_subset is not None:
            self.vocab_subset = vocab_subset.to(device=head.device, dtype=torch.long)
            head = head[self.vocab_subset].contiguous()
        with torch.no_grad():
            self.lm_head = self.linear(head, name="lm_head")
            self.norm = self._norm_weight(model.model.norm.weight)
            self.layers = [self._build_layer(layer) for layer in model.model.layers]
        self.scaling = model.model.layers[0].self_attn.scaling if self.layers else 1.0
        self.split = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        self.intermediate = self.layers[0].gate_up.out_features // 2 if self.layers else 0

    # -- per-architecture hooks (Llama family here) --------------------------------------------------
    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = "",
               parts: tuple[Any, ...] = ()) -> LeanLinear | QuantLinear:
        """The product named ``name`` (``lm_head``, ``<layer>.qkv|o|gate_up|down``): quantized where the plan
        covers it (an int8 product is batch-invariant as it is: exact integer sums), else a LeanLinear.
        ``parts``: the modules ``weight`` fuses; where the product keeps that matrix, they become views of it."""
        if self.quant is not None and self.quant.covers(name):
            return self.quant.linear(name, weight, bias)
        out = LeanLinear(weight, bias, use_onednn=self.use_onednn,
                         tile_rows=INVARIANT_TILE_ROWS if self.batch_invariant else None)
        if parts and out.weight is weight:
            share_rows(parts, weight)
        return out

    def _build_layer(self, layer: Any) -> _Layer:
        a, mlp, i = layer.self_attn, layer.mlp, layer.self_attn.layer_idx
        return _Layer(
            ln1=layer.input_layernorm.weight,
            qkv=self.linear(*fused(a.q_proj, a.k_proj, a.v_proj), name=f"{i}.qkv",
                            parts=(a.q_proj, a.k_proj, a.v_proj)),
            o=self.linear(a.o_proj.weight, a.o_proj.bias, name=f"{i}.o"),
            ln2=layer.post_attention_layernorm.weight,
            gate_up=self.linear(fused(mlp.gate_proj, mlp.up_proj)[0], name=f"{i}.gate_up",
                                parts=(mlp.gate_proj, mlp.up_proj)),
            down=self.linear(mlp.down_proj.weight, name=f"{i}.down"),
        )

    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # as transformers' LlamaRMSNorm: normalise in fp32, scale in the model's dtype
        return weight * self._normalised(x).to(x.dtype)

    def _normalised(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``F.rms_norm(x.float(), weight)`` (fp32), each row reduced alone (on CUDA with batch invariance:
        the Triton kernel, one program per row, the row in fixed blocks)."""
        if self.batch_invariant and x.device.type == "cuda":
            from kernels.batch_invariant import rms_norm

            out = rms_norm(x.reshape(-1, x.shape[-1]), self.eps).view(x.shape)
            return out if weight is None else out * weight
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps=self.eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed)

    def _rope(self, x: torch.Tensor, position_ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer kind: (cos, sin) [b, 1, n, head_dim]."""
        return {FULL: self._rope_of(x, position_ids, FULL)}

    def _rotary(self, x: torch.Tensor, position_ids: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(x, position_ids)

    _ROPE_BLOCK = 1024  # the rotary table grows by this many positions, each block computed in one call

    def _rope_of(self, x: torch.Tensor, position_ids: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [b, 1, n, head_dim] of ``position_ids`` [b, n], read from a table of every position so
        far: a position's values never depend on which positions share the pass."""
        cos, sin = self._rope_tables.get(kind, (None, None))
        need = int(position_ids.max()) + 1
        have = 0 if cos is None else cos.shape[0]
        if need > have:
            blocks = [self._rotary(x, torch.arange(p, p + self._ROPE_BLOCK, device=x.device)[None], kind)
                      for p in range(have, need, self._ROPE_BLOCK)]
            old = [] if cos is None else [(cos[None], sin[None])]
            cos, sin = (torch.cat([b[i][0] for b in old + blocks]) for i in (0, 1))
            self._rope_tables[kind] = (cos, sin)
        return cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)

    def _block(self, i: int, layer: _Layer, x: torch.Tensor, rope: dict, masks: dict, cache: Any) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = layer.qkv(self._norm(x, layer.ln1)).split(self.split, dim=-1)
        q = q.view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        x = x + layer.o(self._attend(i, layer.kind, q, k, v, rope, masks, cache))
        gate, up = layer.gate_up(self._norm(x, layer.ln2)).split(self.intermediate, dim=-1)
        return x + layer.down(F.silu(gate) * up)

    # -- the shared skeleton -------------------------------------------------------------------------
    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def _attend(self, i: int, kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: dict,
                masks: dict, cache: Any) -> torch.Tensor:
        """Rotate q [b, heads, n, d] and k [b, kv_heads, n, d], append k and v [b, kv_heads, n, d] to layer
        ``i``'s cache, attend; returns [b, n, heads * d]."""
        b, n = q.shape[0], q.shape[2]
        cos, sin = rope[kind]
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        if isinstance(cache, PagedPass):  # the runner's pool, read in place
            return cache.attend(i, kind, q, k, v, self.scaling)
        k, v = cache.layers[i].update(k, v)
        mask, start = masks[kind]
        if start:  # a sliding window: keys before it are never attended
            k, v = k[:, :, start:], v[:, :, start:]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                              enable_gqa=self.kv_heads != self.heads)
        return attn.transpose(1, 2).reshape(b, n, self.heads * self.head_dim)

    def _masks(self, past: int, n: int, device: torch.device) -> dict:
        """Per layer kind: (mask or None, first key position attended) for one sequence's pass over a
        ``Cache``: new tokens see the cache and the new tokens before them, and no more than the window on
        sliding layers (whose keys before the window are cut off instead of masked)."""
        out = {}
        for kind in {layer.kind for layer in self.layers}:
            window = self.window if kind == SLIDING else None
            start = max(0, past + 1 - window) if window else 0
            if n == 1:  # one new token sees every key kept
                out[kind] = (None, start)
                continue
            kv = torch.arange(start, past + n, device=device)  # absolute key positions
            q = past + torch.arange(n, device=device)[:, None]
            allowed = kv[None, :] <= q  # [n, keys]
            if window:
                allowed &= kv[None, :] > q - window
            out[kind] = (allowed, start)
        return out

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self._norm(x, self.norm))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.vocab_subset is not None:
            full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
            full[..., self.vocab_subset] = logits
            logits = full
        return logits

    def windows(self) -> dict[str, int | None]:
        """Each layer kind's sliding window (None: the layer attends to every earlier key)."""
        return {layer.kind: self.window if layer.kind == SLIDING else None for layer in self.layers}

    @torch.inference_mode()
    def forward_paged(self, input_ids: torch.Tensor, positions: torch.Tensor, paged: PagedPass,
                      logits_index: torch.Tensor) -> torch.Tensor:
        """One ragged pass over the KV pool: the new tokens of every sequence flat, ``input_ids`` and
        ``positions`` [tokens]; returns the logits of the rows ``logits_index`` [rows] as [rows, vocab]."""
        return self.logits(self.hidden_paged(input_ids, positions, paged)[logits_index])

    @torch.inference_mode()
    def hidden_paged(self, input_ids: torch.Tensor, positions: torch.Tensor, paged: PagedPass,
                     capture: tuple[int, ...] = ()) -> torch.Tensor:
        """:meth:`forward_paged` up to the final norm: the last hidden states [tokens, hidden]. The runner
        projects them to logits a few rows at a time (:meth:`logits`) where a pass scores a whole prompt.

        ``capture``: layer indices whose inputs are kept too (an EAGLE-3 head's features, ``specdec.features``);
        then ``self.captured`` holds them concatenated in that order, [tokens, len(capture) x hidden]."""
        x = self._embed(input_ids[None])  # [1, tokens, hidden]: the sequences share the rows, not padded columns
        rope = self._rope(x, positions[None])
        kept: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                kept[i] = x[0]
            x = self._block(i, layer, x, rope, {}, paged)
        self.captured = torch.cat([kept[i] for i in capture], dim=-1) if capture else None
        return x[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits [rows, vocab] of last hidden states [rows, hidden] (final norm, LM head, softcap)."""
        return self._logits(hidden)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Any = None,
                 logits_to_keep: int = 0, past_key_values: Any = None, use_cache: bool = True) -> SimpleNamespace:
        """One sequence's pass over a transformers ``Cache`` (``input_ids`` [1, n]), as the model is called."""
        cache = cache if cache is not None else past_key_values
        if cache is None:
            raise ValueError("LeanDecoder needs a cache (it serves cached inference only)")
        n = input_ids.shape[1]
        x = self._embed(input_ids)
        rope = self._rope(x, position_ids)
        masks = self._masks(cache.get_seq_length(), n, input_ids.device)
        for i, layer in enumerate(self.layers):
            x = self._block(i, layer, x, rope, masks, cache)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return SimpleNamespace(logits=self._logits(x))

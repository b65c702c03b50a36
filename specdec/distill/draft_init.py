"""The draft: the target's model class and config with fewer layers / a smaller hidden size, initialised
from the target's embeddings and a spread of its layers (projected when the draft is narrower)."""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import torch

from specdec.distill.config import DistillConfig
from specdec.distill.modeling import body
from specdec.errors import ConfigError

logger = logging.getLogger("specdec.distill")  # one logger for the whole command


def make_draft_config(target_config: Any, cfg: DistillConfig) -> Any:
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    dc = copy.deepcopy(tc)
    t_heads = tc.num_attention_heads
    t_kv = getattr(tc, "num_key_value_heads", None) or t_heads
    t_head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // t_heads
    if cfg.heads:
        heads = cfg.heads
        kv = cfg.kv_heads or math.gcd(heads, t_kv)
    else:  # the target's layout, or the largest cut of it (whole KV groups) whose head count divides --hidden
        t_group = t_heads // t_kv
        options = [(g * k, k) for k in range(1, t_kv + 1) for g in range(1, t_group + 1)
                   if cfg.hidden % (g * k) == 0 and (not cfg.kv_heads or k == cfg.kv_heads)]
        if not options:
            raise ConfigError(f"no head layout cut from the target's fits --hidden {cfg.hidden}; give --heads")
        heads, kv = max(options)
    if heads % kv:
        raise ConfigError(f"--heads {heads} must be a multiple of --kv-heads {kv}")
    if cfg.hidden % heads:
        raise ConfigError(f"--hidden {cfg.hidden} must be a multiple of the number of heads ({heads})")
    dc.num_hidden_layers = cfg.layers
    dc.hidden_size = cfg.hidden
    dc.num_attention_heads = heads
    dc.num_key_value_heads = kv
    dc.head_dim = cfg.head_dim or t_head_dim
    dc.intermediate_size = cfg.intermediate or tc.intermediate_size
    dc.tie_word_embeddings = True
    dc.use_cache = True
    if isinstance(getattr(dc, "layer_types", None), list):
        idx = _spread(tc.num_hidden_layers, cfg.layers)
        dc.layer_types = [tc.layer_types[i] for i in idx]
    for attr in ("_name_or_path", "_model_name_or_path"):
        if hasattr(dc, attr):
            try:
                delattr(dc, attr)
            except AttributeError:
                pass
    dc.dtype = "bfloat16"
    try:
        if hasattr(dc, "validate"):
            dc.validate()
    except Exception as exc:  # transformers' own checks, e.g. hidden size vs heads
        raise ConfigError(f"invalid draft architecture: {exc}") from None
    return dc


def _spread(n_target: int, n: int) -> list[int]:
    if n == 1:
        return [n_target - 1]
    return [round(i * (n_target - 1) / (n - 1)) for i in range(n)]


def _llama_like(model: Any) -> bool:
    layer = body(model).layers[0]
    names = {n for n, _ in layer.named_parameters()}
    allowed = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
               "input_layernorm.weight", "post_attention_layernorm.weight",
               "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
    return names <= allowed and type(body(model).norm).__name__.endswith("RMSNorm") and \
        not type(body(model).norm).__name__.startswith("Gemma")


@torch.no_grad()
def residual_projection(teacher: Any, sample: torch.Tensor, hidden: int, kind: str) -> torch.Tensor:
    """(target hidden, hidden) orthonormal columns: the top principal directions of the target's
    residual stream (unit-normalised states of every layer on ``sample``) or of its embedding matrix."""
    emb = teacher.get_input_embeddings().weight.float()
    if kind == "embedding":
        _, _, vh = torch.linalg.svd(emb, full_matrices=False)
        return vh[:hidden].T.contiguous()
    d = emb.shape[1]
    cov = torch.zeros(d, d, dtype=torch.float64)
    for s in range(0, len(sample), 4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = body(teacher)(input_ids=sample[s: s + 4].long(), output_hidden_states=True)
        for hs in out.hidden_states:
            x = hs.float().reshape(-1, d)
            x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)
            cov += (x.T @ x).double()
    evals, evecs = torch.linalg.eigh(cov)
    return evecs[:, torch.argsort(evals, descending=True)[:hidden]].float().contiguous()


def load_draft_weights(draft: Any, folder: str) -> dict[str, Any]:
    """Start from an existing draft's weights (``--init-from``); its architecture must match."""
    from safetensors.torch import load_file

    path = Path(folder).expanduser()
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise ConfigError(f"--init-from {folder}: no *.safetensors weights in that folder")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    own = draft.state_dict()
    wrong = [f"{k}: {tuple(v.shape)} here, {tuple(own[k].shape)} wanted" for k, v in weights.items()
             if k in own and v.shape != own[k].shape]
    unknown = sorted(set(weights) - set(own))
    missing = sorted(set(own) - set(weights) - {"lm_head.weight"})  # the lm_head is tied to the embeddings
    if wrong or unknown or missing:
        raise ConfigError(
            f"--init-from {folder} does not fit the draft architecture of this command (give the same --layers, "
            f"--hidden, --heads, --intermediate as it was made with): "
            + "; ".join(wrong[:3] + [f"unexpected {k}" for k in unknown[:3]] + [f"missing {k}" for k in missing[:3]])
        )
    draft.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    draft.tie_weights()
    return {"text": f"the weights of the existing draft {folder} (--init-from)"}


@torch.no_grad()
def init_draft(teacher: Any, draft: Any, cfg: DistillConfig, sample: torch.Tensor) -> dict[str, Any]:
    """Initialise ``draft`` from ``teacher`` in place; returns a description for the model card."""
    tc, dc = teacher.config.get_text_config(), draft.config
    info: dict[str, Any] = {"method": cfg.init}
    if cfg.init == "random":
        info["text"] = "random initialisation (the target's initializer_range)"
        return info
    P, emb_text = _init_embeddings(teacher, draft, cfg, sample)
    info["embeddings"] = emb_text
    if cfg.init == "embed":
        info["text"] = emb_text + "; layers random"
        return info
    layer_ids = _init_layer_ids(cfg, tc, dc)
    info["layers"] = layer_ids
    t_layers, d_layers = body(teacher).layers, body(draft).layers
    exact = P is None and all(
        getattr(dc, a, None) == getattr(tc, a, None)
        for a in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
    )
    if exact:
        for di, ti in enumerate(layer_ids):
            d_layers[di].load_state_dict(t_layers[ti].state_dict())
        body(draft).norm.load_state_dict(body(teacher).norm.state_dict())
        info["text"] = f"{emb_text}; layers = target layers {layer_ids} (copied); final norm copied"
        return info
    if not _llama_like(teacher):
        info["text"] = f"{emb_text}; layers random (projected layer copy supports Llama-style layers only)"
        logger.warning("projected layer copy needs Llama-style layers; the draft's layers start random")
        return info
    t_heads, t_kv, hd = tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim
    d_heads, d_kv = dc.num_attention_heads, dc.num_key_value_heads
    if dc.head_dim != hd or d_kv > t_kv or d_heads // d_kv > t_heads // t_kv:
        info["text"] = f"{emb_text}; layers random (attention shape incompatible with the target's)"
        logger.warning("draft attention (%d heads / %d kv / dim %d) cannot be cut from the target's "
                       "(%d / %d / %d); layers start random", d_heads, d_kv, dc.head_dim, t_heads, t_kv, hd)
        return info
    _copy_projected(teacher, draft, layer_ids, P)
    info["text"] = _projected_text(tc, dc, emb_text, layer_ids, P is not None)
    return info


def _init_embeddings(teacher: Any, draft: Any, cfg: DistillConfig,
                     sample: torch.Tensor) -> tuple[torch.Tensor | None, str]:
    """Copy the target's embeddings into the draft's (tied lm_head), through a projection when the draft is
    narrower; returns the projection (None at the target's width) and a description."""
    tc, dc = teacher.config.get_text_config(), draft.config
    t_emb = teacher.get_input_embeddings().weight.float()
    if dc.hidden_size == tc.hidden_size:
        draft.get_input_embeddings().weight.copy_(t_emb)
        return None, "embeddings (tied lm_head) copied from the target"
    if dc.hidden_size > tc.hidden_size:
        raise ConfigError(f"--hidden {dc.hidden_size} exceeds the target's hidden size {tc.hidden_size}")
    P = residual_projection(teacher, sample, dc.hidden_size, cfg.projection)
    draft.get_input_embeddings().weight.copy_(t_emb @ P)
    src = ("principal directions of the target's residual stream" if cfg.projection == "hidden"
           else "right singular vectors of the target's embedding matrix")
    return P, f"embeddings (tied lm_head) = target embeddings projected to {dc.hidden_size} dims ({src})"


def _init_layer_ids(cfg: DistillConfig, tc: Any, dc: Any) -> list[int]:
    """The target layers the draft's layers start from: --init-layers, or evenly spread."""
    if not cfg.init_layers:
        return _spread(tc.num_hidden_layers, dc.num_hidden_layers)
    try:
        layer_ids = [int(x) for x in cfg.init_layers.split(",")]
    except ValueError:
        raise ConfigError(f"--init-layers {cfg.init_layers!r}: comma-separated integers expected") from None
    if len(layer_ids) != dc.num_hidden_layers or not all(0 <= i < tc.num_hidden_layers for i in layer_ids):
        raise ConfigError(f"--init-layers needs {dc.num_hidden_layers} indices in [0, {tc.num_hidden_layers})")
    return layer_ids


def _copy_projected(teacher: Any, draft: Any, layer_ids: list[int], P: torch.Tensor | None) -> None:
    """Projected / pruned copy of the target's layers ``layer_ids`` and final norm into the draft's: through
    ``P`` (None at the target's width), the first heads of each kept KV group, and the most important MLP
    neurons when the draft's MLP is narrower. Llama-style layers only."""
    tc, dc = teacher.config.get_text_config(), draft.config
    # Width scale c: the RMS over H dims of x P is ~ sqrt(D/H) x the RMS over D.
    D, H = tc.hidden_size, dc.hidden_size
    Pm = P if P is not None else torch.eye(D)
    c = math.sqrt(D / H) if P is not None else 1.0
    t_heads, t_kv, hd = tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim
    d_heads, d_kv = dc.num_attention_heads, dc.num_key_value_heads
    t_group, d_group = t_heads // t_kv, d_heads // d_kv
    q_heads = [g * t_group + j for g in range(d_kv) for j in range(d_group)]
    q_rows = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in q_heads])
    kv_rows = torch.cat([torch.arange(g * hd, (g + 1) * hd) for g in range(d_kv)])
    I = dc.intermediate_size
    if I > tc.intermediate_size:
        raise ConfigError(f"--intermediate {I} exceeds the target's {tc.intermediate_size} (use --init embed)")

    def inp(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:  # reads the normalised residual
        return (w.float() * g.float()[None, :]) @ Pm * c if P is not None else w.float()

    def outp(w: torch.Tensor) -> torch.Tensor:  # writes the residual
        return Pm.T @ w.float() if P is not None else w.float()

    t_layers, d_layers = body(teacher).layers, body(draft).layers
    for di, ti in enumerate(layer_ids):
        tl, dl = t_layers[ti], d_layers[di]
        g1, g2 = tl.input_layernorm.weight, tl.post_attention_layernorm.weight
        a, da = tl.self_attn, dl.self_attn
        da.q_proj.weight.copy_(inp(a.q_proj.weight[q_rows], g1))
        da.k_proj.weight.copy_(inp(a.k_proj.weight[kv_rows], g1))
        da.v_proj.weight.copy_(inp(a.v_proj.weight[kv_rows], g1))
        for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            tb, db = getattr(a, name).bias, getattr(da, name).bias
            if tb is not None and db is not None:
                db.copy_(tb[rows])
        da.o_proj.weight.copy_(outp(a.o_proj.weight[:, q_rows]))
        m, dm = tl.mlp, dl.mlp
        if I < tc.intermediate_size:  # keep the neurons with the largest weight-norm product
            score = (m.gate_proj.weight.float().norm(dim=1) * m.up_proj.weight.float().norm(dim=1)
                     * m.down_proj.weight.float().norm(dim=0))
            keep = torch.sort(torch.topk(score, I).indices).values
        else:
            keep = torch.arange(I)
        dm.gate_proj.weight.copy_(inp(m.gate_proj.weight[keep], g2))
        dm.up_proj.weight.copy_(inp(m.up_proj.weight[keep], g2))
        dm.down_proj.weight.copy_(outp(m.down_proj.weight[:, keep]))
        if P is not None:
            dl.input_layernorm.weight.fill_(1.0)
            dl.post_attention_layernorm.weight.fill_(1.0)
        else:
            dl.input_layernorm.weight.copy_(g1)
            dl.post_attention_layernorm.weight.copy_(g2)
    t_norm, d_norm = body(teacher).norm, body(draft).norm
    if P is not None:  # diag approx of c P^T diag(g_final) P
        d_norm.weight.copy_(c * ((Pm ** 2) * t_norm.weight.float()[:, None]).sum(0))
    else:
        d_norm.weight.copy_(t_norm.weight)


def _projected_text(tc: Any, dc: Any, emb_text: str, layer_ids: list[int], projected: bool) -> str:
    """The model card's description of a projected / pruned copy."""
    t_heads, t_kv = tc.num_attention_heads, tc.num_key_value_heads
    d_heads, d_kv = dc.num_attention_heads, dc.num_key_value_heads
    I = dc.intermediate_size
    parts = [emb_text, f"layers = target layers {layer_ids}"]
    if projected:
        parts[-1] += f" projected to {dc.hidden_size} dims (RMSNorm gains folded in)"
    if d_heads != t_heads or d_kv != t_kv:
        parts.append(f"attention: {d_heads} of {t_heads} heads, {d_kv} of {t_kv} KV heads")
    if I < tc.intermediate_size:
        parts.append(f"MLP: the {I} of {tc.intermediate_size} neurons with the largest weight norms")
    parts.append("final norm " + ("projected" if projected else "copied"))
    return "; ".join(parts)


@dataclass
class Draft:
    """The draft being trained, with its optimizer."""

    model: Any
    config: Any  # its transformers config
    optimizer: torch.optim.Optimizer
    init_info: dict[str, Any]  # how it was initialised (for the model card)
    embed_scale: float  # LR multiplier of the tied embeddings; 0: frozen
    same_width: bool  # the target's hidden size

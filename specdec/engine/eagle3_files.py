"""EAGLE-3 heads on disk, in the layout published heads use (SpecForge, vLLM, EAGLE's repository).

A head's folder holds ``config.json`` (a Llama decoder config with ``"architectures": ["LlamaForCausalLMEagle3"]``
and ``draft_vocab_size``; optionally ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``)
and its weights, ``model.safetensors`` or ``pytorch_model.bin``: ``fc.weight``, ``midlayer.self_attn.{q,k,v,o}_
proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``, ``midlayer.{input_layernorm,hidden_norm,post_
attention_layernorm}.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d`` and, when the head does not
share the target's, ``embed_tokens.weight``. :func:`load_head` checks the head against its target and says what
does not match; :func:`save_head` writes the same layout (``specdec distill --method eagle3`` ships its heads so).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specdec.engine.eagle3 import Eagle3Config, Eagle3Head
from specdec.errors import ConfigError

ARCHITECTURE = "LlamaForCausalLMEagle3"
_KNOWN = {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
          "draft_vocab_size", "target_hidden_size", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
          "max_position_embeddings", "eagle_config"}
# published name -> this module's parameter
_NAMES = {"fc.weight": "fc.weight", "norm.weight": "norm", "lm_head.weight": "lm_head.weight", "d2t": "d2t",
          "t2d": "t2d", "embed_tokens.weight": "embed_tokens.weight",
          "midlayer.input_layernorm.weight": "input_layernorm", "midlayer.hidden_norm.weight": "hidden_norm",
          "midlayer.post_attention_layernorm.weight": "post_attention_layernorm",
          **{f"midlayer.self_attn.{p}_proj.weight": f"{p}_proj.weight" for p in "qkvo"},
          **{f"midlayer.mlp.{p}_proj.weight": f"{p}_proj.weight" for p in ("gate", "up", "down")}}


def is_eagle3_head(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding an EAGLE-3 head's config."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        raw = json.loads(config.read_text())
    except ValueError:
        return False
    return ARCHITECTURE in raw.get("architectures", []) or "draft_vocab_size" in raw


def read_config(folder: Path) -> Eagle3Config:
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(f"EAGLE-3 head {folder}: no config.json (a head's folder holds config.json and "
                          "model.safetensors in the published EAGLE-3 layout)")
    raw = json.loads(path.read_text())
    if raw.get("speculators_model_type"):
        raise ConfigError(f"EAGLE-3 head {folder} is in the speculators layout ({raw['speculators_model_type']}); "
                          "specdec reads the SpecForge/vLLM layout (config.json with draft_vocab_size, weights fc, "
                          "midlayer.*, norm, lm_head, d2t, t2d)")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in raw]
    if missing:
        raise ConfigError(f"EAGLE-3 head {folder}: config.json lacks {missing}")
    layers = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        vocab_size=raw["vocab_size"], draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
        target_hidden_size=raw.get("target_hidden_size"), head_dim=raw.get("head_dim"),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5), rope_theta=raw.get("rope_theta", 10000.0),
        rope_scaling=raw.get("rope_scaling"), max_position_embeddings=raw.get("max_position_embeddings", 8192),
        feature_layers=tuple(layers) if layers else None,
        extra={k: v for k, v in raw.items() if k not in _KNOWN})


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        out = {}
        for f in bins:
            out.update(torch.load(f, map_location="cpu", weights_only=True))
        return out
    raise ConfigError(f"EAGLE-3 head {folder}: no model.safetensors or pytorch_model.bin")


def load_head(path: str | Path, *, target_hidden_size: int, target_vocab_size: int, target_num_layers: int,
              target_embedding: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> tuple[Eagle3Head, tuple[int, ...]]:
    """The head at ``path``, checked against its target; and the target layers whose inputs it reads.

    ``target_embedding`` [vocab, hidden]: the target's token embedding, for a head that shares it (one whose
    weights hold no ``embed_tokens.weight``). Raises ConfigError saying what does not match."""
    from specdec.features import default_feature_layers

    folder = Path(path)
    cfg = read_config(folder)
    if cfg.target_width != target_hidden_size:
        raise ConfigError(f"EAGLE-3 head {folder} reads features of hidden size {cfg.target_width} (3 x "
                          f"{cfg.target_width} into fc), but the target's hidden size is {target_hidden_size}: "
                          "the head was trained for another target")
    if cfg.vocab_size != target_vocab_size:
        raise ConfigError(f"EAGLE-3 head {folder} maps its draft vocabulary to {cfg.vocab_size} target ids, but the "
                          f"target's vocabulary has {target_vocab_size}: the head was trained for another target")
    layers = cfg.feature_layers or default_feature_layers(target_num_layers)
    if len(layers) != 3 or not all(0 <= i < target_num_layers for i in layers):
        raise ConfigError(f"EAGLE-3 head {folder} reads target layers {list(layers)}; the target has "
                          f"{target_num_layers} (three layers below that are needed)")
    weights = _read_weights(folder)
    head = Eagle3Head(cfg)
    state = head.state_dict()
    unknown = [k for k in weights if k not in _NAMES]
    if unknown:
        raise ConfigError(f"EAGLE-3 head {folder}: unexpected weights {unknown[:5]} (not the EAGLE-3 layout)")
    loaded = {}
    for name, tensor in weights.items():
        ours = _NAMES[name]
        if tuple(tensor.shape) != tuple(state[ours].shape):
            raise ConfigError(f"EAGLE-3 head {folder}: {name} has shape {tuple(tensor.shape)}, config.json says "
                              f"{tuple(state[ours].shape)}")
        loaded[ours] = tensor
    if "embed_tokens.weight" not in loaded:
        if target_embedding is None:
            raise ConfigError(f"EAGLE-3 head {folder} shares the target's token embedding (its weights hold no "
                              "embed_tokens.weight): give the draft the target's model (--target-tokenizer)")
        if tuple(target_embedding.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ConfigError(f"EAGLE-3 head {folder}: the target's embedding is {tuple(target_embedding.shape)}, "
                              f"the head needs ({cfg.vocab_size}, {cfg.hidden_size})")
        loaded["embed_tokens.weight"] = target_embedding
    missing = [k for k in _NAMES.values() if k not in loaded and k not in ("d2t", "t2d")]
    if missing:
        raise ConfigError(f"EAGLE-3 head {folder}: weights lack {missing}")
    if "d2t" not in loaded and cfg.draft_vocab_size != cfg.vocab_size:
        raise ConfigError(f"EAGLE-3 head {folder}: a draft vocabulary of {cfg.draft_vocab_size} ids needs d2t")
    if "d2t" in loaded:
        targets = torch.arange(cfg.draft_vocab_size) + loaded["d2t"].long()
        if bool((targets < 0).any()) or bool((targets >= cfg.vocab_size).any()):
            raise ConfigError(f"EAGLE-3 head {folder}: d2t maps draft ids outside the target's vocabulary")
        loaded["d2t"] = loaded["d2t"].long()
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm"):
        loaded[name] = loaded[name].reshape(-1)
    with torch.no_grad():
        for name, tensor in loaded.items():
            state[name].copy_(tensor.to(state[name].dtype))
    head = head.to(device=device, dtype=dtype)
    head.d2t.data = head.d2t.long()
    head.t2d.data = head.t2d.bool()
    return head.eval().requires_grad_(False), tuple(layers)


def save_head(head: Eagle3Head, folder: str | Path, feature_layers: tuple[int, ...] | None = None,
              with_embedding: bool = True, extra: dict[str, Any] | None = None) -> Path:
    """Write ``head`` in the published layout (``with_embedding``: carry the target's embedding, so the draft
    service needs nothing of the target)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = head.cfg
    raw = {**cfg.extra, "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
           "num_hidden_layers": 1, "tie_word_embeddings": False,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
           "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
           "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
           "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
           "torch_dtype": str(head.fc.weight.dtype).removeprefix("torch."), **(extra or {})}
    if cfg.target_hidden_size:
        raw["target_hidden_size"] = cfg.target_hidden_size
    if cfg.head_dim:
        raw["head_dim"] = cfg.head_dim
    if cfg.rope_scaling:
        raw["rope_scaling"] = cfg.rope_scaling
    layers = feature_layers or cfg.feature_layers
    if layers:
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layers)}
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    state = head.state_dict()
    out = {}
    for published, ours in _NAMES.items():
        if ours == "embed_tokens.weight" and not with_embedding:
            continue
        out[published] = state[ours].detach().contiguous().cpu()
    save_file(out, str(folder / "model.safetensors"))
    return folder


def target_embedding_from_files(folder: str | Path) -> torch.Tensor:
    """The target's token embedding [vocab, hidden], read alone from its safetensors (a draft service never
    loads the target's other weights)."""
    from safetensors import safe_open

    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key.endswith("embed_tokens.weight"):
                    return st.get_tensor(key)
    raise ConfigError(f"the target at {folder} has no embed_tokens.weight in a .safetensors file: the EAGLE-3 head "
                      "needs the target's token embedding")


def load_head_for_target(head_path: str | Path, target_path: str | Path, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> tuple[Eagle3Head, tuple[int, ...], dict[str, Any]]:
    """A head checked against the target in ``target_path`` (a model folder): its config.json gives the shape,
    its safetensors the embedding. Returns (head, feature layers, the target's shape)."""
    raw = json.loads((Path(target_path) / "config.json").read_text())
    text = raw.get("text_config") or raw
    shape = {"hidden_size": text["hidden_size"], "num_hidden_layers": text["num_hidden_layers"],
             "vocab_size": text["vocab_size"], "max_position_embeddings": text.get("max_position_embeddings")}
    embedding = target_embedding_from_files(target_path)
    shape["vocab_size"] = int(embedding.shape[0])
    head, layers = load_head(head_path, target_hidden_size=shape["hidden_size"], target_vocab_size=shape["vocab_size"],
                             target_num_layers=shape["num_hidden_layers"], target_embedding=embedding.float(),
                             dtype=dtype, device=device)
    return head, layers, shape


def quantize_head(head: Eagle3Head, requested: str | None, name: str = "the EAGLE-3 head") -> str:
    """Apply the draft's ``quantization`` to a head, chosen as a draft model's is
    (``specdec.engine.network.resolve_quantization``: ``auto`` is int8 where it runs here, else none, logged; an
    explicit mode that cannot run is a ConfigError saying why). Returns the mode."""
    from specdec.engine.network import resolve_quantization

    mode = resolve_quantization(requested, "draft", name, head.norm.device)
    if mode != "none":
        head.quantize(mode)
    return mode

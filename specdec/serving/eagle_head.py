"""A draft service's EAGLE-3 head: loaded for its target, and what GetInfo says of it (no torch here)."""

from __future__ import annotations

from typing import Any

from specdec.model_files import load_tokenizer, resolve_model_path, tokenizer_fingerprint


def load_eagle_head(cfg: Any, target: str, draft_sample_method: str, top_n: int | None,
                    tree_shape: Any = None) -> tuple[Any, Any, dict]:
    """(the head's sequence store, its worker, its GetInfo fields) for the head ``cfg.model`` over ``target``;
    ``tree_shape``: its token trees (None: chains)."""
    from specdec.engine.eagle3_files import load_head_for_target, quantize_head
    from specdec.engine.eagle3_worker import Eagle3Worker, HeadStore
    from specdec.engine.models import parse_dtype

    target_path = resolve_model_path(target, cfg.revision)[0]
    head_path = resolve_model_path(cfg.model, cfg.revision)[0]
    dtype = parse_dtype(cfg.dtype, cfg.device)
    head, layers, shape = load_head_for_target(head_path, target_path, dtype=dtype, device=cfg.device)
    quantize_head(head, cfg.quantization, cfg.model)
    limit = shape["max_position_embeddings"] or 1 << 20
    max_model_len = min(cfg.max_model_len or limit, limit)
    tokenizer = load_tokenizer(target_path)
    eos = tokenizer.eos_token_id
    store = HeadStore(head, max_model_len, cfg.max_sequences)
    worker = Eagle3Worker(store, draft_sample_method, top_n=top_n,
                          eos_token_ids=frozenset([eos] if eos is not None else []), tree=tree_shape)
    fingerprint = tokenizer_fingerprint(tokenizer)
    info = {"method": "eagle3", "model_name": cfg.model, "vocab_size": shape["vocab_size"],
            "tokenizer_fingerprint": fingerprint, "proposal_tokenizer_fingerprint": fingerprint,
            "dtype": str(dtype).removeprefix("torch."), "device": cfg.device, "eos_token_ids": sorted(worker.eos_token_ids),
            "model_source": head_path, "feature_layers": list(layers)}
    return store, worker, info

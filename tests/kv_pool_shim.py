"""A stand-in for the block-pool API of ``ModelRunner`` while the engine does not have it yet.

The serving layer builds its runners with the pool's settings (``kv_cache_memory``, ``block_size``,
``enable_prefix_caching``, ``gpu_memory_utilization``) and reads ``runner.kv_stats()``. Until
``specdec.engine.runner.ModelRunner`` takes them, the test session runs the services on this subclass:
it accepts the settings, keeps the per-sequence caches it inherits, and reports what a pool of that
size would hold (capacity from the bytes per token of the model, usage from the sequences' lengths;
no prefix sharing, no preemption). ``install()`` does nothing once the real runner has ``kv_stats``:
then this module is dead and can go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ShimKVStats:
    """The fields of ``specdec.engine.kv_cache.KVStats``."""

    num_blocks: int
    block_size: int
    free_blocks: int
    used_blocks: int
    usage: float
    capacity_tokens: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0


def _runner_class():
    from specdec.engine.kv_cache import DEFAULT_BLOCK_SIZE, DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_KV_CACHE_MEMORY
    from specdec.engine.runner import ModelRunner

    class PoolShimRunner(ModelRunner):
        def __init__(self, lm, max_model_len, role, max_sequences=256, logits_vocab_size=None, min_query_tokens=None,
                     lean_forward=None, *, kv_cache_memory=None, block_size=DEFAULT_BLOCK_SIZE,
                     enable_prefix_caching=True, gpu_memory_utilization=DEFAULT_GPU_MEMORY_UTILIZATION):
            super().__init__(lm, max_model_len, role, max_sequences, logits_vocab_size, min_query_tokens, lean_forward)
            cfg = lm.model.config.get_text_config()
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            bytes_per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.finfo(lm.dtype).bits // 8
            memory = kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
            self.block_size = block_size
            self.enable_prefix_caching = enable_prefix_caching
            self.num_blocks = memory // (bytes_per_token * block_size)

        def kv_stats(self) -> ShimKVStats:
            with self.lock:
                used = sum(-(-len(s.tokens) // self.block_size) for s in self.sequences.values())
            used = min(used, self.num_blocks)
            return ShimKVStats(num_blocks=self.num_blocks, block_size=self.block_size,
                               free_blocks=self.num_blocks - used, used_blocks=used,
                               usage=used / self.num_blocks if self.num_blocks else 0.0,
                               capacity_tokens=self.num_blocks * self.block_size)

    return PoolShimRunner


def needed() -> bool:
    """Whether the engine's runner still lacks the pool API."""
    from specdec.engine.runner import ModelRunner

    return not hasattr(ModelRunner, "kv_stats")


def module_command(module: str) -> list[str]:
    """The command line that runs ``python -m module`` (in a service process of the tests), on the stand-in
    while it is needed."""
    import sys

    if not needed():
        return [sys.executable, "-m", module]
    code = ("import runpy; from tests.kv_pool_shim import install; install(); "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", code]


def install():
    """Run the services on the stand-in while the real runner lacks the pool API; returns how to undo it."""
    from specdec.serving import backend

    if not needed():
        return lambda: None
    original = backend.ModelRunner
    backend.ModelRunner = _runner_class()

    def undo() -> None:
        backend.ModelRunner = original

    return undo

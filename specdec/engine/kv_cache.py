"""The KV pool of a model runner (block tensors, a budget, statistics), and a per-sequence cache.

``KVPool`` is what the runner keeps every sequence's keys and values in: per layer one tensor
``[kv_heads, num_blocks * block_size, head_dim]`` for keys and one for values, allocated once (untouched
pages cost no resident memory until written) and sized by a byte budget; :class:`specdec.engine.block_pool.BlockPool`
keeps the books. Passes read the blocks in place (``specdec.engine.attention``).

``SequenceKVCache`` below serves the transformers-forward fallback (architectures the lean forward does
not cover): a pass gathers the sequence's history from the pool into one, runs transformers' model, and
writes the new entries back. Each layer keeps one pre-allocated buffer ``[1, kv_heads, capacity, head_dim]``. A forward pass
writes its new keys/values at ``[length, length + n)`` and attends over the view ``[:length + n]``.
Rolling back after a rejection only moves the pointer: the rejected entries are overwritten by the
next forward pass, never copied. The buffer grows geometrically (rarely: one copy per doubling).

The class speaks transformers' ``Cache`` protocol, so any causal LM in transformers can use it.
Sliding-window layers keep their full history here; the model's sliding-window *mask* still applies,
so the result equals the reference, at the cost of some memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.engine.block_pool import BlockPool

_MIN_CAPACITY = 128
# The defaults of the services' --block-size, --kv-cache-memory, --gpu-memory-utilization and
# --enable-prefix-caching (vLLM's names), of LLM(...) and of the chart.
DEFAULT_BLOCK_SIZE = 16
DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_ENABLE_PREFIX_CACHING = True


@dataclass
class KVStats:
    num_blocks: int
    block_size: int
    free_blocks: int  # free + cached blocks nobody holds
    used_blocks: int  # held by live sequences
    usage: float  # used_blocks / num_blocks
    capacity_tokens: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int  # tokens found there (cumulative)
    preemptions: int  # sequences preempted (cumulative)


class KVPool:
    """Every layer's keys and values in blocks, for one model: ``keys[i]``/``values[i]`` are
    ``[kv_heads, num_blocks * block_size, head_dim]``; block b holds slots ``[b * block_size, (b + 1) * block_size)``."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 budget_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 enable_prefix_caching: bool = DEFAULT_ENABLE_PREFIX_CACHING):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        per_block = self.bytes_per_token(num_layers, kv_heads, head_dim, dtype) * block_size
        num_blocks = int(budget_bytes // per_block)
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens "
                             f"({per_block} bytes each): raise kv_cache_memory")
        self.blocks = BlockPool(num_blocks, block_size, enable_prefix_caching)
        slots = num_blocks * block_size
        # torch.empty: pages become resident only when a pass writes them
        self.key_data = torch.empty((num_layers, kv_heads, slots, head_dim), dtype=dtype, device=device)
        self.value_data = torch.empty((num_layers, kv_heads, slots, head_dim), dtype=dtype, device=device)
        self.keys = list(self.key_data.unbind(0))
        self.values = list(self.value_data.unbind(0))
        self.preemptions = 0

    @property
    def nbytes(self) -> int:
        """The pool's keys and values."""
        return 2 * self.key_data.numel() * self.key_data.element_size()

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.blocks.num_blocks * self.block_size

    def copy_slots(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` slots of block ``src`` into block ``dst``, every layer (copy-on-write)."""
        bs = self.block_size
        for data in (self.key_data, self.value_data):
            data[:, :, dst * bs: dst * bs + n] = data[:, :, src * bs: src * bs + n]

    def stats(self) -> KVStats:
        b = self.blocks
        return KVStats(num_blocks=b.num_blocks, block_size=b.block_size, free_blocks=b.num_free,
                       used_blocks=b.num_used, usage=b.num_used / b.num_blocks, capacity_tokens=self.capacity_tokens,
                       prefix_cache_queries=b.queries, prefix_cache_hits=b.hits, preemptions=self.preemptions)


def kv_budget(device: torch.device, kv_cache_memory: int | None, gpu_memory_utilization: float) -> int:
    """The KV pool's bytes: ``kv_cache_memory`` if set; on CUDA, ``gpu_memory_utilization`` of the device memory
    free when the runner is built (after its weights); on CPU, DEFAULT_KV_CACHE_MEMORY."""
    if kv_cache_memory is not None:
        if kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {kv_cache_memory}")
        return int(kv_cache_memory)
    if device.type == "cuda":
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        # a share of what is free once the weights are loaded: in one process (``specdec serve``) the target
        # is built first and takes that share; the draft then takes the same share of what is left
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * gpu_memory_utilization)
    return DEFAULT_KV_CACHE_MEMORY


class _PointerLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, max_length: int):
        super().__init__()
        self.max_length = max_length
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = key_states.new_empty((*key_states.shape[:2], 0, key_states.shape[-1]))
        self.values = value_states.new_empty((*value_states.shape[:2], 0, value_states.shape[-1]))
        self.is_initialized = True

    def _reserve(self, needed: int) -> None:
        cap = self.keys.shape[-2]
        if needed <= cap:
            return
        new_cap = min(max(needed, 2 * cap, _MIN_CAPACITY), max(needed, self.max_length))
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], new_cap, old.shape[-1]))
            new[..., : self.length, :] = old[..., : self.length, :]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        self._reserve(end)
        self.keys[..., self.length : end, :] = key_states
        self.values[..., self.length : end, :] = value_states
        self.length = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - abs(tokens_to_remove)) if tokens_to_remove < 0 else tokens_to_remove

    def reset(self) -> None:
        self.length = 0

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class SequenceKVCache(Cache):
    """The KV cache of one sequence: ``length`` tokens are cached; ``truncate`` rolls back."""

    def __init__(self, num_layers: int, max_length: int):
        super().__init__(layers=[_PointerLayer(max_length) for _ in range(num_layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length

    def load(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Start from a copy of a history: per layer keys and values [1, kv_heads, length, head_dim]."""
        for layer, k, v in zip(self.layers, keys, values):
            layer.lazy_initialization(k, v)
            n = k.shape[-2]
            layer._reserve(n)
            layer.keys[..., :n, :] = k
            layer.values[..., :n, :] = v
            layer.length = n

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached positions (rollback by pointer; nothing is copied)."""
        if length > self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        for layer in self.layers:
            layer.length = length

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

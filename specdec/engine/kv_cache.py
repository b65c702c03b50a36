"""Per-sequence KV cache with a length pointer.

Each layer keeps one pre-allocated buffer ``[1, kv_heads, capacity, head_dim]``. A forward pass
writes its new keys/values at ``[length, length + n)`` and attends over the view ``[:length + n]``.
Rolling back after a rejection only moves the pointer: the rejected entries are overwritten by the
next forward pass, never copied. The buffer grows geometrically (rarely: one copy per doubling).

The class speaks transformers' ``Cache`` protocol, so any causal LM in transformers can use it.
Sliding-window layers keep their full history here; the model's sliding-window *mask* still applies,
so the result equals the reference, at the cost of some memory.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

_MIN_CAPACITY = 128


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

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached positions (rollback by pointer; nothing is copied)."""
        if length > self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        for layer in self.layers:
            layer.length = length

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


class _BatchLayer(CacheLayerMixin):
    """One layer of a padded batch view: rows are sequences with different cached lengths."""

    is_compileable = False
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, starts: list[int]):
        super().__init__()
        self.keys, self.values, self.starts = keys, values, starts
        self.is_initialized = True
        self.device = keys.device

    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - built initialised
        raise AssertionError("batch layers are built initialised")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        for row, start in enumerate(self.starts):
            self.keys[row, :, start : start + n] = key_states[row]
            self.values[row, :, start : start + n] = value_states[row]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def get_seq_length(self) -> int:
        return min(self.starts)

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class BatchKVView(Cache):
    """A padded ``[batch, heads, length, dim]`` copy of several sequences' caches for one forward pass.

    Row ``i`` holds sequence ``i``'s cached positions ``[0, starts[i])``; the pass writes its new
    keys/values at ``[starts[i], starts[i] + n)``. ``scatter_back`` copies the real new entries into
    each sequence's own cache. The caller supplies the attention mask (padding differs per row).
    """

    def __init__(self, caches: list[SequenceKVCache], num_new: int):
        starts = [c.length for c in caches]
        length = max(starts) + num_new
        layers = []
        for li in range(len(caches[0].layers)):
            ref = caches[0].layers[li]
            if not ref.is_initialized:
                raise ValueError("BatchKVView needs caches that hold at least one token")
            shape = (len(caches), ref.keys.shape[1], length, ref.keys.shape[-1])
            keys = ref.keys.new_zeros(shape)
            values = ref.values.new_zeros((*shape[:3], ref.values.shape[-1]))
            for row, cache in enumerate(caches):
                layer = cache.layers[li]
                keys[row, :, : layer.length] = layer.keys[0, :, : layer.length]
                values[row, :, : layer.length] = layer.values[0, :, : layer.length]
            layers.append(_BatchLayer(keys, values, starts))
        super().__init__(layers=layers)
        self.starts = starts

    def scatter_back(self, caches: list[SequenceKVCache], num_new: list[int]) -> None:
        for li, blayer in enumerate(self.layers):
            for row, cache in enumerate(caches):
                layer = cache.layers[li]
                start, end = self.starts[row], self.starts[row] + num_new[row]
                layer._reserve(end)
                layer.keys[0, :, start:end] = blayer.keys[row, :, start:end]
                layer.values[0, :, start:end] = blayer.values[row, :, start:end]
                layer.length = end

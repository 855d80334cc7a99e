"""A KV cache that reserves room for the tokens still to come, so a decode step appends instead of copying.

transformers' ``DynamicLayer`` grows its keys and values with ``torch.cat`` at every step: each
decode step copies the whole cache of every layer (and briefly holds it twice). At a prompt of a few
hundred tokens the copy costs more than the step's own work: 64 rows of SmolLM2-135M (3 key/value
heads of 64, 30 layers, fp32) at 400 positions are 2 x 590 MB copied per token step. A
:class:`ReservedLayer` allocates, at its first update, room for ``reserve`` more positions than it
was given, writes each new position in place and hands the model views of the filled part: the same
keys and values, the same attention (views are read like the tensors ``cat`` would have made).

Only plain full-attention layers (``DynamicLayer``) are replaced; a model with sliding-window,
linear-attention or other layer kinds keeps transformers' own cache (:func:`reserved_cache` returns
None for it).
"""

from __future__ import annotations

import functools

import torch


class ReservedLayer:
    """Mixed into ``DynamicLayer`` by :func:`_reserved_dynamic_layer` (transformers is imported lazily)."""

    def __init__(self, reserve: int, **kwargs):
        super().__init__(**kwargs)
        self.reserve = max(0, int(reserve))
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def _filled(self) -> int:
        return 0 if self._k is None else self.keys.shape[-2]

    def _view(self, length: int) -> None:
        self.keys, self.values = self._k[..., :length, :], self._v[..., :length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self._filled()
        new = old + key_states.shape[-2]
        if self._k is None or new > self._k.shape[-2]:  # the first update, or more positions than reserved
            k = key_states.new_empty(*key_states.shape[:-2], new + self.reserve, key_states.shape[-1])
            v = value_states.new_empty(*value_states.shape[:-2], new + self.reserve, value_states.shape[-1])
            if old:
                k[..., :old, :], v[..., :old, :] = self.keys, self.values
            self._k, self._v = k, v
        self._k[..., old:new, :] = key_states
        self._v[..., old:new, :] = value_states
        self._view(new)
        return self.keys, self.values

    def reset(self) -> None:
        self._k = self._v = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # shortens the views; the buffer keeps its room
        if self._k is not None:
            self._view(self.keys.shape[-2])

    def _rows(self, pick) -> None:
        if self._k is not None:
            length = self._filled()
            self._k, self._v = pick(self._k), pick(self._v)
            self._view(length)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(lambda t: t[indices, ...])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(lambda t: t.index_select(0, beam_idx.to(t.device)))


@functools.cache
def _reserved_dynamic_layer() -> type:
    from transformers.cache_utils import DynamicLayer

    return type("ReservedDynamicLayer", (ReservedLayer, DynamicLayer), {})


def reserved_cache(model: torch.nn.Module, reserve: int):
    """A ``DynamicCache`` for ``model`` whose layers keep room for ``reserve`` more positions after the
    prompt, or None when the model's cache has layers other than plain full attention."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer

        config = getattr(model, "config", None)
        cache = DynamicCache(config=config) if config is not None else None
    except Exception:  # an older transformers, or a config the cache cannot read: its own cache then
        return None
    if cache is None or not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [_reserved_dynamic_layer()(reserve) for _ in cache.layers]
    return cache

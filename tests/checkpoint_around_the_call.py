"""transformers < 5.24's way of checkpointing a decoder layer, on whichever transformers is installed, so that CI (the
newest releases) runs the code paths that only those releases reach (the GPU image has 5.17)."""

from __future__ import annotations

import functools

import pytest
from torch import nn


def checkpoint_around_the_call(monkeypatch: pytest.MonkeyPatch, layer_class: type[nn.Module]) -> None:
    """Gives `GradientCheckpointingLayer` 5.17's `__call__`, which drops the cache and hands the checkpoint function
    the layer's whole call, hooks and all; takes away 5.24's `__init_subclass__`, which wraps a subclass's `forward` in
    a checkpoint; and gives `layer_class` its `forward` as the model wrote it. Nothing on a transformers < 5.24."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if "__call__" in vars(GradientCheckpointingLayer):
        return

    def call(self, *args, **kwargs):
        module_call = super(GradientCheckpointingLayer, self).__call__
        if not (self.gradient_checkpointing and self.training):
            return module_call(*args, **kwargs)
        # A recomputation would fill a cache again (5.17 names it `past_key_values`, later releases `cache`).
        kwargs.update(use_cache=False, **{name: None for name in ("past_key_values", "cache") if name in kwargs})
        return self._gradient_checkpointing_func(functools.partial(module_call, **kwargs), *args)

    monkeypatch.setattr(GradientCheckpointingLayer, "__call__", call)
    monkeypatch.delattr(GradientCheckpointingLayer, "__init_subclass__")
    monkeypatch.setattr(layer_class, "forward", layer_class.forward.__wrapped__)

"""A plan on the model: the decoder layers given the plan's actions, and the engine told what the plan moves.

`LayersUnderPlan` is the one place a plan reaches the model. Each plan's actions replace the last's
(`layer_actions.apply_layer_actions`); the engine's `remove_hooks` takes the last off with its hooks, giving every
layer back its own checkpointing and forward (a refused budget's too: its profiled steps' plan may have tiled the
layers). A plan that moves nothing has the engine stand aside.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ..engine import OffloadActivations
from .actions import ACTIONS
from .layer_actions import AppliedActions, apply_layer_actions, whole_call_layer

__all__ = ["LayersUnderPlan"]

LayerStarts = Callable[[int, nn.Module, tuple, dict], None]


class LayersUnderPlan:
    """Applies plans to the decoder layers, in the plan's order, and takes the last one off (`remove`, which the
    engine calls with its own hooks' removal).

    The model and the engine are held weakly, as the controller holds them: the engine holds this, and a dropped
    context must not keep them alive.

    Args:
        model: the unwrapped model.
        engine: the offloading context whose windows and standing aside follow the plan.
        layers: the decoder layers, in registration order.
    """

    def __init__(self, model: nn.Module, engine: OffloadActivations, layers: list[nn.Module]) -> None:
        self._model = weakref.ref(model)
        self._engine = weakref.ref(engine)
        self._layers = layers
        self._applied: AppliedActions | None = None
        # transformers before 5.2x checkpoints a layer's whole call: the layer then starts from its checkpoint
        # function, before the call (`_StartsBeforeTheCall`).
        self._whole_call = any(type(layer).__call__ is not nn.Module.__call__ for layer in layers)

    def apply(self, code: str, order: Sequence[int], windows: tuple[int, int | None, int | None] | None,
              layer_starts: LayerStarts, tile_tokens: int = 0, layer_tile_tokens: int = 0) -> None:  # fmt: skip
        """Gives the layers the actions of plan `code`, in the plan's order (`order[position]` is the registration
        index of the plan's layer at `position`), and the engine the plan's `windows` (forward, prefetch, head's
        prefetch; None: as they are). Nothing once the model or the engine is gone.

        `layer_starts` is the controller's pre-hook of layer `index`, `(index, layer, args, kwargs)`: where
        transformers checkpoints a layer's whole call, it runs before the call (`_StartsBeforeTheCall`). Only the
        layers' checkpoint functions hold it, and the plan's removal gives those back: this object does not refer to
        the controller, so that a dropped context is freed as soon as it is dropped."""
        model, engine = self._model(), self._engine()
        if model is None or engine is None:
            return
        actions = [ACTIONS[letter] for letter in code]
        by_index = dict(zip(order, actions))
        in_registration_order = [by_index[index] for index in range(len(actions))]
        self.remove()
        self._applied = apply_layer_actions(model, engine, in_registration_order, tile_tokens, layer_tile_tokens)
        if self._whole_call:
            for index, layer in enumerate(self._layers):
                if layer.gradient_checkpointing:
                    starts = functools.partial(layer_starts, index)
                    layer._gradient_checkpointing_func = _StartsBeforeTheCall(
                        starts, layer._gradient_checkpointing_func
                    )
        if windows is not None:
            engine.use_windows(*windows)
        # A plan that moves nothing (every layer kept, or checkpointed with its input kept): the engine stands aside,
        # so that such a step costs what it costs without the library (no saved-tensor hooks pushed, no region around
        # each layer): plain checkpointing, the trial, runs as transformers runs it.
        if not any(action.moves for action in actions):
            if engine.standing_aside is None:
                engine.stand_aside("planned")
        elif engine.standing_aside == "planned":
            engine.rejoin()

    def remove(self) -> None:
        """Takes the plan in force off the layers."""
        if self._applied is not None:
            self._applied.remove()
            self._applied = None


class _StartsBeforeTheCall:
    """A planned layer's `_gradient_checkpointing_func` where transformers checkpoints the layer's whole call.

    transformers releases whose `GradientCheckpointingLayer` overrides `__call__` (5.17 on the H100 here; 5.2x
    checkpoints the layer's `forward` instead) hand the checkpoint function the layer's whole call, whose pre-hooks
    run inside the checkpoint, after the call has looked the layer's `forward` up; the recomputation in backward
    looks it up again. A plan that tiled the layer from its pre-hook (the first step's, once the probes are in; a
    longer step's) ran it untiled in the forward and tiled in the recomputation: "a different number of tensors was
    saved during the original forward and recomputation: 40 and 10", on the H100. So the layer's start (`starts`,
    the controller's pre-hook, which its pre-hook then repeats to no effect) runs here, before the call, and the call
    goes to the checkpoint function of the plan in force after it, or runs without one if that plan does not
    checkpoint the layer.
    """

    def __init__(self, starts: Callable[..., None], function: Callable[..., Any]) -> None:
        self.starts = starts
        self.function = function

    def __call__(self, function: Callable[..., Any], *args: Any) -> Any:
        layer = whole_call_layer(function)
        if layer is None:  # not a whole call: nothing to start early
            return self.function(function, *args)
        self.starts(layer, args, function.keywords)
        if not layer.gradient_checkpointing:
            return function(*args)
        current = layer._gradient_checkpointing_func
        return (current.function if isinstance(current, _StartsBeforeTheCall) else current)(function, *args)

"""A plan on the model: the decoder layers given the plan's actions, and the engine the plan's settings.

`LayersUnderPlan` is the one place a plan reaches the model and the engine. Each plan's actions replace the last's
(`layer_actions.apply_layer_actions`); the engine's `remove_hooks` takes the last off with its hooks, giving every
layer back its own checkpointing and forward (a refused budget's too: its profiled steps' plan may have tiled the
layers). The engine takes the plan's settings in one call (`engine_settings`, `OffloadActivations.apply_settings`);
a plan that moves nothing has it stand aside.

A plan may be applied in the middle of a training forward (the first step's, once the last kind of layer is probed at
its first call; a longer stack's, as that stack starts). The layers that ran before it keep their actions until the
next forward: a checkpoint's recomputation in backward calls the layer's MLP as it finds it then, and one that the new
plan tiled or untiled would run other code than the forward did ("a different number of tensors was saved during the
original forward and recomputation: 93 and 88", a Qwen3.5 linear-attention layer whose MLP the plan made at the next,
full-attention layer tiled).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ..engine import CopyWindows, EngineSettings, OffloadActivations
from ..model import checkpoints_its_whole_call
from .actions import ACTIONS, LayerAction
from .layer_actions import AppliedActions, apply_layer_actions, whole_call_layer
from .simulate import Plan

__all__ = ["LayersUnderPlan", "engine_settings"]

LayerStarts = Callable[[int, nn.Module, tuple, dict], None]


def engine_settings(code: str, windows: CopyWindows | None = None, tail_cap_bytes: int | None = None,
                    host_cap_bytes: int | None = None, plan: Plan | None = None) -> EngineSettings:  # fmt: skip
    """The engine's settings under plan `code` (`OffloadActivations.apply_settings`): `windows`, the tail's and the
    pinned pool's caps and `plan` as given (None: as they are), and whether the engine stands aside.

    A plan that moves nothing (every layer kept, or checkpointed with its input kept) has the engine stand aside, so
    that such a step costs what it costs without the library (no saved-tensor hooks pushed, no region around each
    layer): plain checkpointing, the trial, runs as transformers runs it.
    """
    stand_aside = not any(ACTIONS[letter].moves for letter in code)
    return EngineSettings(stand_aside, windows, tail_cap_bytes, host_cap_bytes, plan)


class LayersUnderPlan:
    """Applies plans to the decoder layers, in the plan's order, and takes the last one off (`remove`, which the
    engine calls with its own hooks' removal).

    The model and the engine are held weakly, as the controller holds them: the engine holds this, and a dropped
    context must not keep them alive.

    Args:
        model: the unwrapped model.
        engine: the offloading context whose settings follow the plan (`engine_settings`).
        layers: the decoder layers, in registration order.
    """

    def __init__(self, model: nn.Module, engine: OffloadActivations, layers: list[nn.Module]) -> None:
        self._model = weakref.ref(model)
        self._engine = weakref.ref(engine)
        self._layers = layers
        self._applied: AppliedActions | None = None
        self._actions: list[LayerAction] | None = None  # the actions in force, in registration order
        self._tile_tokens = self._layer_tile_tokens = 0  # the chunks of the actions in force
        self._ran: set[int] = set()  # the layers (registration indices) that started in this training forward
        self._deferred: Callable[[], None] | None = None  # the plan to apply whole as the next forward begins
        # transformers before 5.24 checkpoints a layer's whole call: the layer then starts from its checkpoint
        # function, before the call (`_StartsBeforeTheCall`).
        self._whole_call = any(checkpoints_its_whole_call(layer) for layer in layers)

    def apply(self, code: str, order: Sequence[int], settings: EngineSettings, layer_starts: LayerStarts,
              tile_tokens: int = 0, layer_tile_tokens: int = 0) -> None:  # fmt: skip
        """Gives the layers the actions of plan `code`, in the plan's order (`order[position]` is the registration
        index of the plan's layer at `position`), then the engine the plan's `settings` (`engine_settings`). Nothing
        once the model or the engine is gone.

        `layer_starts` is the controller's pre-hook of layer `index`, `(index, layer, args, kwargs)`: where
        transformers checkpoints a layer's whole call, it runs before the call (`_StartsBeforeTheCall`). Only the
        layers' checkpoint functions and a plan deferred to the next forward hold it, and the plan's removal gives
        those back; the controller holds the engine weakly, so that a dropped context is freed as soon as it is
        dropped.

        Applied in the middle of a training forward, it leaves the layers that ran in it (`layer_ran`) their actions,
        and reaches them too as the next forward begins (`forward_begins`)."""
        model, engine = self._model(), self._engine()
        if model is None or engine is None:
            return
        by_index = dict(zip(order, (ACTIONS[letter] for letter in code)))
        actions = [by_index[index] for index in range(len(code))]
        deferred = None
        if self._ran and self._actions is not None:
            now = [self._actions[i] if i in self._ran else action for i, action in enumerate(actions)]
            if now != actions:
                deferred = functools.partial(self.apply, code, order, settings, layer_starts, tile_tokens,
                                             layer_tile_tokens)  # fmt: skip
                # The chunk sizes do not change what a tiled op saves (its input and parameters), only its rounding.
                actions, tile_tokens = now, tile_tokens or self._tile_tokens
                layer_tile_tokens = layer_tile_tokens or self._layer_tile_tokens
        self.remove()
        self._applied = apply_layer_actions(model, engine, actions, tile_tokens, layer_tile_tokens)
        self._actions, self._tile_tokens, self._layer_tile_tokens = actions, tile_tokens, layer_tile_tokens
        self._deferred = deferred
        if self._whole_call:
            for index, layer in enumerate(self._layers):
                if layer.gradient_checkpointing:
                    starts = functools.partial(layer_starts, index)
                    layer._gradient_checkpointing_func = _StartsBeforeTheCall(
                        starts, layer._gradient_checkpointing_func
                    )
        engine.apply_settings(settings)

    def forward_begins(self) -> None:
        """A training forward begins: the last one's backward has recomputed its layers, and a plan applied in its
        middle reaches the layers that ran before it now."""
        self._ran.clear()
        if self._deferred is not None:
            self._deferred()

    def layer_ran(self, index: int) -> None:
        """Layer `index` (registration order) started in this training forward, after any plan its start applied."""
        self._ran.add(index)

    def apply_engine_settings(self, settings: EngineSettings) -> None:
        """Gives the engine a plan's `settings` alone, where the layers run its actions already (a plan kept for
        another length whose layers act alike). Nothing once the engine is gone."""
        engine = self._engine()
        if engine is not None:
            engine.apply_settings(settings)

    def remove(self) -> None:
        """Takes the plan in force off the layers."""
        if self._applied is not None:
            self._applied.remove()
            self._applied = None
        self._actions, self._deferred = None, None


class _StartsBeforeTheCall:
    """A planned layer's `_gradient_checkpointing_func` where transformers checkpoints the layer's whole call.

    transformers releases before 5.24 (5.17 on the GPU image; later ones checkpoint the layer's `forward` instead)
    hand the checkpoint function the layer's whole call (`checkpoints_its_whole_call`), whose pre-hooks run inside
    the checkpoint, after the call has looked the layer's `forward` up; the recomputation in backward looks it up
    again. A plan that tiled the layer from its pre-hook (the first step's, once the probes are in; a longer step's)
    ran it untiled in the forward and tiled in the recomputation: "a different number of tensors was saved during the
    original forward and recomputation: 40 and 10", on the H100. So the layer's start (`starts`, the controller's
    pre-hook, which its pre-hook then repeats to no effect) runs here, before the call, and the call goes to the
    checkpoint function of the plan in force after it, or runs without one if that plan does not
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

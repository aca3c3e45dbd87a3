"""The module hooks that tell the engine where the model is in its forward.

The engine knows nothing about models. `get_act_offloading_ctx_manager` (in `context`) installs these hooks, found with
`model`'s lookups: on the tail of the forward (final norm, head, loss) and on every Liger module, a pair of forward
hooks that suspend offloading while the module runs (and on the token embeddings one that tells the tail a final norm
run before the layers, `_TailHooks`); on the head and on every block's attention, a hook that times the
reloads of backward (`_PrefetchPoints`). Every hook is `eager_only`: inside code that torch.compile traces it does
nothing (see `compile_guard`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn

from .compile_guard import eager_only
from .engine import OffloadActivations
from .model import checkpointing_on, first_tensor

__all__ = [
    "install_exempt_hooks",
    "install_tail_hooks",
    "install_prefetch_points",
    "install_step_tokens_hook",
    "remove_stale_hooks",
]

# --------------------------------------------------------------------------------------------------------------------
# Exemption hooks
# --------------------------------------------------------------------------------------------------------------------


class _ExemptHooks:
    """The forward pre-hook / forward hook pair that suspends offloading while one module runs.

    One instance per module registration, with a per-thread stack of entered regions, so the same module may run
    re-entrantly or in DataParallel replicas, and modules nested in exempt modules behave. The forward hook is
    registered with `always_call=True`, so an exception in the module still exits its region.
    """

    def __init__(self, engine: OffloadActivations) -> None:
        # Weakly: a context dropped without `remove_hooks()` must not live on (its pinned pool with it) through the
        # model's hooks; once it is gone, the hooks do nothing.
        self._engine = weakref.ref(engine)
        self._local = threading.local()

    def _stack(self) -> list[Any]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    @eager_only
    def enter(self, module: nn.Module, args: Any) -> None:
        engine = self._engine()
        if engine is None:
            return
        engine.model_hooks_ran = True  # the module runs eagerly: the forward was not compiled as a whole
        region = engine.exempt() if engine.is_innermost() else None
        if region is not None:
            region.__enter__()
        self._stack().append(region)

    @eager_only
    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        if stack:
            region = stack.pop()
            if region is not None:
                region.__exit__(None, None, None)

    def __deepcopy__(self, memo: dict) -> _ExemptHooks:
        # `copy.deepcopy(model)` (e.g. a DPO reference model) copies hook dicts; share the hook like a plain function
        # would be shared instead of deep-copying the engine, its pinned pool and its streams.
        return self


def install_exempt_hooks(engine: OffloadActivations, module: nn.Module) -> None:
    hooks = _ExemptHooks(engine)
    engine.track_hook(module.register_forward_pre_hook(hooks.enter))
    engine.track_hook(module.register_forward_hook(hooks.exit, always_call=True))


class _TailHooks(_ExemptHooks):
    """Suspends offloading from the first tail module (final norm or head) to the end of the model's forward.

    What runs after the head inside the model's forward is the loss (HF models compute it from the logits), or,
    with Liger's fused linear cross-entropy, the head itself: that kernel reads `lm_head.weight` and never
    calls `lm_head.forward`, but the final norm still runs first. All of it is needed first by backward, so
    the region stays open until the model's forward returns. A tail module called outside the model's forward
    gets an ordinary per-module region.

    A tail module called on the token embeddings' output opens nothing: NanoChat normalizes its embeddings with its
    final norm before the layers, and a region opened there would keep every layer's tensors. The embeddings' own
    forward hook tells (`embeddings_exit`), not the layers': under regional compilation theirs are traced.
    """

    @eager_only
    def embeddings_exit(self, module: nn.Module, args: Any, output: Any) -> None:
        embeddings = first_tensor(output)
        self._local.embeddings = weakref.ref(embeddings) if embeddings is not None else None

    def _is_the_embeddings(self, args: Any) -> bool:
        embeddings = getattr(self._local, "embeddings", None)
        return bool(args) and embeddings is not None and args[0] is embeddings()

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    @eager_only
    def root_enter(self, module: nn.Module, args: Any) -> None:
        engine = self._engine()
        if engine is not None:
            engine.model_hooks_ran = True
        self._local.depth = self._depth() + 1

    @eager_only
    def enter(self, module: nn.Module, args: Any) -> None:
        engine = self._engine()
        if engine is None:
            return
        engine.model_hooks_ran = True  # a head called on its own (`model.lm_head(hidden)`) runs eagerly too
        stack = self._stack()
        if stack and stack[-1][1] == self._depth() and self._depth() > 0:
            return  # the region opened by an earlier tail module of this forward is still open
        if self._depth() > 0 and self._is_the_embeddings(args):
            return  # before the layers: not the tail
        region = engine.exempt(ends_forward=True) if engine.is_innermost() else None
        if region is not None:
            region.__enter__()
        stack.append((region, self._depth()))

    @eager_only
    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._depth() == 0:
            self._close(0)

    @eager_only
    def root_exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self._close(self._depth())
        self._local.depth = self._depth() - 1

    def _close(self, depth: int) -> None:
        stack = self._stack()
        if stack and stack[-1][1] == depth:
            region, _ = stack.pop()
            if region is not None:
                region.__exit__(None, None, None)


def install_tail_hooks(engine: OffloadActivations, model: nn.Module, tail: list[nn.Module],
                       embeddings: nn.Module | None = None) -> None:  # fmt: skip
    hooks = _TailHooks(engine)
    engine.track_hook(model.register_forward_pre_hook(hooks.root_enter))
    engine.track_hook(model.register_forward_hook(hooks.root_exit, always_call=True))
    if embeddings is not None:
        engine.track_hook(embeddings.register_forward_hook(hooks.embeddings_exit))
    for module in tail:
        engine.track_hook(module.register_forward_pre_hook(hooks.enter))
        engine.track_hook(module.register_forward_hook(hooks.exit, always_call=True))


class _PrefetchPoints:
    """Starts reloads from points of the backward that unpacks do not see: the head, and each block's attention.

    A forward hook on each such module registers the engine's `prefetch_hook` on its output (a tensor hook
    changes nothing in the graph), which starts the next reloads when backward reaches that output:

    * The head. Backward's first unpack comes only after the loss's and the head's backward, the step's memory peak
      without checkpointing. The head's backward runs just after that peak (its input gradient is small), and at
      a large vocabulary it takes long enough to reload the last layer's activations. A memory plan that reloads
      far ahead narrows what the head may start (`engine.head_prefetch_window_bytes`): the peak is still close.
    * Each block's attention, with checkpointing. A block unpacks its input once, as its recomputation starts; a
      reload prefetched there would sit on top of the recomputed activations, the peak of the step. At the
      attention's gradient the MLP's activations are gone and the attention's backward (the long part at long
      context) hides the copy; unpacks then stop prefetching (`prefetch_on_unpack`). Under reentrant
      checkpointing the first forward saves no graph; the hook is then registered by the recomputation, whose inner
      backward fires it at the same point. Without checkpointing every saved tensor is unpacked, and unpacks keep
      prefetching as usual; so do they when some decoder layers are not checkpointed (a per-layer plan), whose
      many saved tensors each need their reload ahead, or are checkpointed by a function that hands the engine the
      tensors the checkpoint saves, not only its input (a per-layer plan's selective offload; such a function says
      so by its attribute `offloads_saved_tensors`): their recomputation unpacks all of those at once.
    """

    def __init__(self, engine: OffloadActivations, model: nn.Module, layers: list[nn.Module]) -> None:
        self._engine = weakref.ref(engine)  # a model that outlives the engine must not keep it alive
        self._model = weakref.ref(model)
        self._layers = layers

    @eager_only
    def root_enter(self, module: nn.Module, args: Any) -> None:
        engine = self._engine()
        if engine is not None:
            engine.prefetch_on_unpack = self.unpacks_prefetch()

    def unpacks_prefetch(self) -> bool:
        """Whether unpacks start the next reloads, from the layers' checkpointing now: not when every layer hands the
        engine at most its input. Decided as each forward begins, and again when a memory plan changes the layers
        after that (`OffloadActivations.refresh_prefetch_on_unpack`): the plan's first step would otherwise run the
        last plan's way (on an H200, a plan offloading 5 layers whole after one checkpointing every layer missed a
        reload in its first step)."""
        if self._layers:
            return not all(self._input_only(layer) for layer in self._layers)
        model = self._model()
        return model is None or not checkpointing_on(model)

    @staticmethod
    def _input_only(layer: nn.Module) -> bool:
        """Whether the engine sees at most this layer's input: the layer is checkpointed (or kept, through a
        "checkpoint function" of the plan), and its checkpoint function does not send it what the checkpoint saves."""
        if not getattr(layer, "gradient_checkpointing", False):
            return False
        return not getattr(getattr(layer, "_gradient_checkpointing_func", None), "offloads_saved_tensors", False)

    @eager_only
    def point_exit(self, module: nn.Module, args: Any, output: Any) -> None:
        engine = self._engine()
        if engine is not None:
            engine.model_hooks_ran = True  # a forward of a part of the model (`model.model(...)`), not compiled
        self._prefetch_at(output, head=False)

    @eager_only
    def head_exit(self, module: nn.Module, args: Any, output: Any) -> None:
        """As `point_exit`, within the engine's head window: a memory plan that prefetches far ahead keeps the
        head's reloads narrow, since the loss's peak is then still close."""
        self._prefetch_at(output, head=True)

    def _prefetch_at(self, output: Any, head: bool) -> None:
        engine = self._engine()
        if engine is None or engine.standing_aside is not None:  # nothing to reload
            return
        tensor = first_tensor(output)
        if tensor is not None and tensor.requires_grad:
            tensor.register_hook(engine.prefetch_hook(engine.head_prefetch_window_bytes if head else None))

    def __deepcopy__(self, memo: dict) -> _PrefetchPoints:
        return self  # as for _ExemptHooks: never copy the engine with a model


def install_prefetch_points(engine: OffloadActivations, model: nn.Module, layers: list[nn.Module],
                             head: nn.Module | None, attention: list[nn.Module]) -> None:  # fmt: skip
    points = _PrefetchPoints(engine, model, layers)
    if attention:  # with no blocks found, unpacks keep prefetching
        engine.track_hook(model.register_forward_pre_hook(points.root_enter))
        engine.set_prefetch_on_unpack_rule(points.unpacks_prefetch)
    if head is not None:
        engine.track_hook(head.register_forward_hook(points.head_exit))
    for module in attention:
        engine.track_hook(module.register_forward_hook(points.point_exit))


class _StepTokens:
    """A forward pre-hook (with kwargs) on the model: tells the engine the tokens of each step, from `input_ids` (or
    `inputs_embeds`, or the first positional argument). On the model rather than on a decoder layer, whose hooks are
    traced away when the layers are compiled (regional compilation)."""

    def __init__(self, engine: OffloadActivations) -> None:
        self._engine = weakref.ref(engine)  # a model that outlives the engine must not keep it alive

    @eager_only
    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        engine = self._engine()
        if engine is None:
            return
        inputs = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
        if isinstance(inputs, torch.Tensor) and inputs.dim() >= 1:
            engine.note_step_tokens(inputs.numel() if not inputs.is_floating_point() else inputs.shape[:-1].numel())

    def __deepcopy__(self, memo: dict) -> _StepTokens:
        return self  # as for _ExemptHooks: never copy the engine with a model


def install_step_tokens_hook(engine: OffloadActivations, model: nn.Module) -> None:
    engine.track_hook(model.register_forward_pre_hook(_StepTokens(engine), with_kwargs=True))


def remove_stale_hooks(model: nn.Module) -> None:
    """Remove exempt hooks of ours that no live installation record covers (a deep copy of a hooked model)."""
    for module in model.modules():
        for dict_name in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = getattr(module, dict_name, None)
            if not hooks:
                continue
            for hook_id, hook in list(hooks.items()):
                if isinstance(hook, _StepTokens) or isinstance(getattr(hook, "__self__", None),
                                                               (_ExemptHooks, _PrefetchPoints)):  # fmt: skip
                    del hooks[hook_id]
                    for extra in (
                        "_forward_pre_hooks_with_kwargs",
                        "_forward_hooks_with_kwargs",
                        "_forward_hooks_always_called",
                    ):
                        getattr(module, extra, {}).pop(hook_id, None)

"""Compiling a model's decoder layers one by one (regional compilation), the way offloading keeps working under it.

A model compiled as a whole hands the tensors its forward saves over only after that forward has ended, when moving
them can no longer lower the step's peak (the engine then stands aside). Compiled layer by layer, each layer's graph
saves its tensors as the layer ends, and they move while the next layers run, as without compilation.

Why not `layer.compile()` by hand: transformers checkpoints a layer inside its `forward` (from 5.24 on), so a compiled
layer traces the checkpoint as a higher-order op, and Dynamo refuses any mutation of outside state inside it, because
eager checkpointing would replay that mutation when it recomputes the layer. From transformers 5.25 on, where the
`kernels` package is a dependency, every attention module that carries `use_kernelized_func` sets and resets a
context variable in its forward (`kernels`' `CompileableContextVar`): with checkpointing on, each compiled layer then
falls back to eager code (0 graphs and 1 graph break on a 2-layer Llama, against 1 graph and 0 breaks on 5.24).
That variable only picks which Python function runs; it is set and reset within the same forward and no tensor
depends on it, so not replaying it when backward recomputes the layer changes nothing. `compile_decoder_layers`
traces each layer with `torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint` on, which says exactly
that, and for those layers only: the rest of the user's program keeps Dynamo's defaults.

Before 5.24, transformers checkpoints a layer around its whole call (`GradientCheckpointingLayer.__call__`), outside
what `nn.Module.compile` compiles. Backward then recomputes the layer by running its compiled forward, which makes at
once every tensor that graph saves for its compiled backward; with the checkpoint inside the graph, the compiled
backward recomputes them as it needs them. On the CPU profiler (4 Llama layers of hidden 512, 2 x 1,024 tokens, a
step's forward and backward), the layers compiled peaked at 86.1 MiB on transformers 5.17 against 44.1 MiB for the
model compiled whole, and at 42.0 MiB on 5.25. So on those releases each compiled layer is given 5.24's structure
first (`_checkpointed_inside_forward`): its `forward` checkpoints itself, and its call is `nn.Module`'s.

The loss is a region of its own (`compile_loss`). Eager, a causal LM's loss upcasts the logits to float32 and
`cross_entropy` saves its log-softmax, both the size of the logits in float32; compiled, the kernels fuse and keep
only the logits and a value per token. A model compiled as a whole gets that fusion, and its layers compiled alone
did not: on an H100 (8 Llama layers of hidden 2048, a 32,000-token vocabulary, 2 x 4,096 tokens) the whole-model
compile peaked at 3.72 GiB, the layers compiled and offloaded at 4.27 GiB (`docs/DESIGN.md`, torch.compile).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .model import checkpoints_its_whole_call, find_decoder_layers, unwrap_model

__all__ = ["compile_decoder_layers", "compile_loss", "checkpointed_side_effects_not_replayed"]

# Dynamo's switch that lets a checkpointed region mutate outside state without replaying it in backward.
_SKIP_REPLAY = "skip_fwd_side_effects_in_bwd_under_checkpoint"


@contextlib.contextmanager
def checkpointed_side_effects_not_replayed() -> Iterator[None]:
    """While inside, Dynamo traces a checkpointed layer whose forward mutates outside state (see the module
    docstring) instead of falling back to eager code. A no-op on a torch whose Dynamo has no such switch."""
    if not hasattr(torch._dynamo.config, _SKIP_REPLAY):
        yield
        return
    with torch._dynamo.config.patch(**{_SKIP_REPLAY: True}):
        yield


def _traced_without_replay(compiled_call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(compiled_call)
    def call(*args: Any, **kwargs: Any) -> Any:
        # Dynamo reads its config when it traces, at a layer's first call and at each recompilation.
        with torch._dynamo.config.patch(**{_SKIP_REPLAY: True}):
            return compiled_call(*args, **kwargs)

    return call


def compile_decoder_layers(model: nn.Module, **compile_options: Any) -> list[nn.Module]:
    """Compile each decoder layer of `model` in place (`nn.Module.compile`), once.

    The layers are those `find_decoder_layers` finds on the model under its wrappers (DDP, PEFT, ...); a layer
    compiled already is left as it is. The head, the loss and everything between the layers stay uncompiled. On
    transformers before 5.24 a layer's class becomes a subclass of the same name whose `forward` checkpoints itself,
    as from 5.24 on, so that the checkpoint is inside the compiled graph (the module docstring says why).

    Args:
        model: the model, bare or wrapped.
        **compile_options: keyword arguments of `torch.compile` (`backend`, `mode`, `dynamic`, ...).

    Returns:
        The layers compiled now.
    """
    layers = [layer for _, layer in find_decoder_layers(unwrap_model(model)) if layer._compiled_call_impl is None]
    for layer in layers:
        if _checkpointed_around_its_call(layer):
            layer.__class__ = _checkpointed_inside_forward(type(layer))
        layer.compile(**compile_options)
        if hasattr(torch._dynamo.config, _SKIP_REPLAY):  # decided once, not at every call of the layer
            layer._compiled_call_impl = _traced_without_replay(layer._compiled_call_impl)
    return layers


def _checkpointed_around_its_call(layer: nn.Module) -> bool:
    """Whether transformers checkpoints the layer around its whole call (`checkpoints_its_whole_call`) and its `forward`
    is its class's. A `forward` of the instance's own (accelerate's hooks put one there, which calls the forward of the
    class it had then) would bypass the subclass's, and the layer would not be checkpointed: such a layer keeps its
    class and its checkpoint around the call."""
    return "forward" not in vars(layer) and checkpoints_its_whole_call(layer)


@functools.cache
def _checkpointed_inside_forward(layer_class: type[nn.Module]) -> type[nn.Module]:
    """A subclass of a decoder layer class of transformers < 5.24 that checkpoints inside its `forward`, as 5.24 does.

    Those releases checkpoint in `GradientCheckpointingLayer.__call__`, around the call that `nn.Module.compile`
    compiles (the module docstring says what that costs). The subclass's call is `nn.Module`'s, and its `forward`
    does what that `__call__` did: under checkpointing (the layer's own flag and function, which hf-offload's plans
    set per layer, read at every call) it drops the cache as transformers does and checkpoints the class's `forward`.
    It keeps the class's name, which logs and warnings show. One per class: Dynamo guards on a module's class, so
    layers of one class share their compiled graphs only while they share a class.
    """
    forward = layer_class.forward

    @functools.wraps(forward)
    def checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled()):
            return forward(self, *args, **kwargs)
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if not getattr(self, "_can_checkpoint_with_cache", False):
            kwargs.update({name: None for name in ("past_key_values", "layer_past") if name in kwargs})
        return self._gradient_checkpointing_func(functools.partial(forward, self, **kwargs), *args)

    namespace = {"__call__": nn.Module.__call__, "forward": checkpointed_forward, "__module__": layer_class.__module__,
                 "__qualname__": layer_class.__qualname__}  # fmt: skip
    return type(layer_class.__name__, (layer_class,), namespace)


def compile_loss(model: nn.Module, **compile_options: Any) -> bool:
    """Compile the loss of a transformers model (its `loss_function`, which its forward calls on the logits), once.

    The model's forward keeps calling it: `PreTrainedModel.loss_function` is settable, and the compiled function is
    set on the model under its wrappers (DDP, PEFT, ...). A forward that computes its loss otherwise (Liger's fused
    linear cross-entropy) is unaffected.

    Args:
        model: the model, bare or wrapped.
        **compile_options: keyword arguments of `torch.compile` (`backend`, `mode`, `dynamic`, ...).

    Returns:
        Whether the loss was compiled now: False when the model has no settable `loss_function` or it is compiled
        already.
    """
    core = unwrap_model(model)
    attribute = getattr(type(core), "loss_function", None)
    if not isinstance(attribute, property) or attribute.fset is None:
        return False
    loss_function = core.loss_function
    if hasattr(loss_function, "_torchdynamo_orig_callable"):  # what `torch.compile` returns for a function
        return False
    core.loss_function = torch.compile(loss_function, **compile_options)
    return True

"""Everything hf-offload knows about models.

This module answers four questions for the engine, which itself knows nothing about models:

1. *Which module is the model?*  Trainers hand us models wrapped by DDP, FSDP, DeepSpeed, `torch.compile` and
   PEFT; the head lives on the innermost one (`unwrap_model`).
2. *What is the tail of the forward?*  The output head and the final norm run last in the forward, so their saved
   tensors are the first ones backward needs: moving them to the host and straight back only costs bandwidth, and
   the head's input/logits are often the largest tensors of the step (`find_output_head`).
3. *What must never be offloaded?*  The tail above, and every Liger kernel module (`find_liger_modules`).
4. *When should reloads start?*  From the head's backward, right after the loss's memory peak; with checkpointing, a
   block's input while the block's attention runs backward, after its recomputed MLP activations are freed
   (`find_attention_modules`, `_PrefetchPoints`).

`get_act_offloading_ctx_manager` puts these together: it builds the engine and installs, on every exempt
module, a pair of forward hooks that suspend offloading while that module runs, and on the head and every block's
attention a hook that times the reloads.

Only `torch` is imported at module level: wrappers from optional libraries (PEFT, DeepSpeed, accelerate, dynamo)
are recognised by class name, so importing hf-offload never imports them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .allocator import LongContextCheck
from .compile_guard import eager_only
from .engine import OffloadActivations, top_saved_tensors_pack_hook
from .options import OffloadOptions
from .planner import parse_memory_budget

__all__ = [
    "unwrap_model",
    "find_output_head",
    "find_liger_modules",
    "find_attention_modules",
    "find_decoder_layers",
    "get_act_offloading_ctx_manager",
]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------------------------
# Unwrapping
# --------------------------------------------------------------------------------------------------------------------

# Wrappers that keep the real model in `.module`. Matched by class name anywhere in the MRO, so subclasses and
# wrappers from libraries we do not import (DeepSpeed, apex, fairscale, torch_xla) are recognised. Never unwrap an
# arbitrary `.module`: some transformers layers store a child there (e.g. LeViT's residual block `self.module`).
_DOT_MODULE_WRAPPERS = frozenset(
    {
        "DistributedDataParallel",  # torch DDP, apex DDP
        "DataParallel",
        "FullyShardedDataParallel",  # FSDP1 (FSDP2's fully_shard changes the module in place: nothing to unwrap)
        "XlaFullyShardedDataParallel",
        "ShardedDataParallel",  # fairscale
        "DeepSpeedEngine",  # also PipelineEngine, DeepSpeedHybridEngine (subclasses)
    }
)


def _class_names(obj: object, module_prefix: str | None = None) -> set[str]:
    """Names of the classes in `type(obj)`'s MRO, optionally only those defined under `module_prefix`."""
    return {
        cls.__name__
        for cls in type(obj).__mro__
        if module_prefix is None or (cls.__module__ or "").startswith(module_prefix)
    }


def _child(obj: object, attr: str) -> nn.Module | None:
    """`obj.<attr>` when it is an `nn.Module`, else None."""
    value = getattr(obj, attr, None)
    return value if isinstance(value, nn.Module) else None


def _unwrap_once(model: nn.Module) -> nn.Module | None:
    """One level of unwrapping, or None when `model` is not a wrapper we know."""
    if _class_names(model) & _DOT_MODULE_WRAPPERS:
        return _child(model, "module")
    if "OptimizedModule" in _class_names(model, "torch."):  # torch.compile(model)
        return _child(model, "_orig_mod")
    peft_classes = _class_names(model, "peft")
    if peft_classes & {"PeftModel", "PeftMixedModel"}:
        # PeftModel.base_model is the tuner (LoraModel, ...) or, for prompt learning, the transformers model.
        return _child(model, "base_model")
    if "BaseTuner" in peft_classes:  # LoraModel, IA3Model, MixedModel, ...
        return _child(model, "model")
    return None


def unwrap_model(model: nn.Module) -> nn.Module:
    """Return the innermost model: the one whose attributes name the head and the final norm.

    Peels, until nothing changes, the wrappers a training stack puts around a model: DDP / DataParallel / FSDP1 /
    DeepSpeed engines (`.module`), `torch.compile`'s `OptimizedModule` (`._orig_mod`) and PEFT
    (`PeftModel -> base_model (LoraModel ...) -> model`). Wrappers nest in any order (DDP around a compiled PEFT
    model), hence the loop. Anything else is returned unchanged; in particular a plain module that merely has an
    attribute called `module` is not a wrapper.

    Args:
        model: the model, bare or wrapped.

    Returns:
        The innermost model, or `model` itself when it is not a wrapper.

    Example:

    ```python
    model = unwrap_model(trainer.model_wrapped)  # the transformers model under DDP, torch.compile and PEFT
    ```
    """
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = _unwrap_once(model)
        if inner is None:
            break
        model = inner
    return model


# --------------------------------------------------------------------------------------------------------------------
# Finding the tail of the forward
# --------------------------------------------------------------------------------------------------------------------

# Output heads, most specific first; paths are relative to the unwrapped model. Only the first one found is used:
# a model has one head, and exempting something that is not the tail keeps memory on the GPU for nothing.
_HEAD_PATHS: tuple[str, ...] = (
    "lm_head",  # causal / seq2seq / masked LMs (Llama, Qwen, GPT-2, T5, BART, RoBERTa)
    "output",  # torchtune-style models
    "output.linear",  # ... whose `output` is not a module itself
    "decoder.lm_head",
    "decoder.output",
    "head",  # timm-style and custom models
    "classifier",  # BERT/RoBERTa/ViT sequence and token classification
    "score",  # Llama/Qwen/GPT-2 sequence classification, reward models
    "qa_outputs",  # extractive question answering
    "cls",  # BertForMaskedLM / BertForPreTraining (`cls.predictions.decoder`)
)

# Final norms: the last module of a decoder stack, run right before the head.
# `layernorm`: ViT/DeiT/BEiT/Swin's norm after the encoder (BERT's norms sit inside `embeddings` and the layers).
_FINAL_NORM_NAMES: tuple[str, ...] = ("final_layer_norm", "final_layernorm", "final_norm", "ln_f", "norm_f", "norm",
                                      "layernorm")
# A few decoders (MBart, Whisper, Marian) call their final norm `layer_norm`; only trusted inside a `decoder`.
_DECODER_FINAL_NORM_NAMES: tuple[str, ...] = ("layer_norm",)

# Children that lead from a task model down its text/decoder trunk (`base_model_prefix` is added per model).
# Encoders and vision towers are deliberately absent: their norms are not at the tail of the forward.
_TRUNK_CHILDREN: tuple[str, ...] = ("model", "transformer", "language_model", "decoder", "backbone")
_MAX_TRUNK_DEPTH = 3


def _get_path(model: nn.Module, path: str) -> nn.Module | None:
    """The module at dotted `path` under `model`, or None when some step is missing or not an `nn.Module`."""
    obj: Any = model
    parts = path.split(".")
    for i, part in enumerate(parts):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
        # Intermediate steps may be plain objects (a torchtune `output` holding `.linear`); the target must be a module.
        if i == len(parts) - 1 and not isinstance(obj, nn.Module):
            return None
    return obj


def _find_head(model: nn.Module) -> tuple[str, nn.Module] | None:
    for path in _HEAD_PATHS:
        module = _get_path(model, path)
        if module is not None and module is not model:
            return path, module
    return None


def _trunk(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """`(path, module, is_decoder)` for the model and its trunk containers, breadth first, root first."""
    prefix = getattr(model, "base_model_prefix", None)
    children = ((prefix,) if isinstance(prefix, str) and prefix else ()) + _TRUNK_CHILDREN
    found: list[tuple[str, nn.Module, bool]] = []
    seen: set[int] = set()
    frontier: list[tuple[str, nn.Module, bool]] = [("", model, False)]
    for _ in range(_MAX_TRUNK_DEPTH + 1):
        next_frontier = []
        for path, module, is_decoder in frontier:
            if id(module) in seen:
                continue
            seen.add(id(module))
            found.append((path, module, is_decoder))
            # `_modules`, not getattr: properties (e.g. `language_model` aliases in transformers v5) are skipped.
            for name in children:
                child = module._modules.get(name)
                if child is not None:
                    child_path = f"{path}.{name}" if path else name
                    next_frontier.append((child_path, child, is_decoder or name == "decoder"))
        frontier = next_frontier
    return found


def _find_final_norm(model: nn.Module) -> tuple[str, nn.Module] | None:
    for path, container, is_decoder in _trunk(model):
        names = _FINAL_NORM_NAMES + (_DECODER_FINAL_NORM_NAMES if is_decoder else ())
        for name in names:
            norm = container._modules.get(name)
            if norm is not None:
                return (f"{path}.{name}" if path else name), norm
    return None


def find_output_head(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return the tail of the forward to keep on the device: the output head, then the final norm.

    The head is the first of `lm_head`, `output` / `output.linear`, `decoder.lm_head` / `decoder.output`,
    `head`, `classifier`, `score`, `qa_outputs`, `cls` found on the unwrapped model. The final norm
    (`final_layer_norm`, `final_layernorm`, `final_norm`, `ln_f`, `norm_f`, `norm`, `layernorm`;
    `layer_norm` in a decoder) is searched on the model and down its trunk (`base_model_prefix`, `model`,
    `transformer`, `language_model`, `decoder`, `backbone`) but never in an encoder: T5's
    `encoder.final_layer_norm` runs early, its `decoder.final_layer_norm` runs last.

    Args:
        model: the model, bare or wrapped (it is unwrapped with `unwrap_model` first).

    Returns:
        `[(name, module)]`, head first, then final norm; names are relative to `unwrap_model(model)`. Empty when
        nothing matched.

    Example:

    ```python
    [name for name, _ in find_output_head(model)]  # ["lm_head", "model.norm"] for a Llama causal LM
    ```
    """
    model = unwrap_model(model)
    found: list[tuple[str, nn.Module]] = []
    for match in (_find_head(model), _find_final_norm(model)):
        if match is not None and all(match[1] is not module for _, module in found):
            found.append(match)
    return found


def _is_liger(name: str, module: nn.Module) -> bool:
    if "liger" in name.lower():
        return True
    return any((cls.__module__ or "").startswith("liger_kernel") for cls in type(module).__mro__)


def find_liger_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return every Liger kernel module of the unwrapped model.

    A module is a Liger module when its class (or a base class) is defined under `liger_kernel`, or its qualified
    name in the model contains `liger` (case-insensitive). Liger kernels are fused Triton autograd functions that
    manage their own saved tensors (some compute gradients in the forward and store them in place); they are kept
    out of offloading, as TRL does. The model itself is never matched: exempting the root would switch offloading
    off for the whole model.

    Args:
        model: the model, bare or wrapped (it is unwrapped with `unwrap_model` first).

    Returns:
        `[(name, module)]` in `named_modules()` order, names relative to `unwrap_model(model)`; empty without Liger.
    """
    model = unwrap_model(model)
    return [(name, module) for name, module in model.named_modules() if name and _is_liger(name, module)]


def _outermost(named: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop duplicates and modules nested in another entry: the outer region already covers them."""
    kept: list[tuple[str, nn.Module]] = []
    for name, module in sorted(named, key=lambda item: (item[0].count("."), item[0])):
        if any(module is m or p == "" or name.startswith(p + ".") for p, m in kept):
            continue
        kept.append((name, module))
    return kept


# --------------------------------------------------------------------------------------------------------------------
# Exemption hooks
# --------------------------------------------------------------------------------------------------------------------


def _engine_is_innermost(engine: OffloadActivations) -> bool:
    """Whether tensors saved right now would reach `engine`'s pack hook.

    Only then is there anything to suspend. When another saved-tensor hook sits on top (non-reentrant activation
    checkpointing inside a decoder layer, or another exempt region), pushing a NoOp region would *bypass* that hook:
    under checkpointing it would make autograd keep the very activations checkpointing drops.
    """
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    if enabled is not None and not enabled():
        return False  # entering any saved_tensors_hooks would raise here
    top = top_saved_tensors_pack_hook()
    return top is ... or (top is not None and top == engine.pack_hook)


class _ExemptHooks:
    """The forward pre-hook / forward hook pair that suspends offloading while one module runs.

    One instance per module registration, with a per-thread stack of entered regions, so the same module may run
    re-entrantly or in DataParallel replicas, and modules nested in exempt modules behave. The forward hook is
    registered with `always_call=True`, so an exception in the module still exits its region.
    """

    def __init__(self, engine: OffloadActivations) -> None:
        self.engine = engine
        self._local = threading.local()

    def _stack(self) -> list[Any]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    @eager_only
    def enter(self, module: nn.Module, args: Any) -> None:
        region = self.engine.exempt() if _engine_is_innermost(self.engine) else None
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


def _install_exempt_hooks(engine: OffloadActivations, module: nn.Module) -> None:
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
    """

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    @eager_only
    def root_enter(self, module: nn.Module, args: Any) -> None:
        self.engine.model_hooks_ran = True
        self._local.depth = self._depth() + 1

    @eager_only
    def enter(self, module: nn.Module, args: Any) -> None:
        stack = self._stack()
        if stack and stack[-1][1] == self._depth() and self._depth() > 0:
            return  # the region opened by an earlier tail module of this forward is still open
        region = self.engine.exempt(ends_forward=True) if _engine_is_innermost(self.engine) else None
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


def _install_tail_hooks(engine: OffloadActivations, model: nn.Module, tail: list[nn.Module]) -> None:
    hooks = _TailHooks(engine)
    engine.track_hook(model.register_forward_pre_hook(hooks.root_enter))
    engine.track_hook(model.register_forward_hook(hooks.root_exit, always_call=True))
    for module in tail:
        engine.track_hook(module.register_forward_pre_hook(hooks.enter))
        engine.track_hook(module.register_forward_hook(hooks.exit, always_call=True))


# Attention modules of transformer blocks (Llama/Qwen/Mistral `self_attn`, GPT-2 `attn`, BERT/ViT `attention`, T5
# `SelfAttention`, Falcon/GPT-NeoX `self_attention`). In a pre-norm block the attention runs first, so backward
# reaches it last: after the MLP's backward has freed the MLP's activations.
_ATTENTION_NAMES = frozenset({"self_attn", "attn", "attention", "self_attention", "SelfAttention"})


def find_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return the attention module of every block of the unwrapped model.

    A module is an attention module when its attribute name is one of `self_attn`, `attn`, `attention`,
    `self_attention` or `SelfAttention`; only the outermost matches are kept (a match nested in another is
    covered by it). Backward reaches a pre-norm block's attention after the block's MLP, which is
    where `get_act_offloading_ctx_manager` times the reloads under checkpointing.

    Args:
        model: the model, bare or wrapped (it is unwrapped with `unwrap_model` first).

    Returns:
        `[(name, module)]`, names relative to `unwrap_model(model)`; empty when no block has a matching child.
    """
    model = unwrap_model(model)
    found = [(name, module) for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in _ATTENTION_NAMES]
    return _outermost(found)


def find_decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return the repeated blocks whose checkpointing transformers controls per layer, in registration order.

    They are the instances of `GradientCheckpointingLayer` (matched by class name in the MRO, so transformers is not
    imported). A model without them (custom models, old remote code) has no layers to plan.

    Args:
        model: the model whose modules are searched (not unwrapped: pass the unwrapped model for relative names).

    Returns:
        `[(name, module)]` in `named_modules()` order; empty when the model has no such layers. That is forward order
        within a stack, and for most models across stacks, but some register a language model before the vision
        tower that runs first (the memory budget's controller takes the order from the first step's calls).
    """
    return [
        (name, module)
        for name, module in model.named_modules()
        if any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)
    ]


def first_tensor(output: Any) -> torch.Tensor | None:
    """The module's main output: the tensor itself, or the first element of a tuple (attention returns weights too)."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    return output if isinstance(output, torch.Tensor) else None


def _checkpointing_on(model: nn.Module) -> bool:
    """Whether a transformers model has activation checkpointing on (False for other models)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers renamed it in v5.2x
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


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

    def __init__(self, engine: OffloadActivations, layers: list[nn.Module]) -> None:
        self._engine = weakref.ref(engine)  # a model that outlives the engine must not keep it alive
        self._layers = layers

    @eager_only
    def root_enter(self, module: nn.Module, args: Any) -> None:
        engine = self._engine()
        if engine is None:
            return
        if self._layers:
            input_only = all(self._input_only(layer) for layer in self._layers)
        else:
            input_only = _checkpointing_on(module)
        engine.prefetch_on_unpack = not input_only

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
        tensor = first_tensor(output)
        if engine is not None and tensor is not None and tensor.requires_grad:
            tensor.register_hook(engine.prefetch_hook(engine.head_prefetch_window_bytes if head else None))

    def __deepcopy__(self, memo: dict) -> _PrefetchPoints:
        return self  # as for _ExemptHooks: never copy the engine with a model


def _install_prefetch_points(engine: OffloadActivations, model: nn.Module, layers: list[nn.Module],
                             head: nn.Module | None, attention: list[nn.Module]) -> None:  # fmt: skip
    points = _PrefetchPoints(engine, layers)
    if attention:  # with no blocks found, unpacks keep prefetching
        engine.track_hook(model.register_forward_pre_hook(points.root_enter))
    if head is not None:
        engine.track_hook(head.register_forward_hook(points.head_exit))
    for module in attention:
        engine.track_hook(module.register_forward_hook(points.point_exit))


def _remove_stale_exempt_hooks(model: nn.Module) -> None:
    """Remove exempt hooks of ours that no live installation record covers (a deep copy of a hooked model)."""
    for module in model.modules():
        for dict_name in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = getattr(module, dict_name, None)
            if not hooks:
                continue
            for hook_id, hook in list(hooks.items()):
                if isinstance(getattr(hook, "__self__", None),
                              (_ExemptHooks, _PrefetchPoints)):  # fmt: skip
                    del hooks[hook_id]
                    for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                                  "_forward_hooks_always_called"):
                        getattr(module, extra, {}).pop(hook_id, None)


@dataclass(frozen=True)
class _Installation:
    """What `get_act_offloading_ctx_manager` left on a model, stored as `model._hf_offload_engine`.

    Weak references: the record must keep neither the engine (and its pinned host memory) alive after the user drops
    it, nor the model; a deep copy of the model keeps pointing at the *original* owner, which tells us not to remove
    the original model's hooks when the copy is hooked.
    """

    engine: weakref.ReferenceType
    owner: weakref.ReferenceType


_INSTALLATION_ATTR = "_hf_offload_engine"


def _remove_previous_installation(model: nn.Module) -> None:
    record = model.__dict__.get(_INSTALLATION_ATTR)
    if isinstance(record, _Installation) and record.owner() is model:
        engine = record.engine()
        if engine is not None:
            engine.remove_hooks()
    _remove_stale_exempt_hooks(model)


# --------------------------------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------------------------------

_no_head_warned = False  # once per process: trainers build a context per run, notebooks re-run cells


def _warn_no_head_once(model: nn.Module) -> None:
    global _no_head_warned
    if _no_head_warned:
        return
    _no_head_warned = True
    warnings.warn(
        f"hf_offload: no output head found on {type(model).__name__} (looked for "
        f"{', '.join(_HEAD_PATHS)}). If the model has one, its activations will be offloaded and brought straight "
        "back, which usually slows training (the logits are large). Pass warn_if_no_head=False to silence this.",
        UserWarning,
        stacklevel=3,
    )


# TRL's arguments are named in the signature (for `help()` and IDEs) with the engine's defaults, written once, in
# `OffloadOptions`.
_DEFAULTS = {option.name: option.default for option in dataclasses.fields(OffloadOptions)}


def get_act_offloading_ctx_manager(
    model: nn.Module,
    use_pin_memory: bool = _DEFAULTS["use_pin_memory"],
    use_streams: bool = _DEFAULTS["use_streams"],
    min_offload_size: int = _DEFAULTS["min_offload_size"],
    max_fwd_stash_size: int | None = _DEFAULTS["max_fwd_stash_size"],
    warn_if_no_head: bool = True,
    *,
    options: OffloadOptions | None = None,
    **kwargs: Any,
) -> OffloadActivations:
    """Build the activation offloading context for `model`: a drop-in for TRL's function of the same name.

    The engine is told the parameter storages of `model` (the outermost wrapper: FSDP1 keeps the root's flat
    parameter there, not on the inner model), and the tail of the forward (`find_output_head`) plus every Liger
    module (`find_liger_modules`) get hooks that suspend offloading while they run. Calling it again on the same
    model replaces the previous context's hooks instead of stacking them; `engine.remove_hooks()` takes every hook
    off again.

    Args:
        model: the model, bare or wrapped (DDP, FSDP, DeepSpeed, `torch.compile`, PEFT).
        use_pin_memory, use_streams, min_offload_size, max_fwd_stash_size: TRL's four options, in TRL's order and
            with TRL's meaning (see [`OffloadOptions`]).
        warn_if_no_head: warn once per process when no output head is found (TRL's fifth argument).
        options: an [`OffloadOptions`] instead of individual options.
        **kwargs: the engine's other options ([`OffloadOptions`]), by keyword.

    Returns:
        The context manager (an [`OffloadActivations`]).

    Raises:
        TypeError: `model` is not a `torch.nn.Module`, or an option is unknown.
        ValueError: an option is outside its rule.

    Example:

    ```python
    ctx = get_act_offloading_ctx_manager(model)
    with ctx:
        loss = model(**batch).loss
    loss.backward()
    ```
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_act_offloading_ctx_manager needs a torch.nn.Module, got {type(model).__name__}: "
                        f"{model!r:.80}")  # fmt: skip
    trl_options = {"use_pin_memory": use_pin_memory, "use_streams": use_streams, "min_offload_size": min_offload_size,
                   "max_fwd_stash_size": max_fwd_stash_size}  # fmt: skip
    if options is not None:
        given = [name for name, value in trl_options.items() if value != _DEFAULTS[name]] + list(kwargs)
        if given:
            raise TypeError(f"get_act_offloading_ctx_manager takes either options=OffloadOptions(...) or individual "
                            f"options, not both (given: {', '.join(given)})")  # fmt: skip
        engine = OffloadActivations(options=options)
    else:
        engine = OffloadActivations(**trl_options, **kwargs)
    unwrapped = unwrap_model(model)
    _remove_previous_installation(unwrapped)
    engine.update_model_params(model)

    tail = find_output_head(unwrapped)
    head = _find_head(unwrapped)
    if warn_if_no_head and head is None:  # a final norm alone does not spare the head
        _warn_no_head_once(unwrapped)

    _install_tail_hooks(engine, unwrapped, [module for _, module in tail])
    exempt = _outermost(find_liger_modules(unwrapped))
    for _, module in exempt:
        _install_exempt_hooks(engine, module)
    layers = [layer for _, layer in find_decoder_layers(unwrapped)]
    _install_prefetch_points(engine, unwrapped, layers, head[1] if head is not None else None,
                             [module for _, module in find_attention_modules(unwrapped)])
    if layers:
        engine.track_hook(layers[0].register_forward_pre_hook(LongContextCheck(engine), with_kwargs=True))
    if engine.options.tile_mlp is True:
        from .tiled_mlp import apply_tiled_mlp, default_tokens_per_chunk  # it imports this module

        engine.track_hook(apply_tiled_mlp(unwrapped, default_tokens_per_chunk(unwrapped)))
    if engine.options.memory_budget is not None and engine.active:
        from .budget import MemoryBudgetController  # it applies plans with layer_plan, which imports this module

        engine.budget = MemoryBudgetController(unwrapped, engine, parse_memory_budget(engine.options.memory_budget))
    unwrapped.__dict__[_INSTALLATION_ATTR] = _Installation(weakref.ref(engine), weakref.ref(unwrapped))
    logger.info("hf_offload: tail of the forward kept from %s; Liger modules exempt: %s",
                ", ".join(name for name, _ in tail) or "nowhere", ", ".join(name for name, _ in exempt) or "none")
    return engine

"""Everything hf-offload knows about models: where the real model, its head, its layers and its attention are.

Pure lookups over a module tree: this module imports only torch, and the engine, the hooks (`model_hooks`), the memory
budget and the tiled MLP read models through it. It answers:

1. *Which module is the model?*  Trainers hand us models wrapped by DDP, FSDP, DeepSpeed, `torch.compile` and
   PEFT; the head lives on the innermost one (`unwrap_model`). Is its forward compiled as a whole
   (`compiled_as_a_whole`)?
2. *What is the tail of the forward?*  The output head and the final norm run last in the forward, so their saved
   tensors are the first ones backward needs: moving them to the host and straight back only costs bandwidth, and
   the head's input/logits are often the largest tensors of the step (`find_output_head`).
3. *What must never be offloaded?*  The tail above, and every Liger kernel module (`find_liger_modules`). Which
   functions did Liger put in the model's code (`find_liger_functions`), whose kernels write in place?
4. *Where are the blocks?*  The checkpointable decoder layers (`find_decoder_layers`) and each block's attention
   (`find_attention_modules`), where reloads are timed under checkpointing.

Wrappers from optional libraries (PEFT, DeepSpeed, accelerate, dynamo) are recognised by class name, so importing
hf-offload never imports them.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = [
    "unwrap_model",
    "find_head",
    "find_output_head",
    "find_input_embeddings",
    "find_liger_modules",
    "find_liger_functions",
    "find_attention_modules",
    "find_decoder_layers",
    "compiled_as_a_whole",
    "first_tensor",
    "checkpointing_on",
    "outermost",
]

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


def _wrapper_chain(model: nn.Module) -> list[nn.Module]:
    """`model`, then each module `_unwrap_once` peels it down to, until nothing changes: the innermost is last."""
    chain = [model]
    while (inner := _unwrap_once(chain[-1])) is not None and all(inner is not module for module in chain):
        chain.append(inner)
    return chain


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
    return _wrapper_chain(model)[-1]


def compiled_as_a_whole(model: nn.Module) -> bool:
    """Whether calling `model` runs a forward compiled as a whole: `torch.compile(model)` (an `OptimizedModule`
    anywhere among the wrappers `unwrap_model` peels) or `model.compile()` in place on one of them or on the model.

    Args:
        model: the model, bare or wrapped.

    Returns:
        True when the forward that calls reach is compiled; False for eager models and compiled layers alone.
    """
    return any(
        getattr(module, "_compiled_call_impl", None) is not None or "OptimizedModule" in _class_names(module, "torch.")
        for module in _wrapper_chain(model)
    )


# --------------------------------------------------------------------------------------------------------------------
# Finding the tail of the forward
# --------------------------------------------------------------------------------------------------------------------

# Output heads, most specific first; paths are relative to the unwrapped model. Only the first one found is used:
# a model has one head, and exempting something that is not the tail keeps memory on the GPU for nothing.
HEAD_PATHS: tuple[str, ...] = (
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
    "output_projection",  # BioGPT, TrOCR (a layer's own `output_projection` is never at the top: NeoMME's attention)
    "generator_lm_head",  # ELECTRA and ConvBERT generators
)

# Final norms: the last module of a decoder stack, run right before the head.
# `layernorm`: ViT/DeiT/BEiT/Swin's norm after the encoder (BERT's norms sit inside `embeddings` and the layers).
_FINAL_NORM_NAMES: tuple[str, ...] = (
    "final_layer_norm",
    "final_layernorm",
    "final_norm",
    "ln_f",
    "norm_f",
    "norm",
    "layernorm",
)
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


def find_head(model: nn.Module) -> tuple[str, nn.Module] | None:
    for path in HEAD_PATHS:
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


# The names transformers has given a layer's cache argument (5.24 renamed `past_key_values` to `cache`; Mamba's is
# `cache_params`); a value that is a transformers `Cache` (`is_cache`) is one under any name.
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past", "cache_params")


def is_cache(value: Any) -> bool:
    """Whether `value` is a transformers KV cache (a class named `Cache` among its bases), known without importing
    transformers."""
    return any(cls.__name__ == "Cache" for cls in type(value).__mro__)


def find_output_head(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return the tail of the forward to keep on the device: the output head, then the final norm.

    The head is the first of `lm_head`, `output` / `output.linear`, `decoder.lm_head` / `decoder.output`,
    `head`, `classifier`, `score`, `qa_outputs`, `cls`, `output_projection`, `generator_lm_head` found on the
    unwrapped model. The final norm
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
    for match in (find_head(model), _find_final_norm(model)):
        if match is not None and all(match[1] is not module for _, module in found):
            found.append(match)
    return found


def find_input_embeddings(model: nn.Module) -> nn.Module | None:
    """The unwrapped model's token embeddings (transformers' `get_input_embeddings`), or None where it has none or
    does not say."""
    getter = getattr(unwrap_model(model), "get_input_embeddings", None)
    if getter is None:
        return None
    try:
        embeddings = getter()
    except (NotImplementedError, AttributeError):  # transformers' default for a model without token embeddings
        return None
    return embeddings if isinstance(embeddings, nn.Module) else None


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


def find_liger_functions(model: nn.Module) -> list[str]:
    """Return the Liger functions patched into the modules that define the model's classes.

    `apply_liger_kernel_to_llama` and its siblings (and the Trainer's `use_liger_kernel=True`, through them) replace
    module-level functions of transformers' modeling files, e.g. `modeling_llama.apply_rotary_pos_emb`, for every
    model of the family. Liger's rotary embedding writes the rotated queries and keys into the projections' outputs
    in place, in a Triton kernel that neither autograd nor a dispatch mode sees: a selective checkpoint, which keeps
    those outputs by reference, would hand the recomputation queries already rotated, and rotate them again.

    Args:
        model: the model, bare or wrapped (it is unwrapped with `unwrap_model` first).

    Returns:
        `"module.function"` names, sorted; empty without Liger's functions.
    """
    module_names = {type(module).__module__ for module in unwrap_model(model).modules()}
    found = []
    for module_name in sorted(name for name in module_names if not name.startswith("liger_kernel")):
        module = sys.modules.get(module_name)
        for attribute, value in vars(module).items() if module is not None else ():
            if inspect.isfunction(value) and (value.__module__ or "").startswith("liger_kernel"):
                found.append(f"{module_name}.{attribute}")
    return found


def outermost(named: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop duplicates and modules nested in another entry: the outer region already covers them."""
    kept: list[tuple[str, nn.Module]] = []
    for name, module in sorted(named, key=lambda item: (item[0].count("."), item[0])):
        if any(module is m or p == "" or name.startswith(p + ".") for p, m in kept):
            continue
        kept.append((name, module))
    return kept


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
    return outermost(found)


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
    return [(name, module) for name, module in model.named_modules() if _checkpointing_layer_class(module) is not None]


def _checkpointing_layer_class(module: nn.Module) -> type | None:
    """transformers' `GradientCheckpointingLayer` among the module's classes, matched by name; None when absent."""
    return next((cls for cls in type(module).__mro__ if cls.__name__ == "GradientCheckpointingLayer"), None)


def checkpoints_its_whole_call(layer: nn.Module) -> bool:
    """Whether transformers checkpoints the decoder layer around its whole call, hooks and all: releases before 5.24,
    whose `GradientCheckpointingLayer.__call__` hands the checkpoint function `partial(super().__call__, **kwargs)`.
    Later releases checkpoint inside the layer's `forward`."""
    base = _checkpointing_layer_class(layer)
    return base is not None and vars(base).get("__call__") is type(layer).__call__


def first_tensor(output: Any) -> torch.Tensor | None:
    """The module's main output: the tensor itself, or the first element of a tuple (attention returns weights too)."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    return output if isinstance(output, torch.Tensor) else None


def checkpointing_on(model: nn.Module) -> bool:
    """Whether a transformers model has activation checkpointing on (False for other models)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers renamed it in v5.2x
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False

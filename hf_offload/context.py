"""`get_act_offloading_ctx_manager`: the offloading context for a model, its hooks installed once.

It builds the engine (`OffloadActivations`), tells it the model's parameters, installs the hooks of `model_hooks` where
`model`'s lookups find the tail, the Liger modules and the blocks, and, as the options ask, tiles the MLPs or attaches
the memory budget's controller. It hands each part its options: the engine and the controller are given the same
`OffloadOptions`, and the controller sets the engine only through its settings (`OffloadActivations.apply_settings`).
Calling it again on one model replaces the previous context's hooks.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

from torch import nn

from .allocator import LongContextCheck
from .engine import OffloadActivations
from .memory_budget.controller import MemoryBudgetController
from .memory_budget.spec import parse_memory_budget
from .model import (
    HEAD_PATHS,
    compiled_as_a_whole,
    find_attention_modules,
    find_decoder_layers,
    find_head,
    find_input_embeddings,
    find_liger_modules,
    find_output_head,
    outermost,
    unwrap_model,
)
from .model_hooks import (
    install_exempt_hooks,
    install_prefetch_points,
    install_step_tokens_hook,
    install_tail_hooks,
    remove_stale_hooks,
)
from .options import OffloadOptions, check_option_names
from .tiled.apply import apply_tiled_layer, apply_tiled_mlp
from .tiled.integration import default_tokens_per_chunk

__all__ = ["get_act_offloading_ctx_manager"]

logger = logging.getLogger(__name__)


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
    remove_stale_hooks(model)


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
        f"{', '.join(HEAD_PATHS)}). If the model has one, its activations will be offloaded and brought straight "
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
    else:
        check_option_names(kwargs, "get_act_offloading_ctx_manager")
        options = OffloadOptions(**trl_options, **kwargs)
    engine = OffloadActivations(options=options)
    unwrapped = unwrap_model(model)
    _remove_previous_installation(unwrapped)
    engine.update_model_params(model)

    tail = find_output_head(unwrapped)
    head = find_head(unwrapped)
    if warn_if_no_head and head is None:  # a final norm alone does not spare the head
        _warn_no_head_once(unwrapped)

    install_tail_hooks(engine, unwrapped, [module for _, module in tail], find_input_embeddings(unwrapped))
    exempt = outermost(find_liger_modules(unwrapped))
    for _, module in exempt:
        install_exempt_hooks(engine, module)
    layers = [layer for _, layer in find_decoder_layers(unwrapped)]
    install_prefetch_points(
        engine,
        unwrapped,
        layers,
        head[1] if head is not None else None,
        [module for _, module in find_attention_modules(unwrapped)],
    )
    if layers:
        engine.track_hook(layers[0].register_forward_pre_hook(LongContextCheck(engine), with_kwargs=True))
    install_step_tokens_hook(engine, unwrapped)
    if options.tile_mlp is True:
        engine.track_hook(apply_tiled_mlp(unwrapped, default_tokens_per_chunk(unwrapped)))
    if options.tile_layer is True:
        engine.track_hook(apply_tiled_layer(unwrapped, default_tokens_per_chunk(unwrapped)))
    if options.memory_budget is not None and engine.active:
        controller = MemoryBudgetController(unwrapped, engine, parse_memory_budget(options.memory_budget), options)
        engine.attach_budget(controller, controller.step_faulted)
    if compiled_as_a_whole(model):
        engine.stand_aside_compiled_as_a_whole()
    unwrapped.__dict__[_INSTALLATION_ATTR] = _Installation(weakref.ref(engine), weakref.ref(unwrapped))
    logger.info(
        "hf_offload: tail of the forward kept from %s; Liger modules exempt: %s",
        ", ".join(name for name, _ in tail) or "nowhere",
        ", ".join(name for name, _ in exempt) or "none",
    )
    return engine

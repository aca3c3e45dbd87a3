"""Checkpointing and the offload contexts compared: transformers' native offload flag, TRL's offloader, ours.

The third-party offloaders do not report what they move, so their pack hooks are wrapped with a byte counter."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class SkipMode(Exception):
    """The mode cannot run here (missing package or feature); reported as 'skipped'."""


# get_act_offloading_ctx_manager(model, **options) of TRL or of hf_offload
ContextFactory = Callable[..., Any]


def load_offloader(offloader: str, device: torch.device) -> ContextFactory | None:
    """The offloader's context factory (None for "none" and "native", which need none). Called before anything is
    built, so that a mode that cannot run here is skipped fast."""
    if offloader == "native" and device.type != "cuda":
        raise SkipMode("native offload pins host memory: needs an accelerator")
    if offloader in ("trl", "trl-sync"):
        if device.type != "cuda":
            raise SkipMode("TRL's offloader needs an accelerator")
        try:
            from trl.models.activation_offloading import get_act_offloading_ctx_manager
        except Exception as e:
            raise SkipMode(f"trl not importable: {type(e).__name__}: {e}") from e
        return get_act_offloading_ctx_manager
    if offloader == "hfo":
        try:
            import hf_offload
        except Exception as e:
            raise SkipMode(f"hf_offload not importable: {type(e).__name__}: {e}") from e
        return hf_offload.get_act_offloading_ctx_manager
    return None


def enable_checkpointing(model: torch.nn.Module, offload: bool, every: int = 1) -> str:
    """Non-reentrant checkpointing through the model's own API (``activation_checkpointing_enable``, or
    ``gradient_checkpointing_enable`` on older transformers), with its ``offload`` flag for the native mode, on
    every ``every``-th decoder layer (its ``every_n_layers`` where it has one; else the other layers' flags are
    turned off afterwards, which is what that argument does). Returns the call made, for the report."""
    fn = getattr(model, "activation_checkpointing_enable", None)
    kw_name = "activation_checkpointing_kwargs"
    if fn is None:
        fn = model.gradient_checkpointing_enable
        kw_name = "gradient_checkpointing_kwargs"
    accepted = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {kw_name: {"use_reentrant": False}}
    if offload:
        if "offload" not in accepted:
            import transformers

            raise SkipMode(f"transformers {transformers.__version__}: {fn.__name__} has no 'offload' flag")
        kwargs["offload"] = True
    if every > 1 and "every_n_layers" in accepted:
        kwargs["every_n_layers"] = every
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        fn(**kwargs)
    call = f"{fn.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
    if every == 1:
        return call
    layers = _decoder_layers(model)
    if "every_n_layers" not in kwargs:
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i % every == 0
        call += f", then gradient_checkpointing=False on the decoder layers whose index % {every} != 0"
    return call + f"; checkpointed layers {[i for i, layer in enumerate(layers) if layer.gradient_checkpointing]}"


def disable_checkpointing(model: torch.nn.Module) -> None:
    """Turns the model's checkpointing off again, through its own API (a model built once for several modes)."""
    fn = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the older name's deprecation, as in `enable_checkpointing`
        fn()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers in model order: the modules that read their own ``gradient_checkpointing`` flag."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


class ByteCounter:
    """Bytes and tensors a third-party offloader moved to the host in the current step."""

    def __init__(self) -> None:
        self.bytes = 0
        self.tensors = 0

    def reset(self) -> None:
        self.bytes = 0
        self.tensors = 0

    def add(self, n: int) -> None:
        self.bytes += int(n)
        self.tensors += 1


def _count_native_offload(counter: ByteCounter) -> bool:
    """Swaps the save_on_cpu that transformers' checkpoint wrapper calls for a subclass whose pack hook counts, then
    calls the original. Returns False where that name is not found."""
    import transformers.modeling_utils as mu

    base = getattr(mu, "save_on_cpu", None)
    if base is None:
        return False

    class CountingSaveOnCpu(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            orig = self.pack_hook

            def pack(t):
                if t.device.type != "cpu":
                    counter.add(t.numel() * t.element_size())
                return orig(t)

            self.pack_hook = pack

    mu.save_on_cpu = CountingSaveOnCpu
    return True


def _count_trl_offload(ctx: Any, counter: ByteCounter) -> bool:
    """Wraps TRL's pack hook: after it, TRL's tracker marks the tensors it offloaded. Returns False where the
    context lacks the tracker or the hook."""
    if not hasattr(ctx, "tracker") or not hasattr(ctx, "pack_hook"):
        return False
    orig = ctx.pack_hook

    def pack(t):
        tid = orig(t)
        entry = ctx.tracker.get(tid) if isinstance(tid, int) else None
        if entry is not None and len(entry) > 1 and entry[1]:
            cpu_t = entry[0]
            counter.add(cpu_t.numel() * cpu_t.element_size())
        return tid

    ctx.pack_hook = pack
    return True


@dataclass
class Offload:
    """An offloader set up on the model: the context the steps run in, and who counts the bytes it moves."""

    offloader: str  # one of modes.OFFLOADERS
    # What the step runs inside; None for "none", and for "native", whose save_on_cpu sits inside checkpointing.
    context: Any | None
    # Counts native's and TRL's bytes; None for the others and where the counting hook could not be put in.
    counter: ByteCounter | None

    @property
    def bytes_counted(self) -> bool:
        # ours reports its bytes itself (get_stats); "none" moves none
        return self.counter is not None or self.offloader in ("none", "hfo")


def start_offload(
    offloader: str, factory: ContextFactory | None, model: torch.nn.Module, hfo_options: dict[str, Any]
) -> Offload:
    """The offload context of ``offloader`` on ``model`` (built, checkpointing and LoRA applied), with its counter."""
    counter = ByteCounter()
    if offloader == "native":
        return Offload(offloader, None, counter if _count_native_offload(counter) else None)
    if offloader in ("trl", "trl-sync"):
        ctx = factory(model, use_streams=(offloader == "trl"))
        return Offload(offloader, ctx, counter if _count_trl_offload(ctx, counter) else None)
    if offloader == "hfo":
        return Offload(offloader, factory(model, **hfo_options), None)
    return Offload(offloader, None, None)

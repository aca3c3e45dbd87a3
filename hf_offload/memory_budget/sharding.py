"""What sharding a layer's parameters (FSDP2's `fully_shard`) changes in the memory the budget counts.

Under FSDP2 a rank holds a shard of each parameter between uses (a DTensor) and gathers the whole parameter, in new
storage, only while its layer runs. Two things follow for the model of a step's memory (`simulate`):

* The gradients that last through the step are shards too: a layer's backward creates the whole gradient, which a
  reduce-scatter turns into this rank's shard. So gradient bytes are counted by their local shard (`local_nbytes`),
  and the whole gradient is part of the layer's backward working bytes (the probe measures it there).
* A sharded layer's gathered parameters are memory the rank holds while the layer runs, forward and backward, and
  FSDP2 gathers the next layer to run backward while one does (its implicit backward prefetch). On an 8-layer model
  of 9 MiB layers (two H200s, fp32, eager attention), a plan predicted without them peaked 35.8 MB over the model:
  the layer's gathered parameters (9.44 MB), the next one's (9.44 MB), the root's reduce-scatter and the eager
  attention's mask. `gathered_for_probe` measures a layer's gathered bytes (`LayerProfile.gathered_parameter_bytes`).
  With `reshard_after_forward=False` FSDP2 keeps every layer gathered from its forward to its backward, which this
  model does not count (the closed loop's peak correction learns it from the measured steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

try:  # FSDP2's `fully_shard` (torch >= 2.6)
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # torch built without distributed
    FSDPModule = None

from ..policy import DTensor, local_shard

__all__ = ["local_nbytes", "gathered_for_probe", "gradient_shard_nbytes"]


def local_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes this rank holds of `tensors`: a DTensor's local shard (its `numel()` is the whole tensor's)."""
    return sum(shard.numel() * shard.element_size() for shard in map(local_shard, tensors))


@contextlib.contextmanager
def gathered_for_probe(layer: nn.Module) -> Iterator[int]:
    """For a layer that FSDP2 shards (`fully_shard(layer)`), while the probes run it: its parameters gathered and its
    own forward hooks set aside; yields the bytes of its gathered parameters (0 for a layer FSDP2 does not shard,
    which is probed as it is).

    FSDP2 gathers a layer's parameters in the layer's forward pre-hook, frees them in its forward hook and hooks the
    call's inputs and outputs for backward. The probes run from inside the step's call to the layer: through those
    hooks, a probe's call would free the parameters under the step's call (whose forward then met sharded ones,
    "got mixed torch.Tensor and DTensor") and reduce gradients of its own. So the probes call the layer with its
    forward hooks set aside (the controller's own pre-hook ignores the probes' calls anyway, and transformers' output
    recorders see nothing outside the step's context), on parameters that the step's call gathered already where
    transformers checkpoints `forward`, after the hooks (5.24 on), or that `unshard()` gathers here and `reshard()`
    frees again where it checkpoints the whole call and the probe runs before the hooks (5.17,
    `plan_application._StartsBeforeTheCall`). Every rank probes the same kinds of layer in the same step, so every rank
    joins the gather's collective.
    """
    if FSDPModule is None or not isinstance(layer, FSDPModule):
        yield 0
        return
    sharded = any(isinstance(parameter, DTensor) for parameter in layer.parameters())
    if sharded:
        layer.unshard()
    pre_hooks, hooks = dict(layer._forward_pre_hooks), dict(layer._forward_hooks)
    layer._forward_pre_hooks.clear()
    layer._forward_hooks.clear()
    try:
        # Gathered, the layer's parameters are plain tensors of the dtype FSDP2 computes in.
        yield sum(parameter.numel() * parameter.element_size() for parameter in layer.parameters())
    finally:
        layer._forward_pre_hooks.update(pre_hooks)  # in their order: the dictionaries were emptied
        layer._forward_hooks.update(hooks)
        if sharded:
            layer.reshard()


def gradient_shard_nbytes(layer: nn.Module) -> int | None:
    """The gradient bytes that the layer's backward leaves on this rank where FSDP2 shards it: the local shards of
    its trainable parameters. None for a layer FSDP2 does not shard, and for one gathered now (inside its call),
    whose shards are then out of reach (its whole gradients are counted instead, which is more)."""
    if FSDPModule is None or not isinstance(layer, FSDPModule):
        return None
    trainable = [parameter for parameter in layer.parameters() if parameter.requires_grad]
    if not all(isinstance(parameter, DTensor) for parameter in trainable):
        return None
    return local_nbytes(trainable)

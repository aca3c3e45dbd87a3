"""What gets offloaded: the eligibility rules for one saved tensor, and the plan for the tail of the forward.

Nothing here moves bytes or touches streams; everything is plain bookkeeping so that it can be tested on CPU.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

try:  # DTensor parameters (FSDP2, tensor parallel) keep their local shard in `_local_tensor`.
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = None

__all__ = [
    "kept_reason",
    "is_movable_type",
    "is_parameter_or_view",
    "storage_span",
    "local_shard",
    "parameter_storages",
    "TailPlanner",
]


def storage_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The smallest run of the tensor's storage (in elements: start, length) that holds all its elements.

    Copying this span, rather than the materialised tensor, restores views, transposes, storage offsets and
    broadcast (stride-0) tensors exactly with `as_strided`, and never copies a broadcast dimension.
    PyTorch strides are never negative, so the span runs from the storage offset to the last element.
    """
    if tensor.is_contiguous():  # most saved tensors; the general rule below gives the same, in more calls
        return tensor.storage_offset(), tensor.numel()
    if tensor.numel() == 0:
        return tensor.storage_offset(), 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.storage_offset(), last + 1


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor`: a DTensor's local shard, any other tensor itself."""
    return tensor._local_tensor if DTensor is not None and isinstance(tensor, DTensor) else tensor


def parameter_storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    """Data pointers of the storages behind parameters and buffers, so that views of them are recognised."""
    pointers = set()
    for tensor in map(local_shard, tensors):
        try:
            pointer = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # meta tensors, sharded-away FSDP params
            continue
        if pointer:
            pointers.add(pointer)
    return pointers


def is_parameter_or_view(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a parameter, or a view of one (`weight.t()` saved by a linear layer), wherever its storage
    is now: FSDP2 and DeepSpeed ZeRO-3 gather a layer's parameters into new storage as the layer runs, after any
    pointers were read.

    The checks run cheapest first: `isinstance(x, Parameter)` goes through Parameter's Python metaclass, and a short
    step makes this call for every saved tensor (see `benchmarks/hook_cost.py`). A plain `torch.Tensor` is never a
    Parameter.
    """
    if (base := tensor._base) is not None and isinstance(base, torch.nn.Parameter):
        return True
    return type(tensor) is not torch.Tensor and isinstance(tensor, torch.nn.Parameter)


def is_movable_type(tensor: torch.Tensor) -> bool:
    """Whether offloading can move a tensor of this kind: a plain strided tensor. It keeps subclasses (a DTensor, which
    torch's ring attention saves under context parallelism), sparse layouts and quantized tensors where they are."""
    return type(tensor) is torch.Tensor and tensor.layout is torch.strided and not tensor.is_quantized


def kept_reason(
    tensor: torch.Tensor,
    *,
    device_type: str,
    min_offload_size: int,
    parameter_pointers: set[int],
    in_backward: bool,
) -> str | None:
    """Why this saved tensor must stay where it is, or None if it may be offloaded.

    The reasons are the keys of `hf_offload.stats.KEPT_REASONS`; deduplication, the tail and the host cap are
    decided later by the engine, because they depend on the rest of the step.
    """
    if is_parameter_or_view(tensor):
        return "parameter"
    if not is_movable_type(tensor):
        return "unsupported_type"
    if tensor.device.type != device_type:
        return "not_on_accelerator"
    if in_backward:
        return "in_backward"
    if tensor.untyped_storage().data_ptr() in parameter_pointers:
        return "parameter"
    _, span = storage_span(tensor)
    if span == 0 or span * tensor.element_size() < min_offload_size:
        return "too_small"
    return None


class TailPlanner:
    """Learns which offload candidates at the end of the forward to keep on the GPU.

    Backward needs the last tensors of the forward first. A copy that has not even finished leaving the GPU when
    backward starts is pure cost: the GPU copy is still alive, so keeping it costs no extra memory and saves both
    transfers. The planner watches one step: the position of the first candidate whose copy was unfinished when
    backward began becomes the start of the tail for the next steps (copies finish in pack order, so every
    later candidate was unfinished too). The tail only grows (it never oscillates) and is re-learned when the
    sequence of candidates changes (a different model path, a different number of layers), which is recognised
    by each candidate's dtype and rank so that a new sequence length alone does not discard the plan.

    Memory: the tail holds at most `max_tail_bytes`. The copies still unfinished when the forward ends are
    drained before the loss runs, so keeping them is not free: the tail sits on top of the loss, often the step's
    peak. The bound also keeps a bandwidth-bound model, whose copies always lag, from drifting towards keeping
    everything.
    """

    def __init__(self, enabled: bool, max_tail_bytes: int) -> None:
        self.enabled = enabled
        self.max_tail_bytes = max_tail_bytes
        self._plan_signature: list[tuple[torch.dtype, int]] | None = None
        self._plan_sizes: list[int] = []
        self._tail_start: int | None = None
        # The step being packed.
        self._signature: list[tuple[torch.dtype, int]] = []
        self._sizes: list[int] = []
        self._follows_plan = False

    @property
    def tail_start(self) -> int | None:
        return self._tail_start

    @property
    def candidates_seen(self) -> int:
        """Candidates registered so far in the step being packed (the next one's position)."""
        return len(self._signature)

    def begin_step(self) -> None:
        self._signature = []
        self._sizes = []
        self._follows_plan = self._plan_signature is not None

    def next_candidate(self, dtype: torch.dtype, ndim: int, nbytes: int) -> bool:
        """Registers the next candidate of this step; True if it belongs to the tail (stays on the GPU)."""
        position = len(self._signature)
        key = (dtype, ndim)
        self._signature.append(key)
        self._sizes.append(nbytes)
        if not self._follows_plan:
            return False
        if position >= len(self._plan_signature) or self._plan_signature[position] != key:
            self._follows_plan = False  # a new path through the model: offload as usual, re-plan at backward
            return False
        return self._tail_start is not None and position >= self._tail_start

    def end_forward(self, first_unfinished: int | None) -> None:
        """Called when backward starts. `first_unfinished`: position of the first offloaded candidate whose copy
        had not finished, or None if every copy had."""
        if not self.enabled:
            return
        same_sequence = self._follows_plan and len(self._signature) == len(self._plan_signature)
        start = self._tail_start if same_sequence else None
        self._plan_signature = self._signature
        self._plan_sizes = self._sizes
        if first_unfinished is not None:
            start = first_unfinished if start is None else min(start, first_unfinished)
        self._tail_start = None if start is None else self._cap(start)

    def set_max_tail_bytes(self, max_tail_bytes: int) -> None:
        """A new bound for the tail; a tail already learned is shortened to it at once."""
        self.max_tail_bytes = max_tail_bytes
        if self._tail_start is not None:
            self._tail_start = self._cap(self._tail_start)

    def _cap(self, start: int) -> int:
        """Moves the tail start later until the tail fits its budget."""
        tail_bytes = sum(self._plan_sizes[start:])
        while start < len(self._plan_sizes) and tail_bytes > self.max_tail_bytes:
            tail_bytes -= self._plan_sizes[start]
            start += 1
        return start

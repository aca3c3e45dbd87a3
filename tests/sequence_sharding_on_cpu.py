"""What each rank runs in the CPU tests of sharded sequences (`test_distributed_examples.py`):
`examples/distributed/train_distributed.py` with its arguments, after giving torch, accelerate and DeepSpeed, for this
process only, what they lack to shard sequences over CPU processes (gloo).

Context parallelism (`--cp-size`, accelerate's `ParallelismConfig(cp_size=...)`):
* torch's ring attention (`torch.distributed.tensor.experimental.context_parallel`) handles the CUDA kernels of
  `scaled_dot_product_attention` only; on CPU tensors sdpa runs `_scaled_dot_product_flash_attention_for_cpu`, for
  which it has no handler. `install_cpu_ring_attention` registers one, forward and backward, through torch's own ring
  (`_templated_ring_attention`, private: a torch that moves it fails these tests at once, with an ImportError).
* accelerate accepts a `ParallelismConfig` only for FSDP2 on accelerators (`DistributedType.MULTI_GPU` and the
  like); CPU processes are `MULTI_CPU`. `run_as_multi_device` relabels the process's state once the Trainer's
  arguments have set it up on the CPU (gloo, `use_cpu=True`), so that the Trainer builds FSDP2 and the device mesh on
  the CPU.

DeepSpeed's Ulysses (`--sp-size`, `ParallelismConfig(sp_size=..., sp_backend="deepspeed")`):
* accelerate starts torch.distributed on CPU processes itself, so DeepSpeed's communication layer, which Ulysses' groups
  need, is never started: `start_deepspeed_comm` starts it over gloo once the Trainer's arguments have set up the
  process group, without the shared-memory operator DeepSpeed would compile for CPU processes (a C++ build, which
  nothing here uses).

None of these changes what a rank computes: the tests compare runs that both shard the same way.
"""

import runpy
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental._context_parallel import _attention

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "distributed" / "train_distributed.py"
aten = torch.ops.aten
SEQUENCE_DIM = 2  # sdpa's (batch, heads, sequence, head size)


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _sharded(tensor, mesh):
    return DTensor.from_local(tensor, mesh, [Shard(SEQUENCE_DIM)], run_check=False)


def _forward(op_call, args, kwargs):
    query, key, value = args[:3]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("ring attention on CPU: only is_causal, no attn_mask")
    mesh = query.device_mesh
    out, logsumexp, *_ = _attention._templated_ring_attention(
        mesh.get_group(), SEQUENCE_DIM, aten._scaled_dot_product_flash_attention_for_cpu,
        query=_local(query), key=_local(key), value=_local(value), is_causal=is_causal, dropout_p=dropout_p,
        scale=kwargs.get("scale"),
    )  # fmt: skip
    return _sharded(out, mesh), _sharded(logsumexp, mesh)


def _backward(op_call, args, kwargs):
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = args[:8]
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("ring attention on CPU: only is_causal, no attn_mask")
    mesh = query.device_mesh
    grads = _attention._templated_ring_attention_backward(
        mesh.get_group(), SEQUENCE_DIM, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=_local(grad_out), grad_out_name="grad_out", query=_local(query), key=_local(key),
        value=_local(value), out=_local(out), logsumexp=_local(logsumexp), is_causal=is_causal, dropout_p=dropout_p,
        scale=kwargs.get("scale"),
    )  # fmt: skip
    return tuple(_sharded(grad, mesh) for grad in grads[:3])


def install_cpu_ring_attention() -> None:
    # `context_parallel` merges this module-level table into DTensor's handlers as it enters.
    _attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = _forward
    _attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _backward


def _before_the_trainer(setup: Callable[[], None]) -> None:
    """Runs `setup` as each Trainer is built, once its arguments have set the process group up on the CPU."""
    original = transformers.Trainer.__init__

    def __init__(self, *args, **kwargs):
        kwargs["args"].device  # noqa: B018 (sets the process group up on the CPU)
        setup()
        original(self, *args, **kwargs)

    transformers.Trainer.__init__ = __init__


def run_as_multi_device() -> None:
    _before_the_trainer(lambda: PartialState._shared_state.update(distributed_type=DistributedType.MULTI_GPU))


def start_deepspeed_comm() -> None:
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401 (the module; the package's attribute of that name is torch itself)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    _before_the_trainer(lambda: deepspeed.init_distributed(dist_backend="gloo"))


if __name__ == "__main__":
    if "--sp-size" in sys.argv:
        start_deepspeed_comm()
    else:
        install_cpu_ring_attention()
        run_as_multi_device()
    sys.argv = [str(SCRIPT), *sys.argv[1:]]
    runpy.run_path(str(SCRIPT), run_name="__main__")

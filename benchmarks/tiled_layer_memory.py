#!/usr/bin/env python3
"""One decoder layer's backward at long context: the bytes per token alive at its peak, with the layer tiled
(`hf_offload.tiled.layer_op`) against the same layer untiled, under full checkpointing with the tiled MLP
(what the memory planner ran before it).

The layer: one Llama decoder layer of a shape below (random weights, bf16 unless --dtype says otherwise, frozen, as
under LoRA; the input needs a gradient), SDPA attention, batch 1. Its backward is driven by `(y * w).sum()` with `y`
dropped before it runs, so that the layer receives a real sequence-long gradient and its output is not held (in a
model the next layer's backward has let it go by then).

  CPU: live tensor storages are counted under a dispatch mode (CPU has no allocator counters), all of them and those
       of sequence-long tensors (a dimension as long as the sequence when created): the peak of the latter over the
       backward, per token, is what grows with the context; the rest (one chunk's working set) does not.
  CUDA: torch.cuda.max_memory_allocated over the backward, at each length; per token, the difference between two
       lengths over the difference of their tokens.

  python benchmarks/tiled_layer_memory.py --shape 8b --tokens 320 --chunk 64 --dtype fp32  # CPU, minutes per mode
  python benchmarks/tiled_layer_memory.py --shape 8b --device cuda --tokens 16384 32768 --chunk 2048

Prints one JSON line per measurement, then the per-token figures and the tiled layer's analytic count
(`backward_bytes_per_token`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

SHAPES = {
    # Llama-3-8B's layer; and the same divided by 16 in every width (one sixteenth of its bytes per token, but the
    # softmax statistics, 4 bytes per query head and token, which do not shrink).
    "8b": dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128),
    "8b/16": dict(hidden=256, intermediate=896, heads=32, kv_heads=8, head_dim=8),
}
MODES = ("tiled", "checkpoint+tiled-mlp")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages alive after each operation (views once, by storage), and their peak:
    all of them, and those created as sequence-long tensors (a dimension of size `length`). Storages in `exclude`
    (the weights') are not counted."""

    def __init__(self, length: int, exclude: set[int]) -> None:
        super().__init__()
        self.length, self.exclude = length, exclude
        self.storages: dict[int, tuple[StorageWeakRef, int, bool]] = {}
        self.peak = self.sequence_peak = 0

    def live(self, sequence_only: bool = False) -> int:
        # A weak reference keeps its StorageImpl's address from being reused, so keys never collide.
        self.storages = {key: entry for key, entry in self.storages.items() if not entry[0].expired()}
        return sum(size for _, size, long in self.storages.values() if long or not sequence_only)

    def reset_peak(self) -> None:
        self.peak, self.sequence_peak = self.live(), self.live(sequence_only=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in self.exclude:
                    self.storages.setdefault(ref.cdata, (ref, storage.nbytes(), self.length in tensor.shape))
        self.peak = max(self.peak, self.live())
        self.sequence_peak = max(self.sequence_peak, self.live(sequence_only=True))
        return out


def build_model(shape: str, device: str, dtype: torch.dtype = torch.bfloat16, attn: str = "sdpa") -> Any:
    """A one-layer Llama of `shape` in `dtype`, weights frozen."""
    import transformers

    s = SHAPES[shape]
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                                      num_hidden_layers=1, num_attention_heads=s["heads"],
                                      num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                                      attn_implementation=attn)  # fmt: skip
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype).train().requires_grad_(False)


def measure(model: Any, mode: str, tokens: int, chunk: int) -> dict[str, Any]:
    """One forward and backward of the model's first decoder layer on `tokens` tokens in `mode`: the peak bytes over
    the backward (on CPU also the sequence-long ones) and the backward's time."""
    from hf_offload.tiled.apply import apply_tiled_layer, apply_tiled_mlp

    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    hidden = model.config.hidden_size
    layer = model.model.layers[0]
    positions = torch.arange(tokens, device=device)[None]
    rotary = model.model.rotary_emb(torch.zeros(1, tokens, hidden, dtype=dtype, device=device), positions)
    weights = torch.randn(hidden, dtype=dtype, device=device)
    kwargs = dict(attention_mask=None, position_embeddings=rotary, position_ids=positions)
    exclude = {StorageWeakRef(p.untyped_storage()).cdata for p in model.parameters()}
    cuda = device.type == "cuda"
    meter = LiveBytes(tokens, exclude) if not cuda else None
    handle = apply_tiled_layer(model, chunk) if mode == "tiled" else apply_tiled_mlp(model, chunk)
    try:
        with meter if meter is not None else contextlib.nullcontext():
            x = torch.randn(1, tokens, hidden, dtype=dtype, device=device).requires_grad_()
            if mode == "tiled":
                y = layer(x, **kwargs)
            else:
                y = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False, **kwargs)
            loss = (y * weights).sum()
            del y
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start_bytes = torch.cuda.memory_allocated()
            else:
                meter.reset_peak()
            start = time.perf_counter()
            loss.backward()
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
    finally:
        handle.remove()
    result = dict(mode=mode, tokens=tokens, chunk=chunk, backward_s=round(seconds, 3))
    if cuda:
        result.update(peak_bytes=torch.cuda.max_memory_allocated(), start_bytes=start_bytes)
    else:
        result.update(peak_bytes=meter.peak, sequence_peak_bytes=meter.sequence_peak)
    return result


def per_token(results: list[dict[str, Any]]) -> float:
    """Bytes per token that grow with the sequence: on CPU the sequence-long peak over the tokens (the longest
    measurement), on CUDA the peaks' difference between the shortest and longest measurement."""
    results = sorted(results, key=lambda r: r["tokens"])
    if "sequence_peak_bytes" in results[-1]:
        return results[-1]["sequence_peak_bytes"] / results[-1]["tokens"]
    first, last = results[0], results[-1]
    return (last["peak_bytes"] - first["peak_bytes"]) / (last["tokens"] - first["tokens"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="8b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[320])
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--dtype", choices=DTYPES, default="bf16",
                        help="fp32 on a CPU without fast bf16 matrix products (every activation then takes twice the "
                             "bytes; the analytic count is printed for the same dtype)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cuda" and len(args.tokens) < 2:
        parser.error("--device cuda needs two --tokens lengths (the per-token bytes are the peaks' difference)")
    from hf_offload.tiled.layer_op import backward_bytes_per_token

    model = build_model(args.shape, args.device, DTYPES[args.dtype])
    figures = {}
    for mode in args.modes:
        results = [measure(model, mode, tokens, args.chunk) for tokens in args.tokens]
        for result in results:
            print(json.dumps(result), flush=True)
        figures[mode] = per_token(results)
    s = SHAPES[args.shape]
    analytic = backward_bytes_per_token(s["hidden"], s["heads"], s["kv_heads"], s["head_dim"],
                                        DTYPES[args.dtype].itemsize)  # fmt: skip
    for mode, value in figures.items():
        print(f"{mode}: {value / 1024:.2f} KiB per token")
    print(f"tiled, analytic (backward_bytes_per_token): {analytic / 1024:.2f} KiB per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One decoder layer's memory under the planner's checkpointing actions at growing lengths, against what the
planner's probe predicts from a short call: does the model that plans a 512K step from an 8K profile hold at 512K?

A QLoRA step at 524,288 tokens ran out of memory in the recompute of a layer whose plan was `T` (full
checkpoint, MLP tiled): the 4-layer run of the same shape peaked 2.3 GB above the plan's prediction. This measures,
for one layer of the long-context benchmark's 8B shape (4-bit NF4 base, LoRA r=16 on every linear layer, Liger),
the peak above its input of its checkpointed forward and of its backward (recompute included), per token, at each
length, for `T` (`apply_tiled_mlp` + a full checkpoint) and `L` (`apply_tiled_layer`), next to the probe's
prediction at that length (`hf_offload.memory_budget.probes.probe_layer` on the first length's call, scaled as the
planner scales it: per-token parts in proportion, one chunk's part constant).

  python benchmarks/layer_scaling.py --out $OUT            # on the GPU machine, about a minute
  python benchmarks/layer_scaling.py --precision bf16 --lengths 8192,65536

Writes layer_scaling.json under --out, and prints a table.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before torch is imported anywhere

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPE = dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", choices=["bf16", "qlora"], default="qlora")
    ap.add_argument("--lengths", default="8192,16384,65536,131072,262144",
                    help="comma list of tokens per call; the first is the probe's")  # fmt: skip
    ap.add_argument("--chunk", type=int, default=4096, help="tokens per chunk of the tiled MLP and layer")
    ap.add_argument("--out", default="layer_scaling_out")
    return ap.parse_args(argv)


def build_layer(precision: str) -> tuple[Any, Any]:
    """The long-context benchmark's model with one decoder layer (LoRA, Liger, NF4 for qlora) and its rotary module."""
    import torch
    from harness.model import apply_liger, apply_lora, build_model
    from harness.scenarios import Scenario
    from long_context import quantize_decoder_nf4

    device = torch.device("cuda")
    notes: list[str] = []
    liger = apply_liger(device, notes, "llama")
    scenario = Scenario(**SHAPE, layers=1, vocab=1024, seq=1 << 20, batch=1, lora=True, liger=liger,
                        force_ckpt=False, steps=1, warmup=1)  # fmt: skip
    model = build_model(scenario, 0, device, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    if precision == "qlora":
        quantize_decoder_nf4(model)
    model = apply_lora(model).train()
    return model, notes


def measure(model: Any, tokens: int, action: str, chunk: int) -> dict[str, float]:
    """Peaks above the input and its gradient, per token, of one call under `action` (T or L): its forward, what
    it holds after it, and its backward (the recompute included)."""
    import torch
    import torch.utils.checkpoint as checkpoint

    from hf_offload.tiled.apply import apply_tiled_layer, apply_tiled_mlp

    inner = model.base_model.model.model
    layer = inner.layers[0]
    x = torch.randn(1, tokens, SHAPE["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    positions = torch.arange(tokens, device="cuda")[None]
    cos_sin = inner.rotary_emb(x, positions)
    handle = (apply_tiled_mlp if action == "T" else apply_tiled_layer)(model, chunk, layers=[0])
    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if action == "T":
            out = checkpoint.checkpoint(layer, x, position_embeddings=cos_sin, use_reentrant=False)
        else:
            out = layer(x, position_embeddings=cos_sin)
        torch.cuda.synchronize()
        forward = torch.cuda.max_memory_allocated() - base
        held = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        out.backward(grad)
        torch.cuda.synchronize()
        backward = torch.cuda.max_memory_allocated() - base
    finally:
        handle.remove()
    del out, x, grad
    for p in model.parameters():
        p.grad = None
    torch.cuda.empty_cache()
    return {"forward_per_token": forward / tokens, "held_per_token": held / tokens,
            "backward_per_token": backward / tokens, "backward_bytes": backward}  # fmt: skip


def predicted(probe: Any, tokens: int, chunk: int) -> dict[str, float]:
    """The planner's bytes for this layer's backward at `tokens` under T and L, above its input: as `simulate` adds
    them (saved + one chunk + the backward's working bytes, or the whole-sequence phase's bytes where more)."""
    from hf_offload.memory_budget.simulate import _backward_working

    scale = tokens / probe.tokens
    profile = probe.profile
    out = {}
    for action, saved, per_chunk_token, working, sequence in (
        ("T", profile.tiled_saved_bytes, probe.chunk_bytes_per_token, probe.tiled_working_bytes,
         probe.tiled_sequence_bytes),
        ("L", profile.layer_tiled_saved_bytes, probe.layer_chunk_bytes_per_token, probe.layer_tiled_working_bytes,
         probe.layer_tiled_sequence_bytes),
    ):  # fmt: skip
        if working is None:
            continue
        held = saved * scale + per_chunk_token * chunk
        total = held + _backward_working(round(held), round(working * scale), round((sequence or 0) * scale))
        out[f"{action}_backward_per_token"] = (total - profile.input_bytes * scale) / tokens
    return out


def main(argv: list[str] | None = None) -> int:
    import functools

    import torch

    from hf_offload.memory_budget.probes import Meter, probe_layer
    from hf_offload.tiled.apply import apply_tiled_layer, apply_tiled_mlp

    args = parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, notes = build_layer(args.precision)
    layer = model.base_model.model.model.layers[0]
    inner = model.base_model.model.model
    x = torch.randn(1, lengths[0], SHAPE["hidden"], device="cuda", dtype=torch.bfloat16)
    cos_sin = inner.rotary_emb(x, torch.arange(lengths[0], device="cuda")[None])
    probe = probe_layer(layer, (x,), {"position_embeddings": cos_sin}, Meter("cuda"),
                        functools.partial(apply_tiled_mlp, model, layers=[0]),
                        functools.partial(apply_tiled_layer, model, layers=[0]))  # fmt: skip
    del x, cos_sin
    results: dict[str, Any] = {"precision": args.precision, "shape": SHAPE, "chunk": args.chunk, "notes": notes,
                               "probe_tokens": probe.tokens, "rows": []}  # fmt: skip
    print(f"{'tokens':>8} {'action':>6} {'fwd B/tok':>10} {'held B/tok':>10} {'bwd B/tok':>10} {'model B/tok':>11}")
    for tokens in lengths:
        model_bytes = predicted(probe, tokens, args.chunk)
        for action in ("T", "L"):
            try:
                row = measure(model, tokens, action, args.chunk)
            except torch.cuda.OutOfMemoryError:
                row = {"oom": True}
                torch.cuda.empty_cache()
            model_per_token = model_bytes.get(f"{action}_backward_per_token")
            row.update(tokens=tokens, action=action, model_backward_per_token=model_per_token)
            results["rows"].append(row)
            (out_dir / "layer_scaling.json").write_text(json.dumps(results, indent=1))
            if row.get("oom"):
                print(f"{tokens:>8} {action:>6} OOM")
                continue
            print(
                f"{tokens:>8} {action:>6} {row['forward_per_token']:>10.0f} {row['held_per_token']:>10.0f} "
                f"{row['backward_per_token']:>10.0f} {row['model_backward_per_token'] or 0:>11.0f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

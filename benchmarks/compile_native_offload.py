#!/usr/bin/env python3
"""PyTorch's own compile-time activation offloading on a whole-model-compiled Llama, against hf-offload.

Under `torch.compile(model)` hf-offload stands aside: the compiled forward hands its saved tensors to the pack hook
only after its last kernel, when moving them cannot lower the peak (`engine._note_whole_model_compile`). Offloading a
compiled model's activations therefore has to happen inside the compiled graph. PyTorch has a pass for that in the
min-cut partitioner (`torch._functorch._activation_offloading`, enabled by `torch._functorch.config`'s testing flag
`enable_activation_offloading`): every node a joint-graph pass marks `should_offload` and the partitioner saves for
backward is moved to the host after its last forward use and back before its first backward use; synchronously
(`prims.device_put`), or on a side stream with `activation_offload_separate_stream` (plus `activation_offload_sink_wait`
and `activation_reload_prefetch`, the `ao::offload/reload/wait_tensor` ops).

This script measures whether that pass meets hf-offload's bars on the installed torch: no crash, losses and gradients
bitwise equal to the compiled run without it (which repeats itself), its step time and peak. The joint-graph pass here
marks every tensor-producing node of decoder layers 0..L-2 (the last layer's activations are needed first in
backward); the partitioner keeps only the saved ones (`choose_offload_sets`).

Variants, one after the other in this process (`torch._dynamo.reset()` between them), each on the same weights and
batch, `--steps` steps without an optimizer (so that every step computes the same loss):
  eager                      no compilation, no offloading
  eager+hfo                  hf_offload.get_act_offloading_ctx_manager(model) around each step, no checkpointing
  compiled                   torch.compile(model)
  compiled+native-sync       the partitioner's pass, synchronous copies
  compiled+native-async      the partitioner's pass on a side stream, waits sunk, reloads prefetched
  ckpt/...                    the same with non-reentrant checkpointing (ckpt/eager, ckpt/eager+hfo, ckpt/compiled,
                             ckpt/compiled+native-sync, ckpt/compiled+native-async)

Each variant's losses and gradients are compared bitwise with those of its baseline: the same checkpointing, eager or
compiled, without offloading.

Usage (GPU machine): python benchmarks/compile_native_offload.py [--variants a,b] [--out DIR]
CPU smoke run: python benchmarks/compile_native_offload.py --tiny --variants compiled,compiled+native-sync
(the asynchronous pass times nodes on a GPU, so it needs one).
Writes <out>/compile-native-offload.json, rewritten after every variant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # hf_offload from this checkout

_ASYNC = {"activation_offload_separate_stream": True, "activation_offload_sink_wait": True,
          "activation_reload_prefetch": True}  # fmt: skip
VARIANTS: dict[str, dict[str, Any]] = {
    "eager": {"compiled": False},
    "eager+hfo": {"compiled": False, "hfo": True},
    "compiled": {"compiled": True},
    "compiled+native-sync": {"compiled": True, "native": {}},
    "compiled+native-async": {"compiled": True, "native": _ASYNC},
    "ckpt/eager": {"compiled": False, "ckpt": True},
    "ckpt/eager+hfo": {"compiled": False, "ckpt": True, "hfo": True},
    "ckpt/compiled": {"compiled": True, "ckpt": True},
    "ckpt/compiled+native-sync": {"compiled": True, "ckpt": True, "native": {}},
    "ckpt/compiled+native-async": {"compiled": True, "ckpt": True, "native": _ASYNC},
}
_LAYER = re.compile(r"layers[\.\[]'?(\d+)")


class MarkLayerActivations:
    """The joint-graph pass (`functorch_config.joint_custom_pass`): marks for offloading every node with a tensor
    value inside decoder layers 0..layers-2, found by the module stack Dynamo records on each node."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.marked = 0

    def __call__(self, graph_module: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
        for node in graph_module.graph.nodes:
            if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
                continue
            layer = None
            for entry in (node.meta.get("nn_module_stack") or {}).values():
                match = _LAYER.search(str(entry[0] if isinstance(entry, tuple) else entry))
                if match:
                    layer = int(match.group(1))
            if layer is not None and layer < self.layers - 1:
                node.meta["should_offload"] = True
                self.marked += 1
        return graph_module


def run_variant(args: argparse.Namespace, model_config: Any, state: dict[str, torch.Tensor], input_ids: torch.Tensor,
                compiled: bool, native: dict[str, bool] | None = None, hfo: bool = False,
                ckpt: bool = False) -> dict[str, Any]:  # fmt: skip
    torch._dynamo.reset()
    model = LlamaForCausalLM(model_config).to(device=args.device, dtype=torch.bfloat16)
    model.load_state_dict(state)
    model.train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    offloading = None
    if hfo:
        from hf_offload import get_act_offloading_ctx_manager  # only where a variant offloads with it

        offloading = get_act_offloading_ctx_manager(model)
    mark = MarkLayerActivations(model_config.num_hidden_layers)
    patch = functorch_config.patch(enable_activation_offloading=True, joint_custom_pass=mark, **native) \
        if native is not None else contextlib.nullcontext()  # fmt: skip
    forward = torch.compile(model) if compiled else model
    cuda = args.device == "cuda"
    row: dict[str, Any] = {"step_s": [], "peak_gib": [], "loss": []}
    try:
        with patch:
            for _ in range(args.steps):
                model.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                with offloading if offloading is not None else contextlib.nullcontext():
                    loss = forward(input_ids=input_ids, labels=input_ids).loss
                loss.backward()
                if cuda:
                    torch.cuda.synchronize()
                row["step_s"].append(time.perf_counter() - start)
                row["peak_gib"].append(torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
                row["loss"].append(loss.item())
        row["grads"] = {name: p.grad.float().cpu() for name, p in model.named_parameters() if p.grad is not None}
    except Exception as exc:  # noqa: BLE001 -- a variant that fails is a result
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        row["trace_tail"] = traceback.format_exc()[-3000:]
    row["marked_nodes"] = mark.marked
    del model, forward
    if cuda:
        torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096, help="sequence length")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nondeterministic", action="store_true",
                    help="leave torch's deterministic algorithms off (by default they are on, and cuBLAS gets a fixed "
                         "workspace, so that a gradient that differs from its baseline's is not attention's atomic "
                         "adds in backward)")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: hidden 64, 2 layers, 64 tokens")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/compile-native-offload"))
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.tiny:
        args.hidden, args.layers, args.tokens = 64, 2, 64
    args.device = "cpu" if args.tiny else "cuda"
    # Compile every variant afresh: a cached graph skips the joint-graph pass (nothing marked, nothing measured), and
    # the cache key need not tell the passes of two variants apart.
    inductor_config.force_disable_caches = True
    if not args.nondeterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts, after this line
        torch.use_deterministic_algorithms(True)
    heads = max(1, args.hidden // 128)
    model_config = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                               num_hidden_layers=args.layers, num_attention_heads=heads,
                               num_key_value_heads=max(1, heads // 2), vocab_size=128 if args.tiny else 32000,
                               max_position_embeddings=max(args.tokens, 128), use_cache=False)  # fmt: skip
    model_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    reference = initial_weights(model_config, args.device)
    input_ids = torch.randint(0, model_config.vocab_size, (args.batch, args.tokens), device=args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "torch": torch.__version__,
                               "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                               "deterministic": not args.nondeterministic,
                               "shape": {"layers": args.layers, "hidden": args.hidden, "batch": args.batch,
                                         "tokens": args.tokens},
                               "variants": {}}  # fmt: skip
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for name in variants:
        row = run_variant(args, model_config, reference, input_ids, **VARIANTS[name])
        grads[name] = row.pop("grads", None)
        variant = VARIANTS[name]
        baseline = ("ckpt/" if variant.get("ckpt") else "") + ("compiled" if variant["compiled"] else "eager")
        if name != baseline and grads.get(baseline) and grads[name]:
            row["bitwise_vs"] = {
                "baseline": baseline,
                "loss": row["loss"] == results["variants"][baseline]["loss"],
                "grads": all(torch.equal(grads[name][key], grads[baseline][key]) for key in grads[baseline]),
            }
        timed = sorted(row["step_s"][1:])
        row["median_step_s"] = timed[len(timed) // 2] if timed else None
        results["variants"][name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "trace_tail"})[:1500], flush=True)
        (out / "compile-native-offload.json").write_text(json.dumps(results, indent=1))
    return 0


def initial_weights(model_config: Any, device: str) -> dict[str, torch.Tensor]:
    """The weights every variant loads: one random initialisation from the seed."""
    model = LlamaForCausalLM(model_config).to(device=device, dtype=torch.bfloat16)
    return {key: value.clone() for key, value in model.state_dict().items()}


if __name__ == "__main__":
    sys.exit(main())

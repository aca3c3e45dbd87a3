"""One long-context training step of an 8B-shape Llama (LoRA r=16 on all linear layers, Liger, bf16, batch 1), after
a few short profiling steps: does a sequence of `--tokens` fit, how fast, at what peak, and what did the plan do.

    python benchmarks/long_context_step.py --mode plan@auto --tokens 262144 --out $OUT

Modes: `plan@auto` (hf-offload with `memory_budget="auto"`, the model's own checkpointing off: the library plans per
layer, tiling MLPs where nothing else fits) and `ckpt+hfo` (non-reentrant checkpointing + hf-offload, no plan). The
first `--profile-steps` steps run at `--profile-tokens` (the planner profiles its first two and plans at the third);
then, for `plan@auto`, the library's own model predicts the longest sequence that fits (`--predict`, by bisection over
`search.choose_plan(profile.scaled(n), budget)`), and `--long-steps` steps run at `--tokens` (0: that prediction,
rounded down to a multiple of 8192). With `--profile-steps 0` the first step is already long (a cold start, as a user's
packed run starts): the library plans it before it from its probes, and nothing is predicted. Comparing its first long
step with a run's after `--profile-steps 3` is what a cold start costs (each long step records the pinned pool's growth
and the time it took, which both pay). Every measurement is written to `<out>/long_context_<mode>[-<tag>].json` as it
comes, so a run cut short by its time limit keeps what it measured. A step that runs out of memory is recorded with the
allocator's figures at the failure.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.model import apply_liger, apply_lora, build_model, make_optimizer  # noqa: E402
from harness.scenarios import Scenario  # noqa: E402

import hf_offload  # noqa: E402
from hf_offload.memory_budget.search import choose_plan  # noqa: E402

GIB = 2**30
ROUND = 8192


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def eight_b(layers: int, tokens: int) -> Scenario:
    """Llama-3-8B's shape (rope theta aside: it changes no cost)."""
    return Scenario(hidden=4096, intermediate=14336, layers=layers, heads=32, kv_heads=8, vocab=128256, seq=tokens,
                    batch=1, lora=True, liger=True, force_ckpt=False, steps=1, warmup=0)  # fmt: skip


def predict_longest(ctx: hf_offload.OffloadActivations, limit: int = 2**21) -> dict:
    """The longest multiple of `ROUND` tokens the library's planner finds a plan for, with that plan."""
    controller = ctx.budget_controller
    profile = controller.profile
    budget_bytes = controller.memory_budget.resolve(torch.cuda.get_device_properties(0).total_memory)
    margin = int(budget_bytes * 0.005)
    low, high, best = 1, limit // ROUND, None
    while low <= high:
        middle = (low + high) // 2
        try:
            found = choose_plan(profile.scaled(middle * ROUND), budget_bytes, margin)
            best, low = found, middle + 1
        except ValueError:
            high = middle - 1
    if best is None:
        return {"tokens": 0}
    return {"tokens": best.tokens, "code": best.code, "peak_gib": best.predicted.peak_bytes / GIB,
            "step_s": best.predicted.step_s, "host_gib": best.predicted.host_bytes / GIB,
            "budget_gib": budget_bytes / GIB, "table": best.format_table()}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["plan@auto", "ckpt+hfo"], default="plan@auto")
    parser.add_argument("--tokens", type=int, default=0, help="the long step's tokens; 0: the predicted longest")
    parser.add_argument("--profile-tokens", type=int, default=16384)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument(
        "--long-steps",
        type=int,
        default=1,
        help="steps at --tokens (the first may allocate the pinned pool; compare the later ones)",
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument(
        "--memory-budget",
        default="auto",
        help="plan@auto's memory_budget (a larger card held to a smaller one's budget: e.g. 75.22GiB, an H100's auto)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default=None, help="appended to the output file's name")
    parser.add_argument("--out", default="long_context_out")
    args = parser.parse_args()
    if not args.profile_steps and not args.tokens:
        parser.error("--profile-steps 0 (a cold start) needs --tokens: with no profiled steps nothing is predicted")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"mode": args.mode, "argv": sys.argv, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                    "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "memory_budget": args.memory_budget, "steps": []}  # fmt: skip
    tag = f"-{args.tag}" if args.tag else ""
    path = out / f"long_context_{args.mode.replace('@', '_').replace('+', '_')}{tag}.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=1))

    # hf-offload's INFO lines say what the probes measured (and how long they took) and which plan a step runs.
    library_log = logging.StreamHandler(sys.stdout)
    library_log.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
    logging.getLogger("hf_offload").addHandler(library_log)
    logging.getLogger("hf_offload").setLevel(logging.INFO)
    device = torch.device("cuda")
    notes: list[str] = []
    result["liger"] = apply_liger(device, notes, "llama")
    longest = max(args.tokens, args.profile_tokens, 2**20)
    model = apply_lora(build_model(eight_b(args.layers, longest), args.seed, device))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, result["optimizer"] = make_optimizer(params, notes)
    if args.mode == "plan@auto":
        ctx = hf_offload.get_act_offloading_ctx_manager(model, memory_budget=args.memory_budget)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ctx = hf_offload.get_act_offloading_ctx_manager(model)
    result["static_gib"] = torch.cuda.memory_allocated() / GIB
    result["notes"] = notes
    generator = torch.Generator().manual_seed(args.seed + 1)
    log(f"{args.mode}: model built, {result['static_gib']:.2f} GiB")
    save()

    def step(tokens: int) -> dict:
        ids = torch.randint(0, 128256, (1, tokens), generator=generator).to(device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        record: dict = {"tokens": tokens}
        start = time.perf_counter()
        try:
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        except torch.OutOfMemoryError as error:
            record.update(ok=False, error=str(error).splitlines()[0][:300],
                          allocated_gib=torch.cuda.memory_allocated() / GIB,
                          reserved_gib=torch.cuda.memory_reserved() / GIB)  # fmt: skip
            optimizer.zero_grad(set_to_none=True)
            return record
        seconds = time.perf_counter() - start
        stats = ctx.get_stats()
        record.update(ok=True, seconds=seconds, tokens_per_s=tokens / seconds, loss=loss.item(),
                      peak_gib=torch.cuda.max_memory_allocated() / GIB,
                      reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                      host_rss_gib=psutil.Process().memory_info().rss / GIB,
                      offloaded_gib=stats["bytes_offloaded"] / GIB, pool_grown_gib=stats["pool_grown_bytes"] / GIB,
                      pool_growth_s=stats["pool_growth_s"])  # fmt: skip
        if ctx.memory_plan is not None:
            record["plan"] = ctx.memory_plan.code
            record["predicted_peak_gib"] = ctx.memory_plan.predicted.peak_bytes / GIB
            record["predicted_step_s"] = ctx.memory_plan.predicted.step_s
        return record

    for _ in range(args.profile_steps):
        result["steps"].append(step(args.profile_tokens))
        log(f"step {result['steps'][-1]}")
        save()
    tokens = args.tokens
    controller = ctx.budget_controller
    if controller is not None and args.profile_steps:
        result["profile"] = {"tokens": controller.profile.tokens, "tile_tokens": controller.profile.tile_tokens,
                             "tile_chunk_gib": controller.profile.tile_chunk_bytes / GIB}  # fmt: skip
        result["predicted_longest"] = predict_longest(ctx)
        log(
            f"predicted longest: {result['predicted_longest'].get('tokens')} tokens, plan "
            f"{result['predicted_longest'].get('code')}"
        )
        save()
        tokens = tokens or result["predicted_longest"]["tokens"]
        if tokens:
            predicted = choose_plan(
                controller.profile.scaled(tokens),
                controller.memory_budget.resolve(torch.cuda.get_device_properties(0).total_memory),
            )
            result["predicted_at_tokens"] = {"tokens": tokens, "code": predicted.code,
                                             "peak_gib": predicted.predicted.peak_bytes / GIB,
                                             "step_s": predicted.predicted.step_s}  # fmt: skip
            save()
    result["long_steps"] = []
    for _ in range(args.long_steps if tokens else 0):
        log(f"long step: {tokens} tokens")
        result["long_steps"].append(step(tokens))
        log(f"long step: {result['long_steps'][-1]}")
        save()
        if not result["long_steps"][-1]["ok"]:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory and step time of a ~1.1B Llama (TinyLlama shape, random weights) with and without offloading.

Not a test: a report. Four configurations, measured in one process on one
model: no offload, offload (no checkpointing), checkpointing (non-reentrant), checkpointing + offload. Each:
AdamW, ``--warmup`` steps, then ``--steps`` timed steps; peak = torch.cuda.max_memory_allocated over the
timed steps (optimizer states included). Prints a table; writes $OUT/peak_1b.json when $OUT is set.

    python benchmarks/peak_1b.py [--layers 22] [--seq 4096] [--batch 2] [--steps 5] [--span fwd]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

# The model helpers are the GPU test suite's (tests/gpu/_gpu_models.py), so that this report trains the way the
# tests do. The folder is put on sys.path by hand: run_all.sh runs Python with PYTHONSAFEPATH=1.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_REPO, "tests", "gpu"))
from _gpu_models import enable_checkpointing, forward_backward  # noqa: E402

GiB = 1 << 30


def add_model_args(p: argparse.ArgumentParser, seq: int = 4096, batch: int = 2) -> None:
    """The model's shape (TinyLlama's by default) and the batch: shared with soak_1b.py."""
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": dry run of the script's logic


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--span",
        choices=["fwd", "fwd_bwd"],
        default="fwd",
        help="context around the forward only (Trainer.compute_loss) or forward+backward",
    )
    p.add_argument("--configs", default="none,offload,ckpt,ckpt+offload")
    p.add_argument("--options", default="{}", help="JSON dict of extra engine options")
    p.add_argument("--max-seconds", type=float, default=110.0, help="skip remaining configs past this")
    return p.parse_args(argv)


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 4096),
        attn_implementation="sdpa",
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(args.device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.train()
    return model


def set_ckpt(model, on: bool):
    enable_checkpointing(model, "nonreentrant" if on else "off")


def pinned_bandwidth(nbytes=1 * GiB, reps=5):
    """GB/s of pinned host->device and device->host copies (medians)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[name] = nbytes / statistics.median(times[1:]) / 1e9
    del host, dev
    return out


def _cuda(args) -> bool:
    return args.device != "cpu"


def _sync(args):
    if _cuda(args):
        torch.cuda.synchronize()


def run_config(model, batch, name, args, options):
    import hf_offload

    ckpt, offload = "ckpt" in name, "offload" in name
    set_ckpt(model, ckpt)
    ctx = hf_offload.get_act_offloading_ctx_manager(model, **options) if offload else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    row = {"config": name}
    try:
        times, stats = [], []
        for i in range(args.warmup + args.steps):
            if i == args.warmup and _cuda(args):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            _sync(args)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = forward_backward(model, batch, ctx, args.span)
            opt.step()
            _sync(args)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
                if ctx is not None:
                    stats.append(dict(ctx.get_stats()))
            del loss
        peak = torch.cuda.max_memory_allocated() if _cuda(args) else 0
        row.update(step_s=statistics.median(times), peak_GiB=peak / GiB, step_times_s=times)
        if stats:
            last = stats[-1]
            row.update(
                bytes_offloaded=last.get("bytes_offloaded"),
                tensors_offloaded=last.get("tensors_offloaded"),
                bytes_kept_tail=last.get("bytes_kept_tail"),
                pinned_bytes=last.get("pinned_bytes"),
                compute_wait_s=last.get("compute_wait_s"),
                prefetch_hits=last.get("prefetch_hits"),
                prefetch_misses=last.get("prefetch_misses"),
                stats=last,
            )
    except torch.OutOfMemoryError as e:
        row.update(error=f"OOM: {str(e).splitlines()[0]}")
    finally:
        if ctx is not None:
            ctx.remove_hooks()
        opt.zero_grad(set_to_none=True)
        del opt, ctx
        set_ckpt(model, False)
        gc.collect()
        if _cuda(args):
            torch.cuda.empty_cache()
    return row


def main(argv=None):
    args = parse_args(argv)
    if _cuda(args) and not torch.cuda.is_available():
        print("peak_1b: no CUDA device, nothing to measure")
        return 0
    import transformers

    import hf_offload

    t_start = time.perf_counter()
    options = json.loads(args.options)
    if not _cuda(args):
        options.setdefault("device_type", "cpu")
    bw = pinned_bandwidth() if _cuda(args) else {"h2d": float("nan"), "d2h": float("nan")}
    model = build(args)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
    batch = {"input_ids": ids, "labels": ids}
    header = {
        "device": torch.cuda.get_device_name(0) if _cuda(args) else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_offload": getattr(hf_offload, "__version__", "?"),
        "params": n_params,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "vocab": args.vocab,
        "seq": args.seq,
        "batch": args.batch,
        "span": args.span,
        "warmup": args.warmup,
        "steps": args.steps,
        "engine_options": options,
        "pinned_GBps": bw,
    }
    print(
        f"peak_1b: {n_params / 1e9:.2f}B params, seq {args.seq} x batch {args.batch}, bf16, AdamW, "
        f"{header['device']}; pinned copy h2d {bw['h2d']:.1f} GB/s, d2h {bw['d2h']:.1f} GB/s",
        flush=True,
    )
    rows = []
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        if time.perf_counter() - t_start > args.max_seconds:
            rows.append({"config": name, "error": f"skipped: past --max-seconds {args.max_seconds}"})
            continue
        row = run_config(model, batch, name, args, options)
        rows.append(row)
        print(
            f"  {name}: "
            + ", ".join(
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in row.items()
                if k not in ("config", "stats", "step_times_s")
            ),
            flush=True,
        )

    by = {r["config"]: r for r in rows}
    floor_bw = min(bw.values())
    for r in rows:
        if "step_s" not in r:
            continue
        for ref in ("none", "ckpt"):
            if ref in by and "step_s" in by[ref]:
                r[f"time_vs_{ref}"] = r["step_s"] / by[ref]["step_s"]
        if r.get("bytes_offloaded"):
            r["transfer_floor_s"] = r["bytes_offloaded"] / (floor_bw * 1e9)

    print()
    print(
        f"{'config':<14}{'peak GiB':>10}{'step s':>9}{'vs none':>9}{'vs ckpt':>9}{'offl GiB':>10}"
        f"{'floor s':>9}{'wait s':>8}{'pinned GiB':>11}"
    )
    for r in rows:
        if "step_s" not in r:
            print(f"{r['config']:<14}  {r.get('error')}")
            continue

        def f(key, scale=1.0, fmt="{:.2f}", r=r):
            v = r.get(key)
            return fmt.format(v / scale) if isinstance(v, (int, float)) else "-"

        print(
            f"{r['config']:<14}{f('peak_GiB'):>10}{f('step_s', fmt='{:.3f}'):>9}{f('time_vs_none'):>9}"
            f"{f('time_vs_ckpt'):>9}{f('bytes_offloaded', GiB):>10}{f('transfer_floor_s', fmt='{:.3f}'):>9}"
            f"{f('compute_wait_s', fmt='{:.3f}'):>8}{f('pinned_bytes', GiB):>11}"
        )
    total = time.perf_counter() - t_start
    print(f"peak_1b: done in {total:.0f} s")
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "peak_1b.json"), "w") as fh:
            json.dump({"header": header, "rows": rows, "wall_s": total}, fh, indent=1, default=str)
    return 0 if all("step_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

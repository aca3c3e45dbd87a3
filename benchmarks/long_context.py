#!/usr/bin/env python3
"""Long-context benchmark: the longest sequence that completes one training step in each mode, at what
tokens/s and peak memory, and which limit stops it (GPU memory, host RAM, time).

The model (--family): Llama-3-8B (``LlamaForCausalLM``: hidden 4096, intermediate 14336, 32 layers, 32/8 heads,
vocab 128256, rope theta 500000) or Qwen3-8B (``Qwen3ForCausalLM``, q/k RMSNorm: hidden 4096, intermediate 12288, 36
layers, 32/8 heads, vocab 151936, rope theta 1000000), random bf16 weights built from a config, LoRA r=16 on all
linear layers (peft), Liger (``apply_liger_kernel_to_llama`` or ``_qwen3``, ``fused_linear_cross_entropy=True``),
batch 1, labels = input_ids, AdamW on the adapters. ``--precision qlora`` quantizes the decoder's linear layers to
4-bit NF4 with bitsandbytes (bf16 compute), as ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_compute_dtype=torch.bfloat16)`` does.

Modes, each in a child process of its own (an out-of-memory step cannot poison the next mode):
  ckpt         non-reentrant activation checkpointing alone
  ckpt+hfo     checkpointing + hf_offload.get_act_offloading_ctx_manager(model)
  ckpt+trl     checkpointing + TRL's trl.models.activation_offloading.get_act_offloading_ctx_manager(model)
  ckpt+native  transformers' own offload flag (save_on_cpu(pin_memory=True) around each checkpointed layer)
  plan@auto    hf_offload with memory_budget="auto" and the model's own checkpointing off: the library plans per layer

Per mode: (1) profile: a warm-up step then a measured step at each --profile-tokens length (plan@auto first runs the
library's two profiling steps at the shortest); (2) predict the longest multiple of --round tokens that fits: peak
memory as a line in the tokens, pinned host memory (the engine's pool and its cap; TRL's and native's power-of-two
pinned blocks against the host's RAM), step time a + b*t + c*t^2 with c from a timed attention call; plan@auto with
the library's own planner; (3) with --confirm, one step at that length (skipped when its predicted time does not fit
in what is left of --max-seconds). Every measurement rewrites <out>/long_context-[<family>-]<precision>[-<tag>].json
and .md (the family named unless it is llama3-8b); the log (with timestamps) goes to stdout and the .log beside them.
Each step records the least host memory available while it ran (read every 0.5 s), as well as what is left after it.

  python benchmarks/long_context.py --confirm --out $OUT                      # bf16, all five modes
  python benchmarks/long_context.py --precision qlora --confirm --out $OUT    # 4-bit base, LoRA on top
  python benchmarks/long_context.py --family qwen3-8b --precision qlora --modes plan@auto --out $OUT  # Qwen3-8B
  python benchmarks/long_context.py --tiny --confirm --out /tmp/lc            # CPU smoke run, a tiny model
  python benchmarks/long_context.py --tiny --family qwen3-8b --confirm --out /tmp/lc  # the same, a tiny Qwen3

See benchmarks/README.md ("Long context").
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before torch is imported anywhere

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import weakref  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import GIB, child  # noqa: E402
from harness.longest import (  # noqa: E402
    LIMIT_GPU,
    LIMIT_POOL_CAP,
    LIMIT_SEARCH,
    LIMIT_TIME,
    MemoryModel,
    TimeModel,
    attention_seconds_per_token2,
    fit_line,
    fit_time,
    fmt_size,
    largest_multiple,
    pinning_seconds,
    pow2ceil,
    predict_longest,
    render_markdown,
    static_bytes_per_token,
)

MODES = ["ckpt", "ckpt+hfo", "ckpt+trl", "ckpt+native", "plan@auto"]
# --family: the real model's shape and rope theta, and the harness's model class for it (Scenario.family). Both have
# untied embeddings and head_dim = hidden / heads (128).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama3-8b": {"model": "Llama-3-8B", "family": "llama", "layer_kind": "Llama layers", "rope_theta": 500000.0,
                  "shape": {"hidden": 4096, "intermediate": 14336, "layers": 32, "heads": 32, "kv_heads": 8,
                            "vocab": 128256}},
    "qwen3-8b": {"model": "Qwen3-8B", "family": "qwen3", "layer_kind": "Qwen3 layers (q/k RMSNorm)",
                 "rope_theta": 1000000.0,
                 "shape": {"hidden": 4096, "intermediate": 12288, "layers": 36, "heads": 32, "kv_heads": 8,
                           "vocab": 151936}},
}  # fmt: skip
DEFAULT_FAMILY = "llama3-8b"
TINY = {"hidden": 64, "intermediate": 256, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 512}
# Defaults that differ between the GPU run and the CPU smoke run (--tiny).
DEFAULTS = {
    False: {"profile_tokens": "8192,16384", "round": 8192, "margin_gib": 2.0, "max_tokens": 2**20,
            "attn_probe_tokens": 65536, "host_margin_gib": 4.0, "mode_estimate_s": 75.0},
    # A pretend device of 16 MiB: the tiny model's ~7 KiB per token then runs out of it near 2,000 tokens.
    True: {"profile_tokens": "64,128", "round": 64, "margin_gib": 1 / 512, "max_tokens": 8192,
           "attn_probe_tokens": 512, "host_margin_gib": 0.0, "mode_estimate_s": 15.0, "device_gib": 1 / 64},
}  # fmt: skip
# A confirmation starts only if this multiple of its predicted time (plus a few seconds) fits in what is left: the
# predictions are extrapolations, and a step cut by the call's limit measures nothing.
CONFIRM_SAFETY = 1.15
CONFIRM_SLACK_S = 5.0
# plan@auto: the library profiles its first two training forwards and plans at the third.
LIBRARY_PROFILE_STEPS = 2
_LOG_FILE: Path | None = None  # the parent's .log; children print, and the parent copies their lines into it


def log(message: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {message}"
    print(line, flush=True)
    if _LOG_FILE is not None:
        with open(_LOG_FILE, "a") as f:
            f.write(line + "\n")


def save_results(path: Path, results: dict[str, Any]) -> None:
    """Rewrites the JSON (atomically: a run killed while writing keeps the previous one) and the markdown."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    os.replace(tmp, path)
    path.with_suffix(".md").write_text(render_markdown(results))


# ======================================================================================================= parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", choices=["bf16", "qlora"], default="bf16")
    ap.add_argument(
        "--family",
        choices=list(FAMILIES),
        default=DEFAULT_FAMILY,
        help="the model: its shape, rope theta, model class and Liger patch (--tiny keeps the tiny shape, of this "
        "family's class)",
    )
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    ap.add_argument(
        "--profile-tokens",
        default=None,
        help="comma list of the profiled lengths (8192,16384; tiny "
        "64,128); at least two, so that memory and time can be fitted",
    )
    ap.add_argument("--round", type=int, default=None, help="predicted lengths are multiples of this (8192; tiny 64)")
    ap.add_argument("--margin-gib", type=float, default=None, help="device memory kept out of the prediction (2)")
    ap.add_argument(
        "--device-gib",
        type=float,
        default=None,
        help="predict for this much device memory instead of "
        "the GPU's total (tiny: the pretend device's memory, 1/64 GiB)",
    )
    ap.add_argument(
        "--host-margin-gib",
        type=float,
        default=None,
        help="host RAM kept free when predicting TRL's and native's pinned blocks (4)",
    )
    ap.add_argument("--max-tokens", type=int, default=None, help="the longest length searched (2**20; tiny 8192)")
    ap.add_argument(
        "--max-step-seconds",
        type=float,
        default=500.0,
        help="a step predicted to take longer counts "
        "as limited by time (one step has to fit in a 10-minute call with the profiling before it)",
    )
    ap.add_argument(
        "--attn-probe-tokens",
        type=int,
        default=None,
        help="length of the timed attention call that gives the time's quadratic term (65536; tiny 512)",
    )
    ap.add_argument("--confirm", action="store_true", help="run one step at the predicted longest length")
    ap.add_argument("--confirm-tokens", type=int, default=0, help="confirm at this length instead (implies --confirm)")
    ap.add_argument("--max-seconds", type=float, default=540.0, help="the whole invocation's time budget")
    ap.add_argument(
        "--qlora-prepare",
        choices=["none", "peft"],
        default="none",
        help="qlora: 'peft' also calls peft.prepare_model_for_kbit_training (casts the norms, embeddings "
        "and head to fp32); 'none' keeps them bf16, as TRL's SFTTrainer does",
    )
    ap.add_argument(
        "--max-pinned-fraction",
        type=float,
        default=None,
        help="hf-offload's max_pinned_memory_fraction for ckpt+hfo and plan@auto (the library's default "
        "when not given): the share of available host RAM its pinned pool may take",
    )
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (the family's: 32, qwen3-8b 36; tiny 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny model, hf-offload in its CPU test mode")
    ap.add_argument("--tag", default=None, help="appended to the output files' names")
    ap.add_argument("--out", default="long_context_out")
    return ap.parse_args(argv)


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    defaults = DEFAULTS[args.tiny]

    def pick(name: str) -> Any:
        value = getattr(args, name, None)
        return defaults.get(name) if value is None else value

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise SystemExit(f"--modes: unknown {unknown or 'none given'}; known: {', '.join(MODES)}")
    profile_tokens = sorted({int(t) for t in str(pick("profile_tokens")).split(",") if t.strip()})
    if len(profile_tokens) < 2:
        raise SystemExit("--profile-tokens needs at least two lengths: peak and time are fitted through them")
    family = FAMILIES[args.family]
    shape = dict(TINY if args.tiny else family["shape"])
    if args.layers is not None:
        shape["layers"] = args.layers
    precision_detail = ("bf16 weights" if args.precision == "bf16" else
                        "decoder linears 4-bit NF4 (bitsandbytes, bf16 compute, no double quantization), embeddings, "
                        "norms and head bf16" + (", then peft.prepare_model_for_kbit_training (fp32 norms, embeddings"
                                                 " and head)" if args.qlora_prepare == "peft" else ""))  # fmt: skip
    return {
        "tiny": args.tiny, "precision": args.precision, "qlora_prepare": args.qlora_prepare, "modes": modes,
        "profile_tokens": profile_tokens, "round": pick("round"), "margin_gib": pick("margin_gib"),
        "device_gib": pick("device_gib"), "host_margin_gib": pick("host_margin_gib"),
        "max_tokens": pick("max_tokens"), "max_step_seconds": args.max_step_seconds,
        "attn_probe_tokens": pick("attn_probe_tokens"), "confirm": args.confirm or bool(args.confirm_tokens),
        "confirm_tokens": args.confirm_tokens, "max_seconds": args.max_seconds, "seed": args.seed,
        "max_pinned_fraction": args.max_pinned_fraction,
        "family": args.family, "model_family": family["family"],
        "shape_dims": shape, "rope_parameters": {"rope_type": "default", "rope_theta": family["rope_theta"]},
        "shape": (f"{'tiny' if args.tiny else family['model']}: {family['layer_kind']}, hidden {shape['hidden']}, "
                  f"intermediate {shape['intermediate']}, {shape['layers']} layers, "
                  f"{shape['heads']}/{shape['kv_heads']} heads, vocab {shape['vocab']}, "
                  f"rope theta {family['rope_theta']:.0f}, LoRA r=16 all-linear, "
                  f"{'no Liger (CPU)' if args.tiny else 'Liger (fused linear cross-entropy)'}, batch 1, "
                  "AdamW on the adapters, sdpa"),
        "precision_detail": precision_detail, "mode_estimate_s": defaults["mode_estimate_s"],
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    global _LOG_FILE
    started = time.time()
    args = parse_args(argv)
    settings = resolve_settings(args)
    if settings["precision"] == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        print(
            "--precision qlora needs bitsandbytes, which is not installed here (pip install bitsandbytes; on the "
            "GPU machine it comes from the carried wheel in .whl/)",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out).resolve()  # the children run in the repository's root
    out.mkdir(parents=True, exist_ok=True)
    family = "" if args.family == DEFAULT_FAMILY else f"{args.family}-"  # the Llama runs' names as they were
    stem = f"long_context-{family}{settings['precision']}" + (f"-{args.tag}" if args.tag else "")
    path = out / f"{stem}.json"
    _LOG_FILE = out / f"{stem}.log"
    _LOG_FILE.write_text("")
    modes = settings["modes"]
    results: dict[str, Any] = {
        "benchmark": "long_context", "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "settings": settings, "order": modes, "modes": {m: {"mode": m, "status": "pending"} for m in modes},
        "finished": False,
    }  # fmt: skip
    save_results(path, results)
    log(
        f"long context, {settings['family']}, {settings['precision']}: modes {', '.join(modes)}; profile at "
        f"{settings['profile_tokens']}; confirm {'on' if settings['confirm'] else 'off'}; budget "
        f"{settings['max_seconds']:.0f} s; writing {path}"
    )
    deadline = started + settings["max_seconds"]
    estimate = settings["mode_estimate_s"]
    for index, mode in enumerate(modes):
        record = results["modes"][mode]
        left = deadline - time.time()
        reason = _skip_without_child(settings, mode)
        if reason is None and left < min(estimate, 20.0):
            reason = f"time budget spent ({left:.0f} s left of --max-seconds)"
        if reason is not None:
            record.update(status="skipped", notes=[reason])
            log(f"{mode}: skipped: {reason}")
            save_results(path, results)
            continue
        spec = {
            "mode": mode,
            "results_path": str(path),
            "deadline": deadline,
            "settings": settings,
            "reserve_s": estimate * sum(1 for m in modes[index + 1 :] if _skip_without_child(settings, m) is None),
        }
        log(f"{mode}: starting its process ({left:.0f} s left; {spec['reserve_s']:.0f} s kept for the modes after it)")
        rc, timed_out = run_child(spec, _LOG_FILE, timeout=left)
        results = json.loads(path.read_text())
        record = results["modes"][mode]
        if timed_out:
            record.update(status="timeout", error=f"killed at --max-seconds during {record.get('phase', 'setup')}")
        elif record.get("status") in ("pending", "running"):
            hint = " (killed: host out of memory?)" if rc in (-9, 137) else ""
            record.update(status="crashed", error=f"exit {rc}{hint} during {record.get('phase', 'setup')}")
        if record.get("profile_wall_s"):
            estimate = max(estimate if index else 0.0, record["profile_wall_s"] + 5.0)
        log(f"{mode}: {record.get('status')}" + (f" ({record['error']})" if record.get("error") else ""))
        save_results(path, results)
        if record.get("fatal"):
            for later in modes[index + 1 :]:
                results["modes"][later].update(status="skipped", notes=[f"not run: {record.get('error')}"])
            save_results(path, results)
            break
    results["finished"] = True
    results["elapsed_s"] = time.time() - started
    save_results(path, results)
    print()
    print(path.with_suffix(".md").read_text(), flush=True)
    log(f"wrote {path} and {path.with_suffix('.md')} ({results['elapsed_s']:.0f} s)")
    return 0


def _skip_without_child(settings: dict[str, Any], mode: str) -> str | None:
    """Why a mode cannot run here at all, known without starting its process."""
    if settings["tiny"] and mode in ("ckpt+trl", "ckpt+native"):
        return ("needs an accelerator: TRL's offloader asks torch.accelerator for its device type" if mode == "ckpt+trl"
                else "needs an accelerator: save_on_cpu(pin_memory=True) pins host memory")  # fmt: skip
    return None


def run_child(spec: dict[str, Any], log_path: Path, timeout: float) -> tuple[int | None, bool]:
    """Runs one mode in ``python long_context.py --_child SPEC``; its output goes to stdout and the log as it comes.
    Returns its exit code and whether it was killed at ``timeout``."""
    return child.run_child(Path(__file__).resolve(), ["--_child", json.dumps(spec)], log_path, timeout)


# ======================================================================================================= child


class FatalSetup(Exception):
    """Every mode would fail the same way (e.g. bitsandbytes cannot be imported): the parent stops."""


def child_main(spec: dict[str, Any]) -> int:
    import torch
    from harness.offloaders import SkipMode

    path = Path(spec["results_path"])
    results = json.loads(path.read_text())
    mode = spec["mode"]
    record = results["modes"][mode]
    record.update(status="running", phase="setup", pid=os.getpid(), notes=[], steps=[])

    def save() -> None:
        save_results(path, results)

    save()
    # The library's plan tables, each time it plans: a step that fails a quarter of an hour in says which plan it ran.
    logging.basicConfig(format="%(message)s")
    logging.getLogger("hf_offload").setLevel(logging.INFO)
    started = time.time()
    try:
        ModeRun(spec, results, record, save).run()
        record["status"] = "ok"
    except SkipMode as e:
        record["status"] = "skipped"
        record["notes"].append(str(e))
    except FatalSetup as e:
        record.update(status="error", error=str(e), fatal=True)
    except torch.cuda.OutOfMemoryError as e:  # outside a step: building the model, the attention probe
        record.update(status="OOM", error=str(e).splitlines()[0][:300])
        traceback.print_exc()
    except Exception as e:
        record.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc()
    record["phase"] = "done"
    record["wall_s"] = time.time() - started
    save()
    return 0


class SizeCounter:
    """A byte counter for TRL's and native's pack hooks (``harness.offloaders.ByteCounter``'s interface) that also
    keeps each offloaded tensor's size: PyTorch pins each one in a power-of-two block, so the sizes, not their sum,
    give the host memory they take."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.bytes = 0
        self.tensors = 0
        self.sizes: list[int] = []

    def add(self, n: int) -> None:
        self.bytes += int(n)
        self.tensors += 1
        self.sizes.append(int(n))


def _live_bytes_mode() -> Any:
    """A TorchDispatchMode that measures the peak of the CPU tensors allocated while it is entered (the CPU run has no
    allocator counters): each op's outputs that share no input's storage count until their storage is collected."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live = 0
            self.peak = 0
            self._seen: weakref.WeakSet = weakref.WeakSet()

        def _freed(self, nbytes: int) -> None:
            self.live -= nbytes

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.device.type == "cpu"}  # fmt: skip
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                    continue
                storage = t.untyped_storage()
                nbytes = storage.nbytes()
                if nbytes and storage.data_ptr() not in inputs and storage not in self._seen:
                    self._seen.add(storage)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, nbytes)
            return out

    return LiveBytes()


def quantize_decoder_nf4(model: Any) -> dict[str, Any]:
    """Replaces the decoder's ``nn.Linear`` modules (not the head) with bitsandbytes' ``Linear4bit`` and quantizes
    their weights to NF4 where they are, as loading with ``BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)`` does: transformers'
    ``replace_with_bnb_linear`` makes the modules (on the meta device), and each gets
    ``Params4bit(weight, **its_meta_param.__dict__).to(device)``, transformers' own quantizing step, from the bf16
    weights the model was built with (so qlora starts from the same random weights as bf16). Marks the model
    ``is_loaded_in_4bit``, which peft reads to wrap these layers with its 4-bit LoRA layer."""
    import torch
    from torch import nn

    try:
        import bitsandbytes as bnb
    except Exception as e:
        raise FatalSetup(f"--precision qlora needs bitsandbytes, and importing it failed: {type(e).__name__}: "
                         f"{str(e)[:300]}") from e  # fmt: skip
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    originals = {name: module for name, module in model.named_modules()
                 if type(module) is nn.Linear and name.split(".")[-1] != "lm_head"}  # fmt: skip
    replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"], quantization_config=config)
    for name in list(originals):
        old = originals.pop(name)  # dropped as we go: the bf16 weights are freed one matrix at a time
        new = model.get_submodule(name)
        if not isinstance(new, bnb.nn.Linear4bit):
            raise RuntimeError(f"replace_with_bnb_linear left {name} a {type(new).__name__}")
        new.weight = bnb.nn.Params4bit(old.weight.data, requires_grad=False, **new.weight.__dict__).to(
            old.weight.device
        )
        if old.bias is not None:
            new.bias = nn.Parameter(old.bias.data, requires_grad=False)
        del old
    model.is_loaded_in_4bit = True
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"linears": sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()), "quant_type": "nf4",
            "compute_dtype": "bfloat16", "double_quant": config.bnb_4bit_use_double_quant,
            "quant_storage": str(config.bnb_4bit_quant_storage), "bitsandbytes": bnb.__version__,
            "how": "transformers.integrations.bitsandbytes.replace_with_bnb_linear(modules_to_not_convert=['lm_head'])"
                   " + Params4bit(weight, **meta_param.__dict__).to(device), from the bf16 weights built on the "
                   "device"}  # fmt: skip


def _innermost_frames(error: BaseException, frames: int = 40) -> list[str]:
    """Where `error` was raised: its traceback's innermost `frames` frames as 'file:line function', outermost first. A
    step that runs out of memory 15 minutes in cannot be run again to find out where."""
    return [f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
            for frame in traceback.extract_tb(error.__traceback__)[-frames:]]  # fmt: skip


def _raised_by_planner(error: BaseException) -> bool:
    """Whether the error is hf_offload's planner refusing the budget (a budget no plan fits: the library's clear
    error, raised before anything runs out of memory)."""
    from hf_offload import InfeasibleBudgetError

    return isinstance(error, InfeasibleBudgetError)


def _pool_cap(ctx: Any) -> int | None:
    """The hf-offload engine's pinned-pool cap (``hf_offload.host_memory``): the pool's own once it exists (the cap
    reads the host's available memory when the pool is created), else what it would be now."""
    pool = getattr(ctx, "_pool", None)
    if pool is not None:
        return int(pool.cap_bytes)
    try:
        from hf_offload.host_memory import host_memory_cap

        return int(host_memory_cap(ctx.options.max_pinned_memory_fraction, ctx.options.max_pinned_bytes))
    except Exception:
        return None


class ModeRun:
    """One mode in its child process: build, profile, probe the attention, predict, confirm."""

    def __init__(self, spec: dict[str, Any], results: dict[str, Any], record: dict[str, Any], save: Any) -> None:
        import torch

        self.torch = torch
        self.spec, self.results, self.record, self.save = spec, results, record, save
        self.settings = spec["settings"]
        self.mode = spec["mode"]
        self.started = time.time()
        self.cuda = not self.settings["tiny"]
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.memory: MemoryModel | None = None
        self.time_model: TimeModel | None = None

    # ------------------------------------------------------------------ setup

    def run(self) -> None:
        from harness.measure import StepPeaks

        with StepPeaks(self.device) if self.cuda else contextlib.nullcontext() as peaks:
            self.peaks = peaks
            self.setup()
            self.profile()
            self.probe_attention()
            self.predict()
            self.record["profile_wall_s"] = time.time() - self.started
            self.save()
            if self.settings["confirm"]:
                self.confirm()

    def setup(self) -> None:
        torch = self.torch
        from harness.model import apply_liger, apply_lora, build_model, make_optimizer
        from harness.modes import parse_mode
        from harness.offloaders import Offload, SkipMode, enable_checkpointing, load_offloader, start_offload
        from harness.scenarios import Scenario

        s, record = self.settings, self.record
        notes = record["notes"]
        setup: dict[str, Any] = {}
        record["setup"] = setup
        if self.cuda:
            if not torch.cuda.is_available():
                raise FatalSetup("no CUDA device: run on the GPU machine, or use --tiny for the CPU smoke run")
            torch.cuda.set_device(0)
        else:
            torch.set_num_threads(1)  # tiny models compute fastest on one thread
        self._record_environment()
        self.device_total = self.results["environment"]["device_total_bytes"]
        self.gpu_limit = self.results["environment"]["gpu_limit_bytes"]
        mode = parse_mode(self.mode)
        self.parsed = mode
        factory = load_offloader(mode.offloader, self.device)
        shape = s["shape_dims"]
        self.shape = shape
        started = time.perf_counter()
        liger = (not s["tiny"]) and apply_liger(self.device, notes, s["model_family"])
        setup["liger"] = liger
        scenario = Scenario(hidden=shape["hidden"], intermediate=shape["intermediate"], layers=shape["layers"],
                            heads=shape["heads"], kv_heads=shape["kv_heads"], vocab=shape["vocab"],
                            seq=max(s["max_tokens"], s["confirm_tokens"]), batch=1, lora=True, liger=liger,
                            force_ckpt=False, steps=1, warmup=1, family=s["model_family"])  # fmt: skip
        model = build_model(scenario, s["seed"], self.device, rope_parameters=dict(s["rope_parameters"]))
        setup["model_class"] = type(model).__name__
        if s["precision"] == "qlora":
            setup["quantization"] = quantize_decoder_nf4(model)
            if s["qlora_prepare"] == "peft":
                from peft import prepare_model_for_kbit_training

                prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # the mode decides that
        if mode.checkpointing:
            setup["ckpt_call"] = enable_checkpointing(model, offload=(mode.offloader == "native"))
        model = apply_lora(model)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        setup["trainable_params"] = sum(p.numel() for p in params)
        setup["adapter_dtype"] = str(params[0].dtype) if params else None
        if s["precision"] == "qlora":  # peft wraps a 4-bit base layer in its own 4-bit LoRA layer (lora.bnb)
            setup["lora_4bit_layers"] = sum(type(m).__module__.endswith("lora.bnb") for m in model.modules())
        self.optimizer, setup["optimizer"] = make_optimizer(params, notes)
        hfo_options: dict[str, Any] = {"device_type": "cpu"} if s["tiny"] else {}
        if s["max_pinned_fraction"] is not None:
            hfo_options["max_pinned_memory_fraction"] = s["max_pinned_fraction"]
        if mode.planned:
            # On CPU there is no device memory for "auto" to take a share of: the budget is what --margin-gib leaves
            # of the pretend device. With --device-gib on a GPU, "auto" is resolved for that size, not the device's.
            from hf_offload.memory_budget.spec import parse_memory_budget

            hfo_options["memory_budget"] = (self.gpu_limit if s["tiny"] else "auto" if not s["device_gib"] else
                                            parse_memory_budget("auto").resolve(self.device_total))  # fmt: skip
        setup["hfo_options"] = hfo_options if mode.offloader == "hfo" else None
        if mode.offloader in ("trl", "native"):
            self.counter: SizeCounter | None = SizeCounter()
            self.offload = self._counted_offload(mode.offloader, factory, model)
            if self.offload.counter is None:
                notes.append("the offloader's pack hook could not be wrapped: host bytes are not predicted")
                self.counter = None
        else:
            self.counter = None
            self.offload = start_offload(mode.offloader, factory, model, hfo_options)
        assert isinstance(self.offload, Offload)
        if mode.planned and self.offload.context.budget_controller is None:
            raise SkipMode("no memory budget: hf_offload is inactive on this device")
        self.model = model
        setup["build_s"] = time.perf_counter() - started
        setup["static_bytes"] = torch.cuda.memory_allocated() if self.cuda else self._held_bytes()
        setup["attn_implementation"] = model.config._attn_implementation
        self.generator = torch.Generator().manual_seed(s["seed"] + 1)
        log(f"{self.mode}: built {setup['model_class']} in {setup['build_s']:.1f} s, static "
            f"{fmt_size(setup['static_bytes'])}, {setup['trainable_params']:,} trainable parameters"
            + (f"; {setup.get('ckpt_call')}" if setup.get("ckpt_call") else ""))  # fmt: skip
        self.save()

    def _counted_offload(self, offloader: str, factory: Any, model: Any) -> Any:
        """TRL's or native's offload context with this run's size-keeping counter in its pack hook (the harness's
        ``start_offload`` with a ``SizeCounter`` in place of its ``ByteCounter``)."""
        from harness.offloaders import Offload, _count_native_offload, _count_trl_offload

        if offloader == "native":
            return Offload(offloader, None, self.counter if _count_native_offload(self.counter) else None)
        ctx = factory(model, use_streams=True)
        return Offload(offloader, ctx, self.counter if _count_trl_offload(ctx, self.counter) else None)

    def _record_environment(self) -> None:
        torch = self.torch
        import psutil
        from harness.environment import versions

        env = self.results.setdefault("environment", {})
        if env.get("device_total_bytes"):
            return
        env["versions"] = versions()
        if self.cuda:
            props = torch.cuda.get_device_properties(0)
            env.update(
                device_name=props.name,
                device_total_bytes=int(props.total_memory),
                device_real_total_bytes=int(props.total_memory),
            )
        else:
            env.update(
                device_name="cpu (pretend device of --device-gib)",
                device_total_bytes=int(self.settings["device_gib"] * GIB),
            )
        if self.settings["device_gib"]:  # predictions for another size than the device's
            env["device_total_bytes"] = int(self.settings["device_gib"] * GIB)
        env["gpu_limit_bytes"] = int(env["device_total_bytes"] - self.settings["margin_gib"] * GIB)
        memory = psutil.virtual_memory()
        env.update(host_total_bytes=int(memory.total), host_available_bytes_at_start=int(memory.available))
        self.save()

    def _held_bytes(self) -> int:
        """CPU run: bytes held between steps (parameters, gradients, optimizer state), by distinct storage."""
        torch = self.torch
        storages: dict[int, int] = {}
        tensors = [p for p in self.model.parameters()] + [p.grad for p in self.model.parameters() if p.grad is not None]
        tensors += [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    # ------------------------------------------------------------------ steps

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def _train_step(self, ids: Any) -> float:
        ctx = self.offload.context
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = self.model(input_ids=ids, labels=ids).loss
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach().float().item())

    def step(self, tokens: int, phase: str) -> dict[str, Any]:
        """One training step of ``tokens`` tokens, timed (synchronised) and measured; an out-of-memory step is
        recorded with the allocator's figures at the failure."""
        torch = self.torch
        from harness.measure import HostAvailableMin

        rec: dict[str, Any] = {"phase": phase, "tokens": tokens,
                               "started": datetime.datetime.now().isoformat(timespec="seconds")}  # fmt: skip
        self.record["steps"].append(rec)
        self.record["phase"] = f"{phase} step at {tokens} tokens"
        self.save()
        log(f"{self.mode}: {phase} step, {tokens:,} tokens")
        ids = torch.randint(0, self.shape["vocab"], (1, tokens), generator=self.generator).to(self.device)
        if self.counter is not None:
            self.counter.reset()
        tracker = None if self.cuda else _live_bytes_mode()
        static = 0 if self.cuda else self._held_bytes()
        self._sync()
        if self.cuda:
            self.peaks.start_step()
        start = time.perf_counter()
        failed = None
        try:
            with HostAvailableMin() as host:  # the host's reserve must hold during the step, not only after
                with tracker if tracker is not None else contextlib.nullcontext():
                    loss = self._train_step(ids)
                self._sync()
        except (torch.cuda.OutOfMemoryError, ValueError) as e:
            if isinstance(e, ValueError) and not _raised_by_planner(e):
                raise
            failed = e
            rec.update(ok=False, error_kind="OOM" if isinstance(e, torch.cuda.OutOfMemoryError) else "no plan",
                       error=str(e).splitlines()[0][:600], where=_innermost_frames(e), s=time.perf_counter() - start,
                       allocated_bytes=torch.cuda.memory_allocated() if self.cuda else None,
                       reserved_bytes=torch.cuda.memory_reserved() if self.cuda else None)  # fmt: skip
        rec["host_available_min_bytes"] = host.min_bytes
        if failed is not None:
            del failed
            with contextlib.suppress(Exception):  # the plan the failed step ran: the one in force at the failure
                self._record_offload(rec)
            self.optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
            log(
                f"{self.mode}: {phase} step at {tokens:,} tokens: {rec['error_kind']} ({rec['error'][:160]}); "
                f"allocated {(rec['allocated_bytes'] or 0) / GIB:.2f} GiB, reserved "
                f"{(rec['reserved_bytes'] or 0) / GIB:.2f} GiB; raised in {' < '.join(rec['where'][::-1][:4])}"
            )
            self.save()
            return rec
        seconds = time.perf_counter() - start
        rec.update(ok=True, s=seconds, tokens_per_s=tokens / seconds, loss=loss)
        if self.cuda:
            rec["peak_bytes"], rec["reserved_peak_bytes"] = self.peaks.step_peak()
            rec["reserved_bytes"] = torch.cuda.memory_reserved()
            with contextlib.suppress(Exception):
                rec["host_pinned_allocator_bytes"] = torch.cuda.host_memory_stats().get("allocated_bytes.current")
        else:
            rec["peak_bytes"] = static + tracker.peak
        with contextlib.suppress(Exception):
            import psutil

            rec["rss_bytes"] = psutil.Process().memory_info().rss
            rec["host_available_bytes"] = psutil.virtual_memory().available
        self._record_offload(rec)
        log(f"{self.mode}: {phase} step, {tokens:,} tokens: {seconds:.2f} s ({rec['tokens_per_s']:,.0f} tokens/s), "
            f"peak {fmt_size(rec['peak_bytes'])}" + (f", reserved {fmt_size(rec['reserved_peak_bytes'])}"
                                                     if self.cuda else "")
            + (f", host available at least {fmt_size(host.min_bytes)}" if host.min_bytes is not None else "")
            + (f", offloaded {fmt_size(rec['bytes_offloaded'])}" if "bytes_offloaded" in rec else "")
            + (f", pinned {fmt_size(rec['pinned_bytes'])}" if rec.get("pinned_bytes") else "")
            + (f", plan {rec['plan']}" if rec.get("plan") else ""))  # fmt: skip
        self.save()
        return rec

    def _record_offload(self, rec: dict[str, Any]) -> None:
        if self.parsed.offloader == "hfo":
            stats = self.offload.context.get_stats()
            rec.update(
                bytes_offloaded=int(stats.get("bytes_offloaded", 0)),
                tensors_offloaded=int(stats.get("tensors_offloaded", 0)),
                pinned_bytes=int(stats.get("pinned_bytes", 0)),
                compute_wait_s=stats.get("compute_wait_s"),
            )
            controller = self.offload.context.budget_controller
            if controller is not None and controller.plan is not None:
                plan = controller.plan
                rec.update(plan=plan.code, plan_tokens=plan.tokens, plan_predicted_peak_bytes=plan.predicted.peak_bytes,
                           plan_predicted_step_s=plan.predicted.step_s,
                           plan_static_bytes=controller.profile.static_bytes)  # fmt: skip
        elif self.counter is not None:
            sizes = self.counter.sizes
            rec.update(
                bytes_offloaded=self.counter.bytes,
                tensors_offloaded=self.counter.tensors,
                offloaded_sizes=list(sizes),
                pinned_pow2_bytes=sum(pow2ceil(n) for n in sizes),
            )

    def profile(self) -> None:
        """A warm-up and a measured step at each profiled length; plan@auto first runs the library's two profiling
        steps at the shortest. An out-of-memory step ends the profiling."""
        lengths = self.settings["profile_tokens"]
        if self.parsed.planned:
            for _ in range(LIBRARY_PROFILE_STEPS):
                if not self.step(lengths[0], "library-profile")["ok"]:
                    return
        for tokens in lengths:
            if not self.step(tokens, "warmup")["ok"] or not self.step(tokens, "profile")["ok"]:
                return

    def probe_attention(self) -> None:
        """Times one causal attention call (sdpa, the model's heads, bf16) forward and backward at
        --attn-probe-tokens: the step time's quadratic term is attention's, and this measures it."""
        torch = self.torch
        import torch.nn.functional as F

        tokens = self.settings["attn_probe_tokens"]
        config = self.model.config  # the built model's heads: its family may size them otherwise than hidden / heads
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.record["phase"] = "attention probe"
        probe: dict[str, Any] = {"tokens": tokens}
        self.record["attention_probe"] = probe
        try:
            q = torch.randn(1, heads, tokens, head_dim, device=self.device, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, kv_heads, tokens, head_dim, device=self.device, dtype=torch.bfloat16,
                            requires_grad=True)  # fmt: skip
            v = torch.randn_like(k, requires_grad=True)
            grad = torch.randn_like(q)

            def forward() -> Any:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            def forward_backward() -> None:
                forward().backward(grad)
                q.grad = k.grad = v.grad = None

            probe["forward_s"] = self._median_seconds(forward)
            probe["backward_s"] = max(0.0, self._median_seconds(forward_backward) - probe["forward_s"])
            log(
                f"{self.mode}: attention probe at {tokens:,} tokens: forward {probe['forward_s'] * 1000:.1f} ms, "
                f"backward {probe['backward_s'] * 1000:.1f} ms per layer"
            )
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
            probe["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            log(f"{self.mode}: attention probe failed ({probe['error']}); the time fit goes without it")
        finally:
            q = k = v = grad = None
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
        self.save()

    def _median_seconds(self, fn: Any, reps: int = 3) -> float:
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            self._sync()
            start = time.perf_counter()
            fn()
            self._sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    # ------------------------------------------------------------------ prediction

    def _profiled(self) -> list[dict[str, Any]]:
        return [s for s in self.record["steps"] if s["phase"] == "profile" and s.get("ok")]

    def _attention_c(self, forwards_per_layer: int) -> float | None:
        probe = self.record.get("attention_probe") or {}
        if "forward_s" not in probe:
            return None
        return attention_seconds_per_token2(self.shape["layers"], forwards_per_layer, probe["forward_s"],
                                            probe["backward_s"], probe["tokens"])  # fmt: skip

    def predict(self) -> None:
        self.record["phase"] = "prediction"
        profiled = self._profiled()
        tokens = [s["tokens"] for s in profiled]
        if len(set(tokens)) < 2:
            self.record["prediction"] = {"skipped": f"needs two profiled lengths, measured {sorted(set(tokens))}"}
            log(f"{self.mode}: no prediction: {self.record['prediction']['skipped']}")
            self.save()
            return
        # Every mode here checkpoints every layer (plan@auto does at long context), so attention runs forward twice.
        self.time_model = fit_time(tokens, [s["s"] for s in profiled], self._attention_c(2))
        if self.parsed.planned:
            prediction = self._predict_with_planner(profiled)
        else:
            prediction = self._predict_from_fits(profiled)
        self.record["prediction"] = prediction
        log(f"{self.mode}: predicted longest {prediction.get('longest_tokens', 0):,} tokens (limit: "
            f"{prediction.get('limit')}); peak {fmt_size(prediction.get('predicted_peak_bytes', 0))}, "
            f"{prediction.get('predicted_step_s', 0):.1f} s/step" +
            (f", plan {prediction['plan_code']}" if prediction.get("plan_code") else ""))  # fmt: skip
        self.save()

    def _predict_from_fits(self, profiled: list[dict[str, Any]]) -> dict[str, Any]:
        s = self.settings
        tokens = [p["tokens"] for p in profiled]
        peak0, peak1 = fit_line(tokens, [p["peak_bytes"] for p in profiled])
        how = [f"Peak: least-squares line through the profiled peaks, {fmt_size(peak0)} + {peak1 / 1024:.1f} "
               "KiB/token."]  # fmt: skip
        fields: dict[str, Any] = {"peak0": peak0, "peak1": peak1}
        if self.parsed.offloader == "hfo":
            offload0, offload1 = fit_line(tokens, [p["bytes_offloaded"] for p in profiled])
            cap = _pool_cap(self.offload.context)
            fields.update(offload0=offload0, offload1=offload1, pool_cap_bytes=cap)
            how.append(f"Plus the offloaded bytes ({offload1 / 1024:.1f} KiB/token, a line) past the pinned pool's cap "
                       f"of {(cap or 0) / GIB:.1f} GiB, which the engine keeps on the GPU.")  # fmt: skip
        elif self.counter is not None:
            last = profiled[-1]
            import psutil

            room = int(psutil.virtual_memory().available - s["host_margin_gib"] * GIB)
            fields.update(sizes=tuple(last["offloaded_sizes"]), sizes_tokens=last["tokens"], host_room_bytes=room)
            how.append(
                f"Host: each of the {len(last['offloaded_sizes'])} tensors offloaded per step, grown with the "
                "tokens and rounded up to a power of two (PyTorch's pinned allocator), against the host RAM "
                f"available after profiling less {s['host_margin_gib']:g} GiB ({room / GIB:.1f} GiB)."
            )
        self.memory = MemoryModel(**fields)
        prediction = predict_longest(self.memory, self.time_model, self.gpu_limit, s["round"], s["max_tokens"],
                                     s["max_step_seconds"])  # fmt: skip
        how.append(
            f"Time: {self.time_model.how}; a = {self.time_model.a:.3f} s, b = {self.time_model.b * 1e6:.2f} "
            f"us/token, c = {self.time_model.c * 1e12:.4f} ps/token^2."
        )
        prediction.update(how=how, peak_fit={"intercept_bytes": peak0, "bytes_per_token": peak1},
                          time_model=self.time_model.as_dict(), gpu_limit_bytes=self.gpu_limit,
                          memory_model={k: v for k, v in fields.items() if k != "sizes"})  # fmt: skip
        return prediction

    def _predict_with_planner(self, profiled: list[dict[str, Any]]) -> dict[str, Any]:
        """plan@auto: bisection over the lengths the library's planner finds a plan for, from the profile its plan in
        force was made from, against the budget it plans for, with the planner's own step time."""
        from hf_offload.memory_budget.host import choose_plan_with_host
        from hf_offload.memory_budget.search import choose_plan, prediction_margin_bytes

        s = self.settings
        controller = self.offload.context.budget_controller
        profile = controller.profile
        if profile is None:
            return {"skipped": "the library made no plan during the profiled steps"}
        budget_bytes = controller.memory_budget.resolve(self.device_total)
        margin = prediction_margin_bytes(budget_bytes)  # the planner's own
        # As the controller plans: the pinned pool may grow past its cap, down to the host's reserve, where that is what
        # fits the step (without it, the QLoRA prediction stopped at 425,984 tokens, the default cap's limit).
        caps = self.offload.context.host_caps()
        attempts: dict[int, Any] = {}

        static_per_token = static_bytes_per_token({step["plan_tokens"]: step["plan_static_bytes"] for step in profiled
                                                   if step.get("plan_tokens") == step["tokens"]
                                                   and "plan_static_bytes" in step})  # fmt: skip

        def at(n: int) -> Any:
            grown = int(static_per_token * (n - profile.tokens))
            return dataclasses.replace(profile.scaled(n), static_bytes=profile.static_bytes + grown)

        def attempt(n: int) -> Any:  # a Plan, or the planner's ValueError
            if n not in attempts:
                try:
                    attempts[n] = choose_plan_with_host(lambda candidate: choose_plan(candidate, budget_bytes, margin),
                                                        at(n), caps.most_bytes, caps.reserve_bytes)  # fmt: skip
                except ValueError as e:
                    attempts[n] = e
            return attempts[n]

        def fits(n: int) -> bool:
            return not isinstance(attempt(n), ValueError)

        # The library's probes ran on the first step's tokens (at most its PROBE_MAX_TOKENS), per kind of layer: the
        # first layer's is the decoder's.
        probes = getattr(getattr(controller, "_measured", None), "probes", None)
        probe_tokens = next(iter(probes.values())).tokens if probes else s["profile_tokens"][0]

        def step_s(n: int) -> float:  # the probes time attention apart: the profile scales it with the square
            return attempt(n).predicted.step_s

        round_to, max_tokens = s["round"], s["max_tokens"]
        by_memory = largest_multiple(fits, round_to, max_tokens)
        if by_memory + round_to > max_tokens:
            limit, detail = LIMIT_SEARCH, f"the planner finds plans up to --max-tokens {max_tokens}"
        else:
            limit, detail = LIMIT_GPU, f"{by_memory + round_to} tokens: {str(attempt(by_memory + round_to))[:600]}"
        longest = by_memory
        if by_memory and (host_kept := getattr(attempt(by_memory), "inputs_kept_for_host", None)):
            limit = LIMIT_POOL_CAP
            detail = (
                f"{len(host_kept)} checkpointed layers keep their input on the GPU because the pinned cap "
                f"({attempt(by_memory).host_cap_bytes / GIB:.1f} GiB) is full; then " + detail
            )
        if by_memory and step_s(by_memory) > s["max_step_seconds"]:
            longest = largest_multiple(lambda n: fits(n) and step_s(n) <= s["max_step_seconds"], round_to, max_tokens)
            limit, detail = (
                LIMIT_TIME,
                (
                    f"predicted {step_s(by_memory):.0f} s/step at {by_memory} tokens (the memory "
                    f"limit), over --max-step-seconds {s['max_step_seconds']:g}"
                ),
            )
        out: dict[str, Any] = {"longest_tokens": longest, "limit": limit, "limit_detail": detail,
                               "static_bytes_per_token": static_per_token,
                               "by_memory_tokens": by_memory, "budget_bytes": budget_bytes, "margin_bytes": margin,
                               "profile_tokens": profile.tokens, "probe_tokens": probe_tokens,
                               # to replay the search offline: StepProfile(**profile) with LayerProfile layers
                               "profile": dataclasses.asdict(profile)}  # fmt: skip
        how = [f"The library's planner: the longest multiple of {round_to} tokens for which "
               f"hf_offload.memory_budget.search.choose_plan(ctx.budget_controller.profile.scaled(N), {budget_bytes} "
               f"(its 'auto' budget), {margin}) finds a plan, with the pinned pool grown from its cap of "
               f"{caps.default_bytes / GIB:.1f} GiB up to {caps.most_bytes / GIB:.1f} GiB where that makes the step "
               "fit (host.choose_plan_with_host, as the controller plans; bisection; the profile is the one its plan "
               f"at {profile.tokens} tokens was made from, its static bytes grown by {static_per_token:.0f} "
               "bytes/token, the line through the profiled lengths' plans: the step's per-token tensors held when the "
               "first layer starts)."]  # fmt: skip
        if longest:
            found = attempt(longest)
            out.update(plan_code=found.code, predicted_peak_bytes=found.predicted.peak_bytes,
                       predicted_host_bytes=found.predicted.host_bytes, planner_step_s=found.predicted.step_s,
                       predicted_step_s=found.predicted.step_s, predicted_tokens_per_s=longest / found.predicted.step_s,
                       plan_table=found.format_table())  # fmt: skip
            if self.time_model is not None:
                out["fit_step_s"] = self.time_model(longest)
        how.append(f"Time: the planner's predicted step time (its probes, on {probe_tokens} tokens, time attention "
                   "apart and scale it with the square of the tokens).")  # fmt: skip
        if self.time_model is not None:
            how.append(f"Cross-check (fit_step_s): {self.time_model.how}, through this mode's own profiled steps.")
        out["how"] = how
        self._attempt = attempt
        return out

    # ------------------------------------------------------------------ confirmation

    def confirm(self) -> None:
        s = self.settings
        torch = self.torch
        prediction = self.record.get("prediction") or {}
        tokens = s["confirm_tokens"] or prediction.get("longest_tokens") or 0
        confirm: dict[str, Any] = {"tokens": tokens}
        self.record["confirm"] = confirm
        if not tokens:
            confirm["skipped"] = "no length to confirm: no prediction"
            self.save()
            return
        predicted_s, pin_s, predicted_peak = self._confirm_predictions(tokens)
        left = self.spec["deadline"] - time.time() - self.spec["reserve_s"]
        confirm.update(predicted_s=predicted_s, predicted_pinning_s=pin_s, predicted_peak_bytes=predicted_peak,
                       seconds_left=left)  # fmt: skip
        needed = ((predicted_s or 0.0) + pin_s) * CONFIRM_SAFETY + CONFIRM_SLACK_S
        if predicted_s is None:
            confirm["skipped"] = "no predicted time to check against --max-seconds (the profiling did not finish)"
        elif needed > left:
            confirm["skipped"] = (f"predicted {predicted_s:.0f} s + {pin_s:.0f} s pinning (x {CONFIRM_SAFETY}) > "
                                  f"{left:.0f} s left of --max-seconds after {self.spec['reserve_s']:.0f} s kept for "
                                  "the modes still to run")  # fmt: skip
        if confirm.get("skipped"):
            log(f"{self.mode}: confirmation at {tokens:,} tokens skipped: {confirm['skipped']}")
            self.save()
            return
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        self.save()
        rec = self.step(tokens, "confirm")
        confirm.update({k: v for k, v in rec.items() if k not in ("phase", "offloaded_sizes")})
        self.save()

    def _confirm_predictions(self, tokens: int) -> tuple[float | None, float, int | None]:
        """Predicted seconds, one-off pinning seconds and peak of a step at ``tokens``. All of its host memory is
        taken as newly pinned: blocks of the profiled lengths are too small for its tensors (hf-offload's pool drops
        its unused chunks and pins the large blocks anew; PyTorch's pinned allocator rounds each to a new power of
        two)."""
        seconds = self.time_model(tokens) if self.time_model is not None else None
        if self.parsed.planned:
            attempt = getattr(self, "_attempt", None)
            found = attempt(tokens) if attempt is not None else None
            if found is None or isinstance(found, ValueError):
                return seconds, 0.0, None
            return found.predicted.step_s, pinning_seconds(found.predicted.host_bytes), found.predicted.peak_bytes
        if self.memory is None:
            return seconds, 0.0, None
        return seconds, pinning_seconds(self.memory.host_bytes(tokens)), int(self.memory.gpu_bytes(tokens))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_child":
        sys.exit(child_main(json.loads(sys.argv[2])))
    sys.exit(main())

"""One mode of one scenario, in its own process: build, offload, time, optionally trace; the result goes to a JSON
file that the parent reads (a crash or a timeout leaves none)."""

from __future__ import annotations

import dataclasses
import json
import time
import traceback
from typing import Any

import torch

from .measure import make_train_step, time_steps
from .model import apply_liger, apply_lora, build_model, liger_call, make_input_ids, make_optimizer
from .modes import ModeSpec, parse_mode
from .offloaders import SkipMode, enable_checkpointing, load_offloader, start_offload
from .scenarios import SCENARIOS
from .trace import trace_step


def run_mode(spec: ModeSpec, res: dict[str, Any]) -> None:
    """Builds the scenario, sets the mode up, runs its steps; what it learns goes into ``res``. The order is kept
    the same in every mode (seeding, building, checkpointing, LoRA, data), so that every mode trains the same
    weights on the same data."""
    scenario = SCENARIOS[spec["scenario"]]
    mode = parse_mode(spec["mode"])
    device = torch.device(spec["device"])
    res["device"] = device.type
    if spec.get("deterministic"):
        torch.use_deterministic_algorithms(True, warn_only=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        res["device_name"] = torch.cuda.get_device_name(device)
    notes = res["notes"]

    factory = load_offloader(mode.offloader, device)
    # before the model is built: it patches the classes
    liger = scenario.liger and apply_liger(device, notes, scenario.family)
    if liger:
        res["liger_call"] = liger_call(scenario.family)
    res["liger"] = liger

    model = build_model(scenario, spec["seed"], device)
    res["attn_implementation"] = model.config._attn_implementation
    if mode.checkpointing:
        res["ckpt_call"] = enable_checkpointing(model, offload=(mode.offloader == "native"), every=mode.ckpt_every)
    if scenario.lora:
        model = apply_lora(model)
    model.train()
    runs = compile_model(model, mode.compiled)  # what the steps call: the model, or its compiled wrapper
    if mode.compiled:
        res["compiled"] = mode.compiled
    params = [p for p in model.parameters() if p.requires_grad]
    res["trainable_params"] = sum(p.numel() for p in params)
    res["total_params"] = sum(p.numel() for p in model.parameters())
    optimizer, res["optimizer"] = make_optimizer(params, notes)
    input_ids = make_input_ids(scenario, spec["seed"], device)

    hfo_opts = dict(spec.get("hfo_opts", {}))
    if mode.planned:
        hfo_opts["memory_budget"] = spec["memory_budget"]["option"]
    offload = start_offload(mode.offloader, factory, runs, hfo_opts)
    if mode.offloader == "hfo":
        res["hfo_active"] = bool(getattr(offload.context, "active", True))
        if not res["hfo_active"]:
            notes.append("hf_offload inactive on this device (identity hooks)")
    if mode.planned and not offload.context.active:
        raise SkipMode(
            "no memory budget: hf_offload is inactive on this device (on CPU, its test mode plans: "
            "--hfo-opt device_type=cpu)"
        )
    res["bytes_counted"] = offload.bytes_counted

    train_step = make_train_step(runs, input_ids, params, optimizer, offload.context, spec["span"])
    try:
        time_steps(train_step, offload, spec["warmup"], spec["steps"], device, res)
    except ValueError as e:
        if mode.planned and _raised_by_planner(e):
            raise Infeasible(str(e), getattr(e, "minimum_bytes", None)) from e
        raise
    if mode.planned and offload.context.memory_plan is not None:
        res["plan"] = _plan_summary(offload.context)
        print(res["plan"]["table"], flush=True)
    report = getattr(offload.context, "peak_report", None)  # ours, on a device, without a budget
    if report is not None:
        res["peak_report"] = {"text": report.describe(), "set_in": report.set_in, "peak_bytes": report.peak_bytes,
                              "without_least_bytes": report.without_least_bytes,
                              "without_most_bytes": report.without_most_bytes,
                              "standing_aside": offload.context.standing_aside}  # fmt: skip
        print(f"peak report: {report.describe()}", flush=True)
    if spec.get("profile_path"):
        res["profile_streams"] = trace_step(train_step, device, spec["profile_path"])
        res["profile_path"] = spec["profile_path"]


def compile_model(model: torch.nn.Module, how: str | None) -> torch.nn.Module:
    """`how` "model": `torch.compile(model)`, returned; "layers": each decoder layer compiled in place (regional
    compilation), the model returned; None: the model."""
    if how == "model":
        return torch.compile(model)
    if how == "layers":
        from transformers.modeling_layers import GradientCheckpointingLayer

        for layer in (m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)):
            layer.compile()
    return model


class Infeasible(Exception):
    """The planner refused the budget: it is below the smallest peak any plan reaches (the message says what
    dominates it). Reported as 'infeasible', not as a crash: for a budget too small, that error is the target.
    ``minimum_bytes`` is the smallest budget that works, as the library's error names it (its attribute)."""

    def __init__(self, message: str, minimum_bytes: int | None) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes


def _raised_by_planner(error: ValueError) -> bool:
    """Whether the error is the planner's refusal of the budget."""
    from hf_offload import InfeasibleBudgetError

    return isinstance(error, InfeasibleBudgetError)


def _plan_summary(context: Any) -> dict[str, Any]:
    """The plan in force at the end (``context.memory_plan``, an ``hf_offload`` ``Plan``): its code, what it
    predicts, and, where the context still exposes it, the measured profile it was planned from (for replaying the
    planner offline; the controller that holds it is no public name of the library, so it is read only if found)."""
    plan = context.memory_plan
    predicted = plan.predicted
    summary = {
        "code": plan.code,
        "budget_bytes": plan.budget_bytes,
        "tokens": plan.tokens,
        "predicted_peak_bytes": predicted.peak_bytes,
        "predicted_peak_at": predicted.peak_at,
        "predicted_step_s": predicted.step_s,
        "predicted_host_bytes": predicted.host_bytes,
        "forward_window_bytes": plan.forward_window_bytes,
        "prefetch_window_bytes": plan.prefetch_window_bytes,
        "table": plan.format_table(),
    }
    controller = getattr(context, "budget_controller", None)
    profile = getattr(controller, "profile", None)
    if dataclasses.is_dataclass(profile):
        summary["profile"] = dataclasses.asdict(profile)
    # What the closed loop measured (per plan code, its steps' seconds: the profiled safe plan, the trial of plain
    # checkpointing, the plans it checked) and what it learned from them, where the library has them.
    measurements = getattr(controller, "measurements", None)
    if isinstance(measurements, dict):
        summary["measured_s"] = {code: [step["seconds"] for step in steps] for code, steps in measurements.items()}
    calibration = getattr(controller, "calibration", None)
    if hasattr(calibration, "describe"):
        summary["learned"] = calibration.describe()
    return summary


def run_mode_safely(spec: ModeSpec) -> dict[str, Any]:
    """Runs the mode; returns its result, whatever happened (status "ok", "OOM", "skipped", "infeasible" with the
    smallest budget that works as ``minimum_bytes``, or "error"). ``benchmarks/zoo.py`` runs the modes of a shape
    one after the other in one process through this."""
    res: dict[str, Any] = {"scenario": spec["scenario"], "mode": spec["mode"], "status": "ok", "notes": []}
    t0 = time.time()
    try:
        run_mode(spec, res)
    except torch.cuda.OutOfMemoryError as e:  # also torch.OutOfMemoryError, where torch has that name
        res["status"] = "OOM"
        res["error"] = str(e).splitlines()[0][:300]
        traceback.print_exc()
    except SkipMode as e:
        res["status"] = "skipped"
        res["notes"].append(str(e))
    except Infeasible as e:
        res["status"] = "infeasible"
        res["error"] = str(e)
        if e.minimum_bytes is not None:
            res["minimum_bytes"] = e.minimum_bytes
        print(f"infeasible: {e}", flush=True)
    except Exception as e:
        res["status"] = "error"
        res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    res["wall_s"] = time.time() - t0
    return res


def main(spec: ModeSpec) -> int:
    """Child process entry: runs the mode and writes its result, whatever happened, to ``spec["result_path"]``."""
    res = run_mode_safely(spec)
    with open(spec["result_path"], "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0

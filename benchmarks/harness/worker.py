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
from .modes import Mode, ModeSpec, parse_mode
from .offloaders import SkipMode, disable_checkpointing, enable_checkpointing, load_offloader, start_offload
from .scenarios import SCENARIOS
from .trace import trace_step


@dataclasses.dataclass
class Built:
    """A scenario's model and what its steps need, as `run_mode` builds them."""

    model: torch.nn.Module  # LoRA applied, where the scenario has it
    runs: torch.nn.Module  # what the steps call: the model, or its compiled wrapper
    params: list[torch.nn.Parameter]  # the trainable ones
    optimizer: torch.optim.Optimizer
    input_ids: torch.Tensor
    facts: dict[str, Any]  # what building it tells the report (Liger, attention, optimizer), for each mode run on it


class SharedModel:
    """One model for several modes that run one after another in this process (the zoo's re-check: a budget's plan and
    the simple plan it is compared with, alternately). Built by the first mode, as `run_mode` builds it for that mode;
    each later mode turns the model's checkpointing on or off, starts with the optimizer's state cleared, and takes its
    offload context off the model when it ends. Both sides then run on one build, with no rebuild between them: what
    is left between them is the host's own stalls, which on host-paced short steps still move a plan against itself
    by 5-13% (docs/DESIGN.md, "Held on shapes it was not tuned on")."""

    def __init__(self) -> None:
        self.built: Built | None = None
        self.key: tuple[str, int, str] | None = None  # (scenario, seed, device) it was built for


def run_mode(spec: ModeSpec, res: dict[str, Any], shared: SharedModel | None = None) -> None:
    """Builds the scenario (or takes ``shared``'s model), sets the mode up, runs its steps; what it learns goes into
    ``res``. The order is kept the same in every mode (seeding, building, checkpointing, LoRA, data), so that every
    mode trains the same weights on the same data."""
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
    key = (spec["scenario"], spec["seed"], spec["device"])
    if shared is not None and (mode.compiled or mode.offloader not in ("none", "hfo")):
        # compiled layers and transformers' offload flag are set before LoRA; TRL's hooks cannot be taken off again
        raise ValueError(f"mode {spec['mode']!r} cannot run on a shared model: only uncompiled none and hfo modes can")
    if shared is not None and shared.built is not None:
        if shared.key != key:
            raise ValueError(f"mode {spec['mode']!r} of {key} cannot run on the model built for {shared.key}")
        built = shared.built
        # Each run starts as a run of its own does, its optimizer without state: the memory budget decides its first
        # step's plan with the memory held then, and mistral-7b-8l's re-check, begun with the last run's AdamW state,
        # tiled whole layers from its first step (1.86x) where its sweep ran `C` (1.02x).
        built.optimizer.state.clear()
        if mode.checkpointing:
            res["ckpt_call"] = enable_checkpointing(built.model, offload=False, every=mode.ckpt_every)
        else:
            disable_checkpointing(built.model)
        res["shared_model"] = True
    else:
        built = build_scenario(spec["scenario"], spec["seed"], mode, device, res)
        if shared is not None:
            shared.built, shared.key = built, key
    res.update(built.facts)
    params = built.params
    res["trainable_params"] = sum(p.numel() for p in params)
    res["total_params"] = sum(p.numel() for p in built.model.parameters())

    hfo_opts = dict(spec.get("hfo_opts", {}))
    if mode.planned:
        hfo_opts["memory_budget"] = spec["memory_budget"]["option"]
    offload = start_offload(mode.offloader, factory, built.runs, hfo_opts)
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

    train_step = make_train_step(built.runs, built.input_ids, params, built.optimizer, offload.context, spec["span"])
    try:
        time_steps(train_step, offload, spec["warmup"], spec["steps"], device, res)
    except ValueError as e:
        if mode.planned and _raised_by_planner(e):
            raise Infeasible(str(e), getattr(e, "minimum_bytes", None)) from e
        raise
    finally:
        if shared is not None and offload.context is not None:
            offload.context.remove_hooks()  # the next mode's model is as built: its hooks and layers restored
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


def build_scenario(name: str, seed: int, mode: Mode, device: torch.device, res: dict[str, Any]) -> Built:
    """The scenario's model as ``mode`` runs it: Liger, the model from its config, checkpointing, LoRA, compilation,
    the optimizer and the data, in that order (what went wrong on the way goes to ``res["notes"]``)."""
    scenario = SCENARIOS[name]
    notes = res["notes"]
    facts: dict[str, Any] = {}
    # before the model is built: it patches the classes
    liger = scenario.liger and apply_liger(device, notes, scenario.family)
    if liger:
        facts["liger_call"] = liger_call(scenario.family)
    facts["liger"] = liger

    model = build_model(scenario, seed, device)
    facts["attn_implementation"] = model.config._attn_implementation
    if mode.checkpointing:
        res["ckpt_call"] = enable_checkpointing(model, offload=(mode.offloader == "native"), every=mode.ckpt_every)
    if scenario.lora:
        model = apply_lora(model)
    model.train()
    runs = compile_model(model, mode.compiled)
    if mode.compiled:
        res["compiled"] = mode.compiled
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, facts["optimizer"] = make_optimizer(params, notes)
    input_ids = make_input_ids(scenario, seed, device)
    return Built(model, runs, params, optimizer, input_ids, facts)


def compile_model(model: torch.nn.Module, how: str | None) -> torch.nn.Module:
    """`how` "model": `torch.compile(model)`, returned; "layers": each decoder layer compiled in place (regional
    compilation), the model returned; None: the model."""
    if how == "model":
        return torch.compile(model)
    if how == "layers":
        from hf_offload import compile_decoder_layers

        compile_decoder_layers(model)
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
    # checkpointing, the plans it checked) and what it learned from them, where the library has them; and each of
    # those steps whole (its peak, exact or a bound, and the peak its prediction counted), with which a plan that ran
    # above its prediction can be replayed offline against the profile above.
    measurements = getattr(controller, "measurements", None)
    if isinstance(measurements, dict):
        summary["measured_s"] = {code: [step["seconds"] for step in steps] for code, steps in measurements.items()}
        summary["measurements"] = measurements
    calibration = getattr(controller, "calibration", None)
    if hasattr(calibration, "describe"):
        summary["learned"] = calibration.describe()
    return summary


def run_mode_safely(spec: ModeSpec, shared: SharedModel | None = None) -> dict[str, Any]:
    """Runs the mode (on ``shared``'s model, if given); returns its result, whatever happened (status "ok", "OOM",
    "skipped", "infeasible" with the smallest budget that works as ``minimum_bytes``, or "error").
    ``benchmarks/zoo.py`` runs the modes of a shape one after the other in one process through this."""
    res: dict[str, Any] = {"scenario": spec["scenario"], "mode": spec["mode"], "status": "ok", "notes": []}
    t0 = time.time()
    try:
        run_mode(spec, res, shared)
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

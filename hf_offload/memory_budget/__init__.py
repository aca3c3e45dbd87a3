"""The memory budget: per decoder layer, the cheapest way to keep a training step's peak under the user's budget.

One module per purpose, imported one way (each only from those listed before it, and from the rest of hf_offload):

- `checks`: the checks of the numbers the pure modules are given.
- `spec`: the user's budget (`MemoryBudget`, `parse_memory_budget`) and what "auto" leaves of the device.
- `profile`: what a step costs (`LayerProfile`, `StepProfile`) and how that scales with its tokens.
- `simulate`: the plan as data (`Plan`, action letters, `MeasuredStep`) and the step model (`simulate`).
- `search`: choosing a plan (`choose_plan`), or refusing the budget (`InfeasibleBudgetError`).
- `calibrate`: what the plans that ran teach the step model (the scale of its times, the host's time per offload).
- `layer_actions`: a plan's actions set on the decoder layers (`apply_layer_actions`); the tiled ones (the plans'
  `T`/`t` and `L`/`l`) through `hf_offload.tiled`, the sequence-tiled ops, which are also a feature of their own.
- `probes`: one layer measured on the arguments of its own call (`probe_layer`), the link's bandwidth, the meter.
- `plan_checks`: the closed loop at run time (`PlanChecks`): which steps are timed, when a plan is checked.
- `profiled_steps`: the profile's assembly (`ProfiledSteps`): the probes, the measured step, `profile_now`.
- `planning`: planning at run time (`Planner`): the plan in force, the plans by length, applying a plan.
- `controller`: `MemoryBudgetController`, which sequences the phases: profile, plan, apply, re-plan, check.

The first six are pure Python (the standard library and `hf_offload.units`): plans are computed and tested without
torch. This package imports none of its modules, so that `options`, which reads the option with `spec`, loads neither
the controller nor the engine it imports.
"""

__all__: list[str] = []

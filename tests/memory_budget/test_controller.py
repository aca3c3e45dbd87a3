"""The memory budget's controller end to end in CPU test mode (`memory_budget/controller.py`): the phases in
sequence and the hooks that drive them. What building it refuses, the first plan waiting for the optimizer's first
step, layers whose whole call is checkpointed starting before it, the layers given back and nothing kept alive once
the hooks are removed, a fault in the measured profiled step, and the Trainer taking a budget from its arguments.
What the objects it owns do is in the files named after them: `test_profiled_steps.py`, `test_plan_checks.py` and
`test_planning.py`."""

import gc
import logging
import weakref

import pytest
import torch
import transformers
from budget_runs import (
    LAYERS,
    VOCAB,
    Unchanged,
    accumulate,
    assert_bitwise_equal,
    long_run,
    tiled_forwards,
    tiled_whole,
    tiny_llama,
    train,
)
from checkpoint_around_the_call import checkpoint_around_the_call
from step_comparisons import relative_difference

from hf_offload import InfeasibleBudgetError, get_act_offloading_ctx_manager
from hf_offload.memory_budget import controller as controller_module
from hf_offload.memory_budget import probes


@pytest.mark.parametrize("budget", ["auto", "60%"])
def test_a_share_of_the_device_needs_a_device(budget):
    with pytest.raises(ValueError, match="memory"):
        get_act_offloading_ctx_manager(tiny_llama(), device_type="cpu", memory_budget=budget)


def trainer_run(output_dir, tokenizer, lm_dataset, **offloading) -> transformers.Trainer:
    """5 steps of the Trainer, 2 micro-batches each, padded to each batch's longest line (up to 32 tokens)."""
    from helpers import COMMON_ARGS, tiny_model

    from hf_offload import TrainingArguments

    args = TrainingArguments(str(output_dir), **{**COMMON_ARGS, "eval_strategy": "no", "max_steps": 5}, **offloading)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = transformers.Trainer(model=tiny_model(tokenizer), args=args, train_dataset=lm_dataset,
                                   data_collator=collator)  # fmt: skip
    trainer.train()
    return trainer


def test_the_trainer_takes_a_budget_from_its_arguments_prints_the_plan_and_stays_exact(tmp_path, tokenizer,
                                                                                      lm_dataset, capsys):  # fmt: skip
    from helpers import CPU_TEST_MODE, train_losses

    baseline = trainer_run(tmp_path, tokenizer, lm_dataset)
    planned = trainer_run(tmp_path, tokenizer, lm_dataset, activation_offloading=True,
                          activation_offloading_memory_budget="1GiB", **CPU_TEST_MODE)  # fmt: skip
    assert train_losses(planned) == train_losses(baseline)
    assert "Memory plan for" in capsys.readouterr().out
    planned_logs = [record for record in planned.state.log_history if "offload/plan_predicted_peak_gib" in record]
    # gradient_accumulation_steps=2: the two profiled forwards are the first of the 5 steps; steps 2 to 5 log a plan.
    assert len(planned_logs) == 4


def test_the_trainer_near_the_minimum_runs_longer_padded_batches_on_the_lowest_plan(tmp_path, tokenizer, lm_dataset,
                                                                                   caplog):  # fmt: skip
    """Dynamic padding makes later batches longer than the profiled ones: under a budget just above the smallest
    that fits those, training goes on (one warning) and stays exact. Without tiling (MLPs or whole layers), whose
    gradients are not bitwise, the lowest-memory plan checkpoints every layer."""
    from helpers import CPU_TEST_MODE, assert_same_weights, train_losses

    def planned(budget):
        return trainer_run(tmp_path, tokenizer, lm_dataset, activation_offloading=True,
                           activation_offloading_memory_budget=str(budget), activation_offloading_tile_mlp=False,
                           activation_offloading_tile_layer=False, **CPU_TEST_MODE)  # fmt: skip

    with pytest.raises(InfeasibleBudgetError) as refused:  # at the first plan, from the profiled batches
        planned(1)
    budget = int(refused.value.lowest_plan.predicted.peak_bytes * 1.006)  # the plans' margin included
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        tight = planned(budget)
    over = [record for record in caplog.records if "It runs on the lowest-memory plan" in record.getMessage()]
    assert over and over[0].levelno == logging.WARNING
    assert all(record.levelno == logging.INFO for record in over[1:])
    baseline = trainer_run(tmp_path, tokenizer, lm_dataset)
    assert_same_weights(trainer_run(tmp_path, tokenizer, lm_dataset).model, baseline.model)  # it repeats
    assert_same_weights(tight.model, baseline.model)
    assert train_losses(tight) == train_losses(baseline)


def test_layers_whose_whole_call_is_checkpointed_start_before_it_and_are_tiled_whole(monkeypatch):
    """transformers 5.17 checkpoints a decoder layer's whole call, which looks the layer's forward up after its
    pre-hooks: the first step's first layer, from whose pre-hook the profiled steps' plan is applied, ran untiled in
    the forward and tiled in the recomputation, a checkpoint error on the H100. There the layer starts (is probed,
    and the plan applied) from its checkpoint function, before its call: every layer runs tiled in every step, the
    first too; and a tiled call runs without a checkpoint around it (the tiled op is one: around it, the op would
    run twice)."""
    from hf_offload.memory_budget.simulate import simulate
    from hf_offload.tiled.layer_op import _TiledLayerFunction

    baseline, roomy, _, _ = long_run(10 * 2**30, record=tiled_whole)
    profile = roomy.budget_controller.profile
    budget = (simulate(profile, "L" * LAYERS).peak_bytes + simulate(profile, "T" * LAYERS).peak_bytes) // 2
    checkpoint_around_the_call(monkeypatch, type(tiny_llama().model.layers[0]))
    calls = []
    monkeypatch.setattr(_TiledLayerFunction, "apply", lambda *args, apply=_TiledLayerFunction.apply: calls.append(1)
                        or apply(*args))  # fmt: skip
    results, context, seen, model = long_run(budget, record=tiled_whole)
    # The plan tiles the first layers whole and checkpoints the others (transformers' checkpoint of their whole call).
    whole_layers = [letter in "Ll" for letter in context.memory_plan.code]
    assert whole_layers[0] and not all(whole_layers), context.memory_plan.code
    # The profiled steps run the plan made for their tokens as the first layer starts, which tiles the first layer
    # whole too; the later steps run the first plan.
    assert seen[0] == seen[1] and seen[0][0] and seen[2:] == [whole_layers] * 2
    # Once per tiled call: no checkpoint around it.
    assert len(calls) == sum(map(sum, seen)) + 2 * probes._PROBE_RUNS
    losses, steps = results[:4], len(results[:4])
    assert all(relative_difference(a, b) <= 1e-5 for a, b in zip(losses, baseline[:steps]))
    # As in test_layers_are_tiled_whole_when_nothing_else_fits: 1.7e-4 measured on an AMD EPYC.
    assert all(relative_difference(a, b) <= 1e-3 for a, b in zip(results[steps:], baseline[steps:]))


def test_remove_hooks_gives_the_layers_back_after_a_refused_budget():
    """A budget below every plan is refused at the plan's step, after profiled steps that tiled every layer whole:
    `remove_hooks` gives each layer its own forward and checkpointing back, and nothing keeps the model alive. A
    notebook that retries with another budget must not train a model left tiled, nor hold the first one's memory
    (on the H100 the retry measured 177 MiB more static memory, and its named minimum did not fit)."""
    names = ("forward", "gradient_checkpointing", "_gradient_checkpointing_func")

    def refused_run():
        model = tiny_llama()
        own = [{name: layer.__dict__.get(name) for name in names} for layer in model.model.layers]
        context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=1000)
        seen = []
        model.model.norm.register_forward_pre_hook(lambda *_: seen.append(tiled_whole(model)))
        with pytest.raises(InfeasibleBudgetError):
            train(model, context, steps=4, lengths=(64,))
        context.remove_hooks()
        after = [{name: layer.__dict__.get(name) for name in names} for layer in model.model.layers]
        return own, after, seen, weakref.ref(model.model.layers[0])

    own, after, seen, alive = refused_run()
    assert seen == [[True] * LAYERS] * 2  # the profiled steps
    assert after == own
    gc.collect()
    assert alive() is None


def test_tile_mlp_true_tiles_every_layer_until_the_hooks_are_removed():
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", tile_mlp=True)
    assert tiled_forwards(model) == [True] * LAYERS
    assert model.model.layers[0].mlp.forward.tokens_per_chunk == 64  # the hidden size
    context.remove_hooks()
    assert tiled_forwards(model) == [False] * LAYERS


def test_tile_layer_true_tiles_every_layer_and_is_refused_with_a_budget():
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", tile_layer=True)
    assert tiled_whole(model) == [True] * LAYERS
    assert model.model.layers[0].forward.tokens_per_chunk == 64  # the hidden size
    context.remove_hooks()
    assert tiled_whole(model) == [False] * LAYERS
    # A layer tiled whole is its own checkpoint: a plan's actions would not apply to it.
    with pytest.raises(ValueError, match="tile_layer=True and memory_budget='1GiB' cannot be combined"):
        get_act_offloading_ctx_manager(tiny_llama(), device_type="cpu", tile_layer=True, memory_budget="1GiB")


def test_with_gradient_accumulation_the_first_plan_waits_for_the_optimizers_first_step():
    """Gradient accumulation over four micro-steps: the profiled steps come before the optimizer's first step, and so
    before its state exists (AdamW's: twice the trained parameters; on an H200 a budget at the minimum named then ran
    340-390 MB over once it appeared). The first plan waits for that step: micro-steps 3 and 4 run the safe plan, and
    the plan is made as micro-step 5 begins. A budget no plan fits is refused there. Exact throughout."""
    baseline = accumulate(tiny_llama(), Unchanged(), micro_steps=8, accumulation=4)
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=10 * 2**30)
    plans = []
    results = accumulate(model, context, micro_steps=8, accumulation=4,
                         after_micro_step=lambda: plans.append(context.memory_plan))  # fmt: skip
    assert_bitwise_equal(results, baseline)
    assert plans[:4] == [None] * 4 and plans[4] is not None
    assert context.budget_controller.planner.code == plans[-1].code  # the plan's layers, applied
    model = tiny_llama()
    refused = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget="1KiB")
    forwards = []
    with pytest.raises(InfeasibleBudgetError):
        accumulate(model, refused, micro_steps=8, accumulation=4,
                   after_micro_step=lambda: forwards.append(refused.budget_controller._forwards))  # fmt: skip
    assert forwards == [1, 2, 3, 4]  # refused as the fifth forward began


def test_the_first_plan_waits_for_an_optimizer_step_a_bounded_number_of_forwards(monkeypatch):
    """Gradients held and no `torch.optim` step: an optimizer of its own that calls no step hook, or a loop that only
    accumulates. The first plan waits at most `_FIRST_PLAN_WAIT_FORWARDS` forwards after the profiled ones."""
    monkeypatch.setattr(controller_module, "_FIRST_PLAN_WAIT_FORWARDS", 2)
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=10 * 2**30)
    plans = []
    accumulate(model, context, micro_steps=7, accumulation=1, optimizer=False,
               after_micro_step=lambda: plans.append(context.memory_plan is not None))  # fmt: skip
    assert plans == [False] * 5 + [True] * 2  # forwards 3-5 wait, the sixth plans


def test_only_the_models_own_optimizer_counts_and_a_dropped_context_leaves_no_optimizer_hook():
    """PyTorch's optimizer step hooks are process-wide. Another model's optimizer stepping must not tell this model's
    controller that its optimizer's state exists (its first plan would count none); and a context dropped without
    `remove_hooks()` must not leave its hook behind."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    model, other = tiny_llama(), tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget="1GiB")
    steps = context.budget_controller._optimizer_steps
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    own_optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad][:1], lr=0.1)
    for _ in range(3):
        other_optimizer.step()
    assert steps.count == 0
    own_optimizer.step()
    assert steps.count == 1

    hooks = [steps.handle.id]  # this context's, taken off by remove_hooks()
    for _ in range(3):  # built and dropped, without remove_hooks()
        dropped = get_act_offloading_ctx_manager(tiny_llama(), device_type="cpu", memory_budget="1GiB")
        hooks.append(dropped.budget_controller._optimizer_steps.handle.id)
        assert hooks[-1] in _global_optimizer_post_hooks
        del dropped
    context.remove_hooks()
    del context, steps
    gc.collect()
    assert not set(hooks) & set(_global_optimizer_post_hooks)


def test_a_fault_in_the_measured_profiled_step_is_no_measurement():
    """The second profiled step is the one the profile is measured from. An exception in its forward, caught by the
    caller (a retrying helper such as `auto_find_batch_size`), left the head's saved bytes at 0 and a partial step's
    time in the profile. That step is no measurement: the next one is measured instead, and the profile is the one a
    run without the fault makes (its bytes; times differ between any two runs)."""

    def profile_of(fault_in_forward: int | None):
        model = tiny_llama()
        context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget="1GiB")
        forwards = []

        def fault(module, args):
            forwards.append(1)
            if len(forwards) == fault_in_forward:
                raise RuntimeError("a fault in the forward")

        model.lm_head.register_forward_pre_hook(fault)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
        for _ in range(5 if fault_in_forward is None else 6):
            try:
                with context:
                    loss = model(input_ids=ids, labels=ids).loss
            except RuntimeError:
                continue
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert context.memory_plan is not None
        return context.budget_controller.profile

    clean, faulted = profile_of(None), profile_of(2)
    assert faulted.head_bytes == clean.head_bytes > 0
    assert [layer.saved_bytes for layer in faulted.layers] == [layer.saved_bytes for layer in clean.layers]
    assert faulted.static_bytes == clean.static_bytes and faulted.head_s > 0 and faulted.other_s >= 0

"""The profiled steps (`memory_budget/profiled_steps.py`), end to end in CPU test mode: probing (a long step on its
first tokens, layers that cannot be tiled whole), what the first and the measured steps read (the first step's peak
as its backward ends, the peak counter's reads, the head's bytes, what the step needs after backward, gradients that
come after every layer), and the profile made from them at a step's tokens (the mask and rotary tables, the head
scaled from the profiled step, gradients held under accumulation, what the head's peak hides of its reloads)."""

import dataclasses
import logging

import pytest
import torch
import transformers
from budget_runs import (
    LAYERS,
    VOCAB,
    Unchanged,
    accumulate,
    assert_bitwise_equal,
    budget_for_the_trial,
    long_run,
    planned,
    tiny_gemma3n,
    tiny_llama,
    train,
)
from in_place_rope import patch_in_place_rope

from hf_offload import InfeasibleBudgetError, get_act_offloading_ctx_manager
from hf_offload.memory_budget import probes
from hf_offload.memory_budget.closed_loop import Sample
from hf_offload.memory_budget.search import choose_plan, plan_of, prediction_margin_bytes


def test_the_profile_counts_the_mask_and_rotary_tables_the_model_gives_its_layers():
    """tiny_llama's eager attention gets a float mask of batch x 1 x length x length from the model, rotary tables
    of 1 x length x head size (cos, sin) and int64 position ids of 1 x length: memory held through the step that no
    layer's probe counts."""
    _, roomy, _, model = long_run(10 * 2**30)
    profile, config = roomy.budget_controller.profile, model.config
    head_size = config.hidden_size // config.num_attention_heads
    mask, tables, positions = 2 * 64 * 64 * 4, 2 * 64 * head_size * 4, 64 * 8
    assert (profile.call_argument_bytes, profile.quadratic_call_argument_bytes) == (mask + tables + positions, mask)


def test_liger_functions_in_the_models_code_rule_out_selective_checkpoints(monkeypatch, caplog):
    """With Liger's rotary embedding (an in-place stand-in, `in_place_rope`), the profile offers the planner no
    selective checkpoint, the log says why, and the budget's run trains bitwise as the model does without it."""
    assert planned(10 * 2**30)[1].budget_controller.profile.selective_checkpoint
    patch_in_place_rope(monkeypatch)
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        results, context = planned(10 * 2**30)
    assert not context.budget_controller.profile.selective_checkpoint
    assert "does not checkpoint layers selectively: Liger's functions in the model's code" in caplog.text
    unchanged = train(tiny_llama(), Unchanged())
    assert len(results) == len(unchanged) and all(torch.equal(a, b) for a, b in zip(results, unchanged))


def test_the_profile_says_whether_the_engine_reloads_one_layer_ahead():
    """Llama's attention carries the engine's prefetch points, from which a checkpointed layer's input is reloaded one
    layer ahead whatever the window; Mamba has no attention, and its unpacks reload as far ahead as the window."""
    assert planned(10 * 2**30)[1].budget_controller.profile.reloads_one_layer_ahead
    config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8)
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(config)
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=10 * 2**30)
    train(model, context, steps=3)
    assert not context.budget_controller.profile.reloads_one_layer_ahead


def test_a_model_whose_layers_cannot_be_tiled_whole_is_planned_without_it(caplog):
    """Bloom computes its own (ALiBi) attention, without transformers' attention interface: a tiled layer has no call
    to cut it at. The planner says so in the log and plans without the action."""
    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    model = transformers.BloomForCausalLM(config).train()
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=10 * 2**30)
        train(model, context, steps=3, lengths=(64,))
    assert any("the planner cannot tile whole layers: decoder layer 0" in record.getMessage()
               for record in caplog.records)  # fmt: skip
    assert context.budget_controller.profile.layer_tile_tokens == 0


def test_long_steps_are_probed_on_their_first_tokens(monkeypatch):
    full = long_run(10 * 2**30, steps=3)[1].budget_controller
    monkeypatch.setattr(probes, "PROBE_MAX_TOKENS", 64)
    cut = long_run(10 * 2**30, steps=3)[1].budget_controller
    cut_measured, full_measured = cut.profiled_steps.measured, full.profiled_steps.measured
    [cut_probe], [full_probe] = cut_measured.probes.values(), full_measured.probes.values()  # one kind of layer
    assert (cut_probe.tokens, cut_probe.step_tokens, cut_measured.step_tokens) == (64, 128, 128)
    assert (full_probe.tokens, full_probe.step_tokens, full_measured.step_tokens) == (128, 128, 128)
    # Scaled back to 128 tokens, the first 32 tokens of each sequence predict the whole, eager attention's scores
    # included: the probe separates what grows with the square of the length (batch x heads x 64 x 64 x fp32, the
    # softmax's output), exactly. What does not grow at all (a few KiB) is scaled in proportion, hence the cut probe's
    # small excess.
    cut_layer, full_layer = cut.profile.layers[0], full.profile.layers[0]
    assert cut_layer.input_bytes == full_layer.input_bytes
    assert cut_layer.quadratic_saved_bytes == full_layer.quadratic_saved_bytes == 2 * 4 * 64 * 64 * 4
    scores = 2 * 4 * (64 * 64 - 2 * 32 * 32) * 4  # what the square adds from 64 to 128 tokens: was missed before
    assert 0 <= cut_layer.saved_bytes - full_layer.saved_bytes < scores / 4


def test_a_longer_step_scales_the_profiled_head_once():
    """The head's bytes were measured in the second profiled step; a longer step scales them from that step's tokens
    (in the CPU test mode they come from its statistics, which later steps overwrite)."""
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=10 * 2**30)
    train(model, context, steps=4, lengths=(16, 16, 16, 16))
    controller = context.budget_controller
    head = controller.profile.head_bytes
    assert head > 0
    train(model, context, steps=1, lengths=(64,))
    assert controller.profile.tokens == 2 * 64
    assert controller.profile.head_bytes == 4 * head  # four times the tokens: four times the head
    train(model, context, steps=1, lengths=(128,))
    assert controller.profile.head_bytes == 8 * head  # scaled from the profiled step, not from the last one


def test_the_first_steps_peak_is_read_as_its_backward_ends_and_measures_the_plan_it_ran(monkeypatch):
    """The first step runs `C` on every layer before the profiled steps' plan is decided again with the optimizer's
    state; its peak, read once as its backward ends (not in the probes' backward, nor after the optimizer's step,
    which makes the state), is a measurement of `C`: a peak alone, with the memory held as the step began."""
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=10 * 2**30)
    controller = context.budget_controller
    reads = []

    def read_at_backward_end() -> None:  # the CPU test mode has no counter: the read, counted, with a stand-in figure
        reads.append(controller._forwards)
        controller._peak_counter.at_backward_end = 12345

    monkeypatch.setattr(controller._peak_counter, "read_at_backward_end", read_at_backward_end)
    held = []
    model.model.layers[0].register_forward_pre_hook(lambda *_: held.append(controller.held_memory.at_step_start))
    train(model, context, steps=2)
    assert reads[:1] == [1] and reads.count(1) == 1
    (first,) = [sample for sample in controller.plan_checks.samples["C" * LAYERS] if sample.through_backward]
    assert (first.seconds, first.peak_bytes, first.static_bytes) == (None, 12345, held[0])


@pytest.mark.parametrize("accumulation", [1, 2, 4])
def test_with_gradient_accumulation_plans_hold_every_gradient_through_the_step(accumulation):
    """A micro-step after the first of a cycle holds every gradient from its start; the first plan is made at a
    cycle's first micro-step, which holds none. Planned for the gradients created in backward, the other micro-steps
    ran over the budget by the gradients' part at the peak (H200: 143 MB of 1.53 GB). Under accumulation the plan
    counts them held from the step's start; without it, created in backward."""
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=10 * 2**30)
    accumulate(model, context, micro_steps=6, accumulation=accumulation)
    profile = context.budget_controller.planner.profile
    gradients = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if accumulation == 1:
        assert profile.gradient_bytes == gradients
    else:
        assert profile.gradient_bytes == 0 and profile.late_gradient_bytes == 0
        assert profile.static_bytes >= 2 * gradients  # the parameters and all their gradients


def test_a_peak_counter_reset_by_someone_else_is_not_taken_for_the_step_peak():
    # A benchmark or training script that resets the device's peak counter at each step's start makes the
    # controller's next read (at the next forward's start) a fraction of the step's peak: a plan would seem to fit
    # that does not. The counter never reads below what it read before, unless reset: such a read is no measurement.
    context = get_act_offloading_ctx_manager(tiny_llama(), device_type="cpu", memory_budget=10 * 2**30)
    controller = context.budget_controller
    reads = iter([9 * 2**30, 3 * 2**30, 10 * 2**30])
    controller._meter.peak = lambda: next(reads)
    assert controller._peak_counter.since_own_reset() == 9 * 2**30
    assert controller._peak_counter.since_own_reset() is None  # below the last read: reset by someone else
    assert controller._peak_counter.since_own_reset() == 10 * 2**30  # risen past it: the step peaked at least that high
    # The read at the end of the step's backward comes before anyone's reset between steps: it stands in for the step.
    reads = iter([11 * 2**30, 2 * 2**30])
    controller._peak_counter.read_at_backward_end()
    assert controller._peak_counter.since_own_reset() == 11 * 2**30


def test_what_the_heads_peak_hides_of_its_reloads_is_learned_from_exact_peaks():
    """On S1 (H100) plans with their first layers offloaded whole peaked 1.7-1.8 GiB below the model, whose head
    counts one such layer's reload on top of the loss's peak: the head's prefetch point fires after the loss's
    temporaries are gone. An exact peak below a step's head point bounds what the head hides, up to the reloads the
    point counted; the most any step shows is learned, shrunk for shorter steps and not grown for longer ones. A
    peak that is only a bound (not exact) teaches nothing."""
    _, context = planned(budget_for_the_trial())
    controller = context.budget_controller
    tokens, profile_now = controller.profile.tokens, controller.profiled_steps.profile_now
    assert profile_now(tokens).head_reload_hidden_bytes == 0  # no step peaked below its head's point
    reload_bytes, base = 1000, controller.profile.static_bytes

    def measured(peak: int, exact: bool = True, at: int = tokens) -> None:
        sample = Sample(at, 0.1, peak, peak_exact=exact, predicted_peak_bytes=base + reload_bytes,
                                           head_base_bytes=base, head_reload_bytes=reload_bytes)  # fmt: skip
        controller.plan_checks.samples.setdefault("head test", []).append(sample)

    measured(base + reload_bytes - 5000, exact=False)
    assert profile_now(tokens).head_reload_hidden_bytes == 0
    measured(base + reload_bytes - 300)
    assert profile_now(tokens).head_reload_hidden_bytes == 300
    measured(base + 10, at=2 * tokens)  # 990 hidden in a step twice as long: half of it in this one's
    assert profile_now(tokens).head_reload_hidden_bytes == 495
    measured(base - 50)  # below the point without its reloads: the reloads hid whole, no more is known
    assert profile_now(tokens).head_reload_hidden_bytes == reload_bytes
    assert profile_now(2 * tokens).head_reload_hidden_bytes == reload_bytes  # not grown
    assert profile_now(tokens // 2).head_reload_hidden_bytes == reload_bytes // 2


def test_the_heads_bytes_count_what_the_forward_leaves_besides_the_layers(monkeypatch):
    """The head's peak is measured over the memory held between steps (and the engine's tail), not over what was
    allocated as the head began: on every zoo shape the forward left about two layer inputs more (its last hidden
    states), and plain checkpointing measured that much above the model that left them out (251 MiB on the
    8 x 4K TinyLlama shape). Here the meter says 5 MiB more are allocated as the head begins than between steps."""
    model = tiny_llama()
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=10 * 2**30)
    controller = context.budget_controller
    between, left, peak = 2**20, 5 * 2**20, 40 * 2**20

    def allocated():
        measured = controller.profiled_steps.measured
        in_forward = controller._forwards == 2 and measured.step_start is not None and measured.head_start is None
        return between + left if in_forward else between

    monkeypatch.setattr(controller._meter, "allocated", allocated)
    monkeypatch.setattr(controller._meter, "peak", lambda: peak)
    train(model, context, steps=3)
    assert controller.profiled_steps.measured.head_bytes == peak - between


def test_gradients_that_come_after_every_layer_are_measured():
    """The input embeddings' gradient comes after every layer's backward (256K x 2304 on the zoo's Gemma-2 shape:
    1.1 GiB that the model counted at every layer). Tied to the head it comes as late: autograd sums the weight's two
    uses before it accumulates the gradient. A frozen embedding has none."""
    for change in ("untied", "tied", "frozen"):
        model = tiny_llama()
        if change == "tied":
            model.lm_head.weight = model.model.embed_tokens.weight
        if change == "frozen":
            model.model.embed_tokens.weight.requires_grad_(False)
        context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=10 * 2**30)
        train(model, context, steps=3)
        late = context.budget_controller.profile.late_gradient_bytes
        assert late == (0 if change == "frozen" else model.model.embed_tokens.weight.nbytes), change


def test_what_the_step_needs_after_backward_is_measured_when_the_counter_rose_after_it(monkeypatch):
    """The optimizer step's temporaries: the counter read at the next forward is higher than at the end of
    backward, so the optimizer step set the step's peak."""
    model = tiny_llama()
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    context = get_act_offloading_ctx_manager(model, device_type="cpu", memory_budget=10 * 2**30)
    controller = context.budget_controller
    peaks = {2: parameters + 2**20, 3: parameters + 5 * 2**20}
    monkeypatch.setattr(controller._meter, "peak", lambda: peaks.get(controller._forwards, peaks[3]))
    monkeypatch.setattr(controller._meter, "allocated", lambda: parameters)
    train(model, context, steps=3)
    gradients = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert controller.profile.optimizer_bytes == 5 * 2**20 - gradients


def test_a_layer_that_writes_into_a_product_a_selective_checkpoint_keeps_rules_out_selective_checkpoints(
    monkeypatch, caplog
):
    """Gemma 3n's AltUp adds its input in place into a matrix product's output, through an alias autograd does not
    track, then normalizes the sum: a selective checkpoint's recomputation would add it twice. Under a budget whose
    plan, were selective checkpoints offered, would checkpoint layers selectively (`S` or `s`; their recomputation
    measured free, so that the choice does not hang on the CPU's timings), the probe rules them out, the log says
    why, and the run trains bitwise as the model does without the library (without the refusal, its plan's selective
    layers made the gradients differ)."""
    if not hasattr(transformers, "Gemma3nForCausalLM"):
        pytest.skip("this transformers has no Gemma 3n")
    measured = probes._ProbedCall.kept_and_checkpointed

    def recomputing_for_free(self):
        kept, _ = measured(self)
        return kept, kept.backward_s

    monkeypatch.setattr(probes._ProbedCall, "kept_and_checkpointed", recomputing_for_free)
    roomy = get_act_offloading_ctx_manager(model := tiny_gemma3n(), device_type="cpu", memory_budget=10 * 2**30)
    train(model, roomy, steps=3)
    offered = dataclasses.replace(roomy.budget_controller.profile, selective_checkpoint=True)
    low, high = (plan_of(offered, letter * LAYERS, 10 * 2**30).predicted.peak_bytes for letter in "SK")

    def chosen(budget: int) -> str:
        try:
            return choose_plan(offered, budget, prediction_margin_bytes(budget)).code
        except InfeasibleBudgetError:
            return ""

    selective = [b for b in range(low, high, max(1, (high - low) // 40)) if set(chosen(b)) & set("Ss")]
    budget = selective[len(selective) // 2]  # away from the edges, where a run's own measurements may plan otherwise
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        context = get_act_offloading_ctx_manager(model := tiny_gemma3n(), device_type="cpu", memory_budget=budget)
        results = train(model, context, steps=8)  # past the trial of plain checkpointing
    assert_bitwise_equal(results, train(tiny_gemma3n(), Unchanged(), steps=8))
    assert not set(context.budget_controller.plan.code) & set("Ss")
    assert not context.budget_controller.profile.selective_checkpoint
    assert "does not checkpoint layers selectively: model.layers.0: aten.add_.Tensor writes in place" in caplog.text

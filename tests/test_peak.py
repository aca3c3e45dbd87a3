"""hf_offload/peak.py: where the measured step's peak is set, the bounds of the peak without offloading, and the
engine standing aside where offloading cannot lower it (`min_peak_reduction`).

The CPU has no peak counter, so the engine's tests give its watch a counter that reads a scripted peak per phase;
everything else (the phases' boundaries, the bytes away in each, standing aside, resuming at a longer step, the
summary) runs as on a GPU, in the CPU test mode.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

import hf_offload
from hf_offload.peak import AFTER, BACKWARD, FORWARD, HEAD, PeakReport, PhasePeak, StepPeakWatch
from hf_offload.units import GIB, MIB


def test_head_set_peak_is_lowered_by_exactly_what_was_away() -> None:
    report = PeakReport(
        (
            PhasePeak(FORWARD, 10 * GIB, 0, GIB),
            PhasePeak(HEAD, 20 * GIB, GIB, GIB),
            PhasePeak(BACKWARD, 15 * GIB, 0, GIB),
            PhasePeak(AFTER, 12 * GIB, 0, 0),
        ),
        tokens=4096,
    )
    assert report.peak_bytes == 20 * GIB and report.set_in == HEAD
    assert report.without_least_bytes == report.without_most_bytes == 21 * GIB
    assert report.most_reduction == pytest.approx(1 / 21)
    assert report.describe() == (
        "the step's peak is 20.00 GiB, set in the head and loss; without offloading it would be 21.00 GiB: "
        "offloading lowers it by 1.00 GiB (at most 4.8%)"
    )


def test_optimizer_set_peak_is_not_lowered_at_all() -> None:
    report = PeakReport(
        (
            PhasePeak(FORWARD, 8 * GIB, 0, GIB),
            PhasePeak(HEAD, 9 * GIB, GIB, GIB),
            PhasePeak(BACKWARD, 9 * GIB, 0, GIB),
            PhasePeak(AFTER, 12 * GIB, 0, 0),
        )
    )
    assert report.set_in == AFTER and report.without_most_bytes == report.peak_bytes and report.most_reduction == 0
    assert "lowers it by 0 B (at most 0.0%)" in report.describe()


def test_a_backward_set_peak_has_bounds() -> None:
    report = PeakReport(
        (
            PhasePeak(FORWARD, 5 * GIB, 0, GIB),
            PhasePeak(HEAD, 6 * GIB, GIB, GIB),
            PhasePeak(BACKWARD, 10 * GIB, 0, GIB),
            PhasePeak(AFTER, 4 * GIB, 0, 0),
        )  # fmt: skip
    )
    assert (report.without_least_bytes, report.without_most_bytes) == (10 * GIB, 11 * GIB)
    assert "between 10.00 GiB and 11.00 GiB" in report.describe() and "by 0 B to 1.00 GiB" in report.describe()


class _ScriptedCounter:
    """A peak counter whose reads return the given values in turn, then 0."""

    def __init__(self, values: list[int]) -> None:
        self.values = list(values)
        self.reads = 0

    def __call__(self) -> int:
        self.reads += 1
        return self.values.pop(0) if self.values else 0


def test_watch_measures_the_second_step_only() -> None:
    counter = _ScriptedCounter([0, 1, 2, 3, 4])
    watch = StepPeakWatch(counter)
    assert watch.step_begins() is None and counter.reads == 0  # the first step is not measured
    watch.forward_ends(100)
    watch.backward_begins(100)
    assert watch.step_begins() is None and watch.measuring  # the second step starts: the counter is reset
    watch.note_tokens(64)
    watch.forward_ends(100)
    watch.backward_begins(100)
    watch.backward_ends()
    report = watch.step_begins()
    assert report is watch.report and not watch.measuring and counter.reads == 5
    assert [(p.name, p.peak_bytes, p.least_away_bytes, p.most_away_bytes) for p in report.phases] == [
        (FORWARD, 1, 0, 100), (HEAD, 2, 100, 100), (BACKWARD, 3, 0, 100), (AFTER, 4, 0, 0)]  # fmt: skip
    assert report.tokens == 64
    watch.step_begins()
    assert counter.reads == 5  # nothing measured after the report


def test_watch_without_a_head_hook_joins_forward_and_head() -> None:
    watch = StepPeakWatch(_ScriptedCounter([0, 5, 3, 1]))
    watch.step_begins()
    watch.step_begins()
    watch.backward_begins(10)
    watch.backward_ends()
    report = watch.step_begins()
    assert [phase.name for phase in report.phases] == ["forward, head and loss", BACKWARD, AFTER]
    assert report.set_in == "forward, head and loss" and report.without_most_bytes == 15


def test_watch_tries_later_steps_when_the_measured_one_has_no_backward() -> None:
    counter = _ScriptedCounter([])
    watch = StepPeakWatch(counter)
    for _ in range(6):  # an evaluation forward after another, never a backward
        watch.step_begins()
        watch.forward_ends(0)
    assert watch.report is None and not watch.measuring
    assert counter.reads == 3 * 3  # three attempts (a reset and two phases each), then no more resets


def test_no_counter_measures_nothing() -> None:
    watch = StepPeakWatch(lambda: None)
    for _ in range(3):
        watch.step_begins()
        watch.forward_ends(1)
        watch.backward_begins(1)
        watch.backward_ends()
    assert watch.report is None and not watch.measuring


# ------------------------------------------------------------------------------------------------ the engine


def _model(checkpointing: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256, use_cache=False,
                                      attn_implementation="sdpa")  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _train(lengths: list[int], peaks: list[int] | None, **options) -> tuple[list, list, list, object]:
    """SGD steps at the given sequence lengths; with `peaks`, the engine's watch reads them as the device's counter
    (one per read: the reset at the second step's start, then one per phase)."""
    model = _model()
    context = None
    if peaks is not None:
        context = hf_offload.get_act_offloading_ctx_manager(model, device_type="cpu", min_offload_size=0, **options)
        context._peak_watch = StepPeakWatch(_ScriptedCounter(peaks))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, stats = [], []
    for step, length in enumerate(lengths):
        input_ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(step))
        with context if context is not None else torch.enable_grad():
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        stats.append(context.get_stats() if context is not None else None)
    return losses, [p.detach().clone() for p in model.parameters()], stats, context


# The second step's phases: the head and loss set a peak of 1 GiB that the few KiB this model offloads barely lower.
_HEAD_SET = [0, GIB // 2, GIB, GIB // 2, GIB // 4]


def test_engine_reports_the_measured_step_and_by_default_stands_aside_where_offloading_helps_little(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        _, _, stats, context = _train([32, 32, 32, 32], _HEAD_SET)
    report = context.peak_report
    assert [phase.name for phase in report.phases] == [FORWARD, HEAD, BACKWARD, AFTER]
    away = stats[1]["bytes_offloaded"]
    assert away > 0 and report.phases[1].least_away_bytes == report.phases[1].most_away_bytes == away
    assert report.tokens == 2 * 32 and report.set_in == HEAD and report.without_most_bytes == GIB + away
    warnings = [r.message for r in caplog.records if "offloading stands aside (moves nothing)" in r.message]
    assert len(warnings) == 1 and report.describe() in warnings[0] and "min_peak_reduction=0.05" in warnings[0]
    assert context.standing_aside == "cannot_lower_peak" and stats[3]["bytes_offloaded"] == 0
    assert report.describe() in hf_offload.format_summary(context.get_stats(), "cpu", report)


def test_min_peak_reduction_none_keeps_offloading_on_and_only_reports(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        _, _, stats, context = _train([32, 32, 32, 32], _HEAD_SET, min_peak_reduction=None)
    assert context.standing_aside is None and all(s["bytes_offloaded"] > 0 for s in stats)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.message for r in caplog.records].count(f"hf_offload: {context.peak_report.describe()}") == 1


def test_engine_stands_aside_below_min_peak_reduction_and_stays_exact(caplog) -> None:
    reference_losses, reference_weights, _, _ = _train([32, 32, 32, 32, 48, 48], None)
    with caplog.at_level(logging.INFO, logger="hf_offload"):
        losses, weights, stats, context = _train([32, 32, 32, 32, 48, 48], _HEAD_SET, min_peak_reduction=0.05)
    # Steps 1-2 offload; the report comes as step 3 starts (its first pack went through before it): the rest of
    # step 3 is counted as kept for the reason. Step 4's region is entered while offloading stands aside, so it
    # pushes no saved-tensor hooks: no tensor reaches the engine, and the step is counted as one stood aside.
    assert stats[1]["bytes_offloaded"] > 0 and stats[2]["tensors_kept_cannot_lower_peak"] > 0
    kept = {k for k, v in stats[2].items() if k.startswith("tensors_kept_") and v}
    assert kept == {"tensors_kept_cannot_lower_peak", "tensors_kept_exempt"}  # the head's region counts its own
    assert stats[3]["steps_stood_aside_cannot_lower_peak"] == 1 and stats[3]["bytes_offloaded"] == 0
    assert not any(v for k, v in stats[3].items() if k.startswith("tensors_kept_"))
    # A step of more tokens than the measured one: offloading resumes inside the region that was entered standing
    # aside (the model's pre-hook pushes the hooks), and stays on.
    assert stats[4]["bytes_offloaded"] > 0 and stats[5]["bytes_offloaded"] > 0
    assert stats[4]["steps_stood_aside_cannot_lower_peak"] == 0
    assert context.standing_aside is None
    messages = [r.message for r in caplog.records]
    assert sum("offloading stands aside (moves nothing) from now on, until a step of more than 64 tokens" in m
               for m in messages) == 1  # fmt: skip
    assert sum("a step of 96 tokens, more than the 64" in m for m in messages) == 1
    assert all(torch.equal(a, b) for a, b in zip(losses, reference_losses))
    assert all(torch.equal(a, b) for a, b in zip(weights, reference_weights))


def test_engine_keeps_offloading_where_it_lowers_the_peak_enough() -> None:
    # The head's peak is barely above the other phases: what the forward moved away counts in full.
    _, _, stats, context = _train([32, 32, 32], [0, 100, 120, 110, 50], min_peak_reduction=0.05)
    assert context.peak_report.most_reduction > 0.05 and context.standing_aside is None
    assert stats[2]["bytes_offloaded"] > 0


def test_min_peak_reduction_is_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="min_peak_reduction"):
        hf_offload.OffloadOptions(min_peak_reduction=0.9)
    assert hf_offload.OffloadOptions(min_peak_reduction="none").min_peak_reduction is None
    assert hf_offload.OffloadOptions().min_peak_reduction == 0.05
    # Under a budget the plan decides what moves, and the option is not used: its default is no conflict.
    assert hf_offload.OffloadOptions(memory_budget="2GiB", device_type="cpu").min_peak_reduction == 0.05


def test_no_counter_no_report() -> None:
    model = _model()
    context = hf_offload.get_act_offloading_ctx_manager(model, device_type="cpu", min_offload_size=0)
    for _ in range(3):
        with context:
            loss = model(input_ids=torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long)).loss
        loss.backward()
    assert context.peak_report is None and context.standing_aside is None
    assert MIB  # the units the report writes in are the library's


def test_tokens_come_from_inputs_embeds_too_and_unknown_tokens_never_stand_aside(caplog) -> None:
    model = _model()
    embeds = model.get_input_embeddings()
    context = hf_offload.get_act_offloading_ctx_manager(model, device_type="cpu", min_offload_size=0,
                                                        min_peak_reduction=0.05)  # fmt: skip
    context._peak_watch = StepPeakWatch(_ScriptedCounter(_HEAD_SET))
    input_ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        with context:
            loss = model(inputs_embeds=embeds(input_ids), labels=input_ids).loss
        loss.backward()
    assert context.peak_report.tokens == 32 and context.standing_aside == "cannot_lower_peak"

    blind = hf_offload.OffloadActivations(device_type="cpu", min_offload_size=0, min_peak_reduction=0.05)
    blind._peak_watch = StepPeakWatch(_ScriptedCounter(_HEAD_SET))
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        for _ in range(3):  # no model hooks at all: the tokens stay unknown
            with blind:
                loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
    assert blind.peak_report is not None and blind.standing_aside is None
    assert any("did not say how many tokens" in record.message for record in caplog.records)


def test_standing_aside_a_context_around_many_steps_still_counts_them() -> None:
    model = _model()
    context = hf_offload.get_act_offloading_ctx_manager(model, device_type="cpu", min_offload_size=0,
                                                        min_peak_reduction=0.05)  # fmt: skip
    context._peak_watch = StepPeakWatch(_ScriptedCounter(_HEAD_SET))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    input_ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with context:  # one context around the whole loop, as a custom loop may have it
        for _ in range(5):
            model(input_ids=input_ids, labels=input_ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    stats = context.consume_stats()
    assert context.standing_aside == "cannot_lower_peak" and stats["steps"] == 5

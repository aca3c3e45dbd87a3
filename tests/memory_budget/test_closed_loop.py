"""What the closed loop learns from the steps plans ran (`closed_loop`): the plans' measurements, the model's peak
correction and the reloads the head hides."""

from __future__ import annotations

from step_profiles import s1_profile

from hf_offload.memory_budget.closed_loop import (
    MEASURED_STEPS,
    TRIAL_MEASURED_STEPS,
    Sample,
    head_reload_hidden,
    held_growth,
    measured_plans,
    peak_correction,
)

GIB = 2**30


def test_growth_of_the_memory_held_counts_only_past_the_allocators_noise():
    assert held_growth(100 * GIB, 101 * GIB) == 0  # 1%: noise, most likely the measured step's own
    assert held_growth(100 * GIB, 110 * GIB) == 10 * GIB  # the optimizer's state appeared since
    assert held_growth(100 * GIB, 90 * GIB) == 0


def test_a_plan_counts_once_it_has_enough_steps_by_its_fastest_time_and_largest_peak():
    profile = s1_profile()
    tokens, budget, held = profile.tokens, 40 * GIB, 10 * GIB

    def measured(samples, trialled=frozenset(), held_now=held, accumulate=False):
        return measured_plans(samples, profile, profile.scaled, budget, held_now, accumulate, set(trialled))

    steps = [Sample(tokens, 0.30 + i / 100, (20 + i) * GIB, static_bytes=held) for i in range(MEASURED_STEPS)]
    (plan,) = measured({"C" * 16: steps})
    assert (plan.code, plan.step_s, plan.peak_bytes) == ("C" * 16, 0.30, (20 + MEASURED_STEPS - 1) * GIB)
    assert measured({"C" * 16: steps[:-1]}) == []  # fewer steps are noise
    assert len(measured({"c" * 16: steps[:TRIAL_MEASURED_STEPS]}, trialled={"c" * 16})) == 1  # a trial's are fewer
    assert len(measured({"C" * 16: [Sample(tokens, 0.3, 20 * GIB, profiled=True)]})) == 1  # the profiled step
    # One exact step over the budget proves the plan does not fit, alone.
    (over,) = measured({"O" * 16: [Sample(tokens, 0.3, budget + 1, peak_exact=True)]})
    assert over.peak_bytes == budget + 1
    # A peak grows by what the memory held grew since its step began.
    (grown,) = measured({"C" * 16: steps}, held_now=held * 2)
    assert grown.peak_bytes == plan.peak_bytes + held


def test_the_peak_correction_is_the_largest_excess_grown_with_the_step_and_never_shrunk():
    def exact(tokens: int, peak: int, predicted: int) -> Sample:
        return Sample(tokens, 0.1, peak, peak_exact=True, predicted_peak_bytes=predicted, head_base_bytes=predicted)

    samples = {"CC": [exact(1000, 105, 100)], "cc": [exact(1000, 110, 100), exact(1000, 90, 100)]}
    assert peak_correction(samples, 1000) == (10, "cc")
    assert peak_correction(samples, 4000) == (40, "cc")  # grown in proportion to a longer step
    assert peak_correction(samples, 10) == (10, "cc")  # never shrunk
    assert peak_correction({"CC": [exact(1000, 90, 100)]}, 1000) == (0, "")  # the model was never low
    assert peak_correction({"CC": [Sample(1000, 0.1, 105, predicted_peak_bytes=100)]}, 1000) == (0, "")  # a bound


def test_the_head_hides_at_most_the_reloads_it_counted_and_less_at_a_shorter_step():
    sample = Sample(1000, 0.1, 100, peak_exact=True, predicted_peak_bytes=100, head_base_bytes=90,
                    head_reload_bytes=30)  # fmt: skip
    assert head_reload_hidden({"OO": [sample]}, 1000) == 20  # the head's point was 120, the step peaked at 100
    assert head_reload_hidden({"OO": [sample]}, 500) == 10  # shrunk for a shorter step
    assert head_reload_hidden({"OO": [sample]}, 4000) == 20  # not grown for a longer one
    higher = Sample(1000, 0.1, 10, peak_exact=True, predicted_peak_bytes=10, head_base_bytes=90, head_reload_bytes=30)
    assert head_reload_hidden({"OO": [higher]}, 1000) == 30  # at most what it counted

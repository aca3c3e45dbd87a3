"""The memory budget across ranks (`memory_budget/ranks.py` and the controller's use of it), with two processes of a
gloo group on the CPU: rank 0's plan on every rank, made for the longest of the ranks' steps and the smallest of
their host caps, and the ranks re-planning together or not at all (one re-planning alone would hang)."""

import multiprocessing
import socket

from budget_runs import LAYERS, planned_minimum
from ranks import fsdp2_train_on_rank, plan_on_rank, train_on_rank

from hf_offload.memory_budget.simulate import MeasuredStep


def on_two_ranks(target, *args) -> dict[int, object]:
    """What `target(rank, port, queue, *args)` puts on its queue in each of two spawned processes of a gloo group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=target, args=(rank, port, results, *args)) for rank in (0, 1)]
    try:
        for process in processes:
            process.start()
        return dict(results.get(timeout=240) for _ in processes)  # a rank left waiting in a collective fails here
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def test_every_rank_gets_rank_zeros_plan_or_its_refusal():
    """A refusal raised on rank 0 alone would leave the other ranks waiting in the plan's broadcast."""
    outcomes = on_two_ranks(plan_on_rank)
    assert outcomes[0] == outcomes[1]
    assert [outcome[0] for outcome in outcomes[0]] == ["plan", "refused", "plan"]
    assert outcomes[1][2][1:] == ("CC", MeasuredStep("CC", step_s=0.01, peak_bytes=10_001))


def test_ranks_with_steps_of_different_lengths_run_one_plan_made_for_the_longest_and_the_smallest_host():
    """Padding-free packing gives the ranks different lengths in one step; here rank 1's step is longer at the 4th
    and 9th steps, rank 0's at the 6th and 10th. Every rank runs the same plan at every step, made for at least the
    longest rank's tokens (the 4th and 9th re-plan on both ranks, though rank 0's steps did not grow; the shorter
    steps after them run the plans kept for their lengths, or plans made for them, on both ranks), with the same
    pool cap, which the rank with less host memory can hold; and the arithmetic is exact on both."""
    lengths = ((16, 16, 16, 16, 16, 24, 16, 16, 16, 40), (16, 16, 16, 32, 16, 16, 16, 16, 48, 16))
    budget = int(planned_minimum() * 1.5)
    outcomes = on_two_ranks(train_on_rank, lengths, budget, (100.0, 16.0))
    for rank in (0, 1):
        assert outcomes[rank][0] != "error", outcomes[rank]
    (steps, exact, _), (other_steps, other_exact, smaller_most) = outcomes[0], outcomes[1]
    assert exact and other_exact
    assert steps == other_steps
    assert steps[:2] == [None, None]  # the profiled steps: no plan yet
    for index in range(2, len(steps)):
        code, tokens, cap = steps[index]
        assert len(code) == LAYERS
        assert tokens >= 2 * max(lengths[0][index], lengths[1][index])  # two sequences per step
        assert cap <= smaller_most
    # A shorter step runs the plan kept for its length, or one made for the length step above it (48 -> 54, 80 -> 91).
    assert [step[1] for step in steps[2:]] == [32, 64, 32, 54, 32, 32, 96, 91]


def test_after_a_step_that_no_plan_fits_on_one_rank_both_ranks_run_the_plan_that_fits_the_shorter_steps_again():
    """Rank 1's 5th step and rank 0's 6th are twice as long as the others, and no plan fits them under a budget just
    above the smallest that fits the others: both ranks run the lowest-memory plan made for the longest in those
    two steps, and the plan made for the shorter ones again after them, exactly."""
    lengths = ((16, 16, 16, 16, 16, 32, 16, 16), (16, 16, 16, 16, 32, 16, 16, 16))
    outcomes = on_two_ranks(train_on_rank, lengths, int(planned_minimum() * 1.006), (100.0, 100.0))
    for rank in (0, 1):
        assert outcomes[rank][0] != "error", outcomes[rank]
    (steps, exact, _), (other_steps, other_exact, _) = outcomes[0], outcomes[1]
    assert exact and other_exact and steps == other_steps
    assert [None if step is None else step[1] for step in steps] == [None, None, 32, 32, 64, 64, 32, 32]


def test_a_known_longest_step_that_no_plan_fits_is_refused_on_both_ranks():
    """`memory_budget_max_tokens` checked at the first plan under torch.distributed: rank 0's refusal is every
    rank's (raised on one rank alone, it would leave the other waiting in the next collective)."""
    lengths = ((16, 16, 16, 16), (16, 16, 16, 16))
    outcomes = on_two_ranks(train_on_rank, lengths, int(planned_minimum() * 1.006), (100.0, 100.0), 2 * 32)
    for rank in (0, 1):
        assert outcomes[rank][0] == "error" and "the longest step this run may see, 64 tokens" in outcomes[rank][1]


def test_fsdp2_sharded_layers_are_probed_and_planned_on_both_ranks_and_stay_exact():
    """FSDP2 gathers a layer's parameters in its forward pre-hook and frees them in its forward hook: the probes, which
    run the layer from inside the step's call, once freed them under it (on the CPU with transformers 5.24: "got mixed
    torch.Tensor and DTensor"; on two H200s with 5.17, whose probes run before the hooks on sharded parameters:
    "Attempted to access the data pointer on an invalid python storage"). Both ranks now run one plan, which
    checkpoints layers (this budget is about 1.5x the smallest plan's peak at 64 tokens), and their losses and gradient
    shards are bitwise those of FSDP2 alone. The profile counts what FSDP2 holds: a layer's parameters gathered whole
    while it runs, gradients by their local shards (on two H200s, counted whole, they hid at the profiled steps' peak
    what the model missed elsewhere, and a plan peaked 1.3% over its budget)."""
    outcomes = on_two_ranks(fsdp2_train_on_rank, int(planned_minimum() * 2.2))
    for rank in (0, 1):
        assert outcomes[rank][0] != "error", outcomes[rank]
    (codes, exact, counted, truth), (other_codes, other_exact, *_) = outcomes[0], outcomes[1]
    assert exact and other_exact
    # The profile counts a layer's parameters whole while FSDP2 gathers them, and its gradients by their local
    # shards; the model's too, but for the root's (embeddings, head, final norm): FSDP2 gathers those before the
    # forward's hooks run and holds them through backward, so they are counted whole, which is more.
    (gathered, layer_gradients, gradients), (whole, local, model_local, model_whole) = counted, truth
    assert gathered == whole and layer_gradients == local < whole, (counted, truth)
    assert model_local < gradients < model_whole, (counted, truth)
    assert codes == other_codes
    assert codes[:2] == [None, None]  # the profiled steps
    assert len(codes[-1]) == LAYERS and set(codes[-1]) & set("cC"), codes


def test_ranks_that_each_hold_a_shard_of_the_sequences_plan_for_their_shard_and_agree():
    """Under context or sequence parallelism a rank's layers see its shard of every sequence: here each rank trains
    on its half of 2 x 64 tokens, with the shard's positions. `memory_budget_max_tokens` is a rank's (what the Trainer
    passes from a TRL config: max_length x batch over cp_size or sp_size), the ranks agree on one plan, made for the
    shard's 64 tokens, and each rank's training is bitwise that of its shard without offloading."""
    lengths = ((64,) * 5, (64,) * 5)
    outcomes = on_two_ranks(train_on_rank, lengths, int(planned_minimum() * 1.5), (100.0, 100.0), 2 * 32, True)
    for rank in (0, 1):
        assert outcomes[rank][0] != "error", outcomes[rank]
    (steps, exact, _), (other_steps, other_exact, _) = outcomes[0], outcomes[1]
    assert exact and other_exact
    assert steps == other_steps
    assert steps[:2] == [None, None]  # the profiled steps
    assert [step[1] for step in steps[2:]] == [64, 64, 64]

"""The end-of-training summary (`hf_offload/stats.py`'s `format_summary`): what people read, every figure explained,
in the words of the device it ran on. The Trainer's log entries are `callbacks/test_stats_logs.py`'s, where the
summary lands in a terminal `callbacks/test_callback.py`'s."""

from hf_offload import format_summary
from hf_offload.stats import KEPT_REASONS

STATS = {
    "steps": 2, "tensors_offloaded": 80, "bytes_offloaded": 2 * 3 * 2**20, "prefetch_hits": 2, "prefetch_misses": 4,
    "tensors_kept_tail": 4, "bytes_kept_tail": 2 * 2**20, "tensors_kept_too_small": 2, "bytes_kept_too_small": 1024,
    "compute_wait_s": 0.004, "pinned_bytes": 4 * 2**20,
}  # fmt: skip


def test_the_summary_says_where_tensors_stayed_for_the_device():
    on_gpu, in_test_mode = format_summary(STATS, "cuda"), format_summary(STATS, "cpu")
    assert "kept on the GPU per step:" in on_gpu and "CPU test mode" not in on_gpu
    assert "GPU" not in in_test_mode.replace("no GPU involved", "") and "kept in place per step:" in in_test_mode
    assert "in CPU test mode" in in_test_mode.splitlines()[0]
    # No side streams in the CPU test mode: "0 of 6 ahead of need" would read as a failure.
    assert (
        "reloads in backward: 6 (2 started ahead by the prefetch bookkeeping; the CPU test mode copies" in in_test_mode
    )
    assert "ahead of need" not in in_test_mode


def test_every_figure_of_the_summary_is_explained():
    lines = format_summary(STATS, "cuda").splitlines()
    assert "  moved to host memory per step: 3.00 MiB (40 tensors)" in lines
    assert f"    tail: 1.00 MiB ({KEPT_REASONS['tail']})" in lines
    assert f"    too_small: 512 B ({KEPT_REASONS['too_small']})" in lines
    assert any("2 of 6 (33%) were copied back ahead of need; the others when backward reached them" in line
               for line in lines)  # fmt: skip
    assert "  compute waited for copies: 2.00 ms per step" in lines
    assert "  pinned host memory held (a pool reused every step): 4.00 MiB" in lines


def test_with_gradient_accumulation_the_summary_counts_micro_steps():
    """The engine's step is a forward and backward pass: 4 optimizer steps accumulating over 4 passes are 16 of
    them, which the summary calls micro-steps, with the optimizer steps they make."""
    stats = {"steps": 16, "tensors_offloaded": 32, "bytes_offloaded": 16 * 2**20}
    summary = format_summary(stats, "cuda", accumulation_steps=4)
    assert summary.startswith("activation offloading over 16 micro-step(s) (4 optimizer steps of 4):")
    assert "moved to host memory per micro-step: 1.00 MiB (2 tensors)" in summary and "per step" not in summary
    assert format_summary(stats, "cuda").startswith("activation offloading over 16 step(s):")


def test_the_summary_says_what_growing_the_pool_took_where_it_grew():
    assert "grown by" not in format_summary(STATS, "cuda")  # the pool made in earlier steps, reused
    grew = {**STATS, "pool_grown_bytes": 4 * 2**20, "pool_growth_s": 1.5}
    assert ("  pinned host memory held (a pool reused every step): 4.00 MiB, grown by 4.00 MiB in these steps, which "
            "took 1.50 s of the training thread") in format_summary(grew, "cuda").splitlines()  # fmt: skip

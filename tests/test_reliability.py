"""Long runs and interrupted steps on CPU bookkeeping: nothing grows, and the next step is exact.

The engine's CPU test mode (device_type="cpu") runs the same pack/unpack, dedup, pool and stats code as on a GPU;
these tests watch its internal tables, its host pool and the process's memory over many steps.
"""

from __future__ import annotations

import gc

import psutil
import pytest
import torch
import transformers

from hf_offload import get_act_offloading_ctx_manager


def tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def batch(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, 32), generator=generator)
    return {"input_ids": ids, "labels": ids}


def train_step(model, optimizer, engine, seed: int) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    if engine is None:
        loss = model(**batch(seed)).loss
    else:
        with engine:
            loss = model(**batch(seed)).loss
    loss.backward()
    optimizer.step()
    return loss.detach()


def engine_tables(engine) -> dict[str, int]:
    """Sizes of everything the engine keeps between steps."""
    pool = engine._pool
    # The dedup table holds one entry per storage offloaded this step; a storage freed during the forward may
    # hand its address to the next, replacing an entry, so its size is bounded by the copies, not constant.
    assert len(engine._dedup) <= len(engine._step.copies)
    return {
        "step_copies": len(engine._step.copies),
        "lanes": len(engine._lanes),
        "inflight": sum(len(lane.inflight) for lane in engine._lanes.values()),
        "pending_waits": len(engine._stats.total._pending_waits),
        "warned": len(engine._warned),
        "pool_chunks": pool.allocations,
        "pool_capacity": pool.capacity,
        "pool_in_use": pool.bytes_in_use(),
        "free_ranges": sum(len(ranges) for ranges in pool._free),
    }


def test_soak_tables_pool_and_rss_stay_flat() -> None:
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = get_act_offloading_ctx_manager(model, device_type="cpu", min_offload_size=0)
    process = psutil.Process()
    for seed in range(20):  # warm-up: allocator caches, optimizer state, the pool's first growth
        train_step(model, optimizer, engine, seed)
        engine.consume_stats()
    gc.collect()
    baseline_tables = engine_tables(engine)
    baseline_rss = process.memory_info().rss
    for seed in range(20, 220):
        train_step(model, optimizer, engine, seed)
        engine.consume_stats()
        assert engine_tables(engine) == baseline_tables, seed
    gc.collect()
    grown = process.memory_info().rss - baseline_rss
    assert grown < 16 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 200 steps"
    assert baseline_tables["pool_in_use"] == 0 and baseline_tables["inflight"] == 0


def paired_runs(fault) -> None:
    """Runs 3 steps with offloading and `fault()` after the first; compares with 3 clean steps without it."""
    reference_model = tiny_llama()
    reference_optimizer = torch.optim.AdamW(reference_model.parameters(), lr=1e-3)
    expected = [train_step(reference_model, reference_optimizer, None, seed) for seed in range(3)]

    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = get_act_offloading_ctx_manager(model, device_type="cpu", min_offload_size=0)
    losses = [train_step(model, optimizer, engine, 0)]
    in_use = engine._pool.bytes_in_use()
    fault(model, engine)
    gc.collect()
    assert engine._pool.bytes_in_use() == in_use == 0  # the fault's step left nothing behind
    losses += [train_step(model, optimizer, engine, seed) for seed in (1, 2)]
    for got, want in zip(losses, expected):
        assert torch.equal(got, want)
    for got, want in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(got, want)
    assert engine.get_stats()["bytes_offloaded"] > 0


def evaluation_with_grad(model, engine) -> None:
    with engine:
        _ = model(**batch(99)).loss  # never backpropagated


def evaluation_without_grad(model, engine) -> None:
    model.eval()
    with torch.no_grad(), engine:
        model(**batch(99))
    model.train()


def interrupt_between_forward_and_backward(model, engine) -> None:
    try:
        with engine:
            loss = model(**batch(99)).loss
        raise KeyboardInterrupt  # e.g. a user stopping a notebook cell before backward
    except KeyboardInterrupt:
        del loss


def exception_inside_forward(model, engine) -> None:
    original = model.model.layers[1].forward

    def broken(*args, **kwargs):
        raise RuntimeError("layer failed")

    model.model.layers[1].forward = broken
    try:
        with pytest.raises(RuntimeError, match="layer failed"), engine:
            model(**batch(99))
    finally:
        model.model.layers[1].forward = original


@pytest.mark.parametrize(
    "fault",
    [evaluation_with_grad, evaluation_without_grad, interrupt_between_forward_and_backward, exception_inside_forward],
)
def test_next_steps_exact_after(fault) -> None:
    paired_runs(fault)


@pytest.mark.parametrize("memory_budget", [None, 10**12], ids=["offloading", "memory_budget"])
def test_a_context_and_model_dropped_after_remove_hooks_are_freed_without_a_garbage_collection(memory_budget) -> None:
    """The tail's exempt regions, one or more per step, once referred to themselves through their pack hook (a bound
    method) and held their engine: the engine, its memory budget's controller and through it the model's layers stayed
    allocated until a full garbage collection, on the GPU too."""
    import weakref

    model = tiny_llama()
    options = {} if memory_budget is None else {"memory_budget": memory_budget}
    engine = get_act_offloading_ctx_manager(model, device_type="cpu", **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gc.collect()
    gc.disable()  # from here on only reference counts free anything
    try:
        for seed in range(4):
            train_step(model, optimizer, engine, seed)
        engine.remove_hooks()
        dropped_engine, dropped_layer = weakref.ref(engine), weakref.ref(model.model.layers[0])
        del model, engine, optimizer
        assert dropped_engine() is None and dropped_layer() is None
    finally:
        gc.enable()

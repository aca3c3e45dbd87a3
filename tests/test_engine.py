"""The engine's bookkeeping on CPU tensors (device_type="cpu" moves them to a separate host buffer).

Every test drives real autograd through the real hooks; nothing is mocked, except the accelerator's streams and
events where a test says so (`stand_in_streams`): the CPU has none, and the engine's prefetch decisions live there.
"""

from __future__ import annotations

import ast
import gc
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from stand_in_streams import use_stand_in_streams

from hf_offload import NoOpManager, OffloadActivations
from hf_offload.engine import CopyWindows, EngineSettings, top_saved_tensors_pack_hook
from hf_offload.host_memory import HostMemory, PinnedHostPool, default_host_memory_reserve


def cpu_engine(**options) -> OffloadActivations:
    options.setdefault("min_offload_size", 0)
    return OffloadActivations(device_type="cpu", **options)


class SaveProbe(torch.autograd.Function):
    """Saves `probe` for backward and hands back, in `captured`, the tensor autograd restores."""

    captured: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx, x: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(probe)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        SaveProbe.captured.append(ctx.saved_tensors[0])
        return grad, None


def round_trip(engine: OffloadActivations, *probes: torch.Tensor) -> list[torch.Tensor]:
    SaveProbe.captured = []
    x = torch.ones(2, requires_grad=True)
    with engine:
        y = x
        for probe in probes:
            y = SaveProbe.apply(y, probe)
    y.sum().backward()
    return SaveProbe.captured[::-1]  # backward runs in reverse order


@pytest.mark.parametrize(
    "make",
    [
        lambda base: base,
        lambda base: base.t(),  # non-contiguous
        lambda base: base[3:7, 2:],  # storage offset, non-contiguous rows
        lambda base: base[:, :1].expand(10, 12),  # stride-0 broadcast
        lambda base: base.view(-1)[5:50:3],  # strided 1-D slice
        lambda base: base.unsqueeze(1).expand(10, 4, 12),  # broadcast in the middle
    ],
    ids=["plain", "transposed", "offset", "broadcast", "strided", "broadcast-middle"],
)
def test_restores_values_and_geometry_exactly(make) -> None:
    base = torch.randn(10, 12)
    probe = make(base)
    (restored,) = round_trip(cpu_engine(), probe)
    assert torch.equal(restored, probe)
    assert restored.shape == probe.shape and restored.stride() == probe.stride()
    assert restored.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()  # really a copy


def test_broadcast_copies_only_the_underlying_span() -> None:
    engine = cpu_engine()
    small = torch.randn(16, 1)
    round_trip(engine, small.expand(16, 4096))
    assert engine.get_stats()["bytes_offloaded"] == 16 * 4


def test_views_of_one_storage_are_offloaded_once() -> None:
    engine = cpu_engine()
    base = torch.randn(8, 8)
    restored = round_trip(engine, base, base[2:5], base.t(), base)
    for got, want in zip(restored, [base, base[2:5], base.t(), base]):
        assert torch.equal(got, want) and got.stride() == want.stride()
    stats = engine.get_stats()
    assert stats["tensors_offloaded"] == 1 and stats["bytes_offloaded"] == 8 * 8 * 4
    assert stats["tensors_kept_duplicate"] == 3


def test_prefetch_order_lists_a_storage_again_at_its_last_save() -> None:
    """Backward first unpacks a storage where the forward saved it last, so the prefetch walk (down the step's
    list) must reach it there. The streams that follow this order run on the GPU (test_engine_streams.py)."""
    engine = cpu_engine()
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    x = torch.ones(2, requires_grad=True)
    with engine:
        y = SaveProbe.apply(SaveProbe.apply(SaveProbe.apply(x, a), b), a[1:])
        order = [ref() for ref in engine._step.copies]
    assert len(order) == 3 and order[0] is order[2] and order[1] is not order[0]
    y.sum().backward()


@pytest.mark.parametrize("points", ["every layer", "odd layers"])
def test_reloads_that_no_prefetch_point_started_are_started_by_unpacks_from_the_next_step(points) -> None:
    """Where prefetch points take over from unpacks (checkpointing), a layer whose point never fires (compiled away,
    or no attention in it) would reload its input on demand at every step. The first such miss teaches the engine:
    from the next step on, the unpack before it starts that reload, and only that one; the others stay with their
    points (their place in the layer's backward keeps the reload off the recomputation's peak)."""
    engine = use_stand_in_streams(cpu_engine(keep_tail=False))
    engine.prefetch_on_unpack = False  # as the model's hooks set it under checkpointing
    probes = [torch.randn(64) for _ in range(6)]
    pointed = [i for i in range(len(probes)) if points == "every layer" or i % 2]
    reloads: list[tuple[str, int]] = []  # (who started it, the copy's position)
    started_by = ["unpack"]
    prefetch_from_hook, reload = engine._prefetch_from_hook, engine._reload

    def from_point(step, window):
        started_by[0] = "point"
        prefetch_from_hook(step, window)
        started_by[0] = "unpack"

    engine._prefetch_from_hook = from_point
    engine._reload = lambda copy, compute: (reloads.append((started_by[0], copy.position)), reload(copy, compute))[1]

    def step() -> dict:
        reloads.clear()
        SaveProbe.captured = []
        x = torch.ones(2, requires_grad=True)
        with engine:
            y = x
            for i, probe in enumerate(probes):
                y = SaveProbe.apply(y, probe)
                if i in pointed:  # fires just before layer i's backward unpacks its probe
                    y.register_hook(engine.prefetch_hook())
        y.sum().backward()
        assert all(torch.equal(got, want) for got, want in zip(SaveProbe.captured[::-1], probes))
        return engine.get_stats()

    missed = len(probes) - len(pointed)
    assert step()["prefetch_misses"] == missed
    second = step()
    assert (second["prefetch_misses"], second["prefetch_hits"]) == (0, len(probes))
    assert sorted(position for who, position in reloads if who == "point") == pointed
    assert sorted(position for who, position in reloads if who == "unpack") == sorted(
        set(range(len(probes))) - set(pointed)
    )


MIB = 2**20


@pytest.mark.parametrize(
    "option, sizes, expected",
    [
        (None, [16, 10 * MIB], 4 * 40 * MIB),  # four of the largest copy (float32: 40 MiB)
        (None, [16, 1024], 128 * MIB),  # at least 128 MiB
        (0, [16, 10 * MIB], 0),
        (1234, [16, 10 * MIB], 1234),
    ],
    ids=["default", "default-small", "on-demand", "explicit"],
)
def test_prefetch_window_by_default_holds_four_of_the_step_largest_copies(option, sizes, expected) -> None:
    engine = cpu_engine(prefetch_window_bytes=option)
    round_trip(engine, *(torch.zeros(numel) for numel in sizes))
    assert engine._step.prefetch_window_bytes == expected


def test_view_outside_the_offloaded_span_gets_its_own_copy() -> None:
    engine = cpu_engine()
    base = torch.randn(8, 8)
    restored = round_trip(engine, base[:2], base[4:])
    assert torch.equal(restored[0], base[:2]) and torch.equal(restored[1], base[4:])
    assert engine.get_stats()["tensors_offloaded"] == 2


def test_recycled_storage_address_is_not_mistaken_for_a_duplicate() -> None:
    """A storage freed during the forward may be reallocated at the same address: dedup must check identity."""
    engine = cpu_engine()
    SaveProbe.captured = []
    x = torch.ones(2, requires_grad=True)
    expected = []
    with engine:
        y = x
        for _ in range(6):
            probe = torch.randn(64, 64)
            expected.append(probe.clone())
            y = SaveProbe.apply(y, probe)
            del probe  # its only owner is now the offloaded copy: the allocator may reuse the address
    y.sum().backward()
    for got, want in zip(SaveProbe.captured[::-1], expected):
        assert torch.equal(got, want)
    assert engine.get_stats()["tensors_kept_duplicate"] == 0


def test_size_floor_and_parameters_are_kept() -> None:
    engine = cpu_engine(min_offload_size=1024)
    layer = torch.nn.Linear(64, 64)
    engine.update_model_params(layer)
    round_trip(engine, torch.randn(4), layer.weight.detach(), layer.weight.detach().t(), torch.randn(64, 64))
    stats = engine.get_stats()
    assert stats["tensors_kept_too_small"] == 1
    assert stats["tensors_kept_parameter"] == 2  # by storage: detached views of the weight too
    assert stats["tensors_offloaded"] == 1


def test_parameter_instances_are_kept_without_registration() -> None:
    engine = cpu_engine()
    layer = torch.nn.Linear(16, 16)
    round_trip(engine, layer.weight)
    assert engine.get_stats()["tensors_kept_parameter"] == 1


def test_unsupported_tensor_types_are_kept() -> None:
    engine = cpu_engine()
    sparse = torch.eye(32).to_sparse()
    (restored,) = round_trip(engine, sparse)
    assert restored.is_sparse and torch.equal(restored.to_dense(), sparse.to_dense())
    assert restored._values().data_ptr() == sparse._values().data_ptr()  # the same memory: never copied
    assert engine.get_stats()["tensors_kept_unsupported_type"] == 1


def tiny_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.SiLU(), torch.nn.Linear(64, 8)
    )


def grads_of(model: torch.nn.Module, engine: OffloadActivations | None, *, checkpointing: str = "off",
             backward_inside: bool = False, seed: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:  # fmt: skip
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    x = torch.randn(16, 32, requires_grad=True)

    def forward() -> torch.Tensor:
        if checkpointing == "off":
            return model(x).pow(2).mean()
        reentrant = checkpointing == "reentrant"
        return checkpoint.checkpoint(model, x, use_reentrant=reentrant).pow(2).mean()

    if engine is None:
        loss = forward()
        loss.backward()
    else:
        with engine:
            loss = forward()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def assert_bitwise_equal(a, b) -> None:
    assert torch.equal(a[0], b[0])
    assert len(a[1]) == len(b[1])
    for got, want in zip(a[1], b[1]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("checkpointing", ["off", "non_reentrant", "reentrant"])
@pytest.mark.parametrize("backward_inside", [False, True], ids=["forward-only-ctx", "forward-backward-ctx"])
@pytest.mark.parametrize("use_streams", [True, False])
def test_gradients_bitwise_equal(checkpointing: str, backward_inside: bool, use_streams: bool) -> None:
    model = tiny_mlp()
    reference = grads_of(model, None, checkpointing=checkpointing)
    engine = cpu_engine(use_streams=use_streams)
    engine.update_model_params(model)
    for _ in range(3):  # later steps run with the learned plan and the reused pool
        assert_bitwise_equal(grads_of(model, engine, checkpointing=checkpointing, backward_inside=backward_inside),
                             reference)  # fmt: skip
        assert engine.get_stats()["bytes_offloaded"] > 0


def test_reentrant_recompute_inside_the_context_is_kept() -> None:
    model = tiny_mlp()
    engine = cpu_engine()
    grads_of(model, engine, checkpointing="reentrant", backward_inside=True)
    assert engine.get_stats()["tensors_kept_in_backward"] > 0


def test_pool_is_reused_and_nothing_outlives_the_graph() -> None:
    model = tiny_mlp()
    engine = cpu_engine()
    grads_of(model, engine)
    pool = engine._pool
    allocations, capacity = pool.allocations, pool.capacity
    for _ in range(5):
        grads_of(model, engine)
        assert pool.bytes_in_use() == 0
    assert (pool.allocations, pool.capacity) == (allocations, capacity)
    assert engine.get_stats()["pinned_bytes"] == capacity


def test_forward_without_backward_leaves_nothing_behind() -> None:
    model = tiny_mlp()
    engine = cpu_engine()
    reference = grads_of(model, None)
    with engine:
        loss = model(torch.randn(16, 32)).sum()  # evaluation with grad: no backward
    assert engine._pool.bytes_in_use() > 0
    del loss
    gc.collect()
    assert engine._pool.bytes_in_use() == 0
    assert_bitwise_equal(grads_of(model, engine), reference)


def test_exception_in_forward_leaves_nothing_behind() -> None:
    model = tiny_mlp()
    engine = cpu_engine()
    reference = grads_of(model, None)
    with pytest.raises(RuntimeError, match="boom"):
        with engine:
            hidden = model(torch.randn(16, 32))
            raise RuntimeError("boom")
    del hidden
    gc.collect()
    assert engine._pool.bytes_in_use() == 0
    assert_bitwise_equal(grads_of(model, engine), reference)


def test_retain_graph_and_autograd_grad() -> None:
    model = tiny_mlp()
    torch.manual_seed(3)
    x = torch.randn(16, 32)
    loss_ref = model(x).pow(2).mean()
    expected = torch.autograd.grad(loss_ref, list(model.parameters()))
    engine = cpu_engine()
    with engine:
        loss = model(x).pow(2).mean()
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    second = torch.autograd.grad(loss, list(model.parameters()))
    for a, b, c in zip(first, second, expected):
        assert torch.equal(a, c) and torch.equal(b, c)


def test_gradient_accumulation_over_micro_batches() -> None:
    model = tiny_mlp()

    def accumulate(engine):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        for _ in range(3):
            x = torch.randn(16, 32)
            if engine is None:
                model(x).pow(2).mean().backward()
            else:
                with engine:
                    loss = model(x).pow(2).mean()
                loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    expected = accumulate(None)
    engine = cpu_engine()
    for got, want in zip(accumulate(engine), expected):
        assert torch.equal(got, want)
    assert engine.consume_stats()["steps"] == 3


def test_host_cap_keeps_tensors_on_device_with_one_warning(caplog) -> None:
    model = tiny_mlp()
    reference = grads_of(model, None)
    engine = cpu_engine(max_pinned_bytes=8192)
    with caplog.at_level(logging.WARNING, logger="hf_offload.engine"):
        for _ in range(2):
            assert_bitwise_equal(grads_of(model, engine), reference)
    stats = engine.get_stats()
    assert stats["tensors_kept_over_host_cap"] > 0 and stats["tensors_offloaded"] > 0
    assert stats["pinned_bytes"] <= 8192
    assert sum("cap" in record.getMessage() for record in caplog.records) == 1


def test_the_host_memory_reserve_keeps_tensors_on_device_with_one_warning(caplog, monkeypatch) -> None:
    model = tiny_mlp()
    reference = grads_of(model, None)
    engine = cpu_engine(host_memory_reserve_bytes=2**30)
    # A host with 8 KiB above the reserve, less what the pool takes (its chunks are host memory too).
    monkeypatch.setattr("hf_offload.host_memory.read_host_memory",
                        lambda: HostMemory(2**34, 2**30 + 8192 - engine._pinned_bytes()))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="hf_offload.engine"):
        for _ in range(2):
            assert_bitwise_equal(grads_of(model, engine), reference)
    stats = engine.get_stats()
    assert stats["tensors_kept_host_reserve"] > 0 and stats["tensors_offloaded"] > 0
    assert stats["tensors_kept_over_host_cap"] == 0 and stats["pinned_bytes"] <= 8192
    assert sum("reserve" in record.getMessage() for record in caplog.records) == 1


def test_a_failed_pinned_allocation_keeps_tensors_on_device_with_one_warning(caplog, monkeypatch) -> None:
    model = tiny_mlp()
    reference = grads_of(model, None)
    engine = cpu_engine()

    def fail(self, nbytes: int, exact: bool) -> torch.Tensor:
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(PinnedHostPool, "_new_chunk", fail)
    with caplog.at_level(logging.WARNING, logger="hf_offload.engine"):
        for _ in range(2):
            assert_bitwise_equal(grads_of(model, engine), reference)
    stats = engine.get_stats()
    assert stats["tensors_kept_pinned_alloc_failed"] > 0 and stats["tensors_offloaded"] == 0
    assert sum("allocating pinned host memory failed" in record.getMessage() for record in caplog.records) == 1


@pytest.mark.parametrize(
    ("options", "reserve", "grows"),
    [
        ({}, None, False),  # without a budget nothing changes: the cap alone
        ({"host_memory_reserve_bytes": 2**30}, 2**30, False),  # a reserve the user set holds anyway
        ({"memory_budget": "1GiB"}, "default", True),
        ({"memory_budget": "1GiB", "max_pinned_memory_fraction": 0.5}, "default", False),  # the user's cap is kept
        ({"memory_budget": "1GiB", "max_pinned_bytes": 2**20}, "default", False),
        ({"memory_budget": "1GiB", "host_memory_reserve_bytes": 0}, 0, True),
    ],
)
def test_where_the_pool_has_a_reserve_and_may_grow_past_its_cap(monkeypatch, options, reserve, grows) -> None:
    monkeypatch.setattr("hf_offload.host_memory.read_host_memory", lambda: HostMemory(128 * 2**30, 100 * 2**30))
    monkeypatch.setattr("hf_offload.host_memory.psutil.virtual_memory", lambda: SimpleNamespace(available=100 * 2**30))
    engine = cpu_engine(**options)
    pool = engine._host_pool()
    expected = default_host_memory_reserve(128 * 2**30) if reserve == "default" else reserve
    assert (pool.reserve.reserve_bytes if pool.reserve is not None else None) == expected
    caps = engine.host_caps()
    assert caps.default_bytes == pool.cap_bytes
    assert (caps.most_bytes > caps.default_bytes) == grows
    if grows:
        assert caps.most_bytes == 100 * 2**30 - expected
    engine.set_host_cap(caps.most_bytes)
    assert pool.cap_bytes == caps.most_bytes and pool.default_cap_bytes == caps.default_bytes


def test_noop_manager_and_exempt_regions() -> None:
    engine = cpu_engine()
    x = torch.randn(8, 8, requires_grad=True)
    with engine:
        with NoOpManager():
            a = x.sin()
        with engine.exempt():
            b = a.cos()
        c = b.exp()
    c.sum().backward()
    stats = engine.get_stats()
    assert stats["tensors_kept_exempt"] == 1  # cos saved its input inside the exempt region
    assert stats["tensors_offloaded"] == 1  # exp saves its output; sin's input was hidden by NoOpManager


def test_the_pools_growth_is_counted_in_the_step_that_grew_it() -> None:
    model = tiny_mlp()
    engine = cpu_engine()
    grads_of(model, engine)
    first = engine.get_stats()
    assert first["pool_grown_bytes"] == engine._pool.capacity > 0 and first["pool_growth_s"] > 0
    grads_of(model, engine)
    second = engine.get_stats()
    assert second["pool_grown_bytes"] == 0 and second["pool_growth_s"] == 0  # the same chunks, reused
    assert engine.consume_stats()["pool_grown_bytes"] == engine._pool.capacity


def test_stats_accumulate_until_consumed() -> None:
    model = tiny_mlp()
    engine = cpu_engine()
    for _ in range(4):
        grads_of(model, engine)
    per_step = engine.get_stats()
    total = engine.consume_stats()
    assert total["steps"] == 4 and per_step["steps"] == 1
    assert total["bytes_offloaded"] == 4 * per_step["bytes_offloaded"]
    assert engine.consume_stats()["steps"] == 0


def test_inactive_without_accelerator(caplog) -> None:
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    with caplog.at_level(logging.WARNING, logger="hf_offload.engine"):
        engine = OffloadActivations()
    assert not engine.active
    assert any("inactive" in record.getMessage() for record in caplog.records)
    model = tiny_mlp()
    assert_bitwise_equal(grads_of(model, engine), grads_of(model, None))
    assert engine.get_stats()["tensors_offloaded"] == 0


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"use_pin_memory": "yes"}, "use_pin_memory"),
        ({"use_streams": 1}, "use_streams"),
        ({"keep_tail": None}, "keep_tail"),
        ({"min_offload_size": -1}, "min_offload_size"),
        ({"min_offload_size": 1.5}, "min_offload_size"),
        ({"max_fwd_stash_size": 0}, "max_fwd_stash_size"),
        ({"forward_window_bytes": 0}, "forward_window_bytes"),
        ({"prefetch_window_bytes": -1}, "prefetch_window_bytes"),
        ({"max_pinned_memory_fraction": 0}, "max_pinned_memory_fraction"),
        ({"max_pinned_memory_fraction": 0.95}, "max_pinned_memory_fraction"),
        ({"max_pinned_bytes": -5}, "max_pinned_bytes"),
        ({"device_type": "tpu"}, "device_type"),
    ],
)
def test_invalid_options_name_the_option(options: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        OffloadActivations(**options)


def test_dropped_context_frees_its_pool_without_a_garbage_collection() -> None:
    import weakref

    model = tiny_mlp()
    engine = cpu_engine()
    grads_of(model, engine)
    pool = weakref.ref(engine._pool)
    gc.disable()
    try:
        del engine
        assert pool() is None  # no reference cycle holds the engine (and its host memory)
    finally:
        gc.enable()


def test_context_dropped_between_forward_and_backward_still_restores() -> None:
    model = tiny_mlp()
    reference = grads_of(model, None)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    x = torch.randn(16, 32, requires_grad=True)
    engine = cpu_engine()
    with engine:
        loss = model(x).pow(2).mean()
    del engine  # the graph's copies keep what backward needs
    loss.backward()
    assert_bitwise_equal((loss.detach(), [p.grad for p in model.parameters()] + [x.grad]), reference)


@pytest.mark.parametrize("min_offload_size", [0, 1 << 30], ids=["offloaded", "kept"])
def test_abandoned_forward_releases_its_graph(min_offload_size: int) -> None:
    """Saved outputs (sigmoid, exp) must not keep their own graph alive when backward never runs."""
    import weakref

    engine = cpu_engine(min_offload_size=min_offload_size)
    x = torch.randn(64, 64, requires_grad=True)
    with engine:
        hidden = (x * 2).sigmoid().exp()
        with engine.exempt():
            out = hidden.tanh()
    probe = weakref.ref(hidden)
    del hidden, out
    gc.disable()
    try:
        assert probe() is None
    finally:
        gc.enable()


def test_tensors_elsewhere_warn_once_and_empty_placeholders_not_at_all(caplog):
    """Non-reentrant checkpointing saves an empty CPU placeholder per layer: no reason to ask whether the model is
    on the CPU, nor to count it (the pack hook returns it at once: 36 a step on a 36-layer model). A real tensor on
    another device is. ("meta" stands in for that other device here.)"""
    engine = OffloadActivations(device_type="cpu")
    with caplog.at_level(logging.WARNING, logger="hf_offload.engine"):
        with engine:
            empty = torch.empty(0, device="meta", requires_grad=True)
            empty * empty
        assert "are not offloaded" not in caplog.text
        with engine:
            for _ in range(2):
                real = torch.empty(1024, device="meta", requires_grad=True)
                real * real
    assert caplog.text.count("are not offloaded") == 1
    assert engine.get_stats()["tensors_kept_not_on_accelerator"] == 4  # the two real ones, twice each; no empty one


def test_a_region_entered_standing_aside_pushes_no_hooks_and_rejoining_pushes_them_there() -> None:
    engine = cpu_engine()
    engine.stand_aside("cannot_lower_peak")
    with engine:
        assert top_saved_tensors_pack_hook() is None  # autograd calls no Python for the tensors saved here
        kept = round_trip(NoOpManager(), torch.randn(4))
        engine.rejoin()
        assert top_saved_tensors_pack_hook() is engine.pack_hook
        probe = torch.randn(8)
        restored = round_trip(engine, probe)  # entered again inside: the same engine, now offloading
    assert top_saved_tensors_pack_hook() is None  # exit popped what was pushed late, and only that
    assert kept and torch.equal(restored[0], probe) and engine.get_stats()["tensors_offloaded"] == 1
    with pytest.raises(ValueError, match="reason must be one of"):
        engine.stand_aside("tired")


def test_rejoining_under_someone_elses_hooks_pushes_ours_beneath_them() -> None:
    """A re-plan from a decoder layer's pre-hook runs inside the layer's checkpoint: the engine's hooks go where the
    region's entry would have put them, under the checkpoint's, which keeps its tensors and pops its own hooks."""
    engine = cpu_engine()
    engine.stand_aside("planned")
    with engine:
        inner_probe = torch.randn(8)
        with NoOpManager():
            inner = top_saved_tensors_pack_hook()
            engine.rejoin()
            assert top_saved_tensors_pack_hook() is inner  # still on top: its region keeps what it saves
            kept = round_trip(NoOpManager(), inner_probe)
        assert top_saved_tensors_pack_hook() is engine.pack_hook  # the NoOpManager's exit popped its own
        probe = torch.randn(8)
        restored = round_trip(engine, probe)
    assert top_saved_tensors_pack_hook() is None
    assert torch.equal(kept[0], inner_probe) and torch.equal(restored[0], probe)
    assert engine.get_stats()["tensors_offloaded"] == 1


def test_rejoining_where_hooks_are_disabled_waits_for_the_next_region(caplog) -> None:
    engine = cpu_engine()
    engine.stand_aside("planned")
    with caplog.at_level(logging.WARNING, logger="hf_offload"):
        with engine:
            with torch.autograd.graph.disable_saved_tensors_hooks("a region that forbids them"):
                engine.rejoin()
            assert top_saved_tensors_pack_hook() is None
    assert sum("offloading resumes from the next step" in record.message for record in caplog.records) == 1
    probe = torch.randn(8)
    assert torch.equal(round_trip(engine, probe)[0], probe) and engine.get_stats()["tensors_offloaded"] == 1


def test_only_completed_training_steps_are_counted() -> None:
    """Statistics count training steps: a region under no_grad (the Trainer's evaluation) is none, also while
    offloading stands aside, and a step that an exception left is none either, nor are its partial counts."""
    model = tiny_mlp()
    engine = cpu_engine()
    x = torch.randn(8, 32)

    def step(fail: bool = False) -> None:
        with engine:
            loss = model(x).sum()
            if fail:
                raise RuntimeError("a fault in the forward")
        loss.backward()

    step()
    first = engine.get_stats()
    with torch.no_grad(), engine:
        model(x)
    with pytest.raises(RuntimeError, match="a fault"):
        step(fail=True)
    with pytest.raises(RuntimeError, match="a fault"), engine:  # two regions of one engine, left by one exception
        step(fail=True)
    totals = engine.consume_stats()
    assert totals["steps"] == first["steps"] == 1 and engine.get_stats()["tensors_offloaded"] > 0  # the aborted one's
    assert totals["tensors_offloaded"] == first["tensors_offloaded"] > 0
    assert totals["bytes_offloaded"] == first["bytes_offloaded"]

    engine.stand_aside("cannot_lower_peak")
    step()
    for _ in range(3):  # evaluation passes
        with torch.no_grad(), engine:
            model(x)
    with pytest.raises(RuntimeError, match="a fault"):
        step(fail=True)
    totals = engine.consume_stats()
    assert totals["steps"] == totals["steps_stood_aside_cannot_lower_peak"] == 1


def test_a_plan_sets_the_engine_in_one_call_and_stands_it_aside_only_for_itself() -> None:
    engine = cpu_engine()
    plan = object()  # the engine keeps it for memory_plan and reads nothing of it
    engine.apply_settings(EngineSettings(stand_aside=True, plan=plan))
    assert engine.standing_aside == "planned" and engine.memory_plan is plan
    options = engine.options
    assert (engine.forward_window_bytes, engine.prefetch_window_bytes) == (options.forward_window_bytes,
                                                                           options.prefetch_window_bytes)  # fmt: skip
    engine.apply_settings(EngineSettings(stand_aside=False, windows=CopyWindows(64 * 2**20, None, 1),
                                         tail_cap_bytes=0, host_cap_bytes=2**20))  # fmt: skip
    assert engine.standing_aside is None and engine.memory_plan is None
    assert (engine.forward_window_bytes, engine.prefetch_window_bytes, engine.head_prefetch_window_bytes) == (
        64 * 2**20, None, 1)  # fmt: skip
    assert engine._planner.max_tail_bytes == 0 and engine._pool.cap_bytes == 2**20
    engine.stand_aside("compiled")
    engine.apply_settings(EngineSettings(stand_aside=False))  # a plan rejoins only where a plan stood aside
    engine.apply_settings(EngineSettings(stand_aside=True))
    assert engine.standing_aside == "compiled"
    with pytest.raises(ValueError, match="forward_window_bytes"):
        engine.apply_settings(EngineSettings(stand_aside=False, windows=CopyWindows(0, None, None)))


def test_the_engine_imports_nothing_of_the_memory_budget_but_annotations() -> None:
    """The budget sets the engine through `EngineSettings` alone: no module of the engine imports the budget at run
    time (it would sit below the controller that imports it)."""
    for module in sorted((Path(__file__).resolve().parents[1] / "hf_offload" / "engine").glob("*.py")):
        tree = ast.parse(module.read_text())
        type_checking = [node for node in ast.walk(tree) if isinstance(node, ast.If)
                         and ast.unparse(node.test) == "TYPE_CHECKING"]  # fmt: skip
        annotations = {id(child) for node in type_checking for child in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and "memory_budget" in (node.module or ""):
                assert id(node) in annotations, f"{module.name}:{node.lineno} imports {node.module}"

"""Eligibility rules, the tail planner and the pinned pool: pure bookkeeping."""

from __future__ import annotations

import pytest
import torch

from hf_offload.host_memory import (
    HostMemory,
    HostReserve,
    PinnedHostPool,
    default_host_memory_reserve,
    host_caps,
    host_memory_cap,
    read_host_memory,
)
from hf_offload.policy import TailPlanner, kept_reason, parameter_storages, storage_span
from hf_offload.stats import OffloadStats
from hf_offload.units import GIB, MIB


def reason(tensor: torch.Tensor, **overrides) -> str | None:
    options = {"device_type": "cpu", "min_offload_size": 16, "parameter_pointers": set(), "in_backward": False}
    options.update(overrides)
    return kept_reason(tensor, **options)


def test_storage_span() -> None:
    base = torch.zeros(6, 8)
    assert storage_span(base) == (0, 48)
    assert storage_span(base.t()) == (0, 48)
    assert storage_span(base[2:4, 1:3]) == (17, 10)
    assert storage_span(base[:, :1].expand(6, 100)) == (0, 41)
    assert storage_span(torch.zeros(0, 3)) == (0, 0)


def test_kept_reasons_in_order() -> None:
    weight = torch.nn.Parameter(torch.zeros(8, 8))
    assert reason(weight) == "parameter"
    assert reason(torch.zeros(8, 8), device_type="cuda") == "not_on_accelerator"
    assert reason(torch.zeros(8, 8), in_backward=True) == "in_backward"
    assert reason(torch.zeros(2)) == "too_small"
    assert reason(torch.zeros(0)) == "too_small"
    assert reason(torch.eye(4).to_sparse()) == "unsupported_type"
    assert reason(weight.t()) == "parameter"  # a view of a parameter whose storage nobody registered
    pointers = parameter_storages([weight])
    assert reason(weight.detach()[1:], parameter_pointers=pointers) == "parameter"
    assert reason(torch.zeros(8, 8)) is None
    # The size floor applies to the bytes copied (the span), not to the broadcast view.
    assert reason(torch.zeros(2, 1).expand(2, 1000)) == "too_small"


def follow(planner: TailPlanner, sizes: list[int], dtype=torch.float32) -> list[bool]:
    planner.begin_step()
    return [planner.next_candidate(dtype, 2, size) for size in sizes]


def test_tail_learned_from_unfinished_copies_and_only_grows() -> None:
    planner = TailPlanner(enabled=True, max_tail_bytes=10_000)
    sizes = [100] * 10
    assert follow(planner, sizes) == [False] * 10  # no plan yet
    planner.end_forward(first_unfinished=7)
    assert follow(planner, sizes) == [False] * 7 + [True] * 3
    planner.end_forward(first_unfinished=None)  # everything finished: keep the plan
    assert planner.tail_start == 7
    follow(planner, sizes)
    planner.end_forward(first_unfinished=5)  # copies before the tail lagged: grow it
    assert planner.tail_start == 5


def test_tail_never_exceeds_its_budget() -> None:
    planner = TailPlanner(enabled=True, max_tail_bytes=250)
    sizes = [100] * 10
    follow(planner, sizes)
    planner.end_forward(first_unfinished=6)  # 400 bytes lagged, but only the last 200 fit under 250
    assert planner.tail_start == 8
    follow(planner, sizes)
    planner.end_forward(first_unfinished=2)  # copies keep lagging: the tail does not grow past its budget
    assert planner.tail_start == 8
    # A last candidate larger than the budget is never kept, and neither is anything before it.
    big = TailPlanner(enabled=True, max_tail_bytes=250)
    follow(big, [100] * 9 + [300])
    big.end_forward(first_unfinished=8)
    assert follow(big, [100] * 9 + [300]) == [False] * 10


def test_a_lower_bound_shortens_a_learned_tail_at_once_and_then_holds() -> None:
    # A memory plan chosen because its measured steps met the budget keeps no more tail than they did (the engine's
    # `cap_tail`): the tail learned since is cut back, and copies that lag later do not grow it past the bound.
    planner = TailPlanner(enabled=True, max_tail_bytes=10_000)
    sizes = [100] * 10
    follow(planner, sizes)
    planner.end_forward(first_unfinished=5)
    planner.set_max_tail_bytes(200)
    assert planner.tail_start == 8
    follow(planner, sizes)
    planner.end_forward(first_unfinished=0)
    assert planner.tail_start == 8
    planner.set_max_tail_bytes(10_000)  # raised again: the tail grows as copies lag
    follow(planner, sizes)
    planner.end_forward(first_unfinished=6)
    assert planner.tail_start == 6


def test_tail_replanned_when_the_sequence_changes() -> None:
    planner = TailPlanner(enabled=True, max_tail_bytes=10_000)
    follow(planner, [100] * 10)
    planner.end_forward(first_unfinished=8)
    # A different path (another dtype in the middle): the rest of this step is offloaded as usual.
    planner.begin_step()
    decisions = [planner.next_candidate(torch.float32, 2, 100) for _ in range(4)]
    decisions += [planner.next_candidate(torch.bfloat16, 2, 100) for _ in range(6)]
    assert decisions == [False] * 10
    planner.end_forward(first_unfinished=None)
    assert planner.tail_start is None
    # A longer sequence length keeps the structure (dtype, rank) and therefore the plan.
    planner2 = TailPlanner(enabled=True, max_tail_bytes=10_000)
    follow(planner2, [100] * 4)
    planner2.end_forward(first_unfinished=3)
    assert follow(planner2, [150] * 4) == [False, False, False, True]


def test_tail_disabled() -> None:
    planner = TailPlanner(enabled=False, max_tail_bytes=10_000)
    follow(planner, [100] * 4)
    planner.end_forward(first_unfinished=0)
    assert follow(planner, [100] * 4) == [False] * 4


def test_pool_first_fit_coalesces_and_caps() -> None:
    pool = PinnedHostPool(cap_bytes=4096, pin_memory=False, chunk_bytes=2048)
    blocks = [pool.allocate(500) for _ in range(4)]  # 512 each after alignment
    assert [b.offset for b in blocks] == [0, 512, 1024, 1536] and pool.allocations == 1
    for block in blocks[1:3]:
        pool.free(block)
    merged = pool.allocate(1000)  # fits only in the coalesced hole
    assert merged.offset == 512 and pool.allocations == 1
    big = pool.allocate(2048)
    assert big is not None and pool.allocations == 2 and pool.capacity == 4096
    assert pool.allocate(1) is None  # past the cap
    for block in (blocks[0], blocks[3], merged, big):
        pool.free(block)
    assert pool.bytes_in_use() == 0


def test_the_pool_reports_each_chunk_it_grows_by_and_the_time_it_took() -> None:
    grown: list[tuple[int, float]] = []
    pool = PinnedHostPool(cap_bytes=1 << 20, pin_memory=False, chunk_bytes=4096,
                          on_growth=lambda nbytes, seconds: grown.append((nbytes, seconds)))  # fmt: skip
    blocks = [pool.allocate(3000) for _ in range(3)]
    assert [nbytes for nbytes, _ in grown] == [chunk.numel() for chunk in pool._chunks]
    assert len(grown) == pool.allocations
    assert sum(nbytes for nbytes, _ in grown) == pool.capacity and all(seconds >= 0 for _, seconds in grown)
    for block in blocks:
        pool.free(block)
    pool.allocate(3000)
    assert len(grown) == pool.allocations  # a reused range grows nothing


def test_a_request_past_the_room_left_releases_the_chunks_no_block_uses() -> None:
    pool = PinnedHostPool(cap_bytes=8192, pin_memory=False, chunk_bytes=2048)
    small = [pool.allocate(2048) for _ in range(3)]  # three chunks of 2 KiB
    pool.free(small[0])
    pool.free(small[2])
    big = pool.allocate(4096)  # 2 KiB of room, 4 KiB of chunks nothing uses: those go, the request fits
    assert big is not None and pool.capacity == 2048 + 4096 and pool.bytes_in_use() == 2048 + 4096
    assert pool.allocate(4096) is None  # the chunk still in use stays: past the cap
    pool.free(small[1])
    pool.free(big)
    assert pool.bytes_in_use() == 0


def test_pool_block_views_share_the_chunk() -> None:
    pool = PinnedHostPool(cap_bytes=1 << 20, pin_memory=False, chunk_bytes=4096)
    block = pool.allocate(64)
    view = block.view(torch.float32, 16)
    view.fill_(3.0)
    assert view.shape == (16,) and block.chunk[:64].view(torch.float32).eq(3.0).all()


def test_pool_hands_out_the_same_block_and_view_for_the_same_range() -> None:
    # Every step after the first allocates the ranges of the one before: the blocks and their views are made once.
    pool = PinnedHostPool(cap_bytes=1 << 20, pin_memory=False, chunk_bytes=4096)
    first = pool.allocate(1024)
    view = first.view(torch.bfloat16, 512)
    pool.free(first)
    again = pool.allocate(1024)
    assert again is first and again.view(torch.bfloat16, 512) is view
    assert again.view(torch.float32, 256).data_ptr() == view.data_ptr()  # another dtype: another view, same bytes


def test_pool_remembers_a_bounded_number_of_blocks(monkeypatch) -> None:
    monkeypatch.setattr("hf_offload.host_memory._MAX_REMEMBERED_BLOCKS", 8)
    pool = PinnedHostPool(cap_bytes=1 << 24, pin_memory=False, chunk_bytes=1 << 20)
    for size in range(512, 512 * 40, 512):  # steps whose lengths vary: a new range each time
        pool.free(pool.allocate(size))
    assert len(pool._blocks) <= 8 and pool.bytes_in_use() == 0


def test_a_stall_is_timed_from_the_wait_to_the_copy_and_never_negative() -> None:
    class Done:
        def __init__(self, at_ms: float) -> None:
            self.at_ms = at_ms

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: Done) -> float:
            return end.at_ms - self.at_ms

    stats = OffloadStats()
    stats.add_wait(Done(10.0), Done(12.5))  # compute reached the wait 2.5 ms before the copy completed
    stats.add_wait(Done(10.0), Done(4.0))  # the copy had completed before compute reached the wait
    assert stats.compute_wait_seconds() == pytest.approx(0.0025)


def test_host_cap_is_shared_by_local_ranks(monkeypatch) -> None:
    assert host_memory_cap(0.5, max_pinned_bytes=123) == 123
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = host_memory_cap(0.5, None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    four = host_memory_cap(0.5, None)
    assert 0 < four <= one / 4 * 1.05  # available memory moves a little between the two reads


@pytest.mark.parametrize("size", [1, 511, 512, 513])
def test_pool_alignment(size: int) -> None:
    pool = PinnedHostPool(cap_bytes=1 << 20, pin_memory=False, chunk_bytes=4096)
    pool.allocate(size)
    second = pool.allocate(size)
    assert second.offset % 512 == 0 and second.offset >= size


def test_pool_reserves_about_what_the_step_needs() -> None:
    small = PinnedHostPool(cap_bytes=1 << 40, pin_memory=False)
    for _ in range(4):
        small.allocate(340 * 1024)  # 1.3 MiB in all, as a tiny model's step
    assert small.capacity == 2 * 2**20 and small.allocations == 1

    large = PinnedHostPool(cap_bytes=1 << 40, pin_memory=False, chunk_bytes=64 * 2**20)
    need = 0
    while need < 300 * 2**20:  # chunks double (2, 2, 4, ... 64 MiB) and then stay at the largest chunk size
        large.allocate(2**20)
        need += 2**20
    assert need <= large.capacity <= need + 64 * 2**20
    assert large.allocations <= 12


# The host memory reserve: a floor of available host memory that the pools of one host never cross.


class FakeHost:
    """A host whose available memory is `free` less what its pools hold; `free` drops when another process takes
    memory. Its reads are counted."""

    def __init__(self, total: int, free: int) -> None:
        self.total, self.free, self.pools, self.reads = total, free, [], 0

    def read(self) -> HostMemory:
        self.reads += 1
        return HostMemory(self.total, self.free - sum(pool.capacity for pool in self.pools))

    def pool(self, cap: int, reserve: int, local_ranks: int = 1, chunk_bytes: int = 4 * MIB) -> PinnedHostPool:
        pool = PinnedHostPool(cap, pin_memory=False, chunk_bytes=chunk_bytes,
                              reserve=HostReserve(reserve, local_ranks, read=self.read))  # fmt: skip
        self.pools.append(pool)
        return pool


def write_cgroup(root, path: str, limit: str, current: int, inactive_file: int) -> None:
    folder = root / "sys/fs/cgroup" / path
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory.max").write_text(limit + "\n")
    (folder / "memory.current").write_text(f"{current}\n")
    (folder / "memory.stat").write_text(f"anon {current - inactive_file}\ninactive_file {inactive_file}\n")


def test_read_host_memory_reads_meminfo_and_the_tightest_cgroup_limit_above_the_process(tmp_path) -> None:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text("MemTotal:       131072000 kB\nMemFree:  1000 kB\n"
                                           "MemAvailable:   104857600 kB\n")  # fmt: skip
    assert read_host_memory(str(tmp_path)) == HostMemory(131072000 * 1024, 104857600 * 1024)  # no cgroup file
    (tmp_path / "proc/self/cgroup").write_text("0::/pod/trainer\n")
    write_cgroup(tmp_path, "pod/trainer", "max", 5 * GIB, 0)  # no limit of its own
    write_cgroup(tmp_path, "pod", str(64 * GIB), 40 * GIB, 8 * GIB)  # 64 GiB, 32 used beside reclaimable cache
    assert read_host_memory(str(tmp_path)) == HostMemory(64 * GIB, 32 * GIB)
    write_cgroup(tmp_path, "pod/trainer", str(48 * GIB), 30 * GIB, 0)  # a tighter one below it
    assert read_host_memory(str(tmp_path)) == HostMemory(48 * GIB, 18 * GIB)


def test_read_host_memory_of_this_machine_is_plausible() -> None:
    memory = read_host_memory()
    assert 0 < memory.available_bytes <= memory.total_bytes


def test_the_default_reserve_is_a_tenth_of_the_host_at_least_8_gib_at_most_a_quarter() -> None:
    assert default_host_memory_reserve(16 * GIB) == 4 * GIB
    assert default_host_memory_reserve(64 * GIB) == 8 * GIB
    assert default_host_memory_reserve(128 * GIB) == int(12.8 * GIB)
    assert default_host_memory_reserve(1024 * GIB) == int(102.4 * GIB)


def test_host_caps_without_a_reserve_are_the_cap() -> None:
    caps = host_caps(10 * GIB, 0, None, growable=True)
    assert (caps.default_bytes, caps.most_bytes, caps.reserve_bytes) == (10 * GIB, 10 * GIB, 0)


def test_host_caps_grow_down_to_the_reserve_only_where_the_cap_may_grow() -> None:
    host = FakeHost(128 * GIB, 100 * GIB)
    reserve = HostReserve(12 * GIB, 1, read=host.read)
    grown = host_caps(50 * GIB, 0, reserve, growable=True)
    assert (grown.default_bytes, grown.most_bytes, grown.reserve_bytes) == (50 * GIB, 88 * GIB, 12 * GIB)
    kept = host_caps(50 * GIB, 0, reserve, growable=False)  # the user's cap
    assert kept.default_bytes == kept.most_bytes == 50 * GIB
    host.free = 40 * GIB  # the reserve leaves less than the cap: the plan may not count on the cap either
    tight = host_caps(50 * GIB, 0, reserve, growable=True)
    assert tight.default_bytes == tight.most_bytes == 28 * GIB


def test_host_caps_count_what_the_pool_holds_as_its_own() -> None:
    host = FakeHost(128 * GIB, 100 * GIB)
    pool = host.pool(cap=1 * GIB, reserve=12 * GIB, chunk_bytes=GIB)
    pool.allocate(GIB)  # no longer available on the host, but the pool's
    caps = host_caps(GIB, pool.capacity, pool.reserve, growable=True)
    assert caps.most_bytes == 88 * GIB


def test_the_pool_never_grows_below_the_reserve_as_available_memory_drops() -> None:
    host = FakeHost(64 * GIB, 8 * GIB + 64 * MIB)
    pool = host.pool(cap=GIB, reserve=8 * GIB, chunk_bytes=4 * MIB)
    blocks = [pool.allocate(4 * MIB) for _ in range(4)]
    assert all(blocks) and pool.capacity == 16 * MIB
    host.free -= 40 * MIB  # another process takes memory: 8 MiB above the reserve are left
    assert pool.allocate(4 * MIB) is not None and pool.allocate(4 * MIB) is not None
    assert pool.allocate(4 * MIB) is None and pool.refusal == "reserve"
    assert host.read().available_bytes >= 8 * GIB
    pool.free(blocks[0])  # what the pool holds is still used: no growth needed
    assert pool.allocate(4 * MIB) is not None


def test_the_reserve_is_read_at_each_growth_not_only_when_the_pool_is_made() -> None:
    host = FakeHost(64 * GIB, 9 * GIB)
    pool = host.pool(cap=2 * GIB, reserve=8 * GIB, chunk_bytes=4 * MIB)
    assert pool.allocate(4 * MIB) is not None
    reads = host.reads
    host.free = 8 * GIB  # dropped after the pool was made
    assert pool.allocate(4 * MIB) is None and pool.refusal == "reserve" and host.reads > reads


def test_a_growth_takes_only_the_request_where_a_doubled_chunk_would_cross_the_reserve() -> None:
    host = FakeHost(64 * GIB, 8 * GIB + 20 * MIB)
    pool = host.pool(cap=GIB, reserve=8 * GIB, chunk_bytes=64 * MIB)
    pool.allocate(2 * MIB)
    pool.allocate(14 * MIB)  # a doubling chunk would be 16 MiB: 2 + 16 > 20 MiB above the reserve
    assert pool.capacity == 16 * MIB and host.read().available_bytes == 8 * GIB + 4 * MIB


def test_the_ranks_of_a_host_share_the_room_above_the_reserve() -> None:
    host = FakeHost(128 * GIB, 8 * GIB + 64 * MIB)
    ranks = [host.pool(cap=GIB, reserve=8 * GIB, local_ranks=4, chunk_bytes=4 * MIB) for _ in range(4)]
    for pool in ranks:  # each raises its cap to its share, as a plan does
        pool.cap_bytes = host_caps(pool.default_cap_bytes, pool.capacity, pool.reserve, growable=True).most_bytes
    assert [pool.cap_bytes for pool in ranks] == [16 * MIB] * 4
    for _ in range(8):
        for pool in ranks:
            pool.allocate(2 * MIB)
    assert host.read().available_bytes >= 8 * GIB
    assert sum(pool.capacity for pool in ranks) == 64 * MIB  # together, all of the room, none of the reserve


def test_a_failed_pinned_allocation_degrades_and_is_not_tried_again(monkeypatch) -> None:
    pool = PinnedHostPool(cap_bytes=GIB, pin_memory=False, chunk_bytes=4 * MIB)
    assert pool.allocate(MIB) is not None
    tries = []

    def fail(nbytes: int, exact: bool) -> torch.Tensor:
        tries.append(nbytes)
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(pool, "_new_chunk", fail)
    assert pool.allocate(8 * MIB) is None and pool.refusal == "failed" and "cudaHostAlloc" in pool.failure
    assert pool.allocate(8 * MIB) is None and len(tries) == 1  # each try costs and synchronises the device
    assert pool.allocate(MIB) is not None  # what it holds is still used


def test_host_memory_cap_without_a_fraction_is_the_default_half() -> None:
    default, half = host_memory_cap(None, None), host_memory_cap(0.5, None)
    assert abs(default - half) <= half * 0.05


def test_a_rank_that_plans_after_the_others_grew_gets_what_they_left() -> None:
    host = FakeHost(128 * GIB, 8 * GIB + 64 * MIB)
    first, second = (host.pool(cap=GIB, reserve=8 * GIB, local_ranks=2, chunk_bytes=4 * MIB) for _ in range(2))
    first.cap_bytes = host_caps(GIB, first.capacity, first.reserve, growable=True).most_bytes
    while first.allocate(4 * MIB) is not None:
        pass
    assert first.capacity == 32 * MIB
    second.cap_bytes = host_caps(GIB, second.capacity, second.reserve, growable=True).most_bytes
    assert second.cap_bytes == 16 * MIB  # half of the 32 MiB left: never more than what the host has above the reserve


def test_the_host_memory_examples() -> None:
    import doctest

    from hf_offload import host_memory

    results = doctest.testmod(host_memory)
    assert results.attempted >= 4 and results.failed == 0

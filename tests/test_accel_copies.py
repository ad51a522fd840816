"""kvhal_copy_blocks over an engine chain, with a fake stream module standing in for torch.cuda."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvhal.accel.copies import EngineCopyHooks, split_at
from kvhal.accel.descriptors import Descriptors
from kvhal.accel.engines import CopyJob, TorchCopyEngine
from kvhal.blocks import get_kv_from_block
from kvhal.cache import allocate_dense_kv_cache
from kvhal.copyplan import Direction, plan_copy
from kvhal.errors import TransferError, ValidationError
from kvhal.geometry import KVGeometry
from kvhal.layouts import BLHNC
from kvhal.testing.accel import FakeStreamModule, as_if_direction


class Spy(TorchCopyEngine):
    def __init__(self, module: FakeStreamModule, fail: bool = False) -> None:
        self.module, self.fail, self.jobs, self.streams, self.devices = module, fail, [], [], []

    def run(self, job: CopyJob) -> None:
        self.jobs.append(job)
        self.streams.append(list(self.module.entered))
        self.devices.append(list(self.module.devices_entered))
        if self.fail:
            raise OSError("driver said no")
        super().run(job)


class Plugin(EngineCopyHooks):
    def __init__(self, module, engine, points=(), refuse=None) -> None:
        super().__init__()
        self.module, self.engine = module, engine
        self.points, self.refuse = np.array(points, dtype=np.int64), refuse

    def check_copy_stream(self, stream):
        if stream is self.refuse:
            raise ValidationError("stream", "not this one")

    def host_split_points(self):
        return self.points

    def stream_module(self):
        return self.module

    def engine_names(self):
        return ["spy"]

    def engine_factories(self):
        return {"spy": lambda: self.engine}


@pytest.fixture
def caches():
    g = KVGeometry(2, 8, 4, 2, 8, torch.float16)
    src = allocate_dense_kv_cache(g, BLHNC, "cpu")
    for parts in src.layers:
        parts[0].copy_(torch.randn(parts[0].shape))
    return src, allocate_dense_kv_cache(g, BLHNC, "cpu")


def test_the_copy_runs_inside_the_given_stream_and_the_event_follows_it(caches):
    module = FakeStreamModule()
    spy = Spy(module)
    plugin, stream = Plugin(module, spy), module.Stream()
    event = plugin.kvhal_copy_blocks(as_if_direction(plan_copy(*caches, [(1, 5)]), Direction.D2H), stream)
    assert spy.streams == [[stream]]
    assert event.inner.stream is stream
    assert plugin.kvhal_query_event(event) is True
    assert torch.equal(get_kv_from_block(caches[0], 1), get_kv_from_block(caches[1], 5))


def test_an_engine_that_takes_the_stream_handle_runs_without_entering_the_stream(caches):
    """Entering torch's stream context costs tens of microseconds per copy: an engine that
    passes the stream's handle itself (a driver call) runs without it, with the stream's
    device current (the thread may be one of kvhal's that never used the device)."""
    module = FakeStreamModule()
    spy = Spy(module)
    spy.on_current_stream = False
    plugin, stream = Plugin(module, spy), module.Stream()
    event = plugin.kvhal_copy_blocks(as_if_direction(plan_copy(*caches, [(1, 5)]), Direction.D2H), stream)
    assert spy.streams == [[]] and spy.jobs[0].stream is stream
    assert spy.devices == [[stream.device]], "a driver call runs with its stream's device current"
    assert plugin.kvhal_query_event(event) is True
    assert torch.equal(get_kv_from_block(caches[0], 1), get_kv_from_block(caches[1], 5))


def test_a_failed_submission_is_reported_by_the_event(caches):
    module = FakeStreamModule()
    plugin = Plugin(module, Spy(module, fail=True))
    event = plugin.kvhal_copy_blocks(
        as_if_direction(plan_copy(*caches, [(1, 5)]), Direction.H2D), module.Stream()
    )
    with pytest.raises(TransferError, match="driver said no"):
        plugin.kvhal_synchronize_event(event)


def test_a_load_reads_its_source_early_only_after_the_store_into_it_completed(caches):
    module = FakeStreamModule(hold_events=True)
    spy = Spy(module)
    plugin, stream = Plugin(module, spy), module.Stream()
    src, host = caches
    plugin.kvhal_copy_blocks(as_if_direction(plan_copy(src, host, [(1, 5)]), Direction.D2H), stream)
    load_same = as_if_direction(plan_copy(host, src, [(5, 2)]), Direction.H2D)
    load_other = as_if_direction(plan_copy(host, src, [(6, 3)]), Direction.H2D)
    plugin.kvhal_copy_blocks(load_same, stream)
    plugin.kvhal_copy_blocks(load_other, stream)
    assert [j.source_early for j in spy.jobs] == [False, False, True]
    module.complete_all()
    plugin.kvhal_copy_blocks(load_same, stream)
    assert spy.jobs[-1].source_early is True


def test_host_to_host_drains_the_stream_then_copies_on_the_cpu(caches):
    module = FakeStreamModule()
    spy = Spy(module)
    plugin, stream = Plugin(module, spy), module.Stream()
    plugin.kvhal_copy_blocks(plan_copy(*caches, [(3, 0)]), stream)
    assert stream.synchronized == 1 and spy.jobs == []
    assert torch.equal(get_kv_from_block(caches[0], 3), get_kv_from_block(caches[1], 0))


def test_stream_and_event_hooks_use_the_stream_module():
    module = FakeStreamModule()
    plugin = Plugin(module, None)
    device = torch.device("cpu")
    assert plugin.kvhal_current_stream(device) is module.compute
    stream, event = plugin.kvhal_create_stream(device), plugin.kvhal_create_event(device)
    plugin.kvhal_record_event(event, module.compute)
    plugin.kvhal_stream_wait_event(stream, event)
    assert stream.waited == [event.inner] and event.inner.stream is module.compute


def triples(d: Descriptors) -> list[tuple[int, int, int]]:
    return list(zip(d.src.tolist(), d.dst.tolist(), d.sizes.tolist(), strict=True))


def test_split_at_cuts_source_and_destination_ranges_at_each_point():
    d = Descriptors.from_lists([100, 1000], [5000, 200], [50, 100])
    assert triples(split_at(d, np.array([120, 250]))) == [
        (100, 5000, 20),  # source range [100, 150) holds 120
        (120, 5020, 30),
        (1000, 200, 50),  # destination range [200, 300) holds 250
        (1050, 250, 50),
    ]


def test_split_at_leaves_ranges_that_only_touch_a_point():
    d = Descriptors.from_lists([100, 150], [0, 50], [50, 50])
    assert triples(split_at(d, np.array([150, 100, 200]))) == triples(d)


def test_split_at_cuts_one_range_at_several_points_and_keeps_every_byte():
    d = Descriptors.from_lists([0], [1_000_000], [4096 * 5 + 7])
    pieces = split_at(d, np.array([4096, 8192, 12288, 16384, 20480]))
    assert pieces.sizes.tolist() == [4096] * 5 + [7]
    assert pieces.src.tolist() == [0, 4096, 8192, 12288, 16384, 20480]
    assert (pieces.dst - pieces.src).tolist() == [1_000_000] * 6
    assert split_at(d, np.zeros(0, dtype=np.int64)) is d


def test_copies_are_cut_at_the_plugins_split_points(caches):
    src, dst = caches
    block = dst.storage[0].numel() // dst.num_blocks
    inside_block_3 = dst.storage[0].data_ptr() + 3 * block + 64
    plan = as_if_direction(plan_copy(src, dst, [(i, i) for i in range(8)]), Direction.D2H)
    for points, pieces in (([], 1), ([inside_block_3], 2)):  # the first is the control: one run
        module = FakeStreamModule()
        spy = Spy(module)
        Plugin(module, spy, points=points).kvhal_copy_blocks(plan, module.Stream())
        (job,) = spy.jobs
        assert len(job.descriptors) == pieces and job.descriptors.nbytes == dst.storage[0].numel()
        assert torch.equal(src.storage[0], dst.storage[0])


def test_a_refused_stream_raises_before_anything_is_enqueued(caches):
    module = FakeStreamModule()
    spy = Spy(module)
    stream = module.Stream()
    plugin = Plugin(module, spy, refuse=stream)
    with pytest.raises(ValidationError, match="stream: not this one"):
        plugin.kvhal_copy_blocks(as_if_direction(plan_copy(*caches, [(1, 5)]), Direction.D2H), stream)
    assert spy.jobs == [] and module.events == [] and module.entered == []
    assert int(caches[1].storage[0].count_nonzero()) == 0


@pytest.mark.parametrize("seed", range(5))
def test_split_at_pieces_span_no_point_and_move_the_same_bytes(seed):
    rng = np.random.default_rng(seed)
    n = 40
    d = Descriptors(rng.integers(0, 1 << 20, n), rng.integers(0, 1 << 20, n), rng.integers(1, 1 << 14, n))
    points = np.sort(rng.integers(0, 1 << 20, 30))
    pieces = split_at(d, points)
    for base in (pieces.src, pieces.dst):
        inside = (base[:, None] < points[None, :]) & (points[None, :] < (base + pieces.sizes)[:, None])
        assert not inside.any()

    # In order, the pieces of each descriptor tile it: same start, same src-to-dst offset, same length.
    it = iter(triples(pieces))
    for src, dst, size in triples(d):
        covered = 0
        while covered < size:
            s, t, m = next(it)
            assert (s, t) == (src + covered, dst + covered) and m > 0
            covered += m
        assert covered == size
    assert next(it, None) is None


class FakeDeviceTensor:
    """A device tensor's view onto an allocation: counts the streams recorded on it."""

    def __init__(self, allocation: int, recorded: list) -> None:
        self.allocation, self.recorded = allocation, recorded

    def untyped_storage(self):
        return type("Storage", (), {"data_ptr": lambda _: self.allocation})()

    def record_stream(self, stream) -> None:
        self.recorded.append((self.allocation, stream))


class FakeCache:
    def __init__(self, device: str, allocations: list[int], recorded: list) -> None:
        self.device = torch.device(device)
        self.storage = ()
        self.layers = tuple(
            (FakeDeviceTensor(a, recorded), FakeDeviceTensor(a, recorded)) for a in allocations
        )


def test_a_stream_is_recorded_once_per_cache_and_allocation():
    from kvhal.accel.copies import KeepAlive

    recorded: list = []
    device = FakeCache("meta", [1, 1, 2, 2, 3, 3], recorded)  # 6 layers (K, V) in 3 allocations
    host = FakeCache("cpu", [9], recorded)
    keep = KeepAlive()
    plan = type("Plan", (), {"src": device, "dst": host})()
    first, second = object(), object()
    assert keep(plan, first) == 3 and recorded == [(1, first), (2, first), (3, first)]
    assert keep(plan, first) == 0, "the allocator already waits for this stream at free time"
    assert keep(plan, second) == 3  # another stream: recorded too
    other = FakeCache("meta", [1], recorded)  # another cache object (a one-layer view, say)
    assert keep(type("Plan", (), {"src": host, "dst": other})(), first) == 1
    assert all(a != 9 for a, _ in recorded), "host memory is not the caching allocator's"

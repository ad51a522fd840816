"""kvhal_copy_blocks over an engine chain, with a fake stream module standing in for torch.cuda."""

from __future__ import annotations

import pytest
import torch

from kvhal.accel.copies import EngineCopyHooks
from kvhal.accel.engines import CopyJob, TorchCopyEngine
from kvhal.accel.fakes import FakeStreamModule, as_if_direction
from kvhal.blocks import get_kv_from_block
from kvhal.cache import allocate_dense_kv_cache
from kvhal.copyplan import Direction, plan_copy
from kvhal.errors import TransferError
from kvhal.geometry import KVGeometry
from kvhal.layouts import BLHNC


class Spy(TorchCopyEngine):
    def __init__(self, module: FakeStreamModule, fail: bool = False) -> None:
        self.module, self.fail, self.jobs, self.streams = module, fail, [], []

    def run(self, job: CopyJob) -> None:
        self.jobs.append(job)
        self.streams.append(list(self.module.entered))
        if self.fail:
            raise OSError("driver said no")
        super().run(job)


class Plugin(EngineCopyHooks):
    def __init__(self, module, engine) -> None:
        super().__init__()
        self.module, self.engine = module, engine

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

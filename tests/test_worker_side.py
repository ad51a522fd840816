"""KVHALConnector's worker side on the CPU plugin, without an engine.

The connector's ``WorkerSide`` is driven the way vLLM's model runner drives it
(``begin_step`` from ``handle_preemptions``, loads after the forward launch,
stores in ``wait_for_save``, ``collect`` from ``get_transfer_results``), with a
``ConnectorConfig`` built directly. A gate plugin wrapping ``kvhal_copy_blocks``
holds the copy streams, so "does not wait" and "waits" are shown on data: what
ran while a copy was still held.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvhal.cpu.streams import CPUEvent
from kvhal.errors import ValidationError
from kvhal.geometry import KVFormat
from kvhal.hookspecs import hookimpl
from kvhal.registry import PluginRegistry
from kvhal.vllm import worker_setup, worker_side
from kvhal.vllm.config import ConnectorConfig, GroupInfo
from kvhal.vllm.metadata import KVHALMetadata, LoadJob, StoreJob
from kvhal.vllm.worker_side import WorkerSide

BLOCKS, HEADS, TOKENS, HEAD = 16, 2, 4, 8
DTYPE = torch.bfloat16
#: One block of one layer, K and V together (what vLLM's page_size_bytes says).
PAGE = HEADS * TOKENS * 2 * HEAD * DTYPE.itemsize
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")


def connector_config(page: int = PAGE, slots: int = 8, world_size: int = 1) -> ConnectorConfig:
    return ConnectorConfig(
        cpu_bytes_to_use=slots * len(LAYERS) * page * world_size,
        device=None,
        eviction_policy="lru",
        offload_prompt_only=True,
        block_size=TOKENS,
        groups=(GroupInfo(0, LAYERS, page, HEAD),),
        world_size=world_size,
        layout="LBHNC",
    )


def kv_caches(split: bool, seed: int = 0) -> dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """Per layer a logical [B, H, N, C] tensor, or a (K, V) pair of them as vllm-ascend has."""
    generator = torch.Generator().manual_seed(seed)

    def noise(content: int) -> torch.Tensor:
        return torch.randn(BLOCKS, HEADS, TOKENS, content, generator=generator).to(DTYPE)

    return {name: (noise(HEAD), noise(HEAD)) if split else noise(2 * HEAD) for name in LAYERS}


def block(caches: dict, block_id: int) -> list[torch.Tensor]:
    """Every layer's K and V of one device block, as separate tensors."""
    parts = []
    for value in caches.values():
        if isinstance(value, tuple):
            parts += [value[0][block_id].clone(), value[1][block_id].clone()]
        else:
            parts += [value[block_id, ..., :HEAD].clone(), value[block_id, ..., HEAD:].clone()]
    return parts


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[bool]:
    return [torch.equal(x, y) for x, y in zip(a, b, strict=True)]


def store(job_id: int, req_id: str, block_ids: list[int], slots: list[int]) -> StoreJob:
    return StoreJob(job_id, req_id, {0: (block_ids, slots)})


def load(job_id: int, req_id: str, block_ids: list[int], slots: list[int]) -> LoadJob:
    return LoadJob(job_id, req_id, {0: (block_ids, slots)})


def step(worker: WorkerSide, **meta_fields) -> tuple[set[str], set[str], set[str]]:
    """One engine step as vLLM's model runner makes it (no model)."""
    meta = KVHALMetadata(**meta_fields)
    worker.begin_step(meta)
    worker.start_loads(meta)
    worker.start_stores(meta)
    return worker.collect()


def settle(worker: WorkerSide, timeout: float = 20) -> tuple[set[str], set[str], set[str]]:
    """Poll until no job is in flight; everything reported on the way."""
    finished, failed, sent = set(), set(), set()
    deadline = time.monotonic() + timeout
    while True:
        f, fa, s = worker.collect()
        finished |= f
        failed |= fa
        sent |= s
        if not worker.jobs_in_flight:
            return finished, failed, sent
        assert time.monotonic() < deadline, "jobs never finished"
        time.sleep(0.001)


class Gate:
    """Holds each copy's stream until opened; can make copies fail."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.fail = False

    @hookimpl(wrapper=True)
    def kvhal_copy_blocks(self, plan, stream):
        stream.submit(self.open.wait)  # runs before the copy, on the same stream
        event = yield
        if self.fail:
            stream.submit(self._boom)  # the next event recorded carries the error
            event = CPUEvent()
            stream.record(event)
        return event

    @staticmethod
    def _boom() -> None:
        raise RuntimeError("injected copy failure")


def cpu_plugin_with(monkeypatch, plugin: object, name: str) -> None:
    """WorkerSides made after this use the CPU plugin with ``plugin`` wrapping its hooks."""
    registry = PluginRegistry(autoload=False, allow=None, block=())
    registry.register(plugin, name)
    monkeypatch.setattr(
        worker_setup, "select_device", lambda name=None, device_type=None: registry.select("cpu")
    )


@pytest.fixture
def gate(monkeypatch) -> Gate:
    """WorkerSides made after this use the CPU plugin with a gate on its copies."""
    gate = Gate()
    cpu_plugin_with(monkeypatch, gate, "gate")
    yield gate
    gate.open.set()


def registered(split: bool = True, **config) -> tuple[WorkerSide, dict]:
    caches = kv_caches(split)
    worker = WorkerSide(connector_config(**config))
    worker.register(caches)
    return worker, caches


def finishes_while_gate_closed(gate: Gate, call, results: list | None = None) -> bool:
    """Whether ``call()`` returns while every copy is held (it did not wait for one);
    its result is appended to ``results``. The gate is open again afterwards."""
    gate.open.clear()
    thread = threading.Thread(target=lambda: (results if results is not None else []).append(call()))
    thread.start()
    thread.join(timeout=10)
    returned = not thread.is_alive()
    gate.open.set()
    thread.join()
    return returned


# -- split (K, V) caches ------------------------------------------------------------


@pytest.mark.parametrize("split", [True, False], ids=["kv-pairs", "one-tensor"])
def test_store_then_load_round_trip_through_the_real_worker_side(split):
    """vllm-ascend registers a (k_cache, v_cache) pair per layer; kvhal's own CPU plugin
    (selected by the tensors' device type) declares kv.split and copies both parts."""
    worker, caches = registered(split)
    assert worker.device.name == "cpu"
    assert worker.caches[0].geometry.kv_format is (KVFormat.SPLIT if split else KVFormat.STACKED)
    assert worker.host_tier.slot_bytes == len(LAYERS) * PAGE  # vLLM's page covers K and V
    before = {b: block(caches, b) for b in (3, 5, 7, 9)}
    step(worker, stores=[store(0, "a", [3, 5], [0, 1])])
    settle(worker)
    step(worker, loads=[load(1, "b", [7, 9], [1, 0])])
    finished, failed, _ = settle(worker)
    assert finished == {"b"} and not failed
    assert all(same(block(caches, 7), before[5])) and all(same(block(caches, 9), before[3]))
    # Negative control: the blocks held other bytes, so the comparison saw the loaded ones.
    assert not any(same(before[7], before[5])) and not any(same(before[9], before[3]))
    assert worker.worker_meta().succeeded == {0: 1, 1: 1}
    worker.shutdown()


def test_split_cache_loads_each_part_from_the_host_tier():
    """Noise in the host copy of V (K intact) reaches V of the loaded block only."""
    worker, caches = registered(split=True)
    original = block(caches, 3)
    step(worker, stores=[store(0, "a", [3], [2])])
    settle(worker)
    host = worker.host_views[0]
    for _, v in host.layers:
        v[2].copy_(torch.full_like(v[2], 7.0))  # slot 2's V, every layer
    step(worker, loads=[load(1, "b", [11], [2])])
    settle(worker)
    loaded = block(caches, 11)
    assert same(loaded, original) == [True, False] * len(LAYERS)
    assert all(torch.all(v == 7.0) for v in loaded[1::2])
    worker.shutdown()


@pytest.mark.parametrize(
    ("value", "phrase"),
    [
        ((torch.zeros(2, 2),), "its k_cache has 2 dimensions, not 4"),
        ([torch.zeros(2), torch.zeros(2), torch.zeros(2)], "Mamba state .* got list of 3"),
        ("kv", "got str"),
    ],
)
def test_a_malformed_layer_is_refused_naming_it(value, phrase):
    caches = kv_caches(split=True)
    caches[LAYERS[1]] = value
    with pytest.raises(ValidationError, match=phrase) as raised:
        WorkerSide(connector_config()).register(caches)
    assert raised.value.argument == "kv_caches" and repr(LAYERS[1]) in str(raised.value)


def test_tensors_that_disagree_with_vllms_page_size_are_refused():
    """A spec page that counted K only (half the bytes) must not size the host slots."""
    with pytest.raises(ValidationError, match=f"holds {2 * PAGE} bytes, vLLM's KV cache spec says {PAGE}"):
        WorkerSide(connector_config(page=PAGE // 2)).register(kv_caches(split=True))
    caches = kv_caches(split=True)
    del caches[LAYERS[0]]
    with pytest.raises(ValidationError, match="no tensor for layers"):
        WorkerSide(connector_config()).register(caches)


def test_slots_hold_the_real_bytes_of_a_padded_page():
    """vLLM may pad page_size_bytes (hybrid groups sharing a block pool); copies move the
    real bytes, so the host slots are sized from those and the tensors agree."""
    spec = SimpleNamespace(page_size_bytes=PAGE + 512, real_page_size_bytes=PAGE, head_size=HEAD)
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"cpu_bytes_to_use": 1 << 20}),
        cache_config=SimpleNamespace(block_size=TOKENS),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, world_size=1),
    )
    kv_cache_config = SimpleNamespace(
        prefix_cacheable_group_ids=[0],
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=list(LAYERS))],
        kv_cache_layout=None,
    )
    config = ConnectorConfig.from_vllm(vllm_config, kv_cache_config)
    assert config.slot_bytes == len(LAYERS) * PAGE
    worker = WorkerSide(config)
    worker.register(kv_caches(split=True))
    assert worker.host_tier.slot_bytes == worker.caches[0].geometry.block_bytes
    worker.shutdown()


# -- loads are polled -------------------------------------------------------------


def test_a_load_is_polled_and_reported_in_the_step_that_finds_it_done(gate):
    worker, caches = registered()
    step(worker, stores=[store(0, "a", [3], [0])])
    settle(worker)
    meta = KVHALMetadata(loads=[load(1, "b", [9], [0])])
    results: list = []

    def this_step_and_the_next():
        worker.begin_step(meta)
        worker.start_loads(meta)
        results.append(worker.jobs_in_flight)
        return worker.collect(), step(worker)  # the next step runs nothing new

    # get_transfer_results returns while the load is held: the request stays parked
    assert finishes_while_gate_closed(gate, this_step_and_the_next, results)
    assert results == [1, ((set(), set(), set()), (set(), set(), set()))]
    finished, failed, _ = settle(worker)
    assert finished == {"b"} and not failed
    assert all(same(block(caches, 9), block(caches, 3)))
    worker.shutdown()


def test_collect_never_waits_for_a_load(gate):
    worker, _ = registered()
    step(worker, stores=[store(0, "a", [3], [0])])
    settle(worker)
    meta = KVHALMetadata(loads=[load(1, "b", [9], [0])])

    def submit_and_collect():
        worker.start_loads(meta)
        worker.collect()

    assert finishes_while_gate_closed(gate, submit_and_collect)
    settle(worker)
    worker.shutdown()


def test_a_failed_load_is_reported_as_finished_and_failed(gate):
    worker, _ = registered()
    step(worker, stores=[store(0, "a", [3], [0])])
    settle(worker)
    gate.fail = True
    step(worker, loads=[load(1, "b", [9], [0])])
    finished, failed, sent = settle(worker)
    assert finished == failed == {"b"} and not sent
    worker.shutdown()


# -- synchronous loads: the forward waits for them ----------------------------------


def sync_load(job_id: int, req_id: str, block_ids: list[int], slots: list[int]) -> LoadJob:
    return LoadJob(job_id, req_id, {0: (block_ids, slots)}, sync=True)


def test_a_synchronous_load_holds_the_forward_and_is_not_reported_as_received(gate):
    """vLLM runs the request in this step: start_load_kv returns once the copy is done (on
    the CPU the compute stream is the thread), and vLLM waits for no finished_recving."""
    worker, caches = registered()
    step(worker, stores=[store(0, "a", [3], [0])])
    settle(worker)
    meta = KVHALMetadata(loads=[sync_load(1, "b", [9], [0])])
    assert not finishes_while_gate_closed(gate, lambda: worker.start_loads(meta))
    assert all(same(block(caches, 9), block(caches, 3)))  # in place before the forward
    assert worker.collect() == (set(), set(), set())
    assert worker.take_load_errors() == set() and worker.jobs_in_flight == 0
    assert worker.worker_meta().succeeded == {0: 1, 1: 1}
    worker.shutdown()


def test_an_asynchronous_load_does_not_hold_the_forward(gate):
    """Negative control of the test above: the same load, asynchronous, returns at once."""
    worker, _ = registered()
    step(worker, stores=[store(0, "a", [3], [0])])
    settle(worker)
    meta = KVHALMetadata(loads=[load(1, "b", [9], [0])])
    assert finishes_while_gate_closed(gate, lambda: worker.start_loads(meta))
    settle(worker)
    worker.shutdown()


def test_a_failed_synchronous_load_reports_its_blocks_as_load_errors(gate):
    """vLLM recomputes the blocks get_block_ids_with_load_errors names, in that step."""
    worker, _ = registered()
    step(worker, stores=[store(0, "a", [3, 4], [0, 1])])
    settle(worker)
    gate.fail = True
    assert step(worker, loads=[sync_load(1, "b", [9, 10], [0, 1])]) == (set(), set(), set())
    assert worker.take_load_errors() == {9, 10}
    assert worker.take_load_errors() == set()  # reported once
    assert worker.worker_meta().failed == {1: 1}
    worker.shutdown()


# -- stores overlap the next steps ------------------------------------------------


def test_a_step_does_not_wait_for_stores_it_is_not_told_to_fence(gate):
    worker, _ = registered()
    # the next step starts (and polls) while the store is still held
    assert finishes_while_gate_closed(
        gate, lambda: (step(worker, stores=[store(0, "a", [3, 4], [0, 1])]), step(worker, fence=[]))
    )
    settle(worker)
    worker.shutdown()


def test_a_fenced_store_holds_the_steps_compute_until_it_is_done(gate):
    """Negative control of the test above: the store named in ``fence`` is waited for."""
    worker, _ = registered()
    gate.open.clear()
    step(worker, stores=[store(0, "a", [3], [0]), store(1, "b", [4], [1])])
    returned = threading.Event()
    thread = threading.Thread(target=lambda: (worker.begin_step(KVHALMetadata(fence=[1])), returned.set()))
    thread.start()
    thread.join(timeout=0.5)
    assert not returned.is_set(), "the compute stream did not wait for the fenced store"
    gate.open.set()
    thread.join(timeout=10)
    assert returned.is_set()
    # a fence on a job already done (or a load) is a no-op
    settle(worker)
    assert finishes_while_gate_closed(gate, lambda: worker.begin_step(KVHALMetadata(fence=[0, 1, 99])))
    worker.shutdown()


def test_a_held_request_is_reported_once_its_stores_finish(gate):
    worker, caches = registered()
    before = block(caches, 3)
    results: list = []

    def three_steps():
        step(worker, stores=[store(0, "a", [3], [0])])
        step(worker, stores=[store(1, "a", [4], [1]), store(2, "b", [5], [2])])
        # "a" finished; the scheduler holds its blocks: nothing to report while its stores run
        return step(worker, held=["a", "c"])

    assert finishes_while_gate_closed(gate, three_steps, results)
    assert results == [(set(), set(), {"c"})]  # "c" has no store on this worker
    _, _, sent = settle(worker)
    assert sent == {"a"}
    assert step(worker) == (set(), set(), set())  # reported once
    step(worker, loads=[load(3, "x", [12], [0])])
    settle(worker)
    assert all(same(block(caches, 12), before))  # the store read block 3 as it was
    worker.shutdown()


def test_a_held_request_whose_store_failed_is_still_reported(gate):
    """A failed store reads the blocks no more: vLLM must get them back."""
    worker, _ = registered()
    gate.fail = True
    results: list = []
    assert finishes_while_gate_closed(
        gate, lambda: (step(worker, stores=[store(0, "a", [3], [0])]), step(worker, held=["a"]))[1], results
    )
    assert results == [(set(), set(), set())]
    _, _, sent = settle(worker)
    assert sent == {"a"}
    assert worker.worker_meta().failed == {0: 1}
    worker.shutdown()


def test_shutdown_waits_for_copies_in_flight(gate):
    worker, _ = registered()
    gate.open.clear()
    step(worker, stores=[store(0, "a", [3], [0])])
    threading.Timer(0.2, gate.open.set).start()
    worker.shutdown()
    assert gate.open.is_set() and worker.jobs_in_flight == 0 and worker.host_tier is None


def test_with_two_workers_a_held_request_is_finished_when_both_reported(gate, monkeypatch):
    """vLLM's own KVOutputAggregator (tensor parallelism) frees the blocks only once every
    worker reported the request: the slow worker's store keeps them."""
    slow, _ = registered(world_size=2)
    fast_registry = PluginRegistry(autoload=False, allow=None, block=())
    monkeypatch.setattr(
        worker_setup, "select_device", lambda name=None, device_type=None: fast_registry.select("cpu")
    )
    fast, _ = registered(world_size=2)
    aggregator = KVOutputAggregator(expected_finished_count=2)

    def both(**meta) -> set[str]:
        outputs = []
        for worker in (slow, fast):
            finished, failed, sent = step(worker, **meta)
            kv = KVConnectorOutput(finished_sending=sent, finished_recving=finished, failed_recving=failed)
            outputs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=kv))
        return aggregator.aggregate(outputs).kv_connector_output.finished_sending or set()

    def gated() -> list[set[str]]:  # the gate holds the slow worker's copies only
        # after the second step the fast worker has reported "a"; the slow one has not
        return [both(stores=[store(0, "a", [3], [0])]), both(held=["a"]), *(both() for _ in range(3))]

    results: list = []
    assert finishes_while_gate_closed(gate, gated, results)
    assert results == [[set()] * 5]
    deadline = time.monotonic() + 20
    while not (sent := both()):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert sent == {"a"}
    slow.shutdown()
    fast.shutdown()


# -- an idle engine ------------------------------------------------------------------


@pytest.mark.parametrize("idle", [True, False])
def test_an_idle_step_waits_for_a_job_in_flight_to_end(gate, idle, monkeypatch):
    """vLLM steps an idle engine every millisecond while kvhal has jobs in flight: an idle
    step's collect waits for one to end and reports it in that step; a step with work never
    waits (the negative control)."""
    monkeypatch.setattr(worker_side, "IDLE_WAIT_S", 10.0)  # far longer than the copy's hold
    worker, _ = registered()
    gate.open.clear()
    step(worker, stores=[store(0, "a", [3], [0])])
    threading.Timer(0.2, gate.open.set).start()
    step(worker, idle=idle)
    meta = worker.worker_meta()
    if idle:
        assert meta is not None and meta.succeeded == {0: 1}
    else:
        assert meta is None, "a step with work waited for a copy"
    settle(worker)
    worker.shutdown()


def test_an_idle_steps_wait_has_a_deadline(gate, monkeypatch):
    monkeypatch.setattr(worker_side, "IDLE_WAIT_S", 0.05)
    worker, _ = registered()
    gate.open.clear()
    step(worker, stores=[store(0, "a", [3], [0])])
    start = time.monotonic()
    step(worker, idle=True)  # the copy is held past the deadline
    assert 0.05 <= time.monotonic() - start < 5 and worker.worker_meta() is None
    gate.open.set()
    settle(worker)
    worker.shutdown()

"""KVHALConnector's scheduler side, fed vLLM's own request and scheduler-output objects.

What it decides for stores in flight: which finished requests keep their
blocks (``request_finished`` returns True) until every worker reports them in
``finished_sending``, and which stores a step's compute must wait for (blocks
of a preempted request, or blocks vLLM allocates again) -- no other.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

try:
    from vllm.v1.core.sched.output import KVConnectorBlockState
except ImportError:  # vLLM 0.27.1: no block state handed to connectors
    KVConnectorBlockState = None
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvhal.vllm.config import ConnectorConfig, GroupInfo
from kvhal.vllm.metadata import KVHALMetadata, KVHALWorkerMetadata, StoreJob
from kvhal.vllm.scheduler_side import LOADED_TOKENS, SchedulerSide

BS = 4
PAGE = 1024
PROMPT = list(range(1, 13))  # three full blocks

init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def scheduler_config(slots: int = 64, world_size: int = 1, groups: int = 1, **more) -> ConnectorConfig:
    """The scheduler tests' connector config: ``slots`` host slots per worker, one group of one
    layer per KV cache group; ``more`` sets any other field (a lower or remote tier, say)."""
    return ConnectorConfig(
        cpu_bytes_to_use=slots * PAGE * world_size,
        device=None,
        eviction_policy="lru",
        offload_prompt_only=True,
        block_size=BS,
        groups=tuple(GroupInfo(g, (f"l{g}",), PAGE, 8) for g in range(groups)),
        world_size=world_size,
        layout="LBHNC",
        **more,
    )


def side(world_size: int = 1, load_mode: str = "auto", groups: int = 1) -> SchedulerSide:
    return SchedulerSide(scheduler_config(world_size=world_size, groups=groups, load_mode=load_mode))


def request(req_id: str, tokens: list[int] = PROMPT) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, block_hasher=HASHER)


#: The scheduler output's shape: vLLM 0.32 hands connectors its block table; 0.27.1 does not,
#: and kvhal keeps one from the new and cached requests' block ids (kvhal.vllm.versions).
SHAPES = ("0.32", "0.27.1") if KVConnectorBlockState is not None else ("0.27.1",)
shape = {"now": "0.32"}


@pytest.fixture(params=SHAPES, autouse=True)
def vllm_shape(request: pytest.FixtureRequest) -> str:
    """Every test of the scheduler side runs with both versions' scheduler output."""
    shape["now"] = request.param
    yield request.param
    shape["now"] = "0.32"


def output(
    new: list[tuple[Request, list[int], int]] = (),
    cached: list[tuple[Request, list[int], int]] = (),
    preempted: set[str] = frozenset(),
    tables: dict[str, list[int]] | None = None,
) -> SchedulerOutput:
    """One step: ``new``/``cached`` are (request, block ids handed out, tokens scheduled);
    a new request's block ids are its whole table, its prefix hits first."""
    scheduled = {r.request_id: n for r, _, n in (*new, *cached)}
    tables = tables or {r.request_id: ids for r, ids, _ in new}
    return SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                mm_features=[],
                sampling_params=r.sampling_params,
                pooling_params=None,
                block_ids=(ids,),
                num_computed_tokens=r.num_computed_tokens,
                lora_request=None,
            )
            for r, ids, _ in new
        ],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[r.request_id for r, _, _ in cached],
            resumed_req_ids=set(),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=[(ids,) if ids else None for _, ids, _ in cached],
            num_computed_tokens=[r.num_computed_tokens for r, _, _ in cached],
            num_output_tokens=[0 for _ in cached],
        ),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
        preempted_req_ids=set(preempted),
        **block_state(tables),
    )


#: vLLM 0.27.1 to 0.31 require a field 0.32 dropped (0.30 and 0.31 have the block table too)
OLD_FIELDS = (
    {"num_common_prefix_blocks": [0]}
    if "num_common_prefix_blocks" in {f.name for f in dataclasses.fields(SchedulerOutput)}
    else {}
)


def block_state(tables: dict[str, list[int]]) -> dict:
    """The scheduler output's block table: vLLM 0.32's field, or none in 0.27.1's shape."""
    if KVConnectorBlockState is None:  # vLLM 0.27.1: no such field
        return OLD_FIELDS
    if shape["now"] == "0.27.1":
        return {**OLD_FIELDS, "kv_connector_block_state": None}
    state = KVConnectorBlockState(
        req_ids=set(tables), resolve_block_ids=lambda req_id: (tables[req_id],), boundary_state_offloads={}
    )
    return {**OLD_FIELDS, "kv_connector_block_state": state}


def reported(scheduler: SchedulerSide, job_ids, sent: set[str] = frozenset(), ok: bool = True) -> None:
    """One worker's answer for ``job_ids`` (``sent``: its finished_sending)."""
    counts = {job_id: 1 for job_id in job_ids}
    worker_meta = KVHALWorkerMetadata(succeeded=counts if ok else {}, failed={} if ok else counts)
    scheduler.on_output(KVConnectorOutput(finished_sending=set(sent), kv_connector_worker_meta=worker_meta))


def prefill(scheduler: SchedulerSide, req: Request, blocks: list[int]) -> KVHALMetadata:
    """``req`` runs its whole prompt in one step, in ``blocks``; the step's metadata."""
    scheduler.track(req)
    assert scheduler.lookup(req, 0) == (0, False)
    meta = scheduler.build_meta(output(new=[(req, blocks, len(req.prompt_token_ids))]))
    req.num_computed_tokens = len(req.prompt_token_ids)
    return meta


def store_ids(meta: KVHALMetadata) -> list[int]:
    assert all(isinstance(job, StoreJob) for job in meta.stores)
    return [job.job_id for job in meta.stores]


# -- finished requests keep their blocks while their stores run ---------------------


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_finished_request_keeps_its_blocks_until_every_worker_stored_them(world_size):
    scheduler = side(world_size)
    a = request("a")
    [job] = store_ids(prefill(scheduler, a, [1, 2, 3]))
    hold, params = scheduler.request_finished(a)
    assert hold and params == {LOADED_TOKENS: 0}
    assert scheduler.has_held_blocks() and scheduler.stats.data["held_requests"] == 1
    # the workers hear of it in the next step's metadata, once
    assert scheduler.build_meta(output()).held == ["a"]
    assert scheduler.build_meta(output()).held == []
    for worker in range(world_size):
        assert scheduler.has_jobs_in_flight()
        assert scheduler.manager.lookup([k for k in scheduler.jobs[job].keys]) == 0  # not loadable yet
        last = worker == world_size - 1
        # vLLM's aggregator passes "a" on only when every worker reported it
        reported(scheduler, [job], sent={"a"} if last else set())
        assert scheduler.has_held_blocks() is not last
    assert not scheduler.has_jobs_in_flight()
    assert scheduler.lookup(request("again"), 0) == (8, False)  # stored: loadable now, in its step


def test_a_request_whose_stores_were_reported_is_not_held():
    scheduler = side()
    a = request("a")
    reported(scheduler, store_ids(prefill(scheduler, a, [1, 2, 3])))
    assert scheduler.request_finished(a)[0] is False
    assert scheduler.build_meta(output()).held == [] and not scheduler.has_held_blocks()


def test_a_failed_store_still_releases_the_request():
    scheduler = side()
    a = request("a")
    jobs = store_ids(prefill(scheduler, a, [1, 2, 3]))
    assert scheduler.request_finished(a)[0] is True
    reported(scheduler, jobs, sent={"a"}, ok=False)
    assert not scheduler.has_held_blocks() and not scheduler.has_jobs_in_flight()
    assert scheduler.stats.data["failed_stores"] == 1
    assert scheduler.lookup(request("again"), 0) == (0, False)


def test_a_request_finished_during_its_load_is_not_held():
    """vLLM frees those blocks when the load is reported (finished_recving); holding
    them for finished_sending as well would free them twice."""
    scheduler = side(load_mode="async")
    a = request("a")
    reported(scheduler, store_ids(prefill(scheduler, a, [1, 2, 3])))
    scheduler.request_finished(a)
    b = request("b")
    scheduler.track(b)
    assert scheduler.lookup(b, 0) == (8, True)
    scheduler.after_alloc(b, KVCacheBlocks(([KVCacheBlock(7), KVCacheBlock(8)],)), 8)
    [load] = scheduler.build_meta(output()).loads
    assert load.groups == {0: ([7, 8], load.groups[0][1])}
    assert scheduler.request_finished(b) == (False, {LOADED_TOKENS: 8})  # aborted while loading


# -- host hits load in the step that schedules them -----------------------------------


def stored(scheduler: SchedulerSide) -> None:
    """Request "a"'s three prompt blocks stored and reported: two are loadable hits."""
    a = request("a")
    reported(scheduler, store_ids(prefill(scheduler, a, [1, 2, 3])))
    scheduler.request_finished(a)


def load_of(scheduler: SchedulerSide, req: Request, answer: tuple[int, bool]):
    scheduler.track(req)
    assert scheduler.lookup(req, 0) == answer
    scheduler.after_alloc(req, KVCacheBlocks(([KVCacheBlock(7), KVCacheBlock(8)],)), 8)
    [load] = scheduler.build_meta(output()).loads
    return load


def test_a_host_hit_is_a_synchronous_load():
    """(8, False): vLLM runs the request in this step, and the workers load before its forward."""
    scheduler = side()
    stored(scheduler)
    load = load_of(scheduler, request("b"), (8, False))
    assert load.sync and load.groups[0][0] == [7, 8]
    assert scheduler.stats.data["sync_hit_tokens"] == 8


def test_hits_stay_asynchronous_where_asked():
    scheduler = side(load_mode="async")
    stored(scheduler)
    assert load_of(scheduler, request("b"), (8, True)).sync is False
    assert "sync_hit_tokens" not in scheduler.stats.data


def test_hybrid_models_keep_asynchronous_loads():
    """vLLM raises on block-level load errors with several KV cache groups: hybrid models
    keep the parked (asynchronous) path, whose failures it recomputes per request."""
    assert side(groups=2).config.sync_host_loads is False
    assert side(groups=1).config.sync_host_loads is True


def test_a_failed_synchronous_load_is_never_offered_again_and_reports_nothing_loaded():
    scheduler = side()
    stored(scheduler)
    b = request("b")
    load = load_of(scheduler, b, (8, False))
    reported(scheduler, [load.job_id], ok=False)
    assert scheduler.stats.data["failed_loads"] == 1
    assert scheduler.lookup(b, 0) == (0, False)  # vLLM recomputes; the same hit would fail again
    assert scheduler.request_finished(b) == (False, {LOADED_TOKENS: 0})


# -- fences: only stores whose blocks are about to be rewritten ----------------------


def test_a_step_fences_no_store_when_it_reuses_none_of_their_blocks():
    scheduler = side()
    [job] = store_ids(prefill(scheduler, request("a"), [1, 2, 3]))
    c = request("c", list(range(100, 112)))
    meta = scheduler.build_meta(output(new=[(c, [4, 5, 6], 12)]))
    assert meta.fence == [] and store_ids(meta) != [job]
    # a prefix-cache hit on a block being stored only reads it
    d = request("d")
    d.num_computed_tokens = 8
    assert scheduler.build_meta(output(new=[(d, [1, 2, 9], 4)])).fence == []
    assert "fenced_stores" not in scheduler.stats.data


@pytest.mark.parametrize("how", ["new request", "running request", "kvhal load", "block zeroing"])
def test_a_step_that_reallocates_a_block_being_stored_fences_that_store(how):
    """Blocks freed while their store runs (a sliding window's, say) and handed out again."""
    scheduler = side()
    [job] = store_ids(prefill(scheduler, request("a"), [1, 2, 3]))
    [other] = store_ids(prefill(scheduler, request("b", list(range(50, 62))), [4, 5, 6]))
    c = request("c", list(range(100, 112)))
    if how == "new request":
        out = output(new=[(c, [9, 2, 10], 12)])
    elif how == "running request":
        c.num_computed_tokens = 8
        out = output(cached=[(c, [2], 4)], tables={"c": [11, 12, 2]})
    elif how == "kvhal load":
        reported(scheduler, [job, other])
        [job] = store_ids(prefill(scheduler, request("e", list(range(200, 212))), [13, 14, 15]))
        scheduler.track(c := request("again"))
        assert scheduler.lookup(c, 0) == (8, False)
        scheduler.after_alloc(c, KVCacheBlocks(([KVCacheBlock(14), KVCacheBlock(20)],)), 8)
        out = output()
    else:
        out = output()
        out.new_block_ids_to_zero = [2, 14]
    meta = scheduler.build_meta(out)
    assert meta.fence == [job]
    assert scheduler.stats.data["fenced_stores"] == 1


def test_a_preempted_requests_stores_are_fenced_and_no_longer_hold_it():
    scheduler = side()
    a = request("a")
    [job] = store_ids(prefill(scheduler, a, [1, 2, 3]))
    assert scheduler.build_meta(output(preempted={"a"})).fence == [job]
    # its blocks went back to vLLM at preemption, their reuse fenced: nothing to hold
    assert scheduler.request_finished(a)[0] is False
    reported(scheduler, [job])
    assert not scheduler.has_jobs_in_flight()


def test_reset_is_refused_while_stores_are_in_flight():
    scheduler = side()
    a = request("a")
    jobs = store_ids(prefill(scheduler, a, [1, 2, 3]))
    assert scheduler.reset() is False
    reported(scheduler, jobs)
    assert scheduler.reset() is True and scheduler.lookup(request("again"), 0) == (0, False)


def test_a_step_is_idle_only_when_nothing_computes_and_no_request_is_known():
    """An idle step lets the workers wait a little for jobs in flight (vLLM steps an idle
    engine every millisecond while kvhal has any): never while a request may need them."""
    scheduler = side()
    assert scheduler.build_meta(output()).idle
    a = request("a")
    meta = prefill(scheduler, a, [1, 2, 3])
    assert not meta.idle  # it computes
    assert not scheduler.build_meta(output()).idle  # "a" is known: it may be scheduled next
    scheduler.request_finished(a)
    assert scheduler.build_meta(output()).idle  # its stores may still be in flight: wait for them

"""What the scheduler-side connector tells the workers each step, and what they answer.

A step's work is four kinds of job, each a type of its own, each handled in one place on
each side:

- :class:`LoadJob`: host slots -> the KV cache (after reading the blocks that tiers below
  hold into host slots, :class:`~kvhal.tiers.chain.TierRead`);
- :class:`StoreJob`: the KV cache -> host slots, and then its write-throughs;
- :class:`ReadJob`: tiers below -> host slots, for a request waiting at its lookup (a
  prefetch; no device copy);
- :class:`WriteJob`: host slots -> one tier below (a write-through, run once its store's
  copy is done, or a write-back snapshot).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhal.tiers.chain import TierRead
from kvhal.vllm.vllm_bases import KVConnectorMetadata, KVConnectorWorkerMetadata

#: Per KV cache group, ``(device block ids, host slots)`` of equal length.
Groups = dict[int, tuple[list[int], list[int]]]


@dataclass
class WriteJob:
    """Copy host slots into one tier below.

    :param slots: a local tier's slots (empty for a shared store).
    :param snapshot: the host slots are reused from this step on (write-back of
        evicted blocks): the worker copies them out before anything else.
    :param positions: each key's block in its request (a store's write; empty: not known).
    """

    job_id: int
    tier: str
    keys: list[bytes]
    host_slots: list[int]
    slots: list[int]
    snapshot: bool = False
    positions: list[int] = field(default_factory=list)


@dataclass
class LoadJob:
    """Copy one request's blocks from host slots into the KV cache.

    :param reads: the blocks to read from tiers below into host slots first.
    :param sync: a load vLLM scheduled in this step: the forward waits for its copy, and a
        failure is reported as invalid blocks (``get_block_ids_with_load_errors``).
    :param doomed: the scheduler could not plan it (no host room for a promotion): it
        fails unrun, and vLLM recomputes.
    """

    job_id: int
    req_id: str
    groups: Groups
    reads: list[TierRead] = field(default_factory=list)
    sync: bool = False
    doomed: bool = False

    @property
    def num_blocks(self) -> int:
        return sum(len(ids) for ids, _ in self.groups.values())


@dataclass
class StoreJob:
    """Copy one request's blocks from the KV cache into host slots, then write them to the
    tiers below written through (``writes``, once the copy is done)."""

    job_id: int
    req_id: str
    groups: Groups
    writes: list[WriteJob] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return sum(len(ids) for ids, _ in self.groups.values())


@dataclass
class ReadJob:
    """Read a waiting request's blocks from tiers below into host slots (a prefetch)."""

    job_id: int
    req_id: str
    reads: list[TierRead]


@dataclass
class KVHALMetadata(KVConnectorMetadata):
    """One step's work for every worker.

    :param loads: submitted once the step's forward is launched; each worker
        reports a request in ``finished_recving`` in the step it finds its load done.
    :param stores: submitted after the forward (ordered after its compute).
    :param prefetches: reads from tiers below into host slots, started before the step's
        forward (they overlap it); reported in the worker metadata, never to vLLM.
    :param writes: write-back snapshots, submitted before the step's other copies.
    :param fence: store jobs whose source blocks may be rewritten from this step
        on (their request was preempted, or a block they read was allocated
        again): the compute stream waits for them before the step's work.
    :param held: finished requests whose blocks vLLM keeps until every worker
        reports them in ``finished_sending``, once their store jobs finished there.
    :param idle: nothing computes in this step and no request is known to kvhal: vLLM steps
        an idle engine about every millisecond while kvhal has jobs in flight, so the workers
        wait a little for one of them to end before they answer.
    :param send_stats: the workers send this step's counters (else they keep them for a later
        step): where vLLM drops the stats of a step without request outputs (before 0.32),
        only a step in which a request samples a token sends them.
    :param no_forward: nothing computes in this step: its stores are submitted with its loads
        (vLLM 0.27.1 calls no ``wait_for_save`` in such a step; on 0.32 that call finds them
        submitted).
    """

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    prefetches: list[ReadJob] = field(default_factory=list)
    writes: list[WriteJob] = field(default_factory=list)
    fence: list[int] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    idle: bool = False
    no_forward: bool = False
    send_stats: bool = True


@dataclass
class KVHALWorkerMetadata(KVConnectorWorkerMetadata):
    """Jobs that finished on this worker since the last step: ``job id -> workers``."""

    succeeded: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVHALWorkerMetadata:
        assert isinstance(other, KVHALWorkerMetadata)
        for mine, theirs in ((self.succeeded, other.succeeded), (self.failed, other.failed)):
            for job_id, count in theirs.items():
                mine[job_id] = mine.get(job_id, 0) + count
        return self

"""What the scheduler-side connector tells the workers each step, and what they answer."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


class JobKind(str, enum.Enum):
    STORE = "store"
    LOAD = "load"
    WRITE = "write"  # host slots -> the lower tier


@dataclass
class TierReads:
    """Blocks a load first reads from the lower tier into host slots (a promotion)."""

    keys: list[bytes]
    lower_slots: list[int]
    host_slots: list[int]


@dataclass
class TransferJob:
    """Copy one request's blocks between the device KV cache and host slots.

    :param groups: per KV cache group, ``(device block ids, host slots)`` of equal length.
    :param reads: for a load, the blocks to read from the lower tier first.
    """

    job_id: int
    kind: JobKind
    req_id: str
    groups: dict[int, tuple[list[int], list[int]]]
    reads: TierReads | None = None
    #: for a store, its write-through to the lower tier, run once the store's copy is done
    write: TierWrite | None = None
    #: the scheduler could not plan it (no host room for a promotion): it fails unrun
    doomed: bool = False
    #: for a load, the blocks to read from the remote tier first
    remote_reads: TierReads | None = None
    #: for a store, its write-through to the remote tier, run once the store's copy is done
    remote_write: TierWrite | None = None
    #: a load vLLM scheduled in this step: the forward waits for its copy, and a failure is
    #: reported as invalid blocks (``get_block_ids_with_load_errors``), not in ``finished_recving``
    sync: bool = False
    #: a load with no copy to the device: ``reads`` into host slots, started at the step's
    #: beginning for a request that waits (unscheduled) until they are in host memory
    prefetch: bool = False

    @property
    def num_blocks(self) -> int:
        return sum(len(ids) for ids, _ in self.groups.values())


@dataclass
class KVHALMetadata(KVConnectorMetadata):
    """One step's work for every worker.

    :param loads: submitted once the step's forward is launched; each worker
        reports a request in ``finished_recving`` in the step it finds its load done.
    :param stores: submitted after the forward (ordered after its compute).
    :param fence: store jobs whose source blocks may be rewritten from this step
        on (their request was preempted, or a block they read was allocated
        again): the compute stream waits for them before the step's work.
    :param held: finished requests whose blocks vLLM keeps until every worker
        reports them in ``finished_sending``, once their store jobs finished there.
    :param writes: copies of host slots into the lower tier.
    :param prefetches: reads from the lower tier into host slots, started before the step's
        forward (they overlap it); reported in the worker metadata, never to vLLM.
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

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    prefetches: list[TransferJob] = field(default_factory=list)
    fence: list[int] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    writes: list[TierWrite] = field(default_factory=list)
    idle: bool = False
    no_forward: bool = False
    send_stats: bool = True


@dataclass
class TierWrite:
    """Copy host slots into the lower tier; submitted before the step's other copies.

    :param snapshot: the host slots are reused from this step on (write-back of
        evicted blocks): the worker copies them out before anything else.
    """

    job_id: int
    keys: list[bytes]
    host_slots: list[int]
    lower_slots: list[int]
    snapshot: bool
    remote: bool = False  # to the remote tier (``lower_slots`` is empty)


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

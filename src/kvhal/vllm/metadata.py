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


@dataclass
class TransferJob:
    """Copy one request's blocks between the device KV cache and host slots.

    :param groups: per KV cache group, ``(device block ids, host slots)`` of equal length.
    """

    job_id: int
    kind: JobKind
    req_id: str
    groups: dict[int, tuple[list[int], list[int]]]

    @property
    def num_blocks(self) -> int:
        return sum(len(ids) for ids, _ in self.groups.values())


@dataclass
class KVHALMetadata(KVConnectorMetadata):
    """One step's work: loads go before the forward (or in a no-forward step),
    stores after it."""

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)


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

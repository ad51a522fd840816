"""vLLM's base classes that the worker path's types subclass (the step's metadata, the
worker's answer, the counters), or stand-ins of the same shape where vLLM is not installed.

The worker side (:mod:`kvhal.vllm.worker_side` and what it imports) needs nothing else of
vLLM, so ``kvhal replay`` runs it on a device machine that has a device's torch and no vLLM
(:mod:`kvhal.replay`). Inside an engine these are vLLM's own classes, as vLLM checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    VLLM_INSTALLED = True
except ModuleNotFoundError as missing:  # vLLM itself absent; a broken vLLM still fails
    if missing.name is None or missing.name.split(".")[0] != "vllm":
        raise
    VLLM_INSTALLED = False

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's base of a step's connector metadata."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's base of a worker's answer to the scheduler side."""

        def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
            raise NotImplementedError

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        """Stand-in for vLLM's base of connector statistics: a dict of counters."""

        data: dict[str, Any] = field(default_factory=dict)

        def to_dict(self) -> dict[str, Any]:
            return self.data


__all__ = ["VLLM_INSTALLED", "KVConnectorMetadata", "KVConnectorStats", "KVConnectorWorkerMetadata"]

"""What ``kvhal bench manager`` replays its trace through: one driver per index.

A driver is driven request by request (:class:`Driver`); :class:`KvhalDriver`
drives kvhal's manager, :class:`TierIndexDriver` the tier index (the same API,
the same calls), and :mod:`kvhal.vllm.testing.baseline_manager` vLLM's.
"""

from __future__ import annotations

from typing import Protocol

from kvhal.offload.manager import OffloadingManager
from kvhal.registry import PluginRegistry
from kvhal.tiers.index import TierIndex

Request = list[list[bytes]]  # per KV cache group, block keys in prefix order


class Driver(Protocol):
    name: str
    policy: str

    def start(self, request: Request) -> tuple[int, int, object]: ...
    def finish(self, state: object) -> None: ...
    def tracked(self) -> int: ...


class KvhalDriver:
    """kvhal's manager, driven request by request (the vLLM driver mirrors it)."""

    name = "kvhal OffloadingManager"

    def __init__(self, num_slots: int, policy: str, registry: PluginRegistry) -> None:
        self.policy = policy
        self.manager = OffloadingManager(num_slots, policy, registry=registry)

    def start(self, request: Request) -> tuple[int, int, object]:
        manager = self.manager
        hits = stored = 0
        work = []
        for keys in request:
            n = manager.lookup(keys)
            loaded = keys[:n]
            if n:
                manager.prepare_load(loaded)
            plan = manager.prepare_store(keys[n:])
            to_store = plan.keys if plan is not None else []
            work.append((loaded, to_store))
            hits += n
            stored += len(to_store)
        return hits, stored, (request, work)

    def finish(self, state: object) -> None:
        request, work = state  # type: ignore[misc]
        manager = self.manager
        for loaded, to_store in work:
            if loaded:
                manager.complete_load(loaded)
            if to_store:
                manager.complete_store(to_store)
        # Group-major, each group in prefix order: what vLLM's request end touches.
        manager.touch(request[0] if len(request) == 1 else [k for keys in request for k in keys])

    def tracked(self) -> int:
        return len(self.manager)


class TierIndexDriver(KvhalDriver):
    """The manager's driver over a :class:`TierIndex` (the same API, the same calls)."""

    name = "kvhal TierIndex"

    def __init__(self, num_slots: int, policy: str, registry: PluginRegistry) -> None:
        self.policy = policy
        self.manager = TierIndex(num_slots, policy, registry=registry)  # type: ignore[assignment]

"""vLLM 0.32's ``CPUOffloadingManager`` driven request by request, for ``kvhal bench manager``.

The calls are the ones vLLM 0.32's ``OffloadingConnector`` scheduler makes
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``):
``on_new_request``, one ``lookup(key)`` per block until the first block that
is not ``HIT``, ``prepare_load`` of the hits, ``prepare_store`` of the rest,
``complete_load`` / ``complete_store`` when the transfers finish, and
``on_request_finished``, where 0.32 applies a request's recency updates (its
LRU ranks the request's blocks in reverse prefix order, as kvhal's ``touch``
does).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

HIT = LookupResult.HIT


class VLLMManagerDriver:
    """One request at a time, split into :meth:`start` (lookups, prepare calls)
    and :meth:`finish` (completions, request end), like kvhal's driver."""

    name = "vLLM 0.32 CPUOffloadingManager"

    def __init__(self, num_slots: int, policy: str = "lru") -> None:
        self.policy = policy
        self.manager = CPUOffloadingManager(num_chunks=num_slots, cache_policy=policy, enable_events=False)
        self._requests = 0

    def start(self, request: Sequence[list[bytes]]) -> tuple[int, int, object]:
        """``request``: per KV cache group, the block keys in prefix order.
        Returns (blocks hit, blocks stored, what :meth:`finish` needs)."""
        manager = self.manager
        ctx = ReqContext(req_id=str(self._requests))
        self._requests += 1
        manager.on_new_request(ctx)
        hits = stored = 0
        work = []
        for keys in request:
            n = 0
            for key in keys:
                if manager.lookup(key, ctx) is not HIT:
                    break
                n += 1
            loaded = keys[:n]
            if n:
                manager.prepare_load(loaded, ctx)
            out = manager.prepare_store(keys[n:], ctx)
            to_store = out.keys_to_store if out is not None else []
            work.append((loaded, to_store))
            hits += n
            stored += len(to_store)
        return hits, stored, (ctx, work)

    def finish(self, state: object) -> None:
        ctx, work = state  # type: ignore[misc]
        manager = self.manager
        for loaded, to_store in work:
            if loaded:
                manager.complete_load(loaded, ctx)
            if to_store:
                manager.complete_store(to_store, ctx)
        manager.on_request_finished(ctx)

    def tracked(self) -> int:
        """Blocks the manager holds (stored or being stored)."""
        return self.manager._num_allocated_chunks - len(self.manager._free_list)

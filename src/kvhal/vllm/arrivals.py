"""Lookups started when vLLM queues a request (``on_new_request``), where lookups wait whole.

Where the engine computes on the host's cores (:func:`~kvhal.vllm.local.waits_whole`), a
lookup waits for its stores' answers and its read rather than let the engine step beside
them. Waited for in the step's lookups, one request after another, the requests arriving
together read in turn (three returning chat users: 199 ms of a 443 ms step). So the lookup
starts at arrival: the stores asked and the read started, not waited for; the request's
lookup in the step then waits for what is left of it, and requests arriving together read at
once (a local store server uses both cores while the engine waits). vLLM's own prefix-cache
hit is not known yet: the lookup starts at block 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvhal.vllm.local import waits_whole

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvhal.vllm.scheduler_side import SchedulerSide

#: Requests looked up at their arrival and not yet asked about by vLLM, past which an arrival
#: is not looked up: with more waiting in vLLM's queue the engine is saturated, and blocks read
#: for a request far back in it could be evicted before it runs (a store's blocks are read
#: once: then recomputed).
ARRIVING = 8


def arrived(side: SchedulerSide, request: Request) -> None:
    """``request`` was queued: track it, and look it up now where lookups wait whole (see
    the module) and fewer than :data:`ARRIVING` looked up so wait unasked."""
    side.track(request)
    if not side.tiers or not waits_whole(side.local) or len(side.arriving) >= ARRIVING:
        return
    side.prefetcher.defer = True
    try:
        side.lookup(request, 0)
    finally:
        side.prefetcher.defer = False
    side.arriving.add(request.request_id)

"""The scheduler side's lookup of the shared stores: which blocks after the local hit each holds.

A lookup that the local tiers end short asks every store of the chain (in one round trip
each, at once) whether it holds the following blocks, waiting up to
:data:`STORE_LOOKUP_WAIT_S` for the answers (longer for a store whose lookups take longer,
up to :data:`STORE_LOOKUP_MAX_WAIT_S`, or, where the engine computes on the host's cores, as
long as its lookups take: :func:`_wait_for`); the request is asked again (``None``) until
every store answered or its lookup timeout passed (a miss). A store's answer is kept in the
request's :class:`~kvhal.vllm.request_state.Probe`, and answers for a later lookup of the
same blocks too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent import futures
from typing import TYPE_CHECKING

from kvhal.vllm.config import ConnectorConfig
from kvhal.vllm.keys import offload_key
from kvhal.vllm.request_state import Probe, RequestState
from kvhal.vllm.stats import KVHALStats

if TYPE_CHECKING:
    from kvhal.vllm.tier_list import SchedulerTier

#: How long a lookup waits for the stores to say whether they hold a request's blocks: a
#: round trip of a millisecond or less, where answering ``None`` costs the request a step.
STORE_LOOKUP_WAIT_S = 0.005
#: The longest a lookup waits for a store whose lookups take longer (an object store's
#: ``HEAD`` s: 5-15 ms from a local SeaweedFS on 2 cores): their recent median and half again,
#: where that is within this bound; the engine's step waits meanwhile, as it waits for a
#: local read (:data:`~kvhal.vllm.prefetch.LOCAL_READ_WAIT_S`). A store slower than this (a
#: remote S3: tens of ms) is not waited for beyond :data:`STORE_LOOKUP_WAIT_S`.
STORE_LOOKUP_MAX_WAIT_S = 0.02
#: Where a lookup waits whole (:func:`~kvhal.vllm.local.waits_whole`), it waits up to this many
#: times the store's recent median lookup (and :data:`STORE_LOOKUP_MAX_WAIT_S` at least).
WHOLE_WAIT_LOOKUPS = 4


def lookup_stores(
    stores: Sequence[SchedulerTier],
    config: ConnectorConfig,
    stats: KVHALStats,
    state: RequestState,
    start: int,
    hashes: list[bytes],
    hit: int,
    whole: bool = False,
) -> bool:
    """Ask each store which of the blocks after the local hit (``hashes[hit:]``, from block
    ``start``) it holds, into ``state.held``; False while a store has not answered.
    ``whole``: wait for the answers as long as a store's lookups take
    (:data:`WHOLE_WAIT_LOOKUPS` of them), not just a round trip (an engine computing on the
    host's cores, where a forward run beside the lookup slows both:
    :func:`~kvhal.vllm.local.waits_whole`)."""
    groups = [g.group_id for g in config.groups]
    first, wanted = start + hit, hashes[hit:]
    asked = []
    wait = STORE_LOOKUP_WAIT_S
    for tier in stores:
        probe = state.probes.get(tier.name)
        # The last probe answers for a later first block too (a prefetch made its blocks
        # host blocks): no second round trip, no step lost to it.
        offset = first - probe.first if probe is not None else -1
        if (
            probe is None
            or offset < 0
            or (offset > 0 and probe.found is None)
            or probe.hashes[offset : offset + len(wanted)] != wanted
        ):
            assert tier.store is not None and tier.lookup_timeout_s is not None
            keys = [offload_key(h, g) for h in wanted for g in groups]
            positions = [first + i for i in range(len(wanted)) for _ in groups]
            deadline = time.monotonic() + tier.lookup_timeout_s
            future = tier.store.exist_run(keys, positions)
            probe = state.probes[tier.name] = Probe(first, wanted, future, deadline)
            stats.add_tier("tier_lookups", tier.name, 1)
            asked.append(probe.future)
            wait = max(wait, _wait_for(tier, whole))
    if asked:
        futures.wait(asked, timeout=wait)
    answered = True
    for tier in stores:
        probe = state.probes[tier.name]
        if probe.found is None:
            if not probe.future.done():
                if time.monotonic() < probe.deadline:
                    answered = False
                    continue
                probe.found = []
                stats.add_tier("tier_lookup_timeouts", tier.name, 1)
            elif probe.future.exception() is not None:
                probe.found = []
                stats.add_tier("tier_lookup_errors", tier.name, 1)
            else:
                found, n = probe.future.result(), len(groups)
                probe.found = [all(found[i * n : (i + 1) * n]) for i in range(len(probe.hashes))]
            asked_at = probe.deadline - (tier.lookup_timeout_s or 0.0)
            stats.observe("lookup_wait_seconds", tier.name, time.monotonic() - asked_at)
        offset = first - probe.first
        held = probe.found[offset : offset + len(wanted)]
        state.held[tier.name] = {
            offload_key(h, g) for h, yes in zip(wanted, held, strict=False) if yes for g in groups
        }
    return answered


def _wait_for(tier: SchedulerTier, whole: bool = False) -> float:
    """How long a lookup waits for ``tier``'s answer (:data:`STORE_LOOKUP_MAX_WAIT_S`; with
    ``whole``, :data:`WHOLE_WAIT_LOOKUPS` times its recent median, within its lookup timeout:
    a stalled store costs each request that much until its health check takes it down, not
    the whole timeout)."""
    assert tier.store is not None
    expected = tier.store.expected_lookup_s
    if whole:
        timeout = tier.lookup_timeout_s or STORE_LOOKUP_MAX_WAIT_S
        return min(timeout, max(STORE_LOOKUP_MAX_WAIT_S, WHOLE_WAIT_LOOKUPS * (expected or 0.0)))
    if expected is None or 1.5 * expected > STORE_LOOKUP_MAX_WAIT_S:
        return STORE_LOOKUP_WAIT_S
    return max(STORE_LOOKUP_WAIT_S, 1.5 * expected)

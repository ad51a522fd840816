"""What the scheduler side keeps per request: its lookup's hit, its load and stores in flight,
its lookups of the shared stores (:class:`Probe`) and its prefetch from the tiers below
(:class:`Prefetch`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from vllm.v1.request import Request

from kvhal.vllm.keys import GROUP_BYTES, offload_keys


@dataclass
class Probe:
    """A store's lookup of a request's blocks ``[first, first + len(hashes))``."""

    first: int
    hashes: list[bytes]
    future: Future[list[bool]]
    deadline: float
    #: the answer: per block of ``hashes``, whether the store holds it (every group's)
    found: list[bool] | None = None


@dataclass
class Prefetch:
    """Blocks of a request being read from the tiers below into host slots at its lookup."""

    job_id: int  # the workers' job, or -1 for a read through the in-process worker (``local``)
    deadline: float
    done: bool = False
    started: float = 0.0


@dataclass
class RequestState:
    """A request the scheduler side tracks, from its first lookup until it finishes."""

    request: Request
    tenant: str | None = None  # its cache_salt's label (kvhal.vllm.tenants), None: not counted
    stored_upto: int = 0  # blocks [0, stored_upto) were considered for storing
    hit_start: int = 0  # the last lookup's hit, in blocks
    hit_blocks: int = 0
    hit_sync: bool = False  # the last lookup's hit is loaded in the step that schedules it
    loaded_tokens: int = 0
    load_failed: bool = False
    loading: int | None = None  # the load job in flight, if any
    # its blocks [start, end), held in the host tier by that load (pinned, or being read in)
    loading_blocks: tuple[int, int] = (0, 0)
    # store jobs in flight that read the blocks the request holds now
    store_jobs: set[int] = field(default_factory=set)
    probes: dict[str, Probe] = field(default_factory=dict)  # the last lookup of each store
    held: dict[str, set[bytes]] = field(default_factory=dict)  # keys each store holds, per its probe
    prefetch: Prefetch | None = None  # the read from the tiers below it waits for, if any
    # one prefetch per request: a hit lost again loads as before, and what a store held is
    # recomputed (its blocks are read once, at the prefetch)
    prefetched: bool = False
    recompute_below: bool = False  # the wait policy chose to recompute what is below the host tier
    read_from: dict[str, set[bytes]] = field(default_factory=dict)  # keys its prefetch read, by tier
    hit_split: dict[str, int] = field(default_factory=dict)  # its last hit's tokens by serving tier
    # its blocks' keys per group, made once: every lookup, load, store and its end asks again
    _keys: dict[int, list[bytes]] = field(default_factory=dict, repr=False, compare=False)

    def keys(self, group_id: int, end: int) -> list[bytes]:
        """The keys of the request's blocks in group ``group_id``, at least its first ``end``
        (the list kept: slice it, never change it)."""
        keys = self._keys.get(group_id)
        hashes = self.request.block_hashes
        have = len(keys) if keys is not None else 0
        # vLLM only appends to a request's hashes: a list that differs is made again
        if keys is None or have > len(hashes) or (have and keys[-1][:-GROUP_BYTES] != hashes[have - 1]):
            keys = self._keys[group_id] = []
            have = 0
        if have < end:
            keys += offload_keys(hashes[have:end], group_id)
        return keys

    def forget_read(self, tier: str, keys: list[bytes]) -> None:
        """A read of ``keys`` from ``tier`` failed: the store may hold refused values there, so
        the recomputed blocks are written to it after all (over what it refused)."""
        self.held.get(tier, set()).difference_update(keys)
        self.read_from.get(tier, set()).difference_update(keys)

    def blocks(
        self, group_ids: Iterable[int], table: Sequence[list[int]], first: int, end: int
    ) -> tuple[dict[int, list[int]], list[bytes], list[int]]:
        """The request's blocks ``[first, end)`` in ``table`` (its device block ids per group) but
        those outside a sliding window (block 0): each group's block ids, every group's keys
        in that order, and each key's block index in the request."""
        ids_of: dict[int, list[int]] = {}
        keys: list[bytes] = []
        indices: list[int] = []
        for gid in group_ids:
            ids, group_keys = table[gid][first:end], self.keys(gid, end)[first:end]
            if len(ids) != len(group_keys):
                raise ValueError(f"{self.request.request_id}: {len(ids)} blocks for {len(group_keys)} hashes")
            if 0 in ids:
                kept = [i for i, block_id in enumerate(ids) if block_id != 0]
                ids, group_keys = [ids[i] for i in kept], [group_keys[i] for i in kept]
                indices += [first + i for i in kept]
            else:
                indices += range(first, end)
            ids_of[gid] = ids
            keys += group_keys
        return ids_of, keys, indices

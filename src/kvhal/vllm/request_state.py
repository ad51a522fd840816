"""What the scheduler side keeps per request: its lookup's hit, its load and stores in flight,
its lookups of the shared stores (:class:`Probe`) and its prefetch from the tiers below
(:class:`Prefetch`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from vllm.v1.request import Request


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

    def forget_read(self, tier: str, keys: list[bytes]) -> None:
        """A read of ``keys`` from ``tier`` failed: the store may hold refused values there, so
        the recomputed blocks are written to it after all (over what it refused)."""
        self.held.get(tier, set()).difference_update(keys)
        self.read_from.get(tier, set()).difference_update(keys)

"""What the scheduler side keeps per request: its lookup's hit, its load and stores in flight,
its lookup of the remote store (:class:`Probe`) and its prefetch from a tier below
(:class:`Prefetch`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from vllm.v1.request import Request


@dataclass
class Probe:
    """A remote lookup of a request's blocks ``[first, first + len(hashes))``."""

    first: int
    hashes: list[bytes]
    future: Future[list[bool]]
    deadline: float
    blocks: int | None = None  # the answer: how many of them the store holds, from the first


@dataclass
class Prefetch:
    """Blocks of a request being read from a tier below into host slots at its lookup."""

    job_id: int  # the workers' job, or -1 for a read of the in-process worker's tier (``local``)
    deadline: float
    done: bool = False
    started: float = 0.0
    remote: bool = False  # read from the remote tier (else the lower tier)


@dataclass
class RequestState:
    """A request the scheduler side tracks, from its first lookup until it finishes."""

    request: Request
    stored_upto: int = 0  # blocks [0, stored_upto) were considered for storing
    hit_start: int = 0  # the last lookup's hit, in blocks
    hit_blocks: int = 0
    hit_sync: bool = False  # the last lookup's hit is loaded in the step that schedules it
    loaded_tokens: int = 0
    load_failed: bool = False
    loading: int | None = None  # the load job in flight, if any
    # store jobs in flight that read the blocks the request holds now
    store_jobs: set[int] = field(default_factory=set)
    probe: Probe | None = None  # the last remote lookup
    fetch: set[bytes] = field(default_factory=set)  # keys the remote tier holds, per the probe
    prefetch: Prefetch | None = None  # the read from the lower tier it waits for, if any
    prefetched: bool = False  # one prefetch per request: a hit lost again loads as before
    remote_prefetched: bool = False  # one from the remote tier too: what it missed is recomputed
    recompute_below: bool = False  # the wait policy chose to recompute what is below the host tier
    from_below: set[bytes] = field(default_factory=set)  # keys its prefetch read from below
    from_store: set[bytes] = field(default_factory=set)  # keys its prefetch read from the store

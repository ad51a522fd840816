"""The tiers below the host tier of one engine, in the configured order, opened on each side.

``ConnectorConfig.tiers`` lists them (``kv_connector_extra_config.tiers``, or its short
forms ``disk_path`` and ``remote_url``). Each is a local tier (slots on this machine: the
disk tier, a plugin's backend through ``kvhal_tier_backends``) or a store the fleet shares
(``kvhal_remote_stores``); nothing here names a particular one.

- The scheduler side opens each once (:func:`open_scheduler_tiers`): a local tier's
  backend in the ``index`` role (recovery, ownership of the medium) with the chain's index
  of it; a store's client for lookups (``exist``). Each has its wait policy.
- A local tier's medium may still be another engine's (a rolling update: the engine being
  replaced drains). Its backend is opened deferred (``TierSpec.defer``): the engine starts and
  serves without it (out of the chain: never read or written, ``tier_up`` 0), and it joins
  once its backend is ready, with the index of what the engine before left
  (:meth:`SchedulerTier.join`, polled each step). A worker never moves a byte of a tier
  the scheduler side plans nothing for, so the workers' side of it needs no such wait.
- Each worker opens each for reads and writes of its own share of a block
  (:func:`open_worker_tiers`), behind one interface (:class:`TierReadWrite`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvhal.offload.host_tier import HostTier
from kvhal.offload.wait_policy import StepTimes, WaitPolicy
from kvhal.tiers.backend import ReadOutcome, TierBackend
from kvhal.tiers.chain import ChainTier
from kvhal.tiers.index import TierIndex
from kvhal.tiers.io import TierIO
from kvhal.tiers.remote.tier import RemoteTier
from kvhal.vllm.config import ConnectorConfig, LowerTierConfig, RemoteTierConfig
from kvhal.vllm.lower_tier import open_lower_tier
from kvhal.vllm.remote import open_remote_tier
from kvhal.vllm.stats import KVHALStats

logger = logging.getLogger("vllm." + __name__)  # under "vllm": its handlers and level

#: How long an asynchronous load waits for its reads from a local tier whose ``wait_ms``
#: is null (no prefetch); past it, the request is recomputed and the slots stay reserved
#: until the read returns.
LOCAL_LOAD_WAIT_MS = 1000


@dataclass
class SchedulerTier:
    """One tier below the host tier, on the scheduler side.

    :param chain: what the tier chain keeps of it (its name, a local tier's index).
    :param wait: its wait policy (``None``: no prefetch from it; its hits load asynchronously).
    :param backend: a local tier's backend, opened in the ``index`` role.
    :param store: a store's client, for lookups.
    """

    config: LowerTierConfig | RemoteTierConfig
    chain: ChainTier
    wait: WaitPolicy | None
    backend: TierBackend | None = None
    store: RemoteTier | None = None
    writing: int = 0  # a store's blocks being written now
    gave_up: bool = False  # a local tier whose medium never became this engine's: out for good

    @property
    def name(self) -> str:
        return self.chain.name

    @property
    def up(self) -> bool | None:
        """Whether it serves now: a store reachable at its last call, a local tier joined
        (``None``: closed)."""
        if self.store is not None:
            return self.store.up
        return self.chain.ready if self.backend is not None else None

    @property
    def waiting(self) -> bool:
        """A local tier whose medium is not this engine's yet, and may still become so."""
        return not self.chain.ready and not self.gave_up and self.backend is not None

    def join(self, stats: KVHALStats) -> bool:
        """A waiting local tier joins the chain once its backend is ready: its index is
        recovered (what the engine before left), and it is read and written from then on.
        Where the backend says it never will be (its wait's deadline passed), the tier stays
        out, said once. True: it joined now."""
        backend = self.backend
        if not self.waiting or backend is None:
            return False
        if not backend.ready:
            error = backend.ready_error
            if error is not None:
                self.gave_up = True
                logger.warning(
                    "kvhal: the %s tier stays out: this engine serves without it (tier_up 0) until it "
                    "restarts: %s",
                    self.name,
                    error,
                )
            return False
        recovered = _recover(self, stats)
        self.chain.ready = True
        logger.info(
            "kvhal: the %s tier joins, with %d blocks it holds; it serves from now on", self.name, recovered
        )
        return True

    @property
    def shared(self) -> bool:
        return self.store is not None

    @property
    def lookup_timeout_s(self) -> float | None:
        """How long a request waits for a store to say what it holds."""
        config = self.config
        return config.lookup_timeout_ms / 1000 if isinstance(config, RemoteTierConfig) else None

    def admit_write(self, blocks: int) -> bool:
        """Whether ``blocks`` more may be written to this tier now: a local tier always; a
        store while it is up and under its ``max_inflight_blocks`` (else dropped, counted)."""
        config = self.config
        if not isinstance(config, RemoteTierConfig):
            return True
        assert self.store is not None
        if not self.store.up or self.writing + blocks > config.max_inflight_blocks:
            return False
        self.writing += blocks
        return True

    def reset(self) -> None:
        """Forget what a local tier holds (a prefix-cache reset)."""
        if self.chain.index is not None:
            assert self.backend is not None and isinstance(self.config, LowerTierConfig)
            self.chain.index = TierIndex(self.backend.num_slots, self.config.eviction_policy)

    def close(self) -> None:
        """Release the medium (another engine may open it then), or the store's client."""
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        if self.store is not None:
            self.store.close()
            self.store = None


def open_scheduler_tiers(config: ConnectorConfig, stats: KVHALStats, steps: StepTimes) -> list[SchedulerTier]:
    """Open every tier of ``config`` for the scheduler side, in order; a local tier's index
    is rebuilt from what its medium holds (a warm restart)."""
    tiers = []
    for tier in config.tiers:
        if isinstance(tier, RemoteTierConfig):
            store = open_remote_tier(config, tier, role="index", rank=0, stats=stats)
            wait = WaitPolicy(tier.load_timeout_ms, tier.wait_policy, steps=steps)
            tiers.append(SchedulerTier(tier, ChainTier(tier.name), wait, store=store))
            continue
        backend = open_lower_tier(config, tier, role="index", rank=0, defer=True)
        index = TierIndex(backend.num_slots, tier.eviction_policy)
        wait = WaitPolicy(tier.wait_ms, tier.wait_policy, steps=steps) if tier.wait_ms is not None else None
        chain = ChainTier(tier.name, index, tier.write, ready=False)  # type: ignore[arg-type]
        local = SchedulerTier(tier, chain, wait, backend=backend)
        tiers.append(local)
        if backend.ready:
            _recover(local, stats)
            chain.ready = True
        else:
            logger.info(
                "kvhal: the %s tier is not this engine's yet (another engine holds it): the engine "
                "serves without it, and it joins when it is (tier_up{tier=%s} is 0 meanwhile)",
                tier.name,
                tier.name,
            )
    return tiers


def _recover(tier: SchedulerTier, stats: KVHALStats) -> int:
    """Index what ``tier``'s medium holds (a warm restart, or the engine before's blocks);
    how many blocks."""
    assert tier.backend is not None and tier.chain.index is not None

    def progress(done: int, total: int) -> None:
        logger.info("kvhal: recovering the %s tier's index: %d of %d slots read", tier.name, done, total)

    slots, keys = tier.backend.recover(progress=progress)
    if not keys:
        return 0
    recovered = tier.chain.index.recover(slots, keys)  # a key found twice after a crash is indexed once
    stats.add_tier("tier_recovered_blocks", tier.name, recovered)
    return recovered


class TierReadWrite(Protocol):
    """A worker's reads and writes of one tier below, between host slots and its medium."""

    def read(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        host_slots: Sequence[int],
        positions: Sequence[int] = (),
    ) -> Future[list[ReadOutcome]]: ...

    def write(
        self,
        keys: Sequence[bytes],
        host_slots: Sequence[int],
        slots: Sequence[int],
        snapshot: bool,
        positions: Sequence[int] = (),
    ) -> Future[list[bool]]: ...

    def close(self) -> None: ...


class LocalTierIO:
    """A local tier's :class:`TierReadWrite`: its backend, through the host tier's slots."""

    def __init__(self, host: HostTier, backend: TierBackend) -> None:
        self.io = TierIO(host, backend)
        self.backend = backend

    def read(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        host_slots: Sequence[int],
        positions: Sequence[int] = (),
    ) -> Future[list[ReadOutcome]]:
        return self.io.read(keys, slots, host_slots)

    def write(
        self,
        keys: Sequence[bytes],
        host_slots: Sequence[int],
        slots: Sequence[int],
        snapshot: bool,
        positions: Sequence[int] = (),
    ) -> Future[list[bool]]:
        return self.io.write(keys, host_slots, slots, snapshot)

    def close(self) -> None:
        self.backend.close()


class StoreIO:
    """A store's :class:`TierReadWrite`: values named by key, no slots."""

    def __init__(self, store: RemoteTier) -> None:
        self.store = store

    def read(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        host_slots: Sequence[int],
        positions: Sequence[int] = (),
    ) -> Future[list[ReadOutcome]]:
        return self.store.read(keys, host_slots, positions or None)

    def write(
        self,
        keys: Sequence[bytes],
        host_slots: Sequence[int],
        slots: Sequence[int],
        snapshot: bool,
        positions: Sequence[int] = (),
    ) -> Future[list[bool]]:
        # a store is written through: its host slots stay unchanged until the write ends
        assert not snapshot, "a store is written through, never from a snapshot"
        return self.store.write(keys, host_slots, positions or None)

    def close(self) -> None:
        self.store.close()


def open_worker_tiers(
    config: ConnectorConfig, stats: KVHALStats, host: HostTier, rank: int
) -> dict[str, TierReadWrite]:
    """Open every tier of ``config`` for worker ``rank``'s reads and writes, by name."""
    tiers: dict[str, TierReadWrite] = {}
    for tier in config.tiers:
        if isinstance(tier, RemoteTierConfig):
            tiers[tier.name] = StoreIO(open_remote_tier(config, tier, "io", rank, stats, host=host))
        else:
            tiers[tier.name] = LocalTierIO(host, open_lower_tier(config, tier, role="io", rank=rank))
    return tiers


def load_wait_s(config: ConnectorConfig, names: Sequence[str]) -> float:
    """How long an asynchronous load waits for its reads from the tiers ``names``: the
    shortest of their waits (a store's ``load_timeout_ms``, a local tier's ``wait_ms``)."""
    waits = []
    for tier in config.tiers:
        if tier.name not in names:
            continue
        if isinstance(tier, RemoteTierConfig):
            waits.append(tier.load_timeout_ms)
        else:
            waits.append(tier.wait_ms if tier.wait_ms is not None else LOCAL_LOAD_WAIT_MS)
    return min(waits, default=LOCAL_LOAD_WAIT_MS) / 1000


T = TypeVar("T")


def ends_by(future: Future[Any], deadline: float) -> bool:
    """Whether ``future`` is done by ``deadline`` (waiting for it until then)."""
    with contextlib.suppress(Exception):  # a timeout, or the future's own exception
        future.exception(timeout=max(0.0, deadline - time.monotonic()) if deadline < math.inf else None)
    return future.done()


def result_of(future: Future[list[T]], count: int, failed: T) -> list[T]:
    """A tier future's per-block results; ``failed`` for each if it raised (logged) or has
    not ended (a shutdown's deadline passed)."""
    if not future.done():
        return [failed] * count
    try:
        return future.result()
    except Exception:
        logger.exception("kvhal: a read or write of a tier below raised")
        return [failed] * count

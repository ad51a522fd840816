"""The tier-backend contract: a medium of equal slots below the host tier.

It sits at the contract level beside :mod:`kvhal.hookspecs` (whose
``kvhal_tier_backends`` hook offers backends by name) and depends on nothing
else in kvhal. The built-in ``disk`` backend lives in :mod:`kvhal.tiers.disk`;
third parties (an object store, 3FS, ...) offer theirs through the hook.

A backend only moves bytes between host memory and its medium: it never sees
a device, a device plugin or vLLM, so one backend serves every device. What
it holds is decided elsewhere: kvhal's tier chain (:mod:`kvhal.tiers.chain`) keeps
the index (key -> slot), chooses slots and victims through an eviction policy,
and tells the backend which slot to write or read. The backend keeps, per
slot, enough to prove at read time that the bytes are the ones the chain
asked for (key, checksum, fingerprint), and to tell the chain after a restart
what it holds (:meth:`TierBackend.recover`).

It is opened twice in a vLLM engine: once by the scheduler with
``role="index"`` (recovery, capacity, exclusive ownership of the medium) and
once per worker with ``role="io"`` (reads and writes of that worker's share
of each block; ``rank`` tells the shares apart).

A medium may not be this engine's yet when it starts: in a rolling update, the engine being
replaced still holds it while it drains. A caller that can serve without the tier opens the
``index`` role with ``TierSpec.defer``; a backend that supports it then opens at once, not
:attr:`~TierBackend.ready`, and turns ready on a thread of its own once the medium is its
(:attr:`~TierBackend.ready_error` says why it never will). The chain keeps such a tier out
(never read, never written, its index empty) until then.
"""

from __future__ import annotations

import abc
import enum
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal


class ReadOutcome(str, enum.Enum):
    """What a read of one block delivered. A ``str`` enum: its value names the counter of a
    failure (``tier_corrupt_blocks``, ...), and compares equal to that string."""

    OK = "ok"  # the bytes were delivered and verified
    MISSING = "missing"  # the slot holds no block, or another key
    CORRUPT = "corrupt"  # the checksum does not match: a torn write or a flipped bit
    FOREIGN = "foreign"  # another KV: the fingerprint differs (model, layout, rank, ...)
    UNAUTHENTICATED = "unauthenticated"  # a shared store's value without a valid MAC
    IO_ERROR = "io_error"  # the medium failed (EIO, ENOSPC, a store unreachable)

    @classmethod
    def of(cls, outcome: object) -> ReadOutcome:
        """A backend's outcome as an enum: ``None`` (the contract's first form of OK) or a
        known name; anything else is an I/O error (a plugin's unknown word is no success)."""
        if outcome is None:
            return cls.OK
        try:
            return cls(outcome)
        except ValueError:
            return cls.IO_ERROR


OK = ReadOutcome.OK
MISSING = ReadOutcome.MISSING
CORRUPT = ReadOutcome.CORRUPT
FOREIGN = ReadOutcome.FOREIGN
IO_ERROR = ReadOutcome.IO_ERROR
#: Why a read delivered nothing (the chain recomputes; each is counted).
READ_FAILURES = (MISSING, CORRUPT, FOREIGN, IO_ERROR)


@dataclass(frozen=True)
class TierSpec:
    """What a backend is opened for.

    :param options: the backend's own options, from the user's configuration
        (the ``disk`` backend takes ``path`` and ``bytes_to_use``).
    :param slot_bytes: the bytes of one slot (one block of one KV cache group,
        one worker's share); every read and write moves whole slots.
    :param fingerprint: what the KV is (model and revision, KV dtype and
        quantization, layout and block geometry, KV cache groups, block-hash
        algorithm and seed, tensor-parallel size); JSON-serialisable. Blocks
        stored under another fingerprint are never read back.
    :param role: ``"index"`` (the scheduler: recover, own the medium) or
        ``"io"`` (a worker: read and write).
    :param rank: the worker's tensor-parallel rank; it is part of what the
        KV is, and a worker reads only what its own rank wrote.
    :param world_size: the tensor-parallel size.
    :param defer: the caller serves without the tier until it is ready (the ``index``
        role): where the medium is still another engine's, the backend may open at once,
        not :attr:`TierBackend.ready`, rather than wait for it in the constructor. A
        backend without that ignores it.
    """

    options: Mapping[str, Any]
    slot_bytes: int
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    role: Literal["index", "io"] = "io"
    rank: int = 0
    world_size: int = 1
    defer: bool = False

    def digest(self, rank: int | None = None) -> bytes:
        """8 bytes naming the fingerprint plus ``rank`` (default: this spec's rank)."""
        whole = {
            "kv": self.fingerprint,
            "rank": self.rank if rank is None else rank,
            "world_size": self.world_size,
            "slot_bytes": self.slot_bytes,
        }
        text = json.dumps(whole, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.blake2b(text.encode(), digest_size=8).digest()


class TierBackend(abc.ABC):
    """A medium of :attr:`num_slots` equal slots of ``spec.slot_bytes`` bytes.

    Methods a chain calls, by role:

    - ``index``: :attr:`num_slots`, :meth:`recover`, :meth:`close`;
    - ``io``: :meth:`write`, :meth:`read`, :meth:`close`.

    :meth:`write` and :meth:`read` return at once with a future and never block
    the caller on the medium; the chain polls ``future.done()``. They are
    called from one thread; their futures may complete on any.
    """

    #: Slots the medium holds (fixed once opened, ready or not).
    num_slots: int
    #: Whether the medium is this engine's to recover, read and write. Only an ``index`` role
    #: opened with ``spec.defer`` may start False; it turns True at most once, on any thread,
    #: after what :meth:`recover` returns has been read (the caller polls it: one read a step).
    ready: bool = True
    #: Why a backend that is not :attr:`ready` never will be (its wait's deadline passed, the
    #: medium changed meanwhile); ``None`` while it may still become ready, and once it is.
    ready_error: BaseException | None = None

    @abc.abstractmethod
    def recover(self, progress: Callable[[int, int], None] | None = None) -> tuple[list[int], list[bytes]]:
        """What the medium holds for this spec's fingerprint: ``(slots, keys)``.

        Called once, by the ``index`` role, once :attr:`ready`, before any write; a backend
        that turned ready late has done the reading by then (this returns at once, on the
        caller's thread, while the engine serves). Blocks that cannot
        be shown whole here may be listed anyway: :meth:`read` verifies every
        block it delivers. ``progress(done, total)`` is called now and then.
        """

    @abc.abstractmethod
    def write(
        self, slots: Sequence[int], keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> Future[list[bool]]:
        """Store ``buffers[i]`` (``slot_bytes`` bytes) as ``keys[i]`` in ``slots[i]``.

        The buffers stay valid and unchanged until the future completes. Its
        result is one bool per slot: False for a slot that was not written
        whole (the chain forgets it). A slot written earlier is overwritten;
        after a crash mid-write the slot must read back as :data:`CORRUPT` or
        :data:`MISSING`, never as the new or the old key with other bytes.
        """

    @abc.abstractmethod
    def read(
        self, slots: Sequence[int], keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> Future[list[ReadOutcome]]:
        """Fill ``buffers[i]`` with the block ``keys[i]`` stored in ``slots[i]``.

        Its result is one outcome per slot (a :class:`ReadOutcome`; ``None`` and the
        outcomes' names are taken too, as kvhal 0.1's backends return them): :data:`OK` once the bytes
        are in the buffer and proven to be ``keys[i]``'s, written under this
        spec's fingerprint and rank, with a matching checksum; else one of
        :data:`READ_FAILURES`, and the buffer's content is undefined.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Finish or cancel what is in flight, release the medium (idempotent)."""


#: ``factory(spec)`` opens a backend for ``spec``.
TierFactory = Callable[[TierSpec], TierBackend]

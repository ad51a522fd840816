"""Pinning witnesses: whether host memory is really pinned, asked of the kernel or the runtime.

A device plugin answers ``kvhal_host_buffer_is_pinned`` from its own bookkeeping;
a plugin that records a buffer as pinned without pinning it answers ``True`` all
the same. A :class:`PinningWitness` asks the party that does the pinning instead:
the kernel for memory locked with ``mlock`` (``/proc/self/smaps``), the CUDA or HIP
runtime for memory registered with it (``cudaPointerGetAttributes``). Plugins offer
witnesses through the ``kvhal_pinning_witnesses`` hook, one per torch device type
and pinning mechanism; the conformance suite checks every buffer a plugin says is
pinned against them (clause ``pinned.witness``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass


@dataclass(frozen=True)
class Witnessed:
    """What a witness saw of one address range.

    :param pinned: every byte of the range was seen pinned.
    :param unpinned_at: the offset of the first byte seen not pinned (``None`` when pinned).
    :param how: what was read, for messages and the report (a few words).
    """

    pinned: bool
    unpinned_at: int | None
    how: str

    def __post_init__(self) -> None:
        if self.pinned != (self.unpinned_at is None):
            raise ValueError(
                f"Witnessed(pinned={self.pinned}, unpinned_at={self.unpinned_at}): an unpinned range "
                "names the offset of its first unpinned byte, a pinned one none"
            )


class PinningWitness(abc.ABC):
    """Says whether an address range of this process is pinned, without asking any plugin.

    Subclasses set :attr:`name` and :attr:`device_type` and implement :meth:`unavailable`
    and :meth:`witness`. A witness must read the kernel's or the device runtime's own
    state, never a plugin's bookkeeping: it exists to catch a plugin whose
    ``kvhal_host_buffer_is_pinned`` says ``True`` for memory nobody pinned.
    """

    #: Shown in messages and the report, e.g. ``"mlock (/proc/self/smaps)"``.
    name: str = ""
    #: The torch device type whose host buffers it can judge (``"cpu"``, ``"cuda"``).
    device_type: str = ""

    @abc.abstractmethod
    def unavailable(self) -> str | None:
        """Why this witness cannot judge in this process (its runtime is not loaded, the
        kernel shows no ``smaps``), or ``None`` when it can. Must not raise."""

    @abc.abstractmethod
    def witness(self, address: int, nbytes: int) -> Witnessed:
        """Whether ``[address, address + nbytes)`` is pinned, as the kernel or runtime sees it."""

    def size_limit(self) -> int | None:
        """The most bytes this process can pin by this witness's mechanism (a lock limit),
        or ``None`` for no limit of its own; the suite checks no larger buffer."""
        return None

"""The three host-buffer hooks, over whatever allocates a plugin's host memory;
page-aligned anonymous memory to register; and the ``KVHAL_PIN_HOST``
setting every accelerator plugin reads the same way."""

from __future__ import annotations

import enum
import mmap
import warnings
from typing import Protocol

import torch

from kvhal import env
from kvhal.hookspecs import hookimpl

#: The host page size kvhal aligns host buffers to (the hookspecs promise 4096-byte alignment).
PAGE = 4096
PIN_ENV = "KVHAL_PIN_HOST"
#: What ``KVHAL_PIN_HOST`` accepts (``async`` is a deprecated alias of ``sync``).
PIN_VALUES = ("async", "sync", "off")


class PinMode(str, enum.Enum):
    """Whether host buffers are page-locked.

    There is no background mode: pinning that runs after the allocation hook
    returns can call the device runtime while the engine captures a CUDA graph
    (vLLM 0.32 captures right after ``register_kv_caches``, in global capture
    mode, where a runtime call from any thread breaks the capture: vLLM
    #45850, reverted by #46958 after #46933).
    """

    #: Pinned before the allocation hook returns.
    SYNC = "sync"
    #: Pageable buffers.
    OFF = "off"


def pin_mode(value: str | None) -> PinMode:
    """The mode ``KVHAL_PIN_HOST`` asks for (unset or empty: ``sync``).

    ``async`` is accepted as a deprecated alias of ``sync``, with a
    ``FutureWarning``: it was the default once, so configurations spell it out,
    and refusing it would stop their engine at start-up when ``sync`` gives
    them the pinned buffers they asked for.

    :raises ValueError: ``value`` is none of :data:`PIN_VALUES`.
    """
    if not value:
        return PinMode.SYNC
    text = value.strip().lower()
    if text == "async":
        warnings.warn(
            f"{PIN_ENV}=async is deprecated and means sync: host buffers are pinned before they are "
            "returned, so that pinning never overlaps the engine's CUDA graph capture",
            FutureWarning,
            stacklevel=2,
        )
        return PinMode.SYNC
    try:
        return PinMode(text)
    except ValueError:
        raise ValueError(f"{PIN_ENV}={value!r} is not one of {', '.join(PIN_VALUES)}") from None


def pin_mode_from_env() -> PinMode:
    """The mode this process's ``KVHAL_PIN_HOST`` asks for (:func:`pin_mode` of its value)."""
    return pin_mode(env.read(PIN_ENV))


class HostBuffers(Protocol):
    """Allocates host buffers, says whether one is page-locked, and releases it."""

    def allocate(self, nbytes: int) -> torch.Tensor: ...

    def is_pinned(self, buffer: torch.Tensor) -> bool: ...

    def free(self, buffer: torch.Tensor) -> None: ...


class HostBufferHooks:
    """``kvhal_allocate_host_buffer``, ``kvhal_free_host_buffer`` and
    ``kvhal_host_buffer_is_pinned`` over :meth:`host_buffers`."""

    def host_buffers(self) -> HostBuffers:
        raise NotImplementedError

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        return self.host_buffers().allocate(nbytes)

    @hookimpl
    def kvhal_free_host_buffer(self, buffer: torch.Tensor) -> None:
        self.host_buffers().free(buffer)

    @hookimpl
    def kvhal_host_buffer_is_pinned(self, buffer: torch.Tensor) -> bool:
        return self.host_buffers().is_pinned(buffer)


def round_to_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of :data:`PAGE`."""
    return (nbytes + PAGE - 1) // PAGE * PAGE


def map_zeroed(nbytes: int) -> torch.Tensor:
    """A page-aligned, zero-filled flat ``int8`` CPU tensor of ``nbytes`` over an anonymous mmap.

    The kernel zeroes pages as they are first touched, so there is no memset on the
    allocating thread; the mapping lives as long as the tensor (or any view of it).
    """
    region = mmap.mmap(-1, round_to_pages(nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.int8, count=nbytes)

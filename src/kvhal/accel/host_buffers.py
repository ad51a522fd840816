"""The three host-buffer hooks, over whatever allocates a plugin's host memory,
and the ``KVHAL_PIN_HOST`` setting every accelerator plugin reads the same way."""

from __future__ import annotations

import enum
import os
from typing import Protocol

import torch

from kvhal.hookspecs import hookimpl

PIN_ENV = "KVHAL_PIN_HOST"


class PinMode(str, enum.Enum):
    """When host buffers are page-locked."""

    ASYNC = "async"
    SYNC = "sync"
    OFF = "off"


def pin_mode(value: str | None) -> PinMode:
    """The mode ``KVHAL_PIN_HOST`` asks for (unset or empty: ``async``)."""
    if not value:
        return PinMode.ASYNC
    try:
        return PinMode(value.strip().lower())
    except ValueError:
        raise ValueError(f"{PIN_ENV}={value!r} is not one of {', '.join(m.value for m in PinMode)}") from None


def pin_mode_from_env() -> PinMode:
    """The mode this process's ``KVHAL_PIN_HOST`` asks for (:func:`pin_mode` of its value)."""
    return pin_mode(os.environ.get(PIN_ENV))


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

"""Waiting without hanging, plain-torch copy baselines, and keeping a stream busy.

Checks that need work still running (an event seen incomplete, a copy that
must wait) size that work from a plain torch copy measured in the same run,
so they hold on a fast accelerator and on a loaded shared machine alike.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from kvhal.cache import KVCache
from kvhal.descriptor import Capability
from kvhal.device import Device
from kvhal.geometry import KVGeometry
from kvhal.layouts import KVLayout
from kvhal_conformance import guarded

T = TypeVar("T")

#: A synchronize that takes longer than this is reported as a hang.
WAIT_LIMIT_S = 120.0
#: At most this many copies keep a stream busy, however fast one copy is.
MAX_BUSY_COPIES = 5000
#: A wait longer than this shows its progress, every as long.
PROGRESS_EVERY_S = 5.0


def print_progress(message: str) -> None:
    print(f"kvhal conformance: {message}", file=sys.stderr, flush=True)


_reporter: Callable[[str], None] = print_progress


def set_progress_reporter(reporter: Callable[[str], None]) -> None:
    """Where :func:`progress` writes (the suite's pytest plugin shows it on the terminal,
    past output capturing)."""
    global _reporter
    _reporter = reporter


def progress(message: str) -> None:
    """Say what a long wait is waiting for, while it waits."""
    _reporter(message)


def wait(
    device: Device,
    event: Any,
    what: str,
    limit_s: float = WAIT_LIMIT_S,
    then: Callable[[], T] | None = None,
) -> T | None:
    """``device.synchronize_event(event)``, failing (not hanging) after ``limit_s``.

    ``then`` runs on the waiting thread the moment synchronize returns (no second thread
    wake-up in between); its result is returned.
    """
    done = threading.Event()
    raised: list[BaseException] = []
    result: list[T] = []

    def run() -> None:
        try:
            device.synchronize_event(event)
            if then is not None:
                result.append(then())
        except BaseException as exc:  # re-raised on the caller's thread
            raised.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="kvhal-conformance-wait", daemon=True).start()
    start = time.perf_counter()
    while not done.wait(min(PROGRESS_EVERY_S, max(0.0, start + limit_s - time.perf_counter()))):
        waited = time.perf_counter() - start
        if waited >= limit_s:
            pytest.fail(
                f"kvhal_synchronize_event did not return within {limit_s:.0f} s ({what}): it must return "
                "once the work before the event's last record has completed"
            )
        progress(
            f"kvhal_synchronize_event has not returned after {waited:.0f} s ({what}); "
            f"giving up at {limit_s:.0f} s"
        )
    if raised:
        raise raised[0]
    return result[0] if result else None


def poll(
    device: Device,
    event: Any,
    what: str,
    while_pending: Callable[[], None] | None = None,
    limit_s: float = WAIT_LIMIT_S,
) -> None:
    """Query ``event`` until complete, calling ``while_pending`` before each query."""
    start = time.perf_counter()
    shown = start
    while True:
        if while_pending is not None:
            while_pending()
        if device.query_event(event):
            return
        now = time.perf_counter()
        if now - start > limit_s:
            pytest.fail(
                f"kvhal_query_event still reports incomplete after {limit_s:.0f} s ({what}): the event "
                "must complete once the work before its last record has completed"
            )
        if now - shown >= PROGRESS_EVERY_S:
            shown = now
            progress(
                f"kvhal_query_event still reports incomplete after {now - start:.0f} s ({what}); "
                f"giving up at {limit_s:.0f} s"
            )
        time.sleep(0.0002)


#: How long a plugin declaring host.pinned may take to pin a buffer in the background
#: (``--kvhal-pin-timeout``).
PIN_TIMEOUT_S = 60.0
#: Plugins (name, distribution) with a buffer that was not pinned in time: their later
#: buffers are not waited for (one wrong answer costs one time-out per run, not one per check).
_NEVER_PINNED: set[tuple[str, str | None]] = set()


def set_pin_timeout(seconds: float) -> None:
    """Set the time-out for a run (and forget the plugins an earlier run stopped waiting for)."""
    global PIN_TIMEOUT_S
    PIN_TIMEOUT_S = seconds
    _NEVER_PINNED.clear()


def _plugin_key(device: Device) -> tuple[str, str | None]:
    return device.plugin_name, device.distribution


def wait_pinned(device: Device, buffer: torch.Tensor, timeout: float | None = None) -> bool:
    """Wait until ``buffer`` reports pinned, for a plugin that declares host.pinned.

    Pinning may finish after the buffer is returned (kvhal_allocate_host_buffer's
    contract): timings must not measure a buffer still pageable. False when the
    plugin does not declare host.pinned, or the buffer was not pinned in time; after
    one such time-out, the plugin's buffers are not waited for again
    (:func:`pin_wait_note` says which happened). The wait shows its progress.
    """
    if not device.descriptor.supports(Capability.PINNED_HOST):
        return False
    limit = PIN_TIMEOUT_S if timeout is None else timeout
    start = time.monotonic()
    shown = start
    while not guarded.is_pinned(device, buffer):
        now = time.monotonic()
        if _plugin_key(device) in _NEVER_PINNED or now - start > limit:
            _NEVER_PINNED.add(_plugin_key(device))
            return False
        if now - shown >= PROGRESS_EVERY_S:
            shown = now
            progress(
                f"plugin {device.plugin_name!r} declares host.pinned; waiting for "
                f"kvhal_host_buffer_is_pinned to say a {buffer.numel() * buffer.element_size()}-byte "
                f"buffer is pinned: {now - start:.0f} s of at most {limit:.0f} s (--kvhal-pin-timeout)"
            )
        time.sleep(0.005)
    return True


def pin_wait_note(device: Device) -> str:
    """How long :func:`wait_pinned` waited for a buffer of ``device`` it returned False for."""
    return (
        f"waited {PIN_TIMEOUT_S:.0f} s for background pinning, once per plugin and run: after one "
        "buffer was not pinned in time, the others are not waited for"
    )


def settle(device: Device) -> None:
    """Wait until work already on the compute stream (tensor writes by torch) is done."""
    marker = device.create_event()
    device.record_event(marker, device.current_stream())
    wait(device, marker, "waiting for the compute stream")


def fastest(fn: Callable[[], None], repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` runs of ``fn`` (after one warm-up run)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class TorchCopy:
    """A plain torch copy of ``nbytes`` between a device tensor and one of the plugin's
    host buffers: the baseline plugin copies are compared with."""

    def __init__(self, device: Device, nbytes: int) -> None:
        self.nbytes = nbytes
        self.device = device
        self.on_device = torch.ones(nbytes, dtype=torch.uint8, device=device.torch_device)
        self.buffer = guarded.host_buffer(device, nbytes)
        wait_pinned(device, self.buffer)
        self.host = self.buffer[:nbytes].view(torch.uint8)

    def run(self, direction: str) -> None:
        src, dst = (self.on_device, self.host) if direction == "d2h" else (self.host, self.on_device)
        dst.copy_(src)
        dst[-1].item()  # a blocking read: the copy is complete on any device

    def seconds(self, direction: str, repeats: int = 3) -> float:
        return fastest(lambda: self.run(direction), repeats)

    def free(self) -> None:
        del self.host
        guarded.free_buffer(self.device, self.buffer)


def scratch_geometry(nbytes: int) -> KVGeometry:
    """A bf16 geometry of about ``nbytes``: 4 layers, 16 tokens, 8 heads of 64."""
    g = KVGeometry(
        num_layers=4, num_blocks=1, block_size=16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16
    )
    return g.with_num_blocks(max(8, nbytes // g.block_bytes))


class Busy:
    """Keeps a stream busy for at least a known time with device->host copies.

    One copy of the scratch cache takes no less than a plain torch copy of its bytes;
    ``occupy`` submits enough of them for the time asked.
    """

    def __init__(self, device: Device, layout: KVLayout, nbytes: int) -> None:
        self.device = device
        geometry = scratch_geometry(nbytes)
        self.src: KVCache = guarded.kv_cache(device, geometry, layout)
        self.dst: KVCache = guarded.host_cache(device, geometry, layout, geometry.num_blocks)
        wait_pinned(device, self.dst.storage[0])
        ids = np.arange(geometry.num_blocks)
        self.plan = device.plan_copy(self.src, self.dst, np.stack([ids, ids], axis=1))
        baseline = TorchCopy(device, geometry.total_bytes)
        self.copy_seconds = baseline.seconds("d2h")
        baseline.free()
        settle(device)

    def occupy(self, stream: Any, seconds: float) -> tuple[Any, float]:
        """Submit copies to ``stream`` until at least ``seconds`` of them are still queued;
        (last event, seconds of work still ahead when it returns).

        Submitting takes time too, and on a fast device one copy can run faster than the next
        is submitted (an H200 drained 251 ms of "busy" copies while they were being queued):
        the work counted is what the submitted copies need beyond the time spent submitting
        them, as if the device started on the first at once. The copies only read ``src``
        and rewrite ``dst``: other checks may read ``src`` meanwhile.
        """
        start = time.perf_counter()
        count, event, ahead = 0, None, 0.0
        # At most twice the copies the time asks for: where submitting is slower than copying
        # (a loaded 2-core machine), more would only pile up work the next checks wait behind.
        limit = min(MAX_BUSY_COPIES, 2 * max(1, math.ceil(seconds / self.copy_seconds)))
        while count < limit:
            event = self.device.submit(self.plan, stream, after_compute=False)
            count += 1
            ahead = count * self.copy_seconds - (time.perf_counter() - start)
            if ahead >= seconds:
                break
        return event, max(ahead, 0.0)

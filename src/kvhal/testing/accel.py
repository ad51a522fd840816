"""A CPU stand-in for a torch stream module, for testing plugins without their device.

There is no GPU or NPU where kvhal's plugins are developed. With
:class:`FakeStreamModule` in place of ``torch.cuda`` or ``torch.npu`` (it has
``Stream``, ``Event``, ``current_stream``, ``default_stream``, ``stream``,
``synchronize``, ``current_device`` and ``device``, and records what was done), their
hardware-independent logic (which engine runs, on which stream, with which
ordering hint, what a failure does) runs on the CPU against host memory.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvhal.copyplan import CopyPlan, Direction

#: Fake stream handles look like real ones: never 0 or 1 (the legacy default stream).
_ids = itertools.count(0x7F00_0000)


class FakeStream:
    """A stream: an id (``cuda_stream``), the events it waited on, and how often it was drained."""

    def __init__(self, module: FakeStreamModule, device: Any = None, handle: int | None = None) -> None:
        self.module, self.device = module, device
        self.cuda_stream = next(_ids) if handle is None else handle
        self.waited: list[FakeEvent] = []
        self.synchronized = 0

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)

    def synchronize(self) -> None:
        self.synchronized += 1
        self.module.log.append(("synchronize", self))


class FakeEvent:
    """An event; complete when recorded unless the module holds events back."""

    def __init__(self, module: FakeStreamModule) -> None:
        self.module = module
        self.stream: FakeStream | None = None
        self.done = True
        self.fail_with: BaseException | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream
        self.done = not self.module.hold_events
        self.module.log.append(("record", self))

    def query(self) -> bool:
        if self.fail_with is not None:
            raise self.fail_with
        return self.done

    def synchronize(self) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        self.done = True


@dataclass
class FakeStreamModule:
    """The parts of ``torch.cuda``/``torch.npu`` a plugin touches.

    :param hold_events: recorded events stay incomplete until :meth:`complete_all`.
    """

    hold_events: bool = False
    log: list[tuple[str, Any]] = field(default_factory=list)
    entered: list[FakeStream] = field(default_factory=list)
    devices_entered: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.compute = FakeStream(self)
        self.events: list[FakeEvent] = []

    def Stream(self, device: Any = None) -> FakeStream:  # torch.cuda.Stream
        return FakeStream(self, device)

    def Event(self) -> FakeEvent:  # torch.cuda.Event
        event = FakeEvent(self)
        self.events.append(event)
        return event

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.compute

    def default_stream(self, device: Any = None) -> FakeStream:  # torch.cuda.default_stream
        """The legacy default stream (handle 0), a fresh object each call."""
        return FakeStream(self, device, handle=0)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        self.entered.append(stream)
        try:
            yield
        finally:
            self.entered.pop()

    def synchronize(self, device: Any = None) -> None:
        self.log.append(("device_synchronize", device))

    def current_device(self) -> int:
        return 0

    @contextlib.contextmanager
    def device(self, index: Any) -> Iterator[None]:  # torch.cuda.device
        self.devices_entered.append(index)
        try:
            yield
        finally:
            self.devices_entered.pop()

    def complete_all(self) -> None:
        for event in self.events:
            event.done = True


class _PlanAsIf(CopyPlan):
    """A plan that reports a direction other than its caches' devices say."""

    as_direction: Direction = Direction.D2H

    @property
    def direction(self) -> Direction:  # type: ignore[override]
        return self.as_direction


def as_if_direction(plan: CopyPlan, direction: Direction) -> CopyPlan:
    """``plan`` (between host caches) presented as a ``direction`` copy.

    Without a device both caches live in host memory; this lets a test drive
    the store or load path of a plugin with them.
    """
    fake = _PlanAsIf(plan.src, plan.dst, plan.mapping, plan.runs, plan.families)
    object.__setattr__(fake, "as_direction", direction)
    return fake

"""Events that report failed copies as :class:`~kvhal.errors.TransferError`."""

from __future__ import annotations

from typing import Any

from kvhal.errors import TransferError


class CopyEvent:
    """A device event (``torch.cuda.Event``, ``torch.npu.Event``) plus what went wrong.

    A copy whose submission failed returns an event carrying the error: querying
    or synchronizing it raises :class:`TransferError` -- but only once the work
    it follows is done, since part of the copy may already be queued and still
    writing (a caller that recomputes must not race those writes). An
    asynchronous device error surfacing from the event itself raises too.
    Recording it again makes it follow new work and forgets the old error.
    """

    __slots__ = ("error", "inner")

    def __init__(self, inner: Any, error: BaseException | None = None) -> None:
        self.inner = inner
        self.error = error

    def record(self, stream: Any) -> None:
        self.inner.record(stream)
        self.error = None

    def fail(self, error: BaseException) -> None:
        """Mark the work this event follows as failed."""
        self.error = error

    def _raise_error(self) -> None:
        if self.error is not None:
            raise TransferError(f"copy failed: {type(self.error).__name__}: {self.error}") from self.error

    def query(self) -> bool:
        try:
            done = bool(self.inner.query())
        except RuntimeError as exc:  # an asynchronous device error
            raise TransferError(f"device reported an error: {exc}") from exc
        if done:
            self._raise_error()
        return done

    def synchronize(self) -> None:
        try:
            self.inner.synchronize()
        except RuntimeError as exc:
            raise TransferError(f"device reported an error: {exc}") from exc
        self._raise_error()

    def wait_on(self, stream: Any) -> None:
        """Make ``stream``'s later work wait for this event."""
        stream.wait_event(self.inner)

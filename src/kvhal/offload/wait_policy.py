"""How long a request waits for its blocks to be read from a tier below the host tier.

A read from below is worth waiting for only while it is faster than computing the same
tokens again. :class:`WaitPolicy` learns both speeds as the engine runs (the lower tier's
read bandwidth from the reads it ends, the time an engine step takes for its tokens) and,
per hit, answers how long the request may wait for its read, or that it should not read
at all and recompute (policy ``"auto"``); policy ``"timeout"`` always waits the configured
deadline. A tier not measured yet is read (its first reads measure it), and waited for as
long as a tier just fast enough to be read would take. One measured slower than recomputing
is not read, but probed now and then (``PROBE_S``): one read made while its request
recomputes, waited for by no one, so that a tier that recovers is noticed.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from collections.abc import Callable

__all__ = ["POLICIES", "PROBE", "PROBE_S", "InFlight", "StepTimes", "WaitPolicy"]

#: ``lower_tier_wait_policy``'s values.
POLICIES = ("auto", "timeout")
#: Seconds after its last read ends (or its last probe starts) before a tier skipped as slow
#: is read once more.
PROBE_S = 20.0
#: :meth:`WaitPolicy.wait_for`'s answer for a read that measures the tier: made, not waited
#: for (a wait of 0 is a timeout policy's own).
PROBE = -1.0
#: A read predicted to take less than this share of the recompute is waited for up to
#: the recompute's predicted time times ``1 / WAIT_SHARE``: predictions are rough.
WAIT_SHARE = 0.8
#: A step this many times slower than the line through the others is not fitted.
SLOW_STEP = 2.0
#: The least a request waits for a read it started (a deadline of a few milliseconds
#: would time out reads of a healthy tier on a busy machine).
MIN_WAIT_S = 0.05
#: Reads smaller than this do not feed the bandwidth average: their time is mostly latency
#: (one 192 KiB block from a store that was connecting judged a healthy store slow). Until
#: larger reads are measured, the quickest small read is a lower bound of any read's time.
MIN_RATE_BYTES = 1 << 20
#: A read is predicted by the median of the recent reads within this factor of its size (each
#: scaled to it), where there are :data:`SIMILAR_MIN` of them. A least-squares line through
#: reads of nearly one size (a returning user's 8-14 MiB) is steered by its outliers: reads of
#: 8-15 ms with a few of 30-57 ms (a busy disk) fitted a line predicting 45-117 ms, and the
#: tier was judged slower than recomputing and skipped for the rest of a run.
SIMILAR = 2.0
SIMILAR_MIN = 3
#: ... the newest this many of them: a tier that turns slow, or recovers (its probes come
#: every PROBE_S), is seen within a few reads.
SIMILAR_RECENT = 8
#: The latency-and-bandwidth line is used only over reads whose sizes span this factor.
FIT_SPREAD = 4.0


class StepTimes:
    """An engine step's seconds as ``fixed + per_token * tokens``: a least-squares line through
    the last :attr:`window` steps, refitted without the steps far slower than it (an engine's
    first steps compile kernels, a step may wait on the machine): decode steps, mostly fixed cost,
    and prefill steps, mostly per token, both inform it."""

    def __init__(self, window: int = 64) -> None:
        self.window = window
        self._steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self._line: tuple[float, float] | None = None  # (fixed, per_token), until a new step

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._steps.append((tokens, seconds))
            self._line = None

    def sizes(self) -> list[int]:
        """The token counts (for reads: bytes) of the steps in the window."""
        return [tokens for tokens, _ in self._steps]

    def seconds(self, tokens: int) -> float | None:
        """Predicted seconds of a step of ``tokens``; ``None`` until steps of two sizes were seen."""
        if self._line is None:
            steps = list(self._steps)
            for _ in range(3):  # fit, drop the steps far slower than the line, fit again
                line = _fit(steps)
                if line is None:
                    return None
                kept = [(t, s) for t, s in steps if s <= SLOW_STEP * (line[0] + line[1] * t) + 1e-3]
                if len(kept) == len(steps) or _fit(kept) is None:
                    break
                steps = kept
            self._line = line
        fixed, per_token = self._line
        return fixed + per_token * tokens


def _fit(steps: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least squares ``seconds = fixed + per_token * tokens`` (both at least 0)."""
    n = len(steps)
    if n < 2:
        return None
    mx = sum(t for t, _ in steps) / n
    my = sum(s for _, s in steps) / n
    var = sum((t - mx) ** 2 for t, _ in steps)
    if var <= 0:  # one size only: no slope to fit
        return None
    slope = max(0.0, sum((t - mx) * (s - my) for t, s in steps) / var)
    return max(0.0, my - slope * mx), slope


class InFlight:
    """The blocks being read from one tier, over time: how much of the tier a read had.

    Reads at once share a tier (its bandwidth, a local server's cores): three users' reads
    started together each take about three times as long as one alone. A policy fed those
    times would judge the tier three times slower than it is (one engine judged S3 slower than
    recomputing from its first three concurrent reads and recomputed half a round). A read of
    ``n`` blocks that had ``m`` in flight on average (its own included) is taken to have
    taken ``n / m`` of its time alone (:meth:`end`): what the tier reads against what the
    engine computes, both for one request.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.blocks = 0
        self._area = 0.0  # blocks in flight x seconds, since the first read
        self._at = clock()

    def _advance(self) -> tuple[float, float]:
        now = self.clock()
        self._area += self.blocks * (now - self._at)
        self._at = now
        return now, self._area

    def start(self, blocks: int) -> tuple[float, float]:
        """A read of ``blocks`` starts: the mark :meth:`end` takes."""
        mark = self._advance()
        self.blocks += blocks
        return mark

    def end(self, blocks: int, mark: tuple[float, float]) -> float:
        """The read started at ``mark`` ended: the share of its time it had the tier (0-1]."""
        now, area = self._advance()
        self.blocks = max(0, self.blocks - blocks)
        seconds = now - mark[0]
        if seconds <= 0 or blocks <= 0:
            return 1.0
        mean = (area - mark[1]) / seconds  # blocks in flight on average, its own included
        return min(1.0, blocks / mean) if mean > 0 else 1.0


class WaitPolicy:
    """Whether and how long a request waits for a read from below (see the module)."""

    def __init__(
        self,
        wait_ms: int,
        policy: str = "auto",
        clock: Callable[[], float] = time.monotonic,
        steps: StepTimes | None = None,
    ) -> None:
        """``steps``: the engine's step times, shared by the policies of several tiers below
        (one engine, one compute rate); a fresh one by default."""
        if policy not in POLICIES:
            raise ValueError(f"wait policy must be one of {POLICIES}, got {policy!r}")
        self.wait_s = wait_ms / 1000
        self.policy = policy
        self.clock = clock
        self.reads = StepTimes()  # a read's seconds as latency + bytes / bandwidth
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=64)  # (bytes, s)
        self._small: float | None = None  # the quickest read under MIN_RATE_BYTES
        self.steps = steps if steps is not None else StepTimes()  # what recomputing tokens costs
        self._last = -math.inf  # when the last read ended or the last probe started
        #: The last answer found the tier slower than recomputing: writing to it is wasted too.
        self.slow = False

    def observe_step(self, tokens: int, seconds: float) -> None:
        """An engine step computed ``tokens`` in ``seconds``."""
        self.steps.add(tokens, seconds)

    def observe_read(self, nbytes: int, seconds: float) -> None:
        """A read of ``nbytes`` from below took ``seconds`` from its start to its end."""
        if nbytes >= MIN_RATE_BYTES and seconds > 0:
            self._recent.append((nbytes, seconds))
        elif seconds > 0:
            self._small = seconds if self._small is None else min(self._small, seconds)
        self.reads.add(nbytes, seconds)
        self._last = self.clock()

    def read_seconds(self, nbytes: int) -> float | None:
        """Predicted seconds of a read of ``nbytes``: the median of the newest reads of about its
        size (:data:`SIMILAR`, :data:`SIMILAR_RECENT`), else the latency-and-bandwidth line
        where the reads' sizes span enough to fit one (:data:`FIT_SPREAD`), else the median
        bandwidth of the newest large reads, else the line; never under the quickest small
        read; ``None`` before any read."""
        recent = list(self._recent)
        predicted = None
        if nbytes >= MIN_RATE_BYTES:
            similar = [
                s * nbytes / b for b, s in reversed(recent) if nbytes / SIMILAR <= b <= nbytes * SIMILAR
            ]
            if len(similar) >= SIMILAR_MIN:
                predicted = statistics.median(similar[:SIMILAR_RECENT])
        if predicted is None:
            sizes = self.reads.sizes()
            fitted = self.reads.seconds(nbytes)
            if fitted is not None and max(sizes) >= FIT_SPREAD * max(1, min(sizes)):
                predicted = fitted
            elif recent:
                predicted = nbytes / statistics.median(b / s for b, s in recent[-SIMILAR_RECENT:])
            else:
                predicted = fitted
        if predicted is None:
            return self._small
        return max(predicted, self._small or 0.0)  # the quickest small read bounds any read

    def wait_for(self, tokens: int, nbytes: int, steps_to_see: int = 0) -> float | None:
        """Seconds a request may wait for a read of ``nbytes`` holding ``tokens`` of its
        prompt, learnt of ``steps_to_see`` engine steps after it ends (the workers' reads are
        reported in a step's output); ``None``: do not read, recompute (the tier is slower
        than the engine).
        :data:`PROBE`: read, to see whether the tier is still slow, but recompute rather than
        wait for it (:data:`PROBE_S` after the tier's last read ended)."""
        if self.policy == "timeout":
            return self.wait_s
        read = self.read_seconds(nbytes)
        recompute = self.steps.seconds(tokens)
        if recompute is None:
            return self.wait_s
        self.slow = read is not None and read > WAIT_SHARE * recompute
        if self.slow:
            if self.clock() - self._last < PROBE_S:
                return None
            self._last = self.clock()  # one probe at a time: the next one PROBE_S later
            return PROBE
        step = self.steps.seconds(1) or 0.0  # a step that computes next to nothing
        # A tier measured faster than recomputing is waited for past the recompute's time (a
        # prediction is rough). One not measured yet is read too, but waited for only as long
        # as a tier just fast enough would take: its first reads, three at once when a round of
        # users returns, each waited 1.25x its recompute on a slow tier before (0.5 s).
        allowed = recompute / WAIT_SHARE if read is not None else recompute * WAIT_SHARE
        return min(self.wait_s, max(MIN_WAIT_S, allowed + steps_to_see * step))

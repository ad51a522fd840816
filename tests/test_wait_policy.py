"""The wait policy: a request waits for a read from below only while reading beats
recomputing, learnt from the reads and steps the engine makes (a fake clock here)."""

from __future__ import annotations

import pytest

from kvhal.offload.wait_policy import MIN_WAIT_S, PROBE, PROBE_S, WAIT_SHARE, InFlight, StepTimes, WaitPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def policy(name: str = "auto", wait_ms: int = 1000) -> tuple[WaitPolicy, Clock]:
    clock = Clock()
    return WaitPolicy(wait_ms, name, clock=clock), clock


def ten_thousand_tokens_a_second(wait: WaitPolicy) -> None:
    wait.observe_step(1000, 0.1)
    wait.observe_step(3000, 0.3)


def test_before_the_engine_is_measured_the_configured_wait_holds():
    wait, _ = policy()
    assert wait.wait_for(tokens=1000, nbytes=10 << 20) == 1.0
    wait.observe_read(1, 1.0)  # a slow tier, but no recompute time to compare it with
    assert wait.wait_for(tokens=1000, nbytes=10 << 20) == 1.0


def test_a_tier_not_measured_yet_is_read_and_waited_for_less_than_the_recompute_time():
    """Its read is made (it measures the tier), and waited for as long as a tier just fast
    enough to be read would take: a slow one costs its first requests less than recomputing
    twice. The control: once measured fast, a read is waited for past the recompute's time."""
    wait, _ = policy()
    ten_thousand_tokens_a_second(wait)
    assert wait.wait_for(tokens=1000, nbytes=10 << 20) == pytest.approx(0.1 * WAIT_SHARE)
    wait.observe_read(10 << 20, 0.01)
    assert wait.wait_for(tokens=1000, nbytes=10 << 20) == pytest.approx(0.1 / WAIT_SHARE)


def test_the_wait_is_about_the_recompute_time():
    wait, _ = policy()
    ten_thousand_tokens_a_second(wait)
    wait.observe_read(1 << 30, 0.01)  # a fast tier
    assert wait.wait_for(tokens=2000, nbytes=1 << 20) == pytest.approx(0.2 / WAIT_SHARE)
    assert wait.wait_for(tokens=16, nbytes=1 << 20) == MIN_WAIT_S  # a tiny hit still gets a chance
    assert wait.wait_for(tokens=100_000, nbytes=1 << 20) == 1.0  # never past the configured wait


def test_step_times_are_a_fixed_cost_plus_a_cost_per_token():
    steps = StepTimes()
    steps.add(4, 0.03)
    assert steps.seconds(100) is None  # one step: no line yet
    steps.add(4, 0.03)
    assert steps.seconds(100) is None  # one size only: no slope
    steps.add(1004, 0.13)  # a prefill: 0.1 ms a token over the 30 ms decode step
    assert steps.seconds(2004) == pytest.approx(0.23)
    steps.add(0, 1.0)  # an idle step says nothing
    assert steps.seconds(2004) == pytest.approx(0.23)
    for _ in range(400):  # the engine slowed down: old steps leave the window
        steps.add(4, 0.06)
        steps.add(1004, 0.26)
    assert steps.seconds(2004) == pytest.approx(0.46)


def test_a_step_far_off_the_line_does_not_bend_it():
    """An engine's first step compiles kernels: 2.2 s for 160 tokens (the chat bench's log)."""
    steps = StepTimes()
    steps.add(160, 2.2)
    for i in range(30):
        steps.add(1, 0.009 + 0.0001 * (i % 3))
        if i % 10 == 0:
            steps.add(160, 0.035)
    assert steps.seconds(128) == pytest.approx(0.0305, abs=0.003)


def test_a_tier_slower_than_recompute_is_skipped_then_probed_now_and_then():
    wait, clock = policy()
    ten_thousand_tokens_a_second(wait)
    wait.observe_read(1 << 20, 1.0)  # 1 MiB/s: 10 MiB take 10 s, recomputing 1000 tokens 0.1 s
    assert not wait.slow
    assert wait.wait_for(tokens=1000, nbytes=10 << 20) is None and wait.slow
    clock.now += PROBE_S
    assert wait.wait_for(tokens=1000, nbytes=10 << 20) == PROBE
    assert wait.wait_for(tokens=1000, nbytes=10 << 20) is None  # one probe at a time
    wait.observe_read(10 << 20, 0.01)  # the tier recovered: 1 GiB/s reads pull the average up
    for _ in range(20):
        wait.observe_read(10 << 20, 0.01)
    assert wait.wait_for(tokens=1000, nbytes=10 << 20) == pytest.approx(0.1 / WAIT_SHARE)


def test_a_tier_faster_than_recompute_is_read():
    wait, _ = policy()
    ten_thousand_tokens_a_second(wait)
    wait.observe_read(1 << 30, 1.0)
    assert wait.wait_for(tokens=1000, nbytes=10 << 20) == pytest.approx(0.1 / WAIT_SHARE)


def test_the_timeout_policy_always_waits_its_deadline():
    wait, _ = policy("timeout", wait_ms=300)
    ten_thousand_tokens_a_second(wait)
    wait.observe_read(1, 1.0)
    assert wait.wait_for(tokens=1000, nbytes=10 << 20) == 0.3


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="auto"):
        WaitPolicy(1000, "eager")


def test_a_read_learnt_of_steps_later_is_waited_for_those_steps_too():
    """The workers' reads are reported in a step's output: a step or two after they end."""
    wait, _ = policy()
    wait.observe_step(1, 0.03)  # a decode step: 30 ms
    wait.observe_step(1001, 0.13)  # 0.1 ms a token
    wait.observe_read(1 << 20, 0.001)  # a fast tier
    recompute, step = 0.0299 + 1000 * 1e-4, 0.03  # the line: 29.9 ms + 0.1 ms a token
    assert wait.wait_for(tokens=1000, nbytes=1, steps_to_see=2) == pytest.approx(
        recompute / WAIT_SHARE + 2 * step
    )


@pytest.mark.parametrize("small", [True, False])
def test_a_small_reads_latency_is_not_taken_for_the_tiers_bandwidth(small):
    """One block of 192 KiB that took 50 ms (the store was connecting) bounds any read from
    below, not from above: a returning user's 10 MiB are still read (50 ms against 0.1 s of
    recompute). The control: 50 ms for 1 MiB is a bandwidth, and 10 MiB would take 0.5 s."""
    wait, _ = policy()
    ten_thousand_tokens_a_second(wait)
    wait.observe_read(192 << 10 if small else 1 << 20, 0.05)
    answer = wait.wait_for(tokens=1000, nbytes=10 << 20)
    assert (answer is not None) is small


MiB = 1 << 20
#: A disk tier's first reads in a chat bench's engine (returning users of 8-14 MiB): mostly
#: 8-15 ms, a few 30-57 ms while writes kept the disk busy.
BUSY_DISK_READS = [
    (11, 0.022),
    (8, 0.008),
    (10, 0.010),
    (11, 0.011),
    (12, 0.050),
    (12, 0.039),
    (11, 0.013),
    (13, 0.057),
]


def test_reads_of_nearly_one_size_predict_by_their_median_not_a_line():
    """A line through reads of nearly one size is steered by their outliers; their median,
    scaled to the size asked, is not. The control: the line alone predicts the tier slower
    than recomputing 2,000 tokens (0.14 s here), and it would have been skipped."""
    wait, _ = policy()
    wait.observe_step(100, 0.02)
    wait.observe_step(2000, 0.14)
    for mib, seconds in BUSY_DISK_READS:
        wait.observe_read(mib * MiB, seconds)
    predicted = wait.read_seconds(12 * MiB)
    assert 0.010 < predicted < 0.025, predicted
    assert wait.wait_for(tokens=2000, nbytes=12 * MiB) is not None and not wait.slow
    assert wait.reads.seconds(12 * MiB) > WAIT_SHARE * 0.14, "the control: the line alone skips the tier"


def test_a_slow_tier_is_still_slow_by_the_median():
    """The median is not optimism: reads of about the size asked that are all slow say so."""
    wait, _ = policy()
    ten_thousand_tokens_a_second(wait)
    for mib in (8, 10, 12, 9):
        wait.observe_read(mib * MiB, mib * 0.02)  # 50 MiB/s: 10 MiB take 0.2 s, recomputing 0.1 s
    assert wait.read_seconds(10 * MiB) == pytest.approx(0.2)
    assert wait.wait_for(tokens=1000, nbytes=10 * MiB) is None and wait.slow


def test_reads_of_many_sizes_still_fit_latency_and_bandwidth():
    """Single blocks and whole users (a remote tier): a size no read had is predicted by the
    line through them, latency included."""
    wait, _ = policy()
    for nbytes in (192 << 10, 384 << 10, 12 * MiB, 24 * MiB):
        wait.observe_read(nbytes, 0.002 + nbytes / (1 << 30))  # 2 ms + 1 GiB/s
    assert wait.read_seconds(48 * MiB) == pytest.approx(0.002 + 48 / 1024, rel=0.01)


@pytest.mark.parametrize("turns", ["slow", "fast"])
def test_a_tier_that_turns_slow_or_recovers_is_seen_within_a_few_reads(turns):
    """The median is of the newest similar reads: forty reads of one speed do not outvote
    five of the other."""
    wait, _ = policy()
    ten_thousand_tokens_a_second(wait)
    before, after = (0.01, 0.5) if turns == "slow" else (0.5, 0.01)
    for _ in range(40):
        wait.observe_read(10 * MiB, before)
    for _ in range(5):
        wait.observe_read(10 * MiB, after)
    assert wait.read_seconds(10 * MiB) == pytest.approx(after)


def test_no_read_is_predicted_quicker_than_the_quickest_small_one():
    wait, _ = policy()
    wait.observe_read(768 << 10, 0.004)  # latency: 4 ms whatever the size
    for _ in range(3):
        wait.observe_read(2 * MiB, 0.002)  # 1 MB a millisecond
    assert wait.read_seconds(1 * MiB) == pytest.approx(0.004)
    assert wait.read_seconds(64 * MiB) == pytest.approx(0.064)  # bandwidth, not latency


def test_a_read_shares_the_tier_with_the_reads_in_flight_beside_it():
    clock = Clock()
    flights = InFlight(clock)
    alone = flights.start(10)
    clock.now += 0.04
    assert flights.end(10, alone) == 1.0, "alone: its whole time"
    marks = [flights.start(10) for _ in range(3)]  # three users return at once
    clock.now += 0.12
    assert [flights.end(10, mark) for mark in marks] == pytest.approx([1 / 3] * 3)
    first = flights.start(10)
    clock.now += 0.05
    second = flights.start(30)  # joins for the second half of the first's time
    clock.now += 0.05
    assert flights.end(10, first) == pytest.approx(10 / 25)  # (10 x 0.05 + 40 x 0.05) / 0.1
    assert flights.end(30, second) == pytest.approx(30 / 40)
    assert flights.blocks == 0


def test_three_reads_at_once_do_not_make_a_fast_tier_look_slow():
    """Three returning users' reads of 10 MiB, each 0.03 s alone, started together and each
    taking 0.09 s: fed as measured, the policy judges the tier slower than recomputing their
    1,000 tokens (0.1 s); fed as their share of the tier (InFlight), it does not. The
    control is the first policy."""
    raw, shared = policy()[0], policy()[0]
    clock = Clock()
    flights = InFlight(clock)
    for wait in (raw, shared):
        ten_thousand_tokens_a_second(wait)
    for _ in range(3):
        marks = [flights.start(640) for _ in range(3)]
        clock.now += 0.09
        for mark in marks:
            raw.observe_read(10 << 20, 0.09)
            shared.observe_read(10 << 20, 0.09 * flights.end(640, mark))
    assert raw.wait_for(tokens=1000, nbytes=10 << 20) is None and raw.slow, "judged slower: recomputed"
    assert shared.wait_for(tokens=1000, nbytes=10 << 20) not in (None, PROBE) and not shared.slow

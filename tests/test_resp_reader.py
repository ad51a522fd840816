"""The native Redis reply reader (kvhal.tiers.stores._resp) against reply streams no server
should send: hypothesis writes them (well-formed replies, nil and error replies, negative and
oversized lengths, junk, torn CRLFs, streams cut short or with a byte changed) into a socket,
and the reader must give exactly what a reference parser written here says (each reply's
result and bytes), or refuse with ConnectionError, and never write outside its buffers.
The timeout it is given is clamped or refused, never converted out of range (issue 38).

The same tests run under AddressSanitizer in tests/test_sanitizers.py.
"""

from __future__ import annotations

import math
import socket
import threading
import time

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from tests.helpers import examples

_resp = pytest.importorskip("kvhal.tiers.stores._resp")

MAX_LINE = 4096
DOWN = (b"-LOADING", b"-NOAUTH", b"-MASTERDOWN", b"-BUSY", b"-TRYAGAIN", b"-CLUSTERDOWN")
CANARY = 0xA5


class Refused(Exception):
    pass


def reference(stream: bytes, caps: list[int]) -> tuple[list[int], list[bytes]]:
    """What the reader must return for ``stream`` (each reply's result and delivered bytes),
    or Refused where it must raise."""
    at, results, payloads = 0, [], []

    def line() -> bytes:
        nonlocal at
        end = stream.find(b"\n", at)
        if end < 0 or end - at - 1 > MAX_LINE or end == at or stream[end - 1 : end] != b"\r":
            raise Refused
        text, at = stream[at : end - 1], end + 1
        return text

    for cap in caps:
        head = line()
        if not head:
            raise Refused
        if head[:1] == b"-":
            if any(head.startswith(down) for down in DOWN):
                raise Refused
            results.append(-1)
            payloads.append(b"")
            continue
        digits = head[1:]
        if head[:1] != b"$" or not 0 < len(digits) <= 18:
            raise Refused
        if digits[:1] == b"-":
            if digits != b"-1":
                raise Refused  # RESP has one negative length
            results.append(0)
            payloads.append(b"")
            continue
        if not digits.isdigit() or not digits.isascii():
            raise Refused
        length = int(digits)
        if length > cap + 1:
            raise Refused
        if at + length + 2 > len(stream) or stream[at + length : at + length + 2] != b"\r\n":
            raise Refused
        value, at = stream[at : at + length], at + length + 2
        results.append(-1 if length > cap else length)
        payloads.append(b"" if length > cap else value)
    return results, payloads


def read(stream: bytes, parts: list[list[int]], timeout: float = 5.0, delay: float | None = 0.0):
    """Send ``stream`` into a socket (then close it), read it with buffers of ``parts`` sizes
    (each between canary bytes): the results, each reply's bytes, and the canaries intact.
    ``delay``: the stream is sent that long after the read starts; None: before it (small ones)."""
    ours, theirs = socket.socketpair()
    arena = bytearray([CANARY]) * (sum(map(sum, parts)) + 8 * (sum(map(len, parts)) + 1))
    views, spans, offset = [], [], 8
    for sizes in parts:
        reply = []
        for size in sizes:
            reply.append(memoryview(arena)[offset : offset + size])
            spans.append((offset, offset + size))
            offset += size + 8
        views.append(reply)

    def send() -> None:
        time.sleep(delay or 0.0)
        try:
            theirs.sendall(stream)
            theirs.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    writer = threading.Thread(target=send, daemon=True)
    if delay is None:
        send()
    else:
        writer.start()
    try:
        results = _resp.read_getrange(ours.fileno(), views, timeout)
        got = [b"".join(bytes(v) for v in reply) for reply in views]
    finally:
        for reply in views:
            for view in reply:
                view.release()
        ours.close()
        if writer.is_alive():
            writer.join(10)
        theirs.close()
    inside = set()
    for start, end in spans:
        inside.update(range(start, end))
    outside_ok = all(arena[i] == CANARY for i in range(len(arena)) if i not in inside)
    return results, got, outside_ok


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


replies = st.one_of(
    st.binary(max_size=40).map(bulk),
    st.integers(0, 20000).map(lambda n: bulk(b"v" * n)),  # past 4 KiB: received straight into a slot
    st.just(b"$-1\r\n"),
    st.sampled_from([b"$-2\r\n", b"$-0\r\n\r\n", b"$-01\r\n", b"$-\r\n", b"$-9223372036854775808\r\n"]),
    st.sampled_from([b"-ERR no\r\n", b"-WRONGTYPE x\r\n", b"-LOADING\r\n", b"-BUSY x\r\n", b"-\r\n"]),
    st.sampled_from([b":1\r\n", b"+OK\r\n", b"*1\r\n", b"\r\n", b"$\r\n", b"$99999999999999999999\r\n"]),
    st.sampled_from(
        [b"$3\r\nabc\n", b"$3\nabc\r\n", b"$3\r\nabcd\r\n", b"$0\r\n\r\n", b"$007\r\nabcdefg\r\n"]
    ),
    st.binary(min_size=1, max_size=30),  # junk
)


@st.composite
def streams(draw):
    count = draw(st.integers(1, 5))
    parts = [draw(st.lists(st.integers(0, 24), min_size=0, max_size=3)) for _ in range(count)]
    big = draw(st.booleans())
    if big:  # one reply whose buffers take a large value, in two parts
        parts[0] = [8192, 16384]
    stream = b"".join(draw(replies) for _ in range(count + draw(st.integers(-1, 1))))
    if stream and draw(st.booleans()):
        cut = draw(st.integers(0, len(stream)))
        stream = stream[:cut]
    if stream and draw(st.booleans()):
        i = draw(st.integers(0, len(stream) - 1))
        stream = stream[:i] + bytes([draw(st.integers(0, 255))]) + stream[i + 1 :]
    return stream, parts


@settings(max_examples=examples(1000), deadline=None)
@given(case=streams())
def test_any_reply_stream_reads_as_the_reference_says_or_is_refused(case):
    stream, parts = case
    caps = [sum(sizes) for sizes in parts]
    try:
        expected = reference(stream, caps)
    except Refused:
        expected = None
    try:
        results, got, outside_ok = read(stream, parts)
    except ConnectionError:
        assert expected is None, f"refused a stream the reference reads as {expected}"
        return
    assert expected is not None, f"read {results} from a stream the reference refuses"
    assert outside_ok, "the reader wrote outside its buffers"
    assert results == expected[0]
    for result, mine, want in zip(results, got, expected[1], strict=True):
        assert mine[: max(result, 0)] == want


@pytest.mark.parametrize("header", [b"$-2", b"$-0", b"$-01", b"$-99", b"$-100"])
def test_a_negative_length_other_than_minus_one_is_a_protocol_error(header):
    """Before: any negative length read as "absent", and $-0 as an empty value."""
    with pytest.raises(ConnectionError, match="negative length other than"):
        read(header + b"\r\n" + bulk(b"next"), [[16], [16]])
    assert read(b"$-1\r\n" + bulk(b"next"), [[16], [16]])[0] == [0, 4]


@pytest.mark.parametrize("timeout", [math.inf, 1e10, 9.3e9, 1e300, 2.0**63])
def test_a_huge_or_infinite_timeout_waits_for_the_reply(timeout):
    """Before: (int64_t)(timeout * 1e9) was undefined for these (x86 gives INT64_MIN, and the
    deadline's arithmetic then overflowed into a wait that never ends; UBSan reports both in
    tests/test_sanitizers.py). Now: clamped to a year, and a reply 0.2 s away is read."""
    results, got, _ = read(bulk(b"late"), [[8]], timeout=timeout, delay=0.2)
    assert results == [4] and got[0][:4] == b"late"


def test_a_negative_timeout_reads_only_what_is_there_and_nan_is_refused():
    """Before: -1e300 and nan converted to INT64_MIN, a deadline that never came."""
    results, _, _ = read(bulk(b"here"), [[8]], timeout=-5.0, delay=None)
    assert results == [4]
    with pytest.raises(ConnectionError, match="timed out"):
        read(bulk(b"late"), [[8]], timeout=-1e300, delay=0.5)
    with pytest.raises(ValueError, match="nan"):
        _resp.read_getrange(0, [], math.nan)

"""The header that frames every block in a shared store: what it accepts and what it refuses."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvhal.tiers.backend import CORRUPT, FOREIGN, OK
from kvhal.tiers.remote import format as remote_format
from kvhal.tiers.remote.format import HEADER_BYTES, UNAUTHENTICATED, check, write_header

SPACE = bytes(range(8))
NAME = "kvhal/v2/0001020304050607/ab"


def framed(payload: bytes, secret: bytes | None = None, space: bytes = SPACE, name: str = NAME):
    header = bytearray(HEADER_BYTES)
    write_header(memoryview(header), memoryview(payload), space, name, secret)
    return header


def test_a_block_checks_against_what_it_was_written_as():
    payload = os.urandom(4096)
    header = framed(payload)
    assert HEADER_BYTES == 96
    assert check(memoryview(header), memoryview(payload), SPACE, NAME, None) is OK


@given(st.binary(min_size=1, max_size=512), st.data())
def test_any_flipped_payload_bit_is_corrupt(payload, data):
    header = framed(payload)
    bit = data.draw(st.integers(0, len(payload) * 8 - 1))
    flipped = bytearray(payload)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert check(memoryview(header), memoryview(bytes(flipped)), SPACE, NAME, None) == CORRUPT


def test_another_namespace_or_name_is_foreign():
    payload = os.urandom(256)
    header = framed(payload)
    other_space = bytes(8)
    assert check(memoryview(header), memoryview(payload), other_space, NAME, None) == FOREIGN
    assert check(memoryview(header), memoryview(payload), SPACE, NAME + "0", None) == FOREIGN
    assert check(memoryview(header), memoryview(payload[:-1]), SPACE, NAME, None) == FOREIGN


def test_a_damaged_header_is_corrupt():
    payload = os.urandom(256)
    header = framed(payload)
    header[0] ^= 0xFF  # the magic
    assert check(memoryview(header), memoryview(payload), SPACE, NAME, None) == CORRUPT
    assert check(memoryview(bytearray(10)), memoryview(payload), SPACE, NAME, None) == CORRUPT


def test_with_a_secret_only_values_carrying_its_mac_are_loaded():
    payload = os.urandom(1024)
    secret = b"fleet secret"
    assert check(memoryview(framed(payload, secret)), memoryview(payload), SPACE, NAME, secret) is OK
    # written without the secret: refused by a reader that has it, accepted by one that has not
    plain = framed(payload)
    assert check(memoryview(plain), memoryview(payload), SPACE, NAME, secret) == UNAUTHENTICATED
    assert check(memoryview(plain), memoryview(payload), SPACE, NAME, None) is OK
    # written with another secret
    assert check(memoryview(framed(payload, b"other")), memoryview(payload), SPACE, NAME, secret) == (
        UNAUTHENTICATED
    )


def test_a_forger_who_fixes_the_checksum_still_fails_the_mac():
    """Without the secret, a value whose payload was replaced and whose crc32c was
    recomputed (what an attacker can do) is refused: the MAC covers the payload."""
    secret = b"fleet secret"
    payload = os.urandom(1024)
    forged_payload = os.urandom(1024)
    header = framed(payload, secret)
    forged = framed(forged_payload)  # a valid header for the forged payload, without the secret
    header[: HEADER_BYTES - remote_format.MAC_BYTES] = forged[: HEADER_BYTES - remote_format.MAC_BYTES]
    header[4 * 3] |= remote_format.FLAG_MAC  # claims a MAC (the old one)
    assert check(memoryview(header), memoryview(forged_payload), SPACE, NAME, None) is OK  # crc alone: fooled
    assert check(memoryview(header), memoryview(forged_payload), SPACE, NAME, secret) == UNAUTHENTICATED


@pytest.mark.parametrize("secret", [None, b"s"])
def test_header_size_is_fixed(secret):
    assert len(framed(b"x" * 10, secret)) == HEADER_BYTES


def test_a_value_of_the_previous_format_is_named_elsewhere_and_never_served():
    """Version 1 put the payload itself through HMAC-SHA256; version 2 puts its BLAKE3 digest
    there. A version-1 value carries version 1 (corrupt to this reader) and lives under other
    names, so neither version reads the other's values, nor blocks them (names are never
    replaced). The control: this version's own value is served."""
    import hashlib
    import hmac

    secret, payload = b"fleet secret", os.urandom(4096)
    old = framed(payload, secret)
    old[8:12] = (1).to_bytes(4, "little")  # the version field
    mac = hmac.new(secret, bytes(old[: HEADER_BYTES - remote_format.MAC_BYTES]), hashlib.sha256)
    mac.update(payload)
    old[HEADER_BYTES - remote_format.MAC_BYTES :] = mac.digest()
    assert check(memoryview(old), memoryview(payload), SPACE, NAME, secret) == CORRUPT
    # the MAC itself changed: version 1's MAC under version 2 is refused
    old[8:12] = remote_format.VERSION.to_bytes(4, "little")
    assert check(memoryview(old), memoryview(payload), SPACE, NAME, secret) == UNAUTHENTICATED
    assert check(memoryview(framed(payload, secret)), memoryview(payload), SPACE, NAME, secret) is OK
    assert remote_format.name_prefix("kvhal", SPACE) == f"kvhal/v{remote_format.VERSION}/{SPACE.hex()}/"
    assert remote_format.VERSION == 2

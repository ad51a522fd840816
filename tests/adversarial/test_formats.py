"""Every byte region of kvhal's stored formats, changed one at a time: never served.

The disk tier's 64-byte slot record and its payload, read back by a freshly opened tier (as
after a restart); the remote tier's 96-byte value header and its payload, checked as every
read checks them, without and with the fleet's secret. Each case has its control in the
same run: the neighbouring block, untouched, is served.
"""

from __future__ import annotations

import pytest

from kvhal.tiers.backend import OK
from kvhal.tiers.disk import DiskTier
from kvhal.tiers.disk.format import RECORD_BYTES
from kvhal.tiers.remote import format as remote_format
from tests.test_disk_tier import RANK0, SLOT, data_file, load, make_spec, store

#: the remote header's bits nothing reads without a secret: the reserved bytes, the MAC, and
#: the flag saying a MAC is there (bit 0 of byte 12). A change there leaves the payload and
#: every checked field intact: the KV served is right. (offset -> the bits of it)
UNREAD_WITHOUT_SECRET = {**dict.fromkeys([*range(28, 32), *range(48, 96)], 0xFF), 12: 0x01}
SLOT_PARTS = [f"record+{i}" for i in range(RECORD_BYTES)] + ["payload+0", "payload+mid", "payload+last"]


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Slots 1 and 2 stored by a tier that then closed: the files a restart finds."""
    path = tmp_path_factory.mktemp("formats") / "d"
    tier = DiskTier(make_spec(path))
    contents = store(tier, [1, 2])
    tier.close()
    return path, contents


@pytest.mark.parametrize("where", SLOT_PARTS)
def test_every_byte_of_a_disk_slot(written, where):
    path, contents = written
    part, _, at = where.partition("+")
    if part == "record":
        file, offset = path / RANK0 / "index.bin", 1 * RECORD_BYTES + int(at)
    else:
        within = {"0": 0, "mid": SLOT // 2, "last": SLOT - 1}[at]
        file, offset = data_file(path), 1 * SLOT + within
    flip(file, offset)
    try:
        tier = DiskTier(make_spec(path))
        outcomes, got = load(tier, [1, 2])
        tier.close()
    finally:
        flip(file, offset)  # the next case starts from intact files
    assert outcomes[0] is not OK, f"slot 1 served with {where} changed"
    assert (outcomes[1], got[1]) == (OK, contents[1]), "the control: the untouched slot 2 is served"


@pytest.mark.parametrize("secret", [None, b"fleet secret"], ids=["no secret", "secret"])
def test_every_byte_of_a_store_value(secret):
    payload = bytes(range(256)) * 16
    header = bytearray(remote_format.HEADER_BYTES)
    space, name = b"namespc1", "kvhal/ns/key"
    remote_format.write_header(memoryview(header), memoryview(payload), space, name, secret)

    def served(head: bytes, body: bytes) -> bool:
        return remote_format.check(memoryview(head), memoryview(body), space, name, secret) is OK

    assert served(bytes(header), payload), "the control: the intact value is served"
    for offset in range(remote_format.HEADER_BYTES):
        for bit in (0x01, 0x80):
            changed = bytearray(header)
            changed[offset] ^= bit
            if secret is None and UNREAD_WITHOUT_SECRET.get(offset, 0) & bit:
                continue  # nothing served differs: the payload and every checked field are intact
            assert not served(bytes(changed), payload), f"served with header byte {offset} ^ {bit:#x}"
    for offset in (0, len(payload) // 2, len(payload) - 1):
        changed = bytearray(payload)
        changed[offset] ^= 0x01
        assert not served(bytes(header), bytes(changed)), f"a value served with payload byte {offset} changed"
    assert not served(bytes(header), payload[:-1]), "a truncated value was served"

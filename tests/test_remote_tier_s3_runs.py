"""Runs of blocks as one object, over the real SeaweedFS S3 gateway: a write stores the runs it
holds whole as one object each, a read takes any tail of a run in one ranged GET and verifies
each block alone, a run that is not there is read block by block, and a damaged run is
refused block by block and written again. About 3 s.
"""

from __future__ import annotations

import uuid

import obstore
import pytest

from kvhal.tiers.backend import CORRUPT, MISSING, OK
from kvhal.tiers.remote.format import HEADER_BYTES
from tests import test_remote_tier_s3 as base
from tests.test_remote_tier_s3 import SECRET, SLOT, fresh_keys, open_tier, slot_bytes

K = 4  # blocks per run (the URL's run_blocks): 4 KiB blocks would make runs of 16 by default
_credentials, host = base._credentials, base.host  # the S3 tests' fixtures


@pytest.fixture
def url(seaweedfs) -> str:
    """A prefix of this test's own, runs of :data:`K` blocks."""
    return seaweedfs.url(prefix=f"runs-{uuid.uuid4().hex[:8]}", run_blocks=K)


def _objects(seaweedfs, tier) -> dict[str, int]:
    """The tier's objects in the bucket (the test's own prefix): name -> size."""
    prefix = tier.url.split("?")[0].split("/", 3)[3]
    found = {}
    for batch in obstore.list(seaweedfs.objects(), prefix=prefix):
        for meta in batch:
            found[meta["path"].removeprefix(prefix + "/")] = meta["size"]
    return found


def test_whole_runs_are_one_object_each_and_read_back_from_any_block(seaweedfs, url, host):
    tier = open_tier(url, host, secret=SECRET)
    assert tier.run_blocks == K
    keys = fresh_keys(10)
    positions = list(range(2, 12))  # blocks 2..11: run 1 (4-7) and run 2 (8-11) whole
    assert tier.write(keys, list(range(10)), positions).result(10) == [True] * 10
    sizes = sorted(_objects(seaweedfs, tier).values())
    assert sizes == [HEADER_BYTES + SLOT] * 2 + [K * (HEADER_BYTES + SLOT)] * 2, "2 alone, 2 runs"
    expected = [slot_bytes(host, s) for s in range(10)]
    # every key read back into other slots; blocks 5..11 alone start inside run 1
    assert tier.read(keys, list(range(6, 16)), positions).result(10) == [OK] * 10
    assert [slot_bytes(host, s) for s in range(6, 16)] == expected
    assert tier.read(keys[3:], list(range(9, 16)), positions[3:]).result(10) == [OK] * 7
    assert [slot_bytes(host, s) for s in range(9, 16)] == expected[3:]
    # negative control: without positions the blocks are asked alone, and the runs' are missing
    assert tier.read(keys, list(range(6, 16))).result(10) == [OK] * 2 + [MISSING] * 8
    # the lookup answers from the runs' names
    index = open_tier(url)
    assert index.exist_run(keys, positions).result(10) == [True] * 10
    more = fresh_keys(3)
    assert index.exist_run([*keys, *more], [*positions, 12, 13, 14]).result(10) == [True] * 10 + [False] * 3
    for t in (tier, index):
        t.close()


def test_a_damaged_run_is_refused_block_by_block_and_written_again(seaweedfs, url, host):
    tier = open_tier(url, host, secret=SECRET)
    keys = fresh_keys(4)
    positions = [0, 1, 2, 3]
    assert tier.write(keys, [0, 1, 2, 3], positions).result(10) == [True] * 4
    (name,) = _objects(seaweedfs, tier)
    full = f"{tier.url.split('?')[0].split('/', 3)[3]}/{name}"
    value = bytearray(bytes(obstore.get(seaweedfs.objects(), full).bytes()))
    value[2 * (HEADER_BYTES + SLOT) + HEADER_BYTES + 7] ^= 1  # one byte of the third block
    obstore.delete(seaweedfs.objects(), full)
    obstore.put(seaweedfs.objects(), full, bytes(value))
    assert tier.read(keys, [8, 9, 10, 11], positions).result(10) == [OK, OK, CORRUPT, OK]
    # the engine recomputes and stores the run again: it replaces what was refused
    assert tier.write(keys, [0, 1, 2, 3], positions).result(10) == [True] * 4
    assert tier.read(keys, [8, 9, 10, 11], positions).result(10) == [OK] * 4
    assert [slot_bytes(host, s) for s in (8, 9, 10, 11)] == [slot_bytes(host, s) for s in range(4)]
    # a run cut short: the blocks it no longer reaches are corrupt, never read past it
    obstore.delete(seaweedfs.objects(), full)
    obstore.put(seaweedfs.objects(), full, bytes(value[: 2 * (HEADER_BYTES + SLOT) + 10]))
    assert tier.read(keys, [8, 9, 10, 11], positions).result(10) == [OK, OK, CORRUPT, CORRUPT]
    tier.close()


@pytest.mark.parametrize("written_whole", [True, False])
def test_a_run_not_there_is_read_block_by_block(seaweedfs, url, host, written_whole):
    tier = open_tier(url, host, secret=SECRET)
    keys = fresh_keys(4)
    if written_whole:  # stored as a run, then the run expired: every block missing
        assert tier.write(keys, [0, 1, 2, 3], [0, 1, 2, 3]).result(10) == [True] * 4
        (name,) = _objects(seaweedfs, tier)
        obstore.delete(seaweedfs.objects(), f"{tier.url.split('?')[0].split('/', 3)[3]}/{name}")
        assert tier.read(keys, [8, 9, 10, 11], [0, 1, 2, 3]).result(10) == [MISSING] * 4
    else:  # stored block by block (a decode step's blocks): the read finds them alone
        for i in range(4):
            assert tier.write(keys[i : i + 1], [i], [i]).result(10) == [True]
        assert len(_objects(seaweedfs, tier)) == 4
        assert tier.read(keys, [8, 9, 10, 11], [0, 1, 2, 3]).result(10) == [OK] * 4
        assert [slot_bytes(host, s) for s in (8, 9, 10, 11)] == [slot_bytes(host, s) for s in range(4)]
    tier.close()

"""The built-in ``disk`` tier backend (kvhal.tiers.disk) on real files.

Faults are injected by subclassing DiskTier (its file I/O goes through small
overridable methods), never through switches in the production code.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvhal.errors import ClosedError, TierError, ValidationError
from kvhal.tiers.backend import CORRUPT, FOREIGN, IO_ERROR, MISSING, OK, TierSpec
from kvhal.tiers.disk import DiskTier, namespaces
from kvhal.tiers.disk import format as disk_format
from kvhal.tiers.disk.format import RECORD_BYTES, TREE
from kvhal.tiers.disk.namespaces import namespace_name
from tests.helpers import examples

FP = {"model": "m", "revision": "r1", "dtype": "bf16"}
SLOT = 8192  # 4 KiB-aligned: straight from the caller's buffers under O_DIRECT


def make_spec(path: Path, *, slot_bytes: int = SLOT, num_slots: int = 64, role: str = "io", **kw) -> TierSpec:
    options = {"path": str(path), "bytes_to_use": num_slots * (-(-slot_bytes // 4096) * 4096 + RECORD_BYTES)}
    options.update(kw.pop("options", {}))
    return TierSpec(options, slot_bytes, kw.pop("fingerprint", FP), role, **kw)  # type: ignore[arg-type]


def rank_dir(**spec) -> str:
    """A rank's directory relative to the disk path, in the namespace of ``make_spec(**spec)``'s model."""
    made = make_spec(Path("unused"), **spec)
    return f"{TREE}/{namespace_name(made)}/rank{made.rank}of{made.world_size}"


#: The default model's rank 0.
RANK0 = rank_dir()


def aligned(n: int, slot_bytes: int) -> list[memoryview]:
    """``n`` slot buffers cut from one page-aligned region, as a host tier's are."""
    region = memoryview(mmap.mmap(-1, max(1, n * slot_bytes)))
    return [region[i * slot_bytes : (i + 1) * slot_bytes] for i in range(n)]


def fill(buffers: list[memoryview], seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    for b in buffers:
        b[:] = rng.integers(0, 256, b.nbytes, dtype=np.uint8).tobytes()
    return [bytes(b) for b in buffers]


def keys_for(slots, tag: bytes = b"k") -> list[bytes]:
    return [tag + s.to_bytes(4, "little") * 2 for s in slots]


def data_file(path: Path, name: str = "data-0.bin", rank_dir: str = RANK0) -> Path:
    return path / rank_dir / name


def store(tier: DiskTier, slots: list[int], seed: int = 1, tag: bytes = b"k") -> list[bytes]:
    buffers = aligned(len(slots), tier.geometry.slot_bytes)
    contents = fill(buffers, seed)
    assert tier.write(slots, keys_for(slots, tag), buffers).result(timeout=30) == [True] * len(slots)
    return contents


def load(tier: DiskTier, slots: list[int], tag: bytes = b"k") -> tuple[list, list[bytes]]:
    buffers = aligned(len(slots), tier.geometry.slot_bytes)
    outcomes = tier.read(slots, keys_for(slots, tag), buffers).result(timeout=30)
    return outcomes, [bytes(b) for b in buffers]


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(make_spec(tmp_path / "d"))
    yield t
    t.close()


# ---------------------------------------------------------------- round trips and recovery


def test_round_trip_many_slots_across_files(tmp_path, monkeypatch):
    monkeypatch.setattr(
        disk_format, "MIN_FILE_BYTES", 16 * SLOT
    )  # several data files, runs cut at their ends
    t = DiskTier(make_spec(tmp_path / "d", num_slots=100))
    assert t.geometry.num_files > 2 and t.num_slots == 100
    slots = [*range(0, 40), *range(99, 60, -1), 50, 45]  # contiguous runs, descending, scattered
    contents = store(t, slots, seed=3)
    outcomes, got = load(t, slots)
    assert outcomes == [OK] * len(slots)
    assert got == contents
    t.close()
    # the index role of a new engine finds them all, under the same keys
    index = DiskTier(make_spec(tmp_path / "d", num_slots=100, role="index"))
    calls = []
    slots_found, keys_found = index.recover(lambda done, total: calls.append((done, total)))
    assert dict(zip(slots_found, keys_found, strict=True)) == dict(zip(slots, keys_for(slots), strict=True))
    assert calls[-1] == (100, 100)
    index.close()
    again = DiskTier(make_spec(tmp_path / "d", num_slots=100))
    assert load(again, slots) == ([OK] * len(slots), contents)
    again.close()


@pytest.mark.parametrize("shared", [False, True], ids=["own-threads", "shared-threads"])
def test_a_read_does_not_queue_behind_writes(tmp_path, shared):
    """Reads have threads of their own: a lookup waiting for its read is not held up by the
    write-throughs queued before it (one write thread, held busy, here). The negative
    control: with one pool for both, the read waits for the write."""
    import threading

    release = threading.Event()

    class SlowWrites(DiskTier):
        def _pwritev(self, fd, buffers, offset):
            if fd != self._index_fd:
                release.wait(timeout=30)
            super()._pwritev(fd, buffers, offset)

    index = DiskTier(make_spec(tmp_path / "d", role="index"))
    index.recover()
    index.close()
    t = SlowWrites(make_spec(tmp_path / "d", options={"io_threads": 1}))
    release.set()
    contents = store(t, [0])
    release.clear()
    if shared:
        t._pools["read"] = t._pools["write"]
    pending = t.write([1, 2], keys_for([1, 2]), aligned(2, SLOT))  # holds the only write thread
    buffers = aligned(1, SLOT)
    reading = t.read([0], keys_for([0]), buffers)
    try:
        if shared:
            with pytest.raises(TimeoutError):
                reading.result(timeout=0.5)
        else:
            assert reading.result(timeout=30) == [OK] and bytes(buffers[0]) == contents[0]
            assert not pending.done()
    finally:
        release.set()
    assert pending.result(timeout=30) == [True, True] and reading.result(timeout=30) == [OK]
    t.close()


def test_overwrite_and_wrong_key(tier):
    store(tier, [3], seed=1, tag=b"a")
    new = store(tier, [3], seed=2, tag=b"b")
    assert load(tier, [3], tag=b"b") == ([OK], new)
    assert load(tier, [3], tag=b"a")[0] == [MISSING]
    assert load(tier, [4])[0] == [MISSING]  # never written


def test_close_finishes_what_is_in_flight(tmp_path):
    t = DiskTier(make_spec(tmp_path / "d", num_slots=64, options={"io_threads": 2}))
    slots = list(range(64))
    buffers = aligned(64, SLOT)
    contents = fill(buffers, 8)
    future = t.write(slots, keys_for(slots), buffers)
    t.close()
    assert future.done() and future.result() == [True] * 64
    t = DiskTier(make_spec(tmp_path / "d", num_slots=64))
    assert load(t, slots) == ([OK] * 64, contents)
    t.close()


def test_empty_batch(tier):
    assert tier.write([], [], []).result() == []
    assert tier.read([], [], []).result() == []


# ---------------------------------------------------------------- verification: corrupt, foreign, torn


def test_flipped_payload_byte_reads_corrupt(tmp_path):
    t = DiskTier(make_spec(tmp_path / "d"))
    contents = store(t, [5, 6])
    assert load(t, [5, 6]) == ([OK, OK], contents)  # negative control: untouched bytes read OK
    t.close()
    with open(data_file(tmp_path / "d"), "r+b") as f:
        f.seek(5 * SLOT + 1234)
        byte = f.read(1)
        f.seek(5 * SLOT + 1234)
        f.write(bytes([byte[0] ^ 0x01]))
    t = DiskTier(make_spec(tmp_path / "d"))
    assert load(t, [5, 6])[0] == [CORRUPT, OK]
    t.close()


def test_flipped_record_byte_reads_corrupt_and_is_not_recovered(tmp_path):
    t = DiskTier(make_spec(tmp_path / "d"))
    store(t, [1, 2])
    t.close()
    with open(tmp_path / "d" / RANK0 / "index.bin", "r+b") as f:
        f.seek(1 * RECORD_BYTES + 25)  # inside slot 1's key
        byte = f.read(1)
        f.seek(1 * RECORD_BYTES + 25)
        f.write(bytes([byte[0] ^ 0x80]))
    t = DiskTier(make_spec(tmp_path / "d"))
    assert load(t, [1, 2])[0] == [CORRUPT, OK]
    t.close()
    index = DiskTier(make_spec(tmp_path / "d", role="index"))
    assert index.recover() == ([2], keys_for([2]))
    index.close()


def test_another_model_on_the_path_has_its_own_namespace_and_never_touches_the_first(tmp_path):
    path = tmp_path / "d"
    first = DiskTier(make_spec(path))
    assert first.num_slots == 64
    mine = store(first, [7])
    first.close()
    other = {**FP, "revision": "r2"}  # same geometry, another model
    second = DiskTier(make_spec(path, num_slots=128, fingerprint=other))
    assert second.num_slots == 64, "the budget is shared: the first model holds half of it"
    assert second.namespace != first.namespace
    assert load(second, [7])[0] == [MISSING]
    store(second, [7], seed=9)  # the same slot number, in its own files
    second.close()
    t = DiskTier(make_spec(path))  # its own bytes_to_use, though the path now holds more
    assert load(t, [7]) == ([OK], mine), "another model's writes reached the first model's blocks"
    t.close()
    index = DiskTier(make_spec(path, role="index"))
    assert index.recover() == ([7], keys_for([7]))
    index.close()


def test_a_record_of_another_model_reads_foreign_and_is_not_recovered(tmp_path):
    path = tmp_path / "d"
    t = DiskTier(make_spec(path))
    store(t, [7])
    t.close()
    other = {**FP, "revision": "r2"}
    DiskTier(make_spec(path, num_slots=128, role="index", fingerprint=other)).close()
    mine, theirs = path / RANK0 / "index.bin", path / rank_dir(fingerprint=other) / "index.bin"
    theirs.write_bytes(mine.read_bytes()[: theirs.stat().st_size])  # the first model's records copied over
    t = DiskTier(make_spec(path, num_slots=128, fingerprint=other))
    assert load(t, [7])[0] == [FOREIGN]
    t.close()
    index = DiskTier(make_spec(path, num_slots=128, role="index", fingerprint=other))
    assert index.recover() == ([], [])
    index.close()
    index = DiskTier(make_spec(path, role="index"))  # control: its own model finds it
    assert index.recover() == ([7], keys_for([7]))
    index.close()


def test_a_budget_taken_by_other_models_is_a_clear_error_and_nothing_changes(tmp_path):
    path = tmp_path / "d"
    t = DiskTier(make_spec(path))
    contents = store(t, [0])
    t.close()
    before = {p: p.read_bytes() for p in (path / RANK0).iterdir()}
    other = {**FP, "model": "second"}
    with pytest.raises(
        ValidationError, match=r"bytes_to_use: .* is taken by m-[0-9a-f]{16} \(m, 528384 bytes\)"
    ):
        DiskTier(make_spec(path, fingerprint=other, role="index"))
    # the refused model's scheduler took its (empty) namespace's lock: not named as a cache
    with pytest.raises(ValidationError, match=r"is taken by m-[0-9a-f]{16} \(m, 528384 bytes\), leaving 0;"):
        DiskTier(make_spec(path, fingerprint={**FP, "model": "third"}))
    assert {p: p.read_bytes() for p in (path / RANK0).iterdir()} == before
    t = DiskTier(make_spec(path))
    assert load(t, [0]) == ([OK], contents)
    t.close()


def test_two_models_run_on_one_path_at_once_and_one_model_once(tmp_path):
    path = tmp_path / "d"
    other = {**FP, "model": "second"}
    a = DiskTier(make_spec(path, role="index"))
    b = DiskTier(make_spec(path, role="index", num_slots=128, fingerprint=other))
    with pytest.raises(TierError, match="in use by another engine of this model"):
        DiskTier(make_spec(path, role="index", options={"lock_wait_s": 0}))
    a.close()
    b.close()
    DiskTier(make_spec(path, role="index")).close()  # the refusal released nothing it held


def test_a_namespace_keeps_its_size_and_a_budget_too_small_for_it_is_refused(tmp_path):
    path = tmp_path / "d"
    t = DiskTier(make_spec(path))
    contents = store(t, [0])
    t.close()
    before = {p: p.read_bytes() for p in (path / RANK0).iterdir()}
    with pytest.raises(
        ValidationError, match=r"bytes_to_use: .* this model's cache at .* made with 528384 bytes"
    ):
        DiskTier(make_spec(path, num_slots=32, role="index"))
    bigger = DiskTier(make_spec(path, num_slots=65))
    assert bigger.num_slots == 64, "a namespace is not resized by a later bytes_to_use"
    assert load(bigger, [0]) == ([OK], contents)
    bigger.close()
    assert {p: p.read_bytes() for p in (path / RANK0).iterdir()} == before
    DiskTier(make_spec(path, role="index")).close()  # the lock was released by the refusal


def test_a_slot_size_change_is_another_namespace(tmp_path):
    path = tmp_path / "d"
    t = DiskTier(make_spec(path))
    contents = store(t, [0])
    t.close()
    wider = DiskTier(make_spec(path, num_slots=128, slot_bytes=12288))
    assert wider.namespace != t.namespace and wider.num_slots >= 1
    wider.close()
    t = DiskTier(make_spec(path))
    assert load(t, [0]) == ([OK], contents)
    t.close()


def test_blocks_of_a_tree_from_before_namespaces_move_into_the_model_s_namespace(tmp_path, caplog):
    path = tmp_path / "d"
    t = DiskTier(make_spec(path, num_slots=128, role="index"))
    t.close()
    t = DiskTier(make_spec(path, num_slots=128))
    contents = store(t, [3])
    t.close()
    namespace = Path(t.namespace)
    (namespace / "rank0of1").rename(path / TREE / "rank0of1")  # the layout kvhal wrote before
    (namespace / "namespace.json").unlink()
    # another model's rank directory of that layout: never moved, counted against the budget
    other = {**FP, "model": "second"}
    o = DiskTier(make_spec(tmp_path / "o", num_slots=128, world_size=2, fingerprint=other, rank=1))
    store(o, [1])
    o.close()
    (Path(o.namespace) / "rank1of2").rename(path / TREE / "rank1of2")
    with caplog.at_level("INFO", logger="kvhal"):
        t = DiskTier(make_spec(path, num_slots=128))
    assert load(t, [3]) == ([OK], contents)
    t.close()
    assert "moved into" in caplog.text
    assert not (path / TREE / "rank0of1").exists()
    assert (path / TREE / "rank1of2" / "index.bin").exists()
    with pytest.raises(ValidationError, match=r"rank1of2 \(an earlier kvhal's rank directory"):
        DiskTier(make_spec(path, num_slots=128, fingerprint={**FP, "model": "third"}))


def test_a_namespace_being_sized_by_another_engine_is_waited_for_at_most_its_deadline(tmp_path, monkeypatch):
    path = tmp_path / "d"
    DiskTier(make_spec(path)).close()
    monkeypatch.setattr(namespaces, "BUDGET_WAIT_S", 0.2)
    fd = os.open(path / TREE / "BUDGET", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another engine, stuck while sizing
    try:
        with pytest.raises(TierError, match="BUDGET: another engine held it for 0 s"):
            DiskTier(make_spec(path))
    finally:
        os.close(fd)
    DiskTier(make_spec(path)).close()  # control: released, it opens


class TornTier(DiskTier):
    """Dies between a payload and its record: the payload lands, the record never does."""

    def _write_records(self, first_slot: int, records: bytes) -> None:
        pass


def test_torn_write_reads_corrupt_never_old_or_new(tmp_path):
    t = DiskTier(make_spec(tmp_path / "d"))
    old = store(t, [9, 10], tag=b"old")
    t.close()
    torn = TornTier(make_spec(tmp_path / "d"))
    store(torn, [9], seed=5, tag=b"new")
    torn.close()
    t = DiskTier(make_spec(tmp_path / "d"))
    assert load(t, [9], tag=b"old")[0] == [CORRUPT]  # old record over new bytes
    assert load(t, [9], tag=b"new")[0] == [MISSING]
    assert load(t, [10], tag=b"old") == ([OK], old[1:])  # control: the neighbour is intact
    t.close()


# ---------------------------------------------------------------- tensor parallelism


def test_recover_keeps_slots_every_rank_holds_with_the_same_key(tmp_path):
    path = tmp_path / "d"
    ranks = [DiskTier(make_spec(path, rank=r, world_size=2, num_slots=128)) for r in range(2)]
    assert ranks[0].num_slots == 64  # bytes_to_use is the engine's: halved per rank
    for r in ranks:
        store(r, [0, 1, 2])
    store(ranks[0], [3])  # rank 1 never stored slot 3
    store(ranks[0], [4], tag=b"x")
    store(ranks[1], [4], tag=b"y")  # ranks disagree on slot 4's key
    for r in ranks:
        r.close()
    index = DiskTier(make_spec(path, role="index", world_size=2, num_slots=128))
    assert index.recover() == ([0, 1, 2], keys_for([0, 1, 2]))
    index.close()
    # rank 0's record copied into rank 1's index: the digest names the rank, so it is foreign there
    src = path / rank_dir(rank=0, world_size=2, num_slots=128) / "index.bin"
    dst = path / rank_dir(rank=1, world_size=2, num_slots=128) / "index.bin"
    dst.write_bytes(src.read_bytes())
    rank1 = DiskTier(make_spec(path, rank=1, world_size=2, num_slots=128))
    assert load(rank1, [0])[0] == [FOREIGN]
    rank1.close()
    index = DiskTier(make_spec(path, role="index", world_size=2, num_slots=128))
    assert index.recover() == ([], [])
    index.close()


# ---------------------------------------------------------------- ownership and safety


def test_second_engine_refused_until_the_first_closes(tmp_path):
    first = DiskTier(make_spec(tmp_path / "d", role="index"))
    with pytest.raises(TierError, match=rf"in use by another engine of this model \(pid {os.getpid()}\)"):
        DiskTier(make_spec(tmp_path / "d", role="index", options={"lock_wait_s": 0}))
    worker = DiskTier(make_spec(tmp_path / "d"))  # workers of the owning engine do not lock
    worker.close()
    first.close()
    first.close()  # idempotent
    again = DiskTier(make_spec(tmp_path / "d", role="index"))
    again.close()


def test_symlink_path_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(TierError, match="symbolic link"):
        DiskTier(make_spec(tmp_path / "link"))
    assert list(real.iterdir()) == []


def test_symlink_inside_the_tree_is_dropped_never_followed(tmp_path):
    """A data file replaced by a link elsewhere: the rank starts empty (a damaged cache), the
    link itself is removed, and what it pointed to is neither written nor removed."""
    DiskTier(make_spec(tmp_path / "d")).close()
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(b"theirs")
    victim = data_file(tmp_path / "d")
    victim.unlink()
    victim.symlink_to(elsewhere)
    t = DiskTier(make_spec(tmp_path / "d"))
    contents = store(t, [0])
    assert load(t, [0]) == ([OK], contents)
    t.close()
    assert not victim.is_symlink() and victim.is_file()
    assert elsewhere.read_bytes() == b"theirs"


def test_world_writable_path_holds_a_private_directory(tmp_path):
    """An emptyDir or a fresh volume is 0777: kvhal keeps its files in kvhal-<uid> (0700) under it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    DiskTier(make_spec(shared, role="index")).close()
    private = shared / f"kvhal-{os.geteuid()}"
    assert [p.name for p in shared.iterdir()] == [private.name]
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert (private / RANK0 / "index.bin").is_file()
    shared.chmod(0o775)  # control: group-writable only is the user's choice, used as it is
    DiskTier(make_spec(shared, role="index")).close()
    assert (shared / TREE).is_dir()


def test_path_that_is_a_file_refused(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(TierError, match="not a directory"):
        DiskTier(make_spec(tmp_path / "f"))


def test_modes_private(tmp_path):
    old = os.umask(0)  # the modes must not depend on the umask
    try:
        DiskTier(make_spec(tmp_path / "d", role="index")).close()
    finally:
        os.umask(old)
    root = tmp_path / "d"
    namespace = (root / RANK0).parent
    dirs = [root, root / TREE, namespace, root / RANK0]
    files = [root / TREE / "BUDGET", *namespace.glob("*.json"), namespace / "LOCK", *(root / RANK0).iterdir()]
    assert {stat.S_IMODE(p.stat().st_mode) for p in dirs} == {0o700}
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600}
    assert {p.name for p in (root / RANK0).iterdir()} == {"meta.json", "data-0.bin", "index.bin"}


def test_each_namespace_names_its_model_for_people(tmp_path):
    DiskTier(make_spec(tmp_path / "d", role="index")).close()
    DiskTier(make_spec(tmp_path / "d", role="index", num_slots=128, fingerprint={"model": "other"})).close()
    assert '"other"' in (tmp_path / "d" / rank_dir(fingerprint={"model": "other"}) / "meta.json").read_text()
    assert '"other"' not in (tmp_path / "d" / RANK0 / "meta.json").read_text()


# ---------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("options", "argument"),
    [
        ({"path": "P", "bytes_to_use": 1 << 20, "colour": 1}, "colour"),
        ({"bytes_to_use": 1 << 20}, "path"),
        ({"path": "P"}, "bytes_to_use"),
        ({"path": "P", "bytes_to_use": 0}, "bytes_to_use"),
        ({"path": "P", "bytes_to_use": "8G"}, "bytes_to_use"),
        ({"path": "P", "bytes_to_use": True}, "bytes_to_use"),
        ({"path": "P", "bytes_to_use": 4096}, "bytes_to_use"),  # less than one slot
        ({"path": "P", "bytes_to_use": 1 << 20, "io_threads": 0}, "io_threads"),
        ({"path": "P", "bytes_to_use": 1 << 20, "direct": "yes"}, "direct"),
        ({"path": "P", "bytes_to_use": 1 << 20, "direct": 1}, "direct"),
        ({"path": 5, "bytes_to_use": 1 << 20}, "path"),
    ],
)
def test_bad_options_name_the_option(tmp_path, options, argument):
    options = {k: (str(tmp_path / "d") if v == "P" else v) for k, v in options.items()}
    with pytest.raises(ValidationError) as info:
        DiskTier(TierSpec(options, SLOT, FP, "io"))
    assert info.value.argument == argument
    assert not (tmp_path / "d").exists()


def test_too_little_free_space_refused_before_creating_files(tmp_path):
    vfs = os.statvfs(tmp_path)
    free = vfs.f_bavail * vfs.f_frsize
    with pytest.raises(
        ValidationError, match=r"bytes_to_use: .* needs \d+ more bytes .* has \d+ free"
    ) as info:
        DiskTier(TierSpec({"path": str(tmp_path / "d"), "bytes_to_use": 2 * free}, SLOT, FP, "index"))
    assert info.value.argument == "bytes_to_use"
    assert list((tmp_path / "d" / RANK0).iterdir()) == []
    DiskTier(make_spec(tmp_path / "d", role="index")).close()  # and the lock went with the refusal


def test_batch_validation(tier):
    buffers = aligned(2, SLOT)
    with pytest.raises(ValidationError, match="slots: 64 is not in"):
        tier.write([64], keys_for([0]), buffers[:1])
    with pytest.raises(ValidationError, match="slot 1 appears twice"):
        tier.write([1, 1], keys_for([1, 2]), buffers)
    with pytest.raises(ValidationError, match=r"keys: .*41 bytes"):
        tier.write([1], [b"x" * 41], buffers[:1])
    with pytest.raises(ValidationError, match="buffers: buffer 0 has 8191 bytes"):
        tier.write([1], keys_for([1]), [buffers[0][:-1]])
    with pytest.raises(ValidationError, match="buffers: buffer 0 is read-only"):
        tier.read([1], keys_for([1]), [memoryview(bytes(SLOT))])
    with pytest.raises(ValidationError, match="keys: 2 slots, 1 keys"):
        tier.write([1, 2], keys_for([1]), buffers)
    with pytest.raises(ValidationError, match="role: recover needs the 'index' role"):
        tier.recover()
    assert tier.write([1], [b"x" * 40], buffers[:1]).result() == [True]  # control: 40 bytes is fine
    tier.close()
    with pytest.raises(ClosedError):
        tier.write([1], keys_for([1]), buffers[:1])


# ---------------------------------------------------------------- medium failures


class FailingTier(DiskTier):
    """A medium failing with ``error`` on writes or reads of the data files while ``failing`` is set."""

    error = errno.ENOSPC
    failing: str | None = None

    def _pwritev(self, fd, buffers, offset):
        if self.failing == "write" and fd in self._data_fds:
            raise OSError(self.error, os.strerror(self.error))
        super()._pwritev(fd, buffers, offset)

    def _preadv(self, fd, buffers, offset):
        if self.failing == "read" and fd in self._data_fds:
            raise OSError(self.error, os.strerror(self.error))
        super()._preadv(fd, buffers, offset)


def test_enospc_on_write_is_false_per_slot_never_raised(tmp_path, caplog):
    t = FailingTier(make_spec(tmp_path / "d"))
    contents = store(t, [2])
    t.failing = "write"
    buffers = aligned(3, SLOT)
    fill(buffers, 9)
    assert t.write([1, 2, 30], keys_for([1, 2, 30], b"n"), buffers).result(timeout=30) == [False] * 3
    assert sum("3 of 3 slots failed to write" in r.message for r in caplog.records) == 1  # once per batch
    assert "No space left" in caplog.text
    t.failing = None
    assert load(t, [2]) == ([OK], contents)  # the failed overwrite left the old record: still proven
    assert load(t, [1], b"n")[0] == [MISSING]
    assert store(t, [1]) and load(t, [1])[0] == [OK]  # the medium recovered: writes work again
    t.close()


def test_eio_on_read_is_io_error(tmp_path):
    t = FailingTier(make_spec(tmp_path / "d"))
    store(t, [4, 5])
    t.error, t.failing = errno.EIO, "read"
    assert load(t, [4, 5, 6])[0] == [IO_ERROR, IO_ERROR, MISSING]  # slot 6's record says missing first
    t.failing = None
    assert load(t, [4, 5])[0] == [OK, OK]
    t.close()


# ---------------------------------------------------------------- O_DIRECT and bounce buffers


def fs_takes_o_direct(directory: Path) -> bool:
    probe = directory / "probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwrite(fd, mmap.mmap(-1, 4096), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


def uses_o_direct(t: DiskTier) -> bool:
    flags = {fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT for fd in t._data_fds}
    assert len(flags) == 1
    return bool(flags.pop())


@pytest.mark.parametrize("where", ["tmp", "repo", "shm"])
def test_o_direct_where_the_file_system_takes_it(tmp_path, where):
    base = {"tmp": tmp_path, "repo": Path(__file__).parent, "shm": Path("/dev/shm")}[where]
    if not base.is_dir():
        pytest.skip(f"{base} does not exist here")
    import tempfile

    with tempfile.TemporaryDirectory(dir=base, prefix="kvhal-disk-test-") as d:
        expected = fs_takes_o_direct(Path(d))
        t = DiskTier(make_spec(Path(d) / "t"))
        assert t.direct is expected
        assert uses_o_direct(t) is expected
        contents = store(t, [0, 1, 2])
        assert load(t, [0, 1, 2]) == ([OK] * 3, contents)
        t.close()


class NoDirectFS(DiskTier):
    """A file system refusing O_DIRECT (tmpfs before Linux 6.6, some FUSE file systems)."""

    def _probe_direct(self, dir_fd):
        return "opening with O_DIRECT failed: Invalid argument"


def test_buffered_fallback_when_o_direct_is_refused(tmp_path):
    t = NoDirectFS(make_spec(tmp_path / "d", slot_bytes=5000))
    assert not t.direct and not uses_o_direct(t)
    contents = store(t, [3, 4, 5])
    assert load(t, [3, 4, 5]) == ([OK] * 3, contents)
    t.close()
    with pytest.raises(ValidationError, match=r"direct: the file system .* does not take O_DIRECT") as info:
        NoDirectFS(make_spec(tmp_path / "d", slot_bytes=5000, options={"direct": True}))
    assert info.value.argument == "direct"
    off = DiskTier(make_spec(tmp_path / "d", slot_bytes=5000, options={"direct": False}))
    assert not off.direct and not uses_o_direct(off)
    assert load(off, [3, 4, 5]) == ([OK] * 3, contents)
    off.close()


class CountingTier(DiskTier):
    bounced = 0

    def _bounce(self):
        type(self).bounced += 1
        return super()._bounce()


@pytest.mark.parametrize(
    ("slot_bytes", "offset", "bounce"),
    [(SLOT, 0, False), (SLOT, 1, True), (SLOT, 512, True), (5000, 0, True)],
)
def test_unaligned_buffers_go_through_bounce_buffers(tmp_path, slot_bytes, offset, bounce):
    if not fs_takes_o_direct(tmp_path):
        pytest.skip("no O_DIRECT here: nothing to align")
    CountingTier.bounced = 0
    t = CountingTier(make_spec(tmp_path / "d", slot_bytes=slot_bytes))
    assert t.direct
    slots = [10, 11, 12, 40]
    region = memoryview(mmap.mmap(-1, offset + len(slots) * slot_bytes))  # page-aligned
    buffers = [region[offset + i * slot_bytes : offset + (i + 1) * slot_bytes] for i in range(4)]
    contents = fill(buffers, 4)
    assert t.write(slots, keys_for(slots), buffers).result() == [True] * 4
    out_region = memoryview(mmap.mmap(-1, offset + len(slots) * slot_bytes))
    out = [out_region[offset + i * slot_bytes : offset + (i + 1) * slot_bytes] for i in range(4)]
    assert t.read(slots, keys_for(slots), out).result() == [OK] * 4
    assert [bytes(b) for b in out] == contents
    assert (CountingTier.bounced > 0) is bounce
    t.close()


# ---------------------------------------------------------------- a model check


@settings(
    max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.lists(st.integers(0, 15), min_size=1, max_size=8, unique=True),
            st.integers(0, 3),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_behaves_like_a_dict(tmp_path_factory, ops):
    """Random writes and reads against a dict of slot -> (key, bytes)."""
    t = DiskTier(
        make_spec(tmp_path_factory.mktemp("h"), slot_bytes=3000, num_slots=16, options={"io_threads": 3})
    )
    model: dict[int, tuple[bytes, bytes]] = {}
    try:
        for is_write, slots, tag in ops:
            keys = keys_for(slots, bytes([97 + tag]))
            if is_write:
                buffers = aligned(len(slots), 3000)
                contents = fill(buffers, tag * 1000 + len(model))
                assert t.write(slots, keys, buffers).result() == [True] * len(slots)
                model.update(zip(slots, zip(keys, contents, strict=True), strict=True))
            else:
                outcomes, got = load(t, slots, bytes([97 + tag]))
                for s, k, outcome, data in zip(slots, keys, outcomes, got, strict=True):
                    if model.get(s, (None,))[0] == k:
                        assert (outcome, data) == (OK, model[s][1])
                    else:
                        assert outcome == MISSING
    finally:
        t.close()


# ---------------------------------------------------------------- the record format


def test_valid_records_checks_crc_a_group_at_a_time():
    digest = b"D" * 8
    n = 3 * disk_format.CHECK_GROUP + 17  # whole groups and a short tail
    raw = np.frombuffer(
        b"".join(disk_format.pack_record(b"key%d" % i, digest, i) for i in range(n)), np.uint8
    ).reshape(n, RECORD_BYTES)
    raw = raw.copy()
    assert disk_format.valid_records(raw, digest).all()  # control: intact records of any key pass
    damaged = [5, 300, 301, disk_format.CHECK_GROUP - 1, n - 1]
    for row in damaged:
        raw[row, 30] ^= 0x04  # the same flip in several records of one group must not cancel out
    mask = disk_format.valid_records(raw, digest)
    assert np.flatnonzero(~mask).tolist() == sorted(damaged)
    raw[7, 9] ^= 1  # a digest byte: another fingerprint, no crc needed to tell
    assert not disk_format.valid_records(raw, digest)[7]
    within = np.zeros(n, bool)
    within[10] = True
    assert np.flatnonzero(disk_format.valid_records(raw, digest, within=within)).tolist() == [10]


def test_a_write_submitted_while_the_interpreter_exits_still_lands(tmp_path):
    """vLLM shuts the connector down from an atexit finalizer, after concurrent.futures
    stopped taking work: the engine's last writes must still reach the disk."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import atexit
        import numpy as np
        from kvhal.tiers.backend import TierSpec
        from kvhal.tiers.disk import DiskTier
        tier = DiskTier(TierSpec({{"path": {str(tmp_path)!r}, "bytes_to_use": 1 << 20}}, 8192, role="io"))
        def late():
            done = tier.write([0], [b"late"], [memoryview(np.full(8192, 7, np.uint8))])
            print("written", done.result(), flush=True)
            tier.close()
        atexit.register(late)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert "written [True]" in out
    tier = DiskTier(TierSpec({"path": str(tmp_path), "bytes_to_use": 1 << 20}, 8192, role="index"))
    try:
        assert tier.recover() == ([0], [b"late"])
    finally:
        tier.close()

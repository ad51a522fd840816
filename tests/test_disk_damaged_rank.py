"""A damaged rank of the disk tier is an empty one, never a refused start or a hang: its
``meta.json`` truncated, garbage, not an object, lacking its geometry, a FIFO (which a plain
open blocks on forever), a directory, a symbolic link; or its index or data file truncated,
missing, a FIFO or a directory. The engine's first opener (a worker, then the scheduler) logs
one warning, drops that rank's files and starts the rank empty; the control: an intact one
keeps its blocks."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest

from kvhal.errors import ValidationError
from kvhal.tiers.backend import OK
from kvhal.tiers.disk import DiskTier
from tests.test_disk_tier import RANK0, load, make_spec, rank_dir, store

DAMAGE = {
    "truncated": lambda meta: meta.write_bytes(meta.read_bytes()[:7]),
    "garbage": lambda meta: meta.write_bytes(os.urandom(200)),
    "not an object": lambda meta: meta.write_text("[1, 2, 3]"),
    "no geometry": lambda meta: meta.write_text("{}"),
    "fifo": lambda meta: (meta.unlink(), os.mkfifo(meta)),
    "directory": lambda meta: (meta.unlink(), meta.mkdir(), (meta / "x").write_text("x")),
    "symlink": lambda meta: (meta.unlink(), meta.symlink_to("/etc/hostname")),
    # the rank's other files, meta.json intact
    "index truncated": lambda meta: (meta.parent / "index.bin").write_bytes(b"x" * 100),
    "index missing": lambda meta: (meta.parent / "index.bin").unlink(),
    "index fifo": lambda meta: ((meta.parent / "index.bin").unlink(), os.mkfifo(meta.parent / "index.bin")),
    "data truncated": lambda meta: (meta.parent / "data-0.bin").write_bytes(b"x" * 100),
    "data fifo": lambda meta: ((meta.parent / "data-0.bin").unlink(), os.mkfifo(meta.parent / "data-0.bin")),
    "data directory": lambda m: (os.unlink(m.parent / "data-0.bin"), os.mkdir(m.parent / "data-0.bin")),
}


def opened(spec) -> DiskTier:
    """Open in a thread with a deadline: an open blocked on a FIFO fails the test, not CI."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(_open(spec)), daemon=True)
    thread.start()
    thread.join(20)
    assert result, "opening the tier hung"
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _open(spec) -> object:
    try:
        return DiskTier(spec)
    except BaseException as exc:  # handed to the test's thread
        return exc


@pytest.mark.parametrize("damage", [*DAMAGE, "intact"])
def test_a_damaged_meta_json_starts_an_empty_tier(tmp_path, caplog, damage):
    path = tmp_path / "d"
    worker = DiskTier(make_spec(path))
    contents = store(worker, [0, 1])
    worker.close()
    if damage != "intact":
        DAMAGE[damage](path / RANK0 / "meta.json")
    with caplog.at_level(logging.WARNING, logger="kvhal.tiers.disk"):
        worker = opened(make_spec(path))  # a worker opens first, as in vLLM's engine core
        scheduler = opened(make_spec(path, role="index"))
    warnings = [r for r in caplog.records if "starts empty" in r.getMessage()]
    slots, _ = scheduler.recover()
    if damage == "intact":  # the control: nothing dropped, nothing said
        assert warnings == [] and sorted(slots) == [0, 1]
        assert load(worker, [0, 1]) == ([OK, OK], contents)
    else:
        assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
        assert slots == [], "blocks of a rank whose meta.json was damaged were offered"
        assert (path / RANK0 / "meta.json").is_file() and not (path / RANK0 / "meta.json").is_symlink()
        new = store(worker, [3], seed=9)  # and the tier serves
        assert load(worker, [3]) == ([OK], new)
    assert os.path.exists("/etc/hostname") or damage != "symlink"
    worker.close()
    scheduler.close()


@pytest.mark.parametrize(
    "damage", ["truncated", "garbage", "not an object", "no geometry", "fifo", "symlink", "intact"]
)
def test_a_damaged_namespace_json_starts_the_model_s_namespace_empty(tmp_path, caplog, damage):
    path = tmp_path / "d"
    worker = DiskTier(make_spec(path))
    contents = store(worker, [0, 1])
    worker.close()
    record = path / RANK0 / ".." / "namespace.json"
    if damage != "intact":
        DAMAGE[damage](record.resolve())
    with caplog.at_level(logging.WARNING, logger="kvhal.tiers.disk"):
        worker = opened(make_spec(path))
        scheduler = opened(make_spec(path, role="index"))
    warnings = [r.getMessage() for r in caplog.records if "namespace.json" in r.getMessage()]
    slots, _ = scheduler.recover()
    if damage == "intact":  # the control: nothing dropped, nothing said
        assert warnings == [] and sorted(slots) == [0, 1]
        assert load(worker, [0, 1]) == ([OK, OK], contents)
    else:
        assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
        assert slots == [], "blocks of a namespace whose record was damaged were offered"
        new = store(worker, [3], seed=9)
        assert load(worker, [3]) == ([OK], new)
    worker.close()
    scheduler.close()


# A damaged record that is still valid JSON: one digit of one value changed (64 -> 74). The
# geometry follows from the namespace's name and its recorded size, and the ranks' files agree
# with it, so a meta.json that disagrees is damage, and so is a namespace.json size no rank
# there was made with: the rank (the namespace) starts empty, never a refused start.
GEOMETRY_FIELDS = [
    "format",
    "slot_bytes",
    "stride",
    "num_slots",
    "slots_per_file",
    "num_files",
    "record_bytes",
]


def one_digit_changed(value: int) -> int:
    """``value`` with its first digit one more (a 9 one less): 64 -> 74, 1 -> 2, 528384 -> 628384."""
    text = str(value)
    first = int(text[0])
    return int(str(first + 1 if first < 9 else first - 1) + text[1:])


def reopen_and_count_warnings(path, caplog, needle: str) -> tuple[DiskTier, DiskTier, list[str]]:
    with caplog.at_level(logging.WARNING, logger="kvhal.tiers.disk"):
        worker = opened(make_spec(path))  # a worker opens first, as in vLLM's engine core
        scheduler = opened(make_spec(path, role="index"))
    return worker, scheduler, [r.getMessage() for r in caplog.records if needle in r.getMessage()]


@pytest.mark.parametrize("field", [*GEOMETRY_FIELDS, "intact"])
def test_a_meta_json_one_digit_off_starts_the_rank_empty(tmp_path, caplog, field):
    path = tmp_path / "d"
    worker = DiskTier(make_spec(path))
    contents = store(worker, [0, 1])
    worker.close()
    meta_path = path / RANK0 / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert set(GEOMETRY_FIELDS) <= meta.keys()
    if field != "intact":
        meta[field] = one_digit_changed(meta[field])
        meta_path.write_text(json.dumps(meta))
    worker, scheduler, warnings = reopen_and_count_warnings(path, caplog, "starts empty")
    slots, _ = scheduler.recover()
    if field == "intact":  # the control: nothing dropped, nothing said
        assert warnings == [] and sorted(slots) == [0, 1]
        assert load(worker, [0, 1]) == ([OK, OK], contents)
    else:
        assert len(warnings) == 1 and field in warnings[0], warnings
        assert slots == [], f"blocks of a rank whose meta.json has another {field} were offered"
        assert json.loads(meta_path.read_text())[field] != meta[field], "meta.json was not made again"
        new = store(worker, [3], seed=9)  # and the tier serves
        assert load(worker, [3]) == ([OK], new)
    worker.close()
    scheduler.close()


BYTES = 64 * (8192 + 64)  # make_spec's bytes_to_use: 64 slots of 8 KiB


@pytest.mark.parametrize(
    "change",
    [
        "first digit up",
        "first digit down",
        "one byte more",
        "one byte less",
        "bytes_to_use below it",
        "intact",
    ],
)
def test_a_namespace_json_size_changed_starts_the_namespace_empty(tmp_path, caplog, change):
    path = tmp_path / "d"
    worker = DiskTier(make_spec(path))
    contents = store(worker, [0, 1])
    worker.close()
    record_path = (path / RANK0 / ".." / "namespace.json").resolve()
    record = json.loads(record_path.read_text())
    assert record["bytes"] == record["bytes_to_use"] == BYTES
    if change == "bytes_to_use below it":
        record["bytes_to_use"] = int("4" + str(BYTES)[1:])  # 528384 -> 428384
    else:
        record["bytes"] = {
            "first digit up": one_digit_changed(BYTES),  # past bytes_to_use: a refused start before
            "first digit down": int("4" + str(BYTES)[1:]),  # fewer slots: a refused start before
            "one byte more": BYTES + 1,
            "one byte less": BYTES - 1,
            "intact": BYTES,
        }[change]
    record_path.write_text(json.dumps(record))
    worker, scheduler, warnings = reopen_and_count_warnings(path, caplog, "namespace.json")
    slots, _ = scheduler.recover()
    if change == "intact":  # the control: nothing dropped, nothing said
        assert warnings == [] and sorted(slots) == [0, 1]
        assert load(worker, [0, 1]) == ([OK, OK], contents)
    else:
        assert len(warnings) == 1 and "namespace.json gives" in warnings[0], warnings
        assert slots == [], "blocks of a namespace whose size was damaged were offered"
        rewritten = json.loads(record_path.read_text())
        assert rewritten["bytes"] == rewritten["bytes_to_use"] == BYTES, "the size was not recorded again"
        assert worker.num_slots == scheduler.num_slots == 64
        new = store(worker, [3], seed=9)
        assert load(worker, [3]) == ([OK], new)
    worker.close()
    scheduler.close()


def test_one_rank_s_meta_json_off_by_a_digit_empties_that_rank_only(tmp_path, caplog):
    """Tensor parallelism: rank 1's meta.json is outvoted by rank 0's and by its own files, so
    namespace.json is not blamed and rank 0's files stay as they were."""
    path = tmp_path / "d"
    for rank in (0, 1):
        DiskTier(make_spec(path, rank=rank, world_size=2)).close()
    rank0, rank1 = path / rank_dir(rank=0, world_size=2), path / rank_dir(rank=1, world_size=2)
    kept = (rank0 / "index.bin").stat().st_ino
    meta = json.loads((rank1 / "meta.json").read_text())
    meta["num_slots"] = one_digit_changed(meta["num_slots"])
    (rank1 / "meta.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="kvhal.tiers.disk"):
        opened(make_spec(path, role="index", world_size=2)).close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "rank1of2" in warnings[0] and "num_slots" in warnings[0], warnings
    assert (rank0 / "index.bin").stat().st_ino == kept, "rank 0 was cleared for rank 1's damage"


def test_a_budget_lowered_below_the_cache_is_still_refused_with_intact_records(tmp_path):
    """The one configuration that refuses a kept cache is unchanged: bytes_to_use below the size
    the namespace was made with (its records agreeing) is an error naming it, nothing changed."""
    path = tmp_path / "d"
    worker = DiskTier(make_spec(path))
    store(worker, [0])
    worker.close()
    before = {p: p.read_bytes() for p in (path / RANK0).iterdir()}
    with pytest.raises(ValidationError, match=r"bytes_to_use: .* made with 528384 bytes"):
        DiskTier(make_spec(path, num_slots=32))
    assert {p: p.read_bytes() for p in (path / RANK0).iterdir()} == before

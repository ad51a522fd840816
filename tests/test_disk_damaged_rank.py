"""A damaged rank of the disk tier is an empty one, never a refused start or a hang: its
``meta.json`` truncated, garbage, not an object, lacking its geometry, a FIFO (which a plain
open blocks on forever), a directory, a symbolic link; or its index or data file truncated,
missing, a FIFO or a directory. The engine's first opener (a worker, then the scheduler) logs
one warning, drops that rank's files and starts the rank empty; the control: an intact one
keeps its blocks."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from kvhal.tiers.backend import OK
from kvhal.tiers.disk import DiskTier
from tests.test_disk_tier import RANK0, load, make_spec, store

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

"""A rolling update on one disk path, on real vLLM engines: the replacement starts while the old
engine still holds the disk tier's lock and serves at once, from host memory, without the disk
tier (a block the old engine left there is a miss, and nothing is written there); once the old
engine exits, the replacement takes the lock, the tier joins with the old engine's blocks, and
they are hits. Two small kvhal engines (and the shared baseline); about a minute on 2 cores."""

from __future__ import annotations

import glob
import os
import tempfile
import time

from kvhal.testing.scenario import ServedEngine
from tests.e2e.common import prompts
from tests.e2e.test_vllm_connector import LENGTH, SERVED, baseline, loaded, tokens
from tests.e2e.test_vllm_disk_tier import BLOCKS_PER_PROMPT, ENGINE, metrics, roomy

WAITING = "held by another engine of this model"
TAKEN = "lock taken after"


def _logs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "kvhal-scenario-*", "engine.log")))


def _wait_for_line(before: set[str], line: str, timeout: float) -> bool:
    """Whether a scenario log begun after ``before`` shows ``line`` within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in _logs() - before:
            try:
                with open(path, errors="replace") as f:
                    if line in f.read():
                        return True
            except OSError:
                pass
        time.sleep(0.5)
    return False


def test_a_replacement_serves_while_the_old_engine_drains_then_hits_its_blocks_on_disk(model, tmp_path):
    old_batch = prompts(2, LENGTH, seed=37)  # the old engine's: on disk when the replacement starts
    own = prompts(1, LENGTH, seed=38)  # the replacement's own, served from its host tier
    expected = baseline(model, old_batch + own)  # one engine without kvhal, as before
    old = ServedEngine({"model": model, "kvhal": roomy(tmp_path), "engine": ENGINE})
    new = None
    try:
        old.submit([{"op": "generate", "prompts": old_batch}, {"op": "settle"}])
        before = _logs()
        # its start returns while the old engine holds the path (it used to wait for the lock)
        new = ServedEngine({"model": model, "kvhal": roomy(tmp_path, disk_lock_wait_s=600), "engine": ENGINE})
        waiting = new.submit(
            [
                {"op": "generate", "prompts": old_batch[:1]},  # on disk, but not this engine's yet
                {"op": "generate", "prompts": own},
                {"op": "settle"},
                {"op": "reset"},  # vLLM's prefix cache: the next round is kvhal's
                {"op": "generate", "prompts": own},
                {"op": "metrics"},
            ]
        )
        assert old.thread.is_alive(), "the old engine ended before the replacement served"
    finally:
        old.close()  # the old engine drained and exits: its lock goes with its process
    try:
        assert new is not None
        assert tokens(waiting[0]) == expected[:1] and loaded(waiting[0]) == [0], "the negative control"
        assert tokens(waiting[1]) == expected[2:] and loaded(waiting[1]) == [0]
        assert tokens(waiting[4]) == expected[2:] and loaded(waiting[4]) == [SERVED], "a host hit"
        meanwhile = metrics(waiting[5])
        assert meanwhile.get("tier_written_blocks", 0) == 0, "the waiting engine wrote to the disk"
        assert meanwhile.get("tier_recovered_blocks", 0) == 0
        assert _wait_for_line(before, TAKEN, 300), "the replacement never took the lock"
        after = new.submit([{"op": "generate", "prompts": old_batch[1:]}, {"op": "metrics"}])
        assert tokens(after[0]) == expected[1:2]
        assert loaded(after[0]) == [SERVED], "the replacement did not serve the old engine's blocks"
        joined = metrics(after[1])
        assert joined["tier_recovered_blocks"] == 2 * BLOCKS_PER_PROMPT
        assert joined["tier_hit_tokens"] == SERVED
        output = new.stop()["stderr"]
    finally:
        if new is not None:
            new.close()
    assert WAITING in output, "the replacement did not wait for the lock: the overlap was not tested"
    assert f"joins, with {2 * BLOCKS_PER_PROMPT} blocks" in output, output[-3000:]

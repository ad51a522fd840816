"""A rolling update on one disk path, on real vLLM engines: the replacement starts while the old
engine still holds the disk tier's lock, waits for it (``disk_lock_wait_s``), and once the old
engine exits serves what the old one stored. Two small engines; about a minute on 2 cores."""

from __future__ import annotations

import glob
import os
import re
import tempfile
import threading
import time

from kvhal.testing.scenario import ServedEngine, run_scenario
from tests.e2e.common import prompts
from tests.e2e.test_vllm_connector import LENGTH, SERVED, baseline, loaded, tokens
from tests.e2e.test_vllm_disk_tier import BLOCKS_PER_PROMPT, ENGINE, metrics, roomy

WAITING = "held by another engine of this model"


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


def test_a_replacement_waits_for_the_lock_then_serves_the_old_engine_s_blocks(model, tmp_path):
    batch = prompts(2, LENGTH, seed=37)
    old = ServedEngine({"model": model, "kvhal": roomy(tmp_path), "engine": ENGINE})
    result: dict = {}
    try:
        old.submit([{"op": "generate", "prompts": batch}, {"op": "settle"}])
        before = _logs()
        steps = [{"op": "generate", "prompts": batch}, {"op": "metrics"}]

        def replacement() -> None:
            try:
                spec = {"model": model, "kvhal": roomy(tmp_path, disk_lock_wait_s=600), "steps": steps}
                result["run"] = run_scenario({**spec, "engine": ENGINE, "env": {}})
            except BaseException as exc:  # reported below
                result["error"] = exc

        thread = threading.Thread(target=replacement, daemon=True)
        thread.start()
        # the replacement reached the lock (its log says it waits) while the old engine runs
        _wait_for_line(before, WAITING, 300)  # else go on: the engine's output below decides
        assert thread.is_alive(), f"the replacement ended while the old engine held the lock: {result}"
    finally:
        old.close()  # the old engine drained and exits: its lock goes with its process
    thread.join(600)
    assert "error" not in result, result.get("error")
    raw, output = result["run"]["steps"], result["run"]["stderr"]
    assert WAITING in output, "the replacement did not wait for the lock: the overlap was not tested"
    assert re.search(r"lock taken after [0-9.]+ s", output), output[-3000:]
    assert tokens(raw[0]) == baseline(model, batch)
    assert loaded(raw[0]) == [SERVED] * 2, "the replacement did not serve the old engine's blocks"
    assert metrics(raw[1])["tier_recovered_blocks"] == 2 * BLOCKS_PER_PROMPT

"""The end-to-end harness without an engine: jobs handed over in files (the runner's job loop
and :class:`~kvhal.testing.scenario.ServedEngine`), and which scenarios the fork server may run.

The engines themselves are the e2e tests' (tests/e2e/); here the engine is replaced by the
same job loop with an echoing handler."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvhal.testing import scenario
from kvhal.testing.scenario import ForkServer, ScenarioError
from kvhal.vllm.testing.steps import serve_jobs


def echoing_engine(spec: dict, timeout: float) -> dict:
    """Stands in for run_scenario: serves the ``serve`` step's folder as the runner does."""
    (step,) = spec["steps"]

    def handle(job: dict) -> dict:
        if job["steps"][0]["op"] == "boom":  # the runner answers a step that raised so
            return {"error": "Traceback: boom!"}
        return {"steps": [{"op": s["op"], "echo": s.get("x")} for s in job["steps"]]}

    return {"steps": [{"jobs": serve_jobs(step["folder"], 30, handle)}]}


def test_a_served_engine_answers_job_after_job_and_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scenario, "run_scenario", echoing_engine)
    served = scenario.ServedEngine({"model": "m", "kvhal": None})
    try:
        first = served.submit([{"op": "a", "x": 1}, {"op": "b", "x": 2}])
        assert first == [{"op": "a", "echo": 1}, {"op": "b", "echo": 2}]
        assert served.submit([{"op": "c", "x": 3}]) == [{"op": "c", "echo": 3}]
        with pytest.raises(ScenarioError, match="a served job failed:\nTraceback: boom!"):
            served.submit([{"op": "boom"}])
        assert served.submit([{"op": "d", "x": 4}]) == [{"op": "d", "echo": 4}], "one failed job ends nothing"
    finally:
        served.close()
    assert not served.thread.is_alive(), "stop did not end the engine's job loop"
    assert not served.folder.exists()


def test_a_served_engine_that_ended_is_an_error_naming_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def dies(spec: dict, timeout: float) -> dict:
        raise ScenarioError("engine process exited with 1:\nno such model")

    monkeypatch.setattr(scenario, "run_scenario", dies)
    with pytest.raises(ScenarioError, match=r"(?s)the engine ended before ready: .*no such model"):
        scenario.ServedEngine({"model": "m", "kvhal": None}, start_timeout=30)


def test_variables_read_at_process_start_send_a_scenario_to_a_fresh_interpreter() -> None:
    server = object.__new__(ForkServer)  # no process: only its decision is under test
    server.python = sys.executable
    server.env = {"PATH": "/bin", "MALLOC_ARENA_MAX": "2"}
    server.proc = types.SimpleNamespace(poll=lambda: None)
    # set after a fork, these still take effect: the child sets them before anything reads them
    same = {"PATH": "/usr/bin", "MALLOC_ARENA_MAX": "2", "PYTHONPATH": "/faults", "KVHAL_TEST_FAULTS": "load"}
    assert server.accepts(same, None)
    assert not server.accepts({"MALLOC_ARENA_MAX": "4"}, None), "glibc reads malloc tuning at start"
    assert not server.accepts({"MALLOC_ARENA_MAX": "2", "PYTHONHASHSEED": "0"}, None)
    assert not server.accepts({"MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}, None)
    assert not server.accepts({"MALLOC_ARENA_MAX": "2"}, "/another/python")
    server.proc = types.SimpleNamespace(poll=lambda: 1)  # the server died
    assert not server.accepts({"MALLOC_ARENA_MAX": "2"}, None)


EXITING = Path(__file__).resolve().parents[1] / "src" / "kvhal" / "vllm" / "testing" / "exiting.py"
#: A process ending through exit_now: the module loaded from its file (no kvhal or vLLM import).
ENDS = """
import atexit, importlib.util, pathlib, sys, threading, time
spec = importlib.util.spec_from_file_location("exiting", sys.argv[1])
exiting = importlib.util.module_from_spec(spec)
spec.loader.exec_module(exiting)
out = pathlib.Path(sys.argv[2])

class TornDown:  # alive at exit: only the interpreter's teardown would run this
    def __init__(self, path):
        self.path = path
    def __del__(self, open=open):
        with open(self.path, "w") as f:
            f.write("ran")

kept = TornDown(str(out / "teardown"))
def late():
    time.sleep(0.3)
    (out / "thread").write_text("joined")
threading.Thread(target=late).start()  # not a daemon: the interpreter joins it first
threading._register_atexit(lambda: (out / "threading-hook").write_text("ran"))
atexit.register(lambda: (out / "atexit").write_text("ran"))
print("flushed", end="")
exiting.exit_now(3)
"""


def test_an_engine_process_ends_as_the_interpreter_ends_it_less_its_teardown(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", ENDS, str(EXITING), str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "flushed", "stdout was not flushed"
    # what vLLM's shutdown and kvhal's last stores rest on: threading's hooks, every non-daemon
    # thread joined, the atexit handlers
    assert {p.name for p in tmp_path.iterdir()} == {"thread", "threading-hook", "atexit"}, (
        "the teardown ran, or a step before it did not"
    )

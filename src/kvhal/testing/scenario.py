"""Run a vLLM scenario in a process of its own and get its JSON result (no vLLM import here).

The process is a fresh interpreter, or (:func:`use_fork_server`, as the tests do) a fork of
a server that imported torch, vLLM and kvhal once; :class:`ServedEngine` keeps one engine
running for many jobs.

A scenario is a dict: ``model`` (a folder), ``steps`` (see
:mod:`kvhal.vllm.testing.runner`), ``kvhal`` (``kv_connector_extra_config``, or
``None`` to run without kvhal), ``engine`` (``vllm.LLM`` argument overrides),
``multiprocessing`` (``VLLM_ENABLE_V1_MULTIPROCESSING``) and ``env``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvhal.env import read as env_setting
from kvhal.testing.ports import free_port

#: Environment every engine runs with on these machines (../shared/docs/vllm-cpu.md).
BASE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class ScenarioError(RuntimeError):
    """The engine process failed; the message ends with its stderr."""


#: Variables a process reads only when it starts (the C library, the interpreter, OpenMP and
#: BLAS pools, vLLM's logging set-up): a fork cannot change them, so a scenario that sets them
#: to other values than the fork server has runs in a fresh process.
EXEC_TIME_PREFIXES = (
    "MALLOC_", "GLIBC_", "LD_", "PYTHON", "OMP_", "KMP_", "GOMP_", "OPENBLAS_", "MKL_",
    "VLLM_LOGGING", "VLLM_CONFIGURE_LOGGING",
)  # fmt: skip


def _exec_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(EXEC_TIME_PREFIXES) and k != "PYTHONPATH"}


class ForkServer:
    """A :mod:`kvhal.vllm.testing.forkserver` process: imports torch, vLLM and kvhal once and
    forks a fresh engine process per scenario (about 6 s saved per engine on these machines)."""

    def __init__(self, python: str | None = None) -> None:
        self.python = python or sys.executable
        self.env = {**os.environ, **BASE_ENV}
        fd, self.log = tempfile.mkstemp(prefix="kvhal-forkserver-", suffix=".log")
        self.proc = subprocess.Popen(
            [self.python, "-m", "kvhal.vllm.testing.forkserver"],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=fd,
        )
        os.close(fd)
        self._pending = bytearray()
        self._replies: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._next_id = 0
        self._await(None, "ready", deadline=time.monotonic() + 300)

    def accepts(self, env: dict[str, str], python: str | None) -> bool:
        """Whether a scenario with ``env`` can be forked from this server."""
        return (
            self.proc.poll() is None
            and (python or sys.executable) == self.python
            and _exec_time(env) == _exec_time(self.env)
        )

    def _await(self, rid: int | None, key: str, deadline: float) -> dict[str, Any]:
        """The server's reply to request ``rid`` that holds ``key``, waiting until ``deadline``
        (TimeoutExpired past it). Threads share the pipe: whoever holds the lock reads for all."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            with self._lock:
                for i, reply in enumerate(self._replies):
                    if reply.get("id") == rid and key in reply:
                        return self._replies.pop(i)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(self.proc.args, 0)
                if select.select([fd], [], [], min(left, 0.05))[0]:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        log = Path(self.log).read_text(errors="replace")[-3000:]
                        raise ScenarioError(f"the fork server died:\n{log}")
                    self._pending += chunk
                    while b"\n" in self._pending:
                        line, _, rest = bytes(self._pending).partition(b"\n")
                        self._pending = bytearray(rest)
                        self._replies.append(json.loads(line))

    def run(self, argv: list[str], env: dict[str, str], log: Path, timeout: float) -> tuple[int, int]:
        """Run the runner with ``argv`` in a forked child; (its return code, its minor faults)."""
        assert self.proc.stdin is not None
        deadline = time.monotonic() + timeout
        with self._lock:
            rid, self._next_id = self._next_id, self._next_id + 1
            request = {"id": rid, "argv": argv, "env": env, "log": str(log)}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        pid = self._await(rid, "pid", deadline)["pid"]
        try:
            done = self._await(rid, "returncode", deadline)
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)  # as subprocess.run does on a timeout
            self._await(rid, "returncode", time.monotonic() + 60)
            raise subprocess.TimeoutExpired(argv, timeout) from None
        return done["returncode"], done["minor_faults"]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log)


_fork_server: ForkServer | None = None
_use_fork_server = False
_fork_server_lock = threading.Lock()  # a served engine's thread starts scenarios too


def use_fork_server(enabled: bool = True) -> None:
    """Run later scenarios' engines forked from one :class:`ForkServer` (the tests do; the
    benchmarks do not: they measure whole processes)."""
    global _use_fork_server, _fork_server
    _use_fork_server = enabled
    if not enabled and _fork_server is not None:
        _fork_server.close()
        _fork_server = None


def _server_for(env: dict[str, str], python: str | None) -> ForkServer | None:
    with _fork_server_lock:
        return _locked_server_for(env, python)


def _locked_server_for(env: dict[str, str], python: str | None) -> ForkServer | None:
    global _fork_server
    if not _use_fork_server:
        return None
    if _fork_server is not None and _fork_server.proc.poll() is not None:
        _fork_server.close()  # died: start another
        _fork_server = None
    if _fork_server is None:
        _fork_server = ForkServer(python)
        atexit.register(use_fork_server, False)
    return _fork_server if _fork_server.accepts(env, python) else None


def run_scenario(
    scenario: dict[str, Any], *, timeout: float = 900, python: str | None = None
) -> dict[str, Any]:
    """Run ``scenario`` with ``python -m kvhal.vllm.testing.runner`` (or forked from the fork
    server, see :func:`use_fork_server`) and return its result."""
    env = {**os.environ, **BASE_ENV, **{k: str(v) for k, v in scenario.get("env", {}).items()}}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if scenario.get("multiprocessing") else "0"
    # vLLM scans upward from VLLM_PORT for its own ports (torch.distributed's store among
    # them): below the ephemeral range no outgoing connection takes one before it binds
    env.setdefault("VLLM_PORT", str(free_port()))
    started = time.perf_counter()
    try:
        return _run_scenario(scenario, env, timeout, python)
    finally:
        _log_time(scenario, started)


def _log_time(scenario: dict[str, Any], started: float) -> None:
    """With KVHAL_SCENARIO_LOG set, one JSON line per engine run: which test, how long, how
    (where a test suite's time goes: engines, fresh or forked, served or not)."""
    path = env_setting("KVHAL_SCENARIO_LOG")
    if path:
        line = {
            "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
            "seconds": round(time.perf_counter() - started, 2),
            "served": any(s.get("op") == "serve" for s in scenario.get("steps", [])),
            "tp": scenario.get("engine", {}).get("tensor_parallel_size", 1),
            "multiprocessing": bool(scenario.get("multiprocessing")),
        }
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def _run_scenario(
    scenario: dict[str, Any], env: dict[str, str], timeout: float, python: str | None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvhal-scenario-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(
            json.dumps({k: v for k, v in scenario.items() if k not in ("env", "multiprocessing")})
        )
        log = Path(tmp) / "engine.log"
        server = _server_for(env, python)
        if server is not None:
            log.touch()
            returncode, minor_faults = server.run([str(spec), str(out)], env, log, timeout)
        else:
            faults_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
            with log.open("w") as sink:  # a file, not a pipe: the engine never waits on its reader
                proc = subprocess.run(
                    [python or sys.executable, "-m", "kvhal.vllm.testing.runner", str(spec), str(out)],
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    timeout=timeout,
                    check=False,
                )
            returncode = proc.returncode
            # Children's counts only grow, and scenarios run one at a time: the difference is this one's.
            minor_faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - faults_before
        output = log.read_text(errors="replace")
        if returncode != 0 or not out.exists():
            tail = "\n".join(output.splitlines()[-40:])
            raise ScenarioError(f"engine process exited with {returncode}:\n{tail}")
        result = json.loads(out.read_text())
    result["stderr"] = output
    result["minor_faults"] = minor_faults
    return result


class JobEngine:
    """An engine whose runner serves jobs handed over in files (the runner's ``serve`` and
    ``chat_jobs`` steps: :func:`kvhal.vllm.testing.steps.serve_jobs`), run by
    :func:`run_scenario` in a thread: hand it jobs, read their answers, stop it for its result.

    Files are written whole (a temporary name, then renamed). An engine that ended raises
    :class:`ScenarioError` (chained to why), a deadline passed :class:`TimeoutError`.
    """

    def __init__(self, spec: dict[str, Any], folder: Path, timeout: float = 3600) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.jobs = 0
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(spec, timeout), daemon=True)
        self.thread.start()

    def _run(self, spec: dict[str, Any], timeout: float) -> None:
        try:
            self.result = run_scenario(spec, timeout=timeout)
        except BaseException as error:  # reported by _wait_for() and stop()
            self.error = error

    def _wait_for(self, path: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            if not self.thread.is_alive():
                raise ScenarioError(f"the engine ended before {path.name}: {self.error}") from self.error
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {path} after {timeout} s")
            time.sleep(0.005)

    def ready(self, timeout: float = 900) -> None:
        """Wait until the engine serves jobs."""
        self._wait_for(self.folder / "ready", timeout)

    def hand(self, job: dict[str, Any]) -> int:
        """Write job file K whole (the engine reads it as soon as it exists); K."""
        number = self.jobs
        self.jobs += 1  # handed out, whether or not its answer ever comes
        tmp = self.folder / f".job-{number}.tmp"
        tmp.write_text(json.dumps(job))
        tmp.rename(self.folder / f"job-{number}.json")
        return number

    def answer(self, job: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
        """Hand ``job`` over and wait for its answer."""
        done = self.folder / f"result-{self.hand(job)}.json"
        self._wait_for(done, timeout)
        return json.loads(done.read_text())

    def stop(self, timeout: float = 300) -> dict[str, Any]:
        """End the job loop; the scenario's result (the engine's error raised again)."""
        if self.thread.is_alive():
            with contextlib.suppress(OSError):
                self.hand({"stop": True})
            self.thread.join(timeout)
            if self.thread.is_alive():
                raise TimeoutError(f"the engine of {self.folder.name} did not stop within {timeout} s")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class ServedEngine(JobEngine):
    """One engine kept running for many tests (the runner's ``serve`` step): tests that need
    the same engine again (a baseline without kvhal, say) ask it instead of starting one."""

    def __init__(self, scenario: dict[str, Any], *, start_timeout: float = 600) -> None:
        folder = Path(tempfile.mkdtemp(prefix="kvhal-served-"))
        super().__init__({**scenario, "steps": [{"op": "serve", "folder": str(folder)}]}, folder, 24 * 3600)
        self.ready(start_timeout)

    def submit(self, steps: list[dict[str, Any]], timeout: float = 600) -> list[dict[str, Any]]:
        """Run ``steps`` on the engine; their records, as :func:`run_scenario`'s ``steps``."""
        answer = self.answer({"steps": steps}, timeout)
        if "error" in answer:
            raise ScenarioError(f"a served job failed:\n{answer['error']}")
        return answer["steps"]

    def close(self) -> None:
        """Stop the engine (at a session's end: whatever it failed with was reported already)."""
        if self.thread.is_alive():
            self.hand({"stop": True})
            self.thread.join(120)
        shutil.rmtree(self.folder, ignore_errors=True)

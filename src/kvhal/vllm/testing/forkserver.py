"""A fork server for scenario engines: ``python -m kvhal.vllm.testing.forkserver``.

Every scenario runs its engine in a fresh process (see :mod:`kvhal.vllm.testing.runner`),
and on these 2-core machines a fresh process spends about 9 s importing torch, vLLM and
kvhal before the engine starts. This server pays that once: it imports them, then
forks one child per scenario, which sets the scenario's environment and runs the runner
exactly as ``python -m kvhal.vllm.testing.runner`` would (same ``main``, same exit path,
:func:`kvhal.vllm.testing.exiting.exit_now`: ``atexit`` handlers and vLLM's shutdown
run). The engine is still built from nothing in its own process; only the module imports
are shared.

The server itself starts no engine, runs no torch op (a forked libgomp thread pool
would hang the child) and starts no thread of its own. Variables a process reads
only when it starts (malloc tuning, ``PYTHONHASHSEED``, OpenMP's) cannot be changed after
a fork: :mod:`kvhal.testing.scenario` sends such scenarios to a fresh process instead.

Protocol, one JSON object a line: the client writes ``{"id": I, "argv": [SPEC, OUT], "env":
{...}, "log": PATH}``; the server answers ``{"id": I, "pid": N}`` when the child runs and
``{"id": I, "pid": N, "returncode": R, "minor_faults": F}`` when it ended (``R`` negative:
killed by signal ``-R``). Several children may run at once.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from typing import Any


def _preload() -> None:
    # What every scenario imports; vllm.v1.engine.llm_engine is most of LLM's import time.
    import torch  # noqa: F401
    import vllm
    import vllm.v1.engine.llm_engine  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    import kvhal.vllm
    import kvhal.vllm.testing.runner  # noqa: F401


def _become(request: dict[str, Any]) -> list[str]:
    """In the child: take the scenario's environment, paths and output; its runner argv."""
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    _channel.close()  # the server's replies are not the child's to write
    sys.argv = ["-m kvhal.vllm.testing.runner", *request["argv"]]
    return list(request["argv"])


def serve() -> list[str] | None:
    """Answer requests until stdin closes and every child ended (returns None), or, in a
    forked child, return the runner's argv. Children run side by side (a test may keep one
    engine serving while it starts others)."""
    fd = sys.stdin.fileno()
    children: dict[int, Any] = {}  # pid -> request id
    pending, reading = b"", True
    _reply({"ready": os.getpid()})
    while reading or children:
        if reading and select.select([fd], [], [], 0.02)[0]:
            chunk = os.read(fd, 65536)
            reading = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if not line.strip():
                    continue
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    return _become(request)
                children[pid] = request.get("id")
                _reply({"id": request.get("id"), "pid": pid})
        elif not reading:
            time.sleep(0.02)
        while children:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            reply = {"pid": pid, "returncode": code, "minor_faults": usage.ru_minflt}
            _reply({"id": children.pop(pid), **reply})
    return None


#: The replies' pipe: the server's stdout as it started. Its fd 1 then goes to its log, so
#: what an import prints there (vLLM 0.27.1 logs to stdout) never breaks the replies.
_channel: Any = None


def _reply(message: dict[str, Any]) -> None:
    _channel.write(json.dumps(message) + "\n")
    _channel.flush()


def main() -> int:
    global _channel
    _channel = os.fdopen(os.dup(1), "w")
    os.set_inheritable(_channel.fileno(), False)
    os.dup2(2, 1)
    _preload()
    argv = serve()
    if argv is None:
        return 0
    from kvhal.vllm.testing.exiting import exit_now
    from kvhal.vllm.testing.runner import main as run_scenario_main

    exit_now(run_scenario_main(argv))


if __name__ == "__main__":
    sys.exit(main())

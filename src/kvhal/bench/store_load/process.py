"""A client process of ``kvhal bench store-load``: ``python -m kvhal.bench.store_load.process
JOBS_FD RESULTS_FD``.

Started afresh by the parent (never a fork of it: the parent runs threads), it takes jobs as
JSON lines from one pipe and answers each with a JSON line on the other: a ``load`` job
(:mod:`.client`), a ``verify`` or a ``killcheck`` job (:mod:`.verify`), or a ``ping`` (the
parent's way to know it is ready). An empty line, or the pipe's end, ends
it; a killed process answers nothing (the parent knows), and a process whose parent is gone
ends itself.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import IO

from kvhal.bench.store_load.client import run_load
from kvhal.bench.store_load.verify import run_killcheck, run_ping, run_verify

JOBS = {"load": run_load, "verify": run_verify, "killcheck": run_killcheck, "ping": run_ping}


def client_main(jobs: IO[str], results: IO[str]) -> None:
    """Run each job of ``jobs``, answer its result on ``results``; see the module."""
    for line in jobs:
        if not line.strip():
            return
        job = json.loads(line)
        try:
            result = JOBS[job["kind"]](job)
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        result["pid"] = os.getpid()
        results.write(json.dumps(result) + "\n")
        results.flush()


def _exit_with_parent(parent: int) -> None:
    """End this process once its parent is gone (killed: no one reads its answers)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


if __name__ == "__main__":
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    with open(int(sys.argv[1])) as job_lines, open(int(sys.argv[2]), "w") as result_lines:
        client_main(job_lines, result_lines)

"""A client process of ``kvhal bench store-load``: ``python -m kvhal.bench.store_load.process
JOBS_FD RESULTS_FD``.

Started afresh by the parent (never a fork of it: the parent runs threads), it takes jobs as
JSON lines from one pipe and answers each with a JSON line on the other: a ``load`` job
(:mod:`.client`) or a ``verify`` job (:mod:`.verify`). An empty line, or the pipe's end, ends
it; a killed process answers nothing (the parent knows).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import IO

from kvhal.bench.store_load.client import run_load
from kvhal.bench.store_load.verify import run_verify


def client_main(jobs: IO[str], results: IO[str]) -> None:
    """Run each job of ``jobs``, answer its result on ``results``; see the module."""
    for line in jobs:
        if not line.strip():
            return
        job = json.loads(line)
        try:
            result = run_load(job) if job["kind"] == "load" else run_verify(job)
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        result["pid"] = os.getpid()
        results.write(json.dumps(result) + "\n")
        results.flush()


if __name__ == "__main__":
    with open(int(sys.argv[1])) as job_lines, open(int(sys.argv[2]), "w") as result_lines:
        client_main(job_lines, result_lines)

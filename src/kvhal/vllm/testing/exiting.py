"""How an engine's process ends (:mod:`kvhal.vllm.testing.runner`, and its fork server's
children): no vLLM import here."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """End the engine's process as the interpreter ends it, less what comes after the atexit
    handlers: threading's exit hooks and the join of every non-daemon thread, then the atexit
    handlers (vLLM shuts its engine down there, through weakref.finalize: the connector's
    shutdown, kvhal's last stores and trace with it; logging's flush), then ``os._exit``. What
    is left out, the interpreter freeing every object of torch, vLLM and kvhal, took 3.2-3.4 s
    of every engine process on these 2-core machines (0.1-0.2 s with it left out), after its
    result was written."""
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's first step at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)

"""Where an engine step's time goes (``kvhal bench chat``'s step trace): the scheduler's
schedule and output update, the model's execution and sampling, and inside them kvhal's
scheduler-side and worker-side hooks. Single-process engines only: everything is timed on
the engine's thread by wrapping the instances' methods, at a few microseconds a call."""

from __future__ import annotations

import atexit
import cProfile
import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from kvhal import env

#: The connector's hooks vLLM's scheduler calls, and those its worker calls.
SCHEDULER_HOOKS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
    "has_pending_block_frees",
    "has_pending_push_work",
)
WORKER_HOOKS = (
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "get_kv_connector_stats",
)


class StepClock:
    """Seconds per part since the last :meth:`take`, each part's own: a call timed inside
    another (kvhal's worker hooks inside ``execute``, a layer's wait inside ``model``) counts
    for its part only, so the parts of a step add up to at most the step."""

    def __init__(self, profiler: cProfile.Profile | None = None) -> None:
        self.parts: dict[str, float] = {}
        #: profiles the hooks timed with ``detail`` (``KVHAL_HOOK_PROFILE``)
        self.profiler = profiler
        self._inner = threading.local()  # per thread: seconds of timed calls inside the current one

    def wrap(self, owner: Any, method: str, part: str, detail: bool = False) -> None:
        """Time ``owner.method`` into ``part`` (and, with ``detail``, into ``hook:METHOD`` too)."""
        original: Callable[..., Any] | None = getattr(owner, method, None)
        if original is None or getattr(original, "_kvhal_clocked", False):
            return

        profiler = self.profiler if detail else None

        inner = self._inner

        @functools.wraps(original)
        def clocked(*args: Any, **kwargs: Any) -> Any:
            outer = getattr(inner, "seconds", 0.0)
            inner.seconds = 0.0
            start = time.perf_counter()
            try:
                if profiler is not None:
                    profiler.enable()
                return original(*args, **kwargs)
            finally:
                if profiler is not None:
                    profiler.disable()
                elapsed = time.perf_counter() - start
                self.parts[part] = self.parts.get(part, 0.0) + elapsed - inner.seconds
                inner.seconds = outer + elapsed
                if detail:
                    self.parts[f"hook:{method}"] = self.parts.get(f"hook:{method}", 0.0) + elapsed

        clocked._kvhal_clocked = True  # type: ignore[attr-defined]
        setattr(owner, method, clocked)

    def take(self) -> dict[str, float]:
        parts, self.parts = self.parts, {}
        return {name: round(seconds, 6) for name, seconds in parts.items()}


def install(llm: Any) -> StepClock | None:
    """A clock on ``llm``'s engine core, or None where the engine core runs in another process."""
    from vllm.v1.engine.core_client import InprocClient

    client = llm.llm_engine.engine_core
    if not isinstance(client, InprocClient):
        return None
    core = client.engine_core
    existing = getattr(core, "_kvhal_step_clock", None)
    if existing is not None:
        return existing
    clock = StepClock(_profiler())
    clock.wrap(core.scheduler, "schedule", "schedule")
    clock.wrap(core.scheduler, "update_from_output", "update")
    clock.wrap(core.model_executor, "execute_model", "execute")
    clock.wrap(core.model_executor, "sample_tokens", "sample")
    # the model itself, inside ``execute`` (its layers' kvhal hooks included)
    worker = getattr(getattr(core.model_executor, "driver_worker", None), "worker", None)
    runner = getattr(worker, "model_runner", None)
    if runner is not None:
        clock.wrap(runner, "_model_forward", "model")
    connector = getattr(core.scheduler, "connector", None)
    if connector is not None:
        for hook in SCHEDULER_HOOKS:
            clock.wrap(connector, hook, "kvhal_scheduler", detail=True)
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        connector = get_kv_transfer_group()
        for hook in WORKER_HOOKS:
            clock.wrap(connector, hook, "kvhal_worker", detail=True)
    core._kvhal_step_clock = clock
    return clock


def _profiler() -> cProfile.Profile | None:
    """A profiler of kvhal's hooks, written at exit, where ``KVHAL_HOOK_PROFILE`` names a prefix."""
    prefix = env.read("KVHAL_HOOK_PROFILE")
    if not prefix:
        return None
    profiler = cProfile.Profile()
    atexit.register(profiler.dump_stats, f"{prefix}.{os.getpid()}.prof")
    return profiler

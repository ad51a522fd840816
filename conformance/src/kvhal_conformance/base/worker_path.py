"""Contract: the worker path, the hooks together as a vLLM engine's worker calls them.

The other contracts check each hook alone, on small caches. This one replays recorded traces
of a vLLM worker's connector calls (:mod:`kvhal_conformance.traces`, recorded with
``KVHAL_TRACE_DIR``; docs/replay.md) through :func:`kvhal.replay.replay` on the device under
test: the KV cache as the engine had it (its shapes, strides and layers), every step's loads,
per-layer waits, stores and polls in the recorded order, with a stand-in forward between the
layers. Every loaded block must hold the bytes stored from it, every store must land whole,
and every job must end as it ended when recorded. A trace needing what the device or the
replay lacks (a store below the host tier that a replay cannot reach, a cache the device
cannot allocate) is reported "not tested", naming why, never a silent pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from kvhal.replay import ReplayResult, replay
from kvhal.vllm.trace_format import TraceError
from kvhal_conformance.base.fixtures import ContractFixtures, final
from kvhal_conformance.clauses import covers, depends_on, violated
from kvhal_conformance.target import Target
from kvhal_conformance.traces import KEPT

#: ``target.metrics`` key of each trace's replay: ``{trace name: row}`` (see :func:`row`).
METRIC = "worker_path"
#: What a replay's verdict rests on: host buffers, streams, events and copies that keep their
#: own promises (where another check found one of these broken, the worker path reads "not
#: judged", not a second blame for that defect).
DEPENDS = (
    "layouts.permutation",
    "host.buffer",
    "host.distinct",
    "stream.new",
    "stream.order",
    "current.compute",
    "event.new",
    "record.after_work",
    "record.completes",
    "record.again",
    "query.state",
    "sync.waits",
    "wait.orders",
    "copy.data",
    "copy.dst_only",
    "copy.src_unchanged",
    "copy.ordering",
    "copy.on_stream",
    "copy.event",
)


def trace_name(path: Path) -> str:
    """A trace's name in the report: its file name without ``.json.gz``."""
    return path.name.removesuffix(".gz").removesuffix(".json")


def row(result: ReplayResult) -> dict[str, Any]:
    """A replay as the report's row: status (and why), what was checked, the engine thread's
    time in kvhal's calls a step, the first failure."""
    summary = result.summary()
    return {
        "status": result.status,
        "reason": result.reason,
        "steps": result.steps,
        "jobs": result.jobs,
        "blocks_loaded": result.blocks_loaded,
        "blocks_stored": result.blocks_stored,
        "blocks_unchecked": result.blocks_unchecked,
        "failures": result.failure_count,
        "first_failure": result.failures[0] if result.failures else "",
        "step_median_us": summary.get("step_median_us"),
        "step_p90_us": summary.get("step_p90_us"),
        "wall_s": result.wall_s,
    }


class WorkerPathContract(ContractFixtures):
    """Contract ``worker_path``: each trace of :meth:`traces_to_replay` replays on the plugin's
    device with every block, store and job outcome as recorded (:data:`~kvhal_conformance.clauses.
    WORKER_PATH`); one check per trace.

    Fixtures: ``kvhal_target`` (see :class:`ContractFixtures`); the replay binds the device
    through the target's registry, so a plugin object registered there (``--kvhal-plugin``,
    :meth:`Target.of_plugin`) is the one replayed.

    Hooks: :meth:`traces_to_replay`.
    """

    contract_id = "worker_path"

    def traces_to_replay(self, config: pytest.Config) -> Mapping[str, Path]:
        """The traces to replay, by name (collected before any fixture runs). Default: the kept
        traces, :data:`kvhal_conformance.traces.KEPT`; add your model's (docs/replay.md)."""
        return KEPT

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        super().pytest_generate_tests(metafunc)
        if "trace" in metafunc.fixturenames:
            traces = dict(self.traces_to_replay(metafunc.config))
            metafunc.parametrize("trace", list(traces.values()), ids=list(traces))

    @final
    @covers("worker.path")
    @depends_on(*DEPENDS, judges=("worker.path",))
    def test_trace_replays(self, kvhal_target: Target, trace: Path) -> None:
        """The trace's connector calls replayed on the device load every block with the bytes
        stored from it, store every block whole and end every job as recorded; a trace needing
        what the device or the replay lacks is not tested, naming why."""
        kvhal_target.require_device()
        name = trace_name(trace)
        try:
            result = replay(trace, kvhal_target.name, registry=kvhal_target.registry)
        except TraceError as exc:
            pytest.fail(
                f"trace {name} ({trace}) was refused: {exc}: the replay reads traces of this kvhal "
                "version only; record it again (docs/replay.md)",
                pytrace=False,
            )
        kvhal_target.metrics.setdefault(METRIC, {})[name] = row(result)
        if result.status == "not tested" and not result.failures:
            pytest.skip(f"worker path: trace {name} not tested on {kvhal_target.label}: {result.reason}")
        if result.status != "passed":  # failed: wrong bytes, other outcomes, or a stall
            first = result.failures[0] if result.failures else result.reason
            more = f" (the first of {result.failure_count})" if result.failure_count > 1 else ""
            stalled = f"; {result.reason.split(':')[0]}" if "stalled" in result.reason else ""
            violated(
                "worker.path",
                f"trace {name} replayed on {kvhal_target.label}: {first}{more}{stalled}; "
                f"`kvhal replay {trace} --device {kvhal_target.name}` names every one",
            )

"""Engine chains fall back only while an engine has never worked; forced engines; op schemas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvhal.accel.descriptors import Descriptors
from kvhal.accel.engines import (
    CopyArgumentError,
    CopyJob,
    EngineChain,
    SizeSplitEngine,
    TorchCopyEngine,
    apply_forced,
    build_engines,
    op_has_argument,
)
from kvhal.copyplan import Direction


class Recorder:
    """An engine that records the descriptors it ran, failing on chosen calls
    (``refuse_on``: with :class:`CopyArgumentError`, the job's fault)."""

    batched = False

    def __init__(self, name: str, fail_on: set[int] = frozenset(), refuse_on: set[int] = frozenset()) -> None:
        self.name, self.fail_on, self.refuse_on, self.runs = name, set(fail_on), set(refuse_on), []

    def run(self, job: CopyJob) -> None:
        call = len(self.runs)
        self.runs.append(job.descriptors)
        if call in self.refuse_on:
            raise CopyArgumentError(f"{self.name} refused call {call}")
        if call in self.fail_on:
            raise OSError(f"{self.name} failed on call {call}")


def job(sizes=(8, 8)) -> CopyJob:
    d = Descriptors.from_lists(list(range(len(sizes))), list(range(len(sizes))), list(sizes))
    return CopyJob(plan=None, descriptors=d, direction=Direction.D2H, stream=None)  # type: ignore[arg-type]


def test_an_engine_that_fails_before_ever_working_is_dropped_and_the_job_reruns():
    first, second = Recorder("batch", fail_on={0}), Recorder("loop")
    chain = EngineChain([first, second])
    chain.run(job())
    assert len(first.runs) == 1 and len(second.runs) == 1
    assert chain.active is second
    assert chain.dropped[0][0] == "batch" and "failed on call 0" in chain.dropped[0][1]
    chain.run(job())
    assert len(first.runs) == 1 and len(second.runs) == 2


def test_a_failure_of_an_engine_that_has_worked_is_the_copy_failure():
    first, second = Recorder("batch", fail_on={1}), Recorder("loop")
    chain = EngineChain([first, second])
    chain.run(job())
    with pytest.raises(OSError, match="failed on call 1"):
        chain.run(job())
    assert second.runs == [] and chain.active is first


def test_the_last_engine_failing_is_the_copy_failure():
    only = Recorder("torch", fail_on={0})
    with pytest.raises(OSError):
        EngineChain([only]).run(job())


def test_an_engine_refusing_a_jobs_arguments_is_kept_and_only_that_job_moves_on():
    first, second = Recorder("batch", refuse_on={0}), Recorder("loop")
    chain = EngineChain([first, second])
    chain.run(job())
    assert len(first.runs) == 1 and len(second.runs) == 1, "the refused job ran on the next engine"
    assert chain.active is first and chain.dropped == []
    assert chain.argument_failures == {"batch": 1}
    chain.run(job())
    assert len(first.runs) == 2 and len(second.runs) == 1, "the next job used the first engine again"


def test_an_engine_that_never_worked_keeps_its_place_after_argument_refusals():
    first, second = Recorder("batch", refuse_on={0, 1}), Recorder("loop")
    chain = EngineChain([first, second])
    chain.run(job())
    chain.run(job())
    assert chain.names == ["batch", "loop"] and chain.argument_failures == {"batch": 2}


def test_an_argument_refusal_by_the_last_engine_is_the_copy_failure():
    only = Recorder("torch", refuse_on={0})
    chain = EngineChain([only])
    with pytest.raises(CopyArgumentError, match="refused call 0"):
        chain.run(job())
    assert chain.names == ["torch"]


def test_a_middle_engine_that_fails_before_working_is_dropped_behind_a_refusing_one():
    first = Recorder("batch", refuse_on={0})
    middle, last = Recorder("op", fail_on={0}), Recorder("loop")
    chain = EngineChain([first, middle, last])
    chain.run(job())
    assert [len(e.runs) for e in (first, middle, last)] == [1, 1, 1]
    assert chain.names == ["batch", "loop"] and chain.dropped[0][0] == "op"
    chain.run(job())
    assert [len(e.runs) for e in (first, middle, last)] == [2, 1, 1]


def test_an_empty_chain_is_refused():
    with pytest.raises(ValueError):
        EngineChain([])


def test_size_split_sends_large_descriptors_to_the_batch_and_small_ones_to_the_loop():
    large, small = Recorder("batch"), Recorder("loop")
    engine = SizeSplitEngine(large, small, min_bytes=256 << 10)
    engine.run(job(sizes=(64 << 10, 1 << 20, 256 << 10, 4096)))
    assert large.runs[0].sizes.tolist() == [1 << 20, 256 << 10]
    assert small.runs[0].sizes.tolist() == [64 << 10, 4096]
    engine.run(job(sizes=(8,)))
    assert len(large.runs) == 1, "an empty part is not sent"


def test_build_engines_skips_unavailable_ones_unless_forced():
    def broken():
        raise OSError("libcuda.so.1 cannot be loaded")

    make = {"batch": broken, "torch.copy_": TorchCopyEngine}
    assert [e.name for e in build_engines(["batch", "torch.copy_"], make)] == ["torch.copy_"]
    with pytest.raises(RuntimeError, match="forced but is unavailable"):
        build_engines(["batch"], make, fallback=False)


def test_apply_forced():
    assert apply_forced(["a", "b"], None, ["a", "b"], "ENV") == ["a", "b"]
    assert apply_forced(["a", "b"], "b", ["a", "b"], "ENV") == ["b"]
    with pytest.raises(ValueError, match="ENV='c' is not an engine"):
        apply_forced(["a"], "c", ["a", "b"], "ENV")


def test_op_has_argument_reads_a_registered_ops_schema():
    lib = torch.library.Library("kvhal_test_schema", "DEF")
    lib.define("swap(Tensor a, Tensor b, Tensor c, bool is_src_access_order_any=False) -> ()")
    op = torch.ops.kvhal_test_schema.swap
    assert op_has_argument(op, "is_src_access_order_any")
    assert op_has_argument(op.default, "c")
    assert not op_has_argument(op, "direction")
    assert not op_has_argument(np.zeros(1), "a")

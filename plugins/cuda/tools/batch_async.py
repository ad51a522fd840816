"""Does a batched copy return before it runs? On a CUDA GPU, per copy engine and batch size.

The conformance suite's ``copy.async`` check failed on an H200 for its "large" copy
(524,288 descriptors of 64 bytes): ``kvhal_copy_blocks`` returned only after the copy had
run, behind 728 ms of queued work. This queues ``torch.cuda._sleep`` on a stream, submits
one device -> host copy of N 64-byte pieces behind it and reports how long the call took
and whether the copy's bytes had arrived when it returned; with ``--chunks`` it also splits
the driver batch into calls of at most that many descriptors.

    python plugins/cuda/tools/batch_async.py
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import numpy as np
import torch

from kvhal.accel.descriptors import Descriptors
from kvhal.accel.engines import CopyJob
from kvhal.geometry import KVGeometry
from kvhal.registry import PluginRegistry
from kvhal_cuda import native
from kvhal_cuda.engines import BatchEngine

SLEEP_S = 0.3


def device_for(engine: str):
    os.environ["KVHAL_CUDA_COPY_ENGINE"] = engine
    return PluginRegistry(allow="cuda").select("cuda")


def pieces(device, blocks: int):
    g = KVGeometry(2, blocks, 1, 1, 16, torch.bfloat16)
    layout = device.kv_layouts()[0]
    src = device.allocate_kv_cache(g, layout)
    for parts in src.layers:
        for t in parts:
            t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
    dst = device.allocate_host_cache(g, layout, blocks)
    ids = np.arange(blocks)
    plan = device.plan_copy(src, dst, np.stack([ids, ids[::-1]], axis=1))  # reversed: no coalescing
    torch.cuda.synchronize()
    # what the last descriptor must deliver, read now: no device read may wait on the test's stream
    expected = src.layers[-1][-1][plan.mapping[-1][0]].cpu()
    return expected, dst, plan


def arrived(expected, dst, plan) -> bool:
    return bool(torch.equal(expected, dst.layers[-1][-1][plan.mapping[-1][1]]))


def trial(device, expected, dst, plan, submit) -> tuple[float, bool, float]:
    for parts in dst.layers:
        for t in parts:
            t.zero_()
    stream = device.create_stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(SLEEP_S * 1.98e9))  # cycles at the H100/H200 boost clock
    start = time.perf_counter()
    event = submit(stream)
    took = time.perf_counter() - start
    done = arrived(expected, dst, plan)
    idle_start = time.perf_counter()
    device.synchronize_event(event) if event is not None else stream.synchronize()
    waited = time.perf_counter() - idle_start
    assert arrived(expected, dst, plan), "the copy never arrived"
    return took, done, waited


HEADER = ("engine", "descriptors", "chunk", "call ms", "done at return", "then ms")


def row(*cells) -> str:
    widths = (34, 11, 7, 8, 15, 8)
    first, *rest = zip(cells, widths, strict=True)
    return " ".join([f"{first[0]!s:<{first[1]}}", *(f"{c!s:>{w}}" for c, w in rest)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, nargs="+", default=[1024, 16384, 65536, 262144])
    parser.add_argument("--chunks", type=int, nargs="+", default=[4096, 65536])
    args = parser.parse_args()
    print(row(*HEADER))
    for engine in ("cuMemcpyBatchAsync", "cudaMemcpyAsync"):
        device = device_for(engine)
        for blocks in args.blocks:
            expected, dst, plan = pieces(device, blocks)
            submitters = {"-": functools.partial(whole, device, plan)}
            if engine == "cuMemcpyBatchAsync":
                for chunk in args.chunks:
                    batch = BatchEngine(native.resolve_cu_memcpy_batch(), max_descriptors=chunk)
                    submitters[str(chunk)] = functools.partial(chunked, batch, plan)
            for chunk, submit in submitters.items():
                took, done, waited = trial(device, expected, dst, plan, submit)
                print(row(engine, 2 * blocks, chunk, f"{took * 1e3:.1f}", done, f"{waited * 1e3:.1f}"))


def whole(device, plan, stream):
    return device.submit(plan, stream, after_compute=False)


def chunked(batch, plan, stream):
    batch.run(CopyJob(plan, Descriptors.of(plan), plan.direction, stream))


if __name__ == "__main__":
    main()

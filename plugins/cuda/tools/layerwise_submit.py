"""What a layer-by-layer load costs the thread that submits it (vLLM's engine thread):
a job of scattered blocks of a 32-layer model, loaded host -> device as the vLLM worker
does it, side by side:

- ``per layer, checked per layer``: each layer's copy planned and checked on its own, its
  stream ordered after compute each time (kvhal before this tool's commit);
- ``per layer, checked once``: the job checked once and cut into layers
  (``kvhal.copyplan.plan_by_layer``), the stream ordered once (``LayerGate.submit`` now);
- ``whole job, one copy``: one copy of every layer (a synchronous load that is not layer by layer);
- ``one torch.copy_``: the job's bytes as one contiguous copy (the link's limit).

Per row: the submitting thread's time (median), the time until every copy has finished, and
the resulting throughput.

Then a forward beside the load (one matrix product per layer on the compute stream, each
layer's waiting for its copies, as ``wait_for_layer_load`` makes it, after ``--launch-us`` of
Python per layer that holds the GIL, as a model's own code does): the wall time from the
load's submission to the forward's end, per load size, with the layers submitted on the
forward's thread before it starts (``LayerGate``), beside the forward alone (no load: the
floor) and one whole copy waited for before it.
Prints tables; ``--json PATH`` writes them.

    python plugins/cuda/tools/layerwise_submit.py [cuda|cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvhal.copyplan import plan_by_layer
from kvhal.device import Device
from kvhal.geometry import KVGeometry
from kvhal.layouts import LBNHC
from kvhal.offload.transfer import TransferEngine, TransferKind
from kvhal.registry import select_device

LAYERS = 32
DTYPE = torch.bfloat16  # a GPU model's dtype; on the CPU only copies run, no arithmetic


def timed(submit: Callable[[], list[int]], engine: TransferEngine, repeats: int) -> tuple[float, float]:
    """Medians of (submitting thread's seconds, seconds until every copy finished)."""
    submit_s, done_s = [], []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        jobs = submit()
        t1 = time.perf_counter()
        results = engine.wait(jobs)
        t2 = time.perf_counter()
        if not all(r.success for r in results):
            raise SystemExit(f"a copy failed: {[r.error for r in results if not r.success][:1]}")
        if i >= 2:  # two warm-ups
            submit_s.append(t1 - t0)
            done_s.append(t2 - t0)
    return statistics.median(submit_s), statistics.median(done_s)


class Bench:
    """The caches, their one-layer views and a transfer engine, on ``device``."""

    def __init__(self, device: Device, num_blocks: int) -> None:
        # vLLM's FlashAttention cache of a Llama-8B-like model: 16 tokens x 8 KV heads x 128,
        # K and V: 64 KiB per block and layer, 2 MiB per block of all 32 layers
        self.device = device
        self.geometry = KVGeometry(LAYERS, num_blocks, 16, 8, 128, DTYPE)
        self.cache = device.allocate_kv_cache(self.geometry, LBNHC)
        self.host = device.allocate_host_cache(self.geometry, LBNHC, num_blocks)
        self.cache_layers = [self.cache.of_layers([i]) for i in range(LAYERS)]
        self.host_layers = [self.host.of_layers([i]) for i in range(LAYERS)]
        self.engine = TransferEngine(device)
        self.rng = np.random.default_rng(0)

    def mapping(self, blocks: int) -> np.ndarray:
        """``blocks`` random (slot, device block) pairs, scattered as a real job's are."""
        n = self.geometry.num_blocks
        return np.stack(
            [self.rng.choice(n, blocks, replace=False), self.rng.choice(n, blocks, replace=False)], 1
        )

    def per_layer_checked(self, mapping: np.ndarray) -> list[int]:
        return [
            self.engine.submit_load((), self.host_layers[i], self.cache_layers[i], mapping)
            for i in range(LAYERS)
        ]

    def per_layer_once(self, mapping: np.ndarray) -> list[int]:
        whole = self.device.plan_copy(self.host, self.cache, mapping)
        plans = plan_by_layer(whole, self.host_layers, self.cache_layers)
        return [
            self.engine.submit_plan(TransferKind.LOAD, p, after_compute=i == 0) for i, p in enumerate(plans)
        ]

    def whole_job(self, mapping: np.ndarray) -> list[int]:
        return [self.engine.submit_load((), self.host, self.cache, mapping)]

    def plain_copy_s(self, nbytes: int, repeats: int) -> float:
        """Median seconds of one contiguous host -> device copy of ``nbytes`` (the limit)."""
        gpu = self.device.torch_device
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=gpu.type != "cpu")
        dst = torch.empty(nbytes, dtype=torch.uint8, device=gpu)
        times = []
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            if gpu.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("device", nargs="?", default=None)
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--forward-dim",
        type=int,
        default=None,
        help="matrix size per layer (default: 4096 on a GPU, 256 on a CPU)",
    )
    parser.add_argument("--forward-blocks", type=int, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument(
        "--launch-us", type=float, nargs="+", default=[0, 150], help="the model's Python per layer, in us"
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile the submission of 4-block loads, then exit"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    device = select_device(args.device)
    if args.forward_dim is None:
        args.forward_dim = 256 if device.torch_device.type == "cpu" else 4096
    bench = Bench(device, 2 * max([*args.blocks, *args.forward_blocks]))
    if args.profile:
        profile(bench)
        return
    rows = []
    for blocks in args.blocks:
        mapping = bench.mapping(blocks)
        nbytes = blocks * bench.geometry.block_bytes
        for name, fn in (
            ("per layer, checked per layer", bench.per_layer_checked),
            ("per layer, checked once", bench.per_layer_once),
            ("whole job, one copy", bench.whole_job),
        ):
            submit_s, done_s = timed(lambda fn=fn, m=mapping: fn(m), bench.engine, args.repeats)
            rows.append(
                {
                    "blocks": blocks,
                    "MiB": nbytes / 2**20,
                    "how": name,
                    "submit_us": submit_s * 1e6,
                    "done_us": done_s * 1e6,
                    "GBps": nbytes / done_s / 1e9,
                }
            )
        done_s = bench.plain_copy_s(nbytes, args.repeats)
        rows.append(
            {
                "blocks": blocks,
                "MiB": nbytes / 2**20,
                "how": "one torch.copy_ (limit)",
                "submit_us": None,
                "done_us": done_s * 1e6,
                "GBps": nbytes / done_s / 1e9,
            }
        )
    forward_rows = forward_beside_load(bench, args)
    device.free_host_cache(bench.host)
    print(
        f"device {device.name} ({device.torch_device}), torch {torch.__version__}; {LAYERS} layers, "
        f"{bench.geometry.block_bytes // 2**10} KiB per block; medians of {args.repeats}"
    )
    print(f"{'blocks':>6} {'MiB':>6}  {'how':<30} {'submit (us)':>11} {'done (us)':>10} {'GB/s':>6}")
    for r in rows:
        submit = "" if r["submit_us"] is None else f"{r['submit_us']:.0f}"
        print(f"{r['blocks']:>6} {r['MiB']:>6.0f}  {r['how']:<30} {submit:>11} ", end="")
        print(f"{r['done_us']:>10.0f} {r['GBps']:>6.1f}")
    print(
        f"\na forward of {LAYERS} matrix products ({args.forward_dim}^3 each) beside a load; forward end (us)"
    )
    print(
        f"{'launch us':>9} {'blocks':>6}  "
        + "  ".join(f"{how:>26}" for how in dict.fromkeys(r["how"] for r in forward_rows))
    )
    for launch_us in args.launch_us:
        for blocks in args.forward_blocks:
            cells = [r for r in forward_rows if r["launch_us"] == launch_us and r["blocks"] == blocks]
            alone = cells[0]["end_us"]
            line = "  ".join(f"{r['end_us']:>17.0f} ({r['end_us'] / alone:4.2f}x)" for r in cells)
            print(f"{launch_us:>9.0f} {blocks:>6}  {line}")
    if args.json:
        meta = {
            "device": device.name,
            "torch": torch.__version__,
            "layers": LAYERS,
            "repeats": args.repeats,
            "forward_dim": args.forward_dim,
            "forward_blocks": args.forward_blocks,
            "launch_us": args.launch_us,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "forward": forward_rows}, f, indent=1)


def profile(bench: Bench) -> None:
    """Where the submitting thread's time goes: cProfile over 50 layer-by-layer loads."""
    import cProfile
    import pstats

    mapping = bench.mapping(4)
    for _ in range(5):
        bench.engine.wait(bench.per_layer_once(mapping))
    profiler = cProfile.Profile()
    for _ in range(50):
        profiler.enable()
        jobs = bench.per_layer_once(mapping)
        profiler.disable()
        bench.engine.wait(jobs)
    stats = pstats.Stats(profiler).strip_dirs().sort_stats("tottime")
    stats.print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)


def forward_beside_load(bench: Bench, args: argparse.Namespace) -> list[dict]:
    """Wall times from a load's submission to the end of a forward that waits per layer, per
    load size and Python launch time per layer (the engine thread's own work, holding the GIL)."""
    device, engine, host, cache = bench.device, bench.engine, bench.host, bench.cache
    n = args.forward_dim
    gpu = device.torch_device
    dtype = DTYPE if gpu.type != "cpu" else torch.float32
    x = torch.randn(n, n, device=gpu, dtype=dtype)
    weights = [torch.randn(n, n, device=gpu, dtype=dtype) for _ in range(LAYERS)]
    compute = device.current_stream()

    def sync() -> None:
        if gpu.type == "cuda":
            torch.cuda.synchronize()

    def forward(copy_of: Callable[[int], list[int]] | None, launch_s: float) -> None:
        y = x
        for i in range(LAYERS):
            if copy_of is not None:
                engine.order_after(compute, copy_of(i))
            end = time.perf_counter() + launch_s
            while time.perf_counter() < end:  # the model's Python per layer, holding the GIL
                pass
            y = torch.mm(y, weights[i])
            y = y / n**0.5

    def run(how: str, mapping: np.ndarray, launch_s: float) -> None:
        if how == "forward alone (no load)":
            forward(None, launch_s)
        elif how == "whole copy, then forward":
            engine.order_after(compute, [engine.submit_load((), host, cache, mapping)])
            forward(None, launch_s)
        else:
            out = bench.per_layer_once(mapping)  # one copy per layer, as LayerGate submits them
            forward(lambda i: [out[i]], launch_s)

    rows = []
    hows = (
        "forward alone (no load)",
        "whole copy, then forward",
        "per layer, inline",
    )
    for launch_us in args.launch_us:
        for blocks in args.forward_blocks:
            mapping = bench.mapping(blocks)
            for how in hows:
                times = []
                for _ in range(args.repeats + 2):
                    sync()
                    t0 = time.perf_counter()
                    run(how, mapping, launch_us / 1e6)
                    sync()
                    times.append(time.perf_counter() - t0)
                    failed = [r.error for r in engine.wait() if not r.success]
                    if failed:  # a failed copy is fast: its time would mean nothing
                        raise SystemExit(f"{how}: a copy failed: {failed[0]}")
                rows.append(
                    {
                        "launch_us": launch_us,
                        "blocks": blocks,
                        "how": how,
                        "end_us": statistics.median(times[2:]) * 1e6,
                    }
                )
    return rows


if __name__ == "__main__":
    main()

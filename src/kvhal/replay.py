"""``kvhal replay``: a vLLM worker's recorded trace (:mod:`kvhal.vllm.trace`) run on any device
plugin, with no vLLM: the worker side's calls in the recorded order, a stand-in forward per
layer, every loaded block and every stored host slot checked byte for byte.

The replay allocates the KV cache as the engine had it (each storage once, on the plugin's
device, each layer's tensor a view at its recorded offset and strides), then, event by event:

- ``begin`` / ``loads`` / ``stores`` / ``stats`` / ``shutdown``: the worker side's call with
  the recorded step's metadata;
- ``layer``: ``wait_for_layer_load`` of that layer, then a stand-in for its compute (a matmul
  of the model's width on the device, so copies overlap compute as they would);
- before ``stores``: the step's stored blocks are written with a pattern derived from the
  digest the recording took of them (the engine's bytes stay with the engine);
- ``collect`` / ``worker_meta`` / ``load_errors``: the worker's answers; the replay goes on
  only once every job the recording had ended by then has ended here too (the scheduler's
  later steps reuse their host slots), waiting at most ``catch_up_s``.

Checks: a load that ended here fills each block with the pattern of the digest the recording
saw (a digest no store of the trace produced cannot be checked, and is counted so); a store
leaves the pattern it was given in its host slots; each job ends as it did when recorded
(a recorded failure, one the metadata carries, fails here too). A wrong byte is named by
step, job, group, layer, block and offset.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvhal.cache import KVCache
from kvhal.device import Device
from kvhal.errors import KVHALError
from kvhal.registry import PluginRegistry
from kvhal.vllm.metadata import KVHALMetadata, LoadJob, StoreJob
from kvhal.vllm.trace import WorkerObserver, block_bytes, load, pattern, traits_from
from kvhal.vllm.trace_format import TraceError, config_from, meta_from, read_from, reader
from kvhal.vllm.worker_side import WorkerSide

#: the worker side's calls on the engine's thread, by the trace's event names
ENGINE_CALLS = ("begin", "loads", "layer", "stores", "collect", "load_errors", "worker_meta", "stats")
#: failures named at most (the count is given whole)
MAX_FAILURES = 20


@dataclass
class ReplayResult:
    """One trace replayed on one device.

    :param status: ``passed``, ``failed`` or ``not tested`` (``reason`` says why).
    :param timings_us: per worker-side call, each call's wall time (microseconds).
    :param step_us: per step, the engine thread's time in kvhal's calls (no forward, no pattern).
    """

    trace: str
    device: str
    status: str
    reason: str = ""
    steps: int = 0
    blocks_loaded: int = 0
    blocks_stored: int = 0
    blocks_unchecked: int = 0
    jobs: int = 0
    failures: list[str] = field(default_factory=list)
    failure_count: int = 0
    timings_us: dict[str, list[float]] = field(default_factory=dict)
    step_us: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        """The result as JSON: each call's median and p90 (us), the steps' median and p90."""
        calls = {
            name: {
                "calls": len(values),
                "median_us": round(statistics.median(values), 1),
                "p90_us": round(_p90(values), 1),
                "total_ms": round(sum(values) / 1e3, 2),
            }
            for name, values in self.timings_us.items()
            if values
        }
        out = dataclasses.asdict(self)
        del out["timings_us"], out["step_us"]
        out["calls"] = calls
        if self.step_us:
            out["step_median_us"] = round(statistics.median(self.step_us), 1)
            out["step_p90_us"] = round(_p90(self.step_us), 1)
        return out


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


class NotTested(Exception):
    """The trace needs what this device or this replay lacks (the reason)."""


class Stalled(Exception):
    """Jobs the recording had ended never ended here: the replay cannot go on (a failure)."""


class _Checks(WorkerObserver):
    """The replay's observer: every load's and store's bytes against the trace's digests."""

    def __init__(self, result: ReplayResult, stored: dict[int, dict[str, list[str]]], loaded: dict[int, Any]):
        self.result = result
        self.store_digests = stored  # store job -> group -> digests of its device blocks
        self.load_records = loaded  # load job -> {"ok", "digests"} as recorded
        self.contents = {d for groups in stored.values() for ds in groups.values() for d in ds}
        self.step = 0
        self.outcomes: dict[int, bool] = {}  # job -> ok, every kind, as this worker reported them
        self.answers: dict[str, list[Any]] = {"collect": [[], [], []], "load_errors": []}
        self.store_step: dict[str, int] = {}  # content digest -> the step that stored it first
        self.names: dict[int, tuple[str, ...]] = {}  # group -> its layers' names

    def fail(self, message: str) -> None:
        self.result.failure_count += 1
        if len(self.result.failures) < MAX_FAILURES:
            self.result.failures.append(message)

    def loaded(self, job: LoadJob, ok: bool, caches: Mapping[int, KVCache]) -> None:
        recorded = self.load_records.get(job.job_id)
        if not ok or recorded is None or not recorded["ok"]:  # outcomes: compared at the end
            return
        for group, digests in recorded["digests"].items():
            cache = caches[int(group)]
            ids = job.groups[int(group)][0]
            for block, content in zip(ids, digests, strict=True):
                if content not in self.contents:
                    self.result.blocks_unchecked += 1
                    continue
                self.result.blocks_loaded += 1
                self._compare(
                    block_bytes(cache, block),
                    pattern(content, cache.geometry.block_bytes),
                    cache,
                    f"step {self.step}: load job {job.job_id} (request {job.req_id}), group {group}, "
                    f"device block {block} (stored in step {self.store_step.get(content, '?')})",
                    int(group),
                )

    def store_ended(self, job: StoreJob, ok: bool, host_views: Mapping[int, KVCache]) -> None:
        if not ok:  # outcomes: compared at the end
            return
        for group, digests in self.store_digests.get(job.job_id, {}).items():
            host = host_views[int(group)]
            ids, slots = job.groups[int(group)]
            for block, slot, content in zip(ids, slots, digests, strict=True):
                self.result.blocks_stored += 1
                self._compare(
                    block_bytes(host, slot),
                    pattern(content, host.geometry.block_bytes),
                    host,
                    f"step {self.step}: store job {job.job_id} (request {job.req_id}), group {group}, "
                    f"device block {block} -> host slot {slot}",
                    int(group),
                )

    def _compare(self, actual: bytes, expected: bytes, cache: KVCache, where: str, group: int) -> None:
        if actual == expected:
            return
        differ = np.frombuffer(actual, np.uint8) != np.frombuffer(expected, np.uint8)
        first = int(np.flatnonzero(differ)[0])
        per_layer = cache.geometry.block_bytes // cache.geometry.num_layers
        layer = first // per_layer
        names = self.names.get(group, ())
        name = f" ({names[layer]})" if layer < len(names) else ""
        self.fail(
            f"{where}: layer {layer}{name}, byte {first % per_layer} of the layer's block "
            f"is 0x{actual[first]:02x}, expected 0x{expected[first]:02x}"
        )


def _dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TraceError(where, f"unknown dtype {name!r}")
    return dtype


def allocate_caches(caches: Mapping[str, Any], device: Device) -> dict[str, Any]:
    """The engine's KV cache tensors rebuilt on ``device``: each storage once, each layer a view
    at its recorded offset, shape and strides.

    :raises NotTested: the device cannot allocate them (naming what).
    """
    r = reader(caches, "caches")
    sizes = r.ints("storages")
    try:
        storages = [torch.zeros(n, dtype=torch.uint8, device=device.torch_device) for n in sizes]
    except (RuntimeError, MemoryError) as exc:
        raise NotTested(
            f"the KV cache's {sum(sizes) >> 20} MiB cannot be allocated on {device}: {exc}"
        ) from exc

    def view(spec: Any, where: str) -> torch.Tensor:
        t = reader(spec, where)
        index = t.get("storage", int)
        if not 0 <= index < len(storages):
            raise TraceError(f"{where}.storage", f"{index} names no storage (there are {len(storages)})")
        dtype = _dtype(t.get("dtype", str), f"{where}.dtype")
        itemsize = torch.empty(0, dtype=dtype).element_size()
        offset = t.get("offset_bytes", int)
        shape, stride = t.ints("shape"), t.ints("stride")
        if offset % itemsize or len(shape) != len(stride):
            raise TraceError(
                where, f"offset {offset} or strides {stride} do not fit dtype {dtype} and shape {shape}"
            )
        end = offset + itemsize * (1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True) if s))
        if min(shape, default=1) > 0 and end > sizes[index]:
            raise TraceError(where, f"reaches byte {end} of storage {index}, which has {sizes[index]}")
        out = torch.empty(0, dtype=dtype, device=device.torch_device)
        return out.set_(storages[index].untyped_storage(), offset // itemsize, shape, stride)

    layers: dict[str, Any] = {}
    for name, spec in r.get("layers", dict).items():
        where = f"caches.layers.{name}"
        if isinstance(spec, dict) and "unsupported" in spec:
            layers[name] = None
        elif isinstance(spec, dict) and "parts" in spec:
            layers[name] = tuple(view(p, f"{where}.parts[{i}]") for i, p in enumerate(spec["parts"]))
        else:
            layers[name] = view(spec, where)
    return {k: v for k, v in layers.items() if v is not None}


class _Forward:
    """A stand-in for one layer's compute: a matmul of the model's width on the device."""

    def __init__(self, device: torch.device, width: int, tokens: int) -> None:
        self.a = torch.randn(tokens, width, device=device)
        self.b = torch.randn(width, width, device=device)

    def __call__(self) -> None:
        torch.matmul(self.a, self.b)


def replay(
    path: Path | str,
    device_name: str | None = None,
    *,
    registry: PluginRegistry | None = None,
    tokens: int = 64,
    catch_up_s: float = 30.0,
) -> ReplayResult:
    """Replay the trace at ``path`` on the device plugin ``device_name`` (the auto-selected one
    if None; ``registry``: where to find it, default the installed plugins).

    :raises TraceError: a trace that is not one, truncated, altered, or of another version.
    """
    path = Path(path)
    started = time.perf_counter()
    trace = load(path)
    result = ReplayResult(trace=path.name, device=device_name or "auto", status="passed")
    try:
        _run(trace, result, device_name, registry or PluginRegistry(), tokens, catch_up_s)
    except NotTested as exc:
        result.status, result.reason = "not tested", str(exc)
    except Stalled as exc:  # its failure, naming the jobs, was recorded
        result.status, result.reason = "failed", f"{exc}: {result.failures[0] if result.failures else ''}"
    if result.status == "passed" and result.failure_count:
        result.status = "failed"
        result.reason = f"{result.failure_count} wrong: {result.failures[0]}"
    result.wall_s = round(time.perf_counter() - started, 3)
    return result


def _run(
    trace: dict[str, Any],
    result: ReplayResult,
    device_name: str | None,
    registry: PluginRegistry,
    tokens: int,
    catch_up_s: float,
) -> None:
    events = reader(trace, "").items("events")
    traits = traits_from(trace)
    stored: dict[int, dict[str, list[str]]] = {}
    loaded: dict[int, Any] = {}
    for event in events:
        name = event.value[0] if isinstance(event.value, list) and event.value else None
        if name == "stored":
            p = reader(event.value[1], event.where)
            stored[p.get("job_id", int)] = p.get("digests", dict)
        elif name == "loaded":
            p = reader(event.value[1], event.where)
            loaded[p.get("job_id", int)] = {"ok": p.get("ok", bool), "digests": p.get("digests", dict)}
    with tempfile.TemporaryDirectory(prefix="kvhal-replay-") as tiers_dir:
        config, stores = config_from(reader(trace, "").sub("config"), Path(tiers_dir))
        if stores:
            raise NotTested(
                f"the trace read and wrote the store(s) {', '.join(stores)}, which a replay cannot reach"
            )
        try:
            device = registry.select(device_name)
        except KVHALError as exc:
            raise NotTested(f"no device: {exc}") from exc
        result.device = f"{device.plugin_name} ({device.torch_device})"
        kv_caches = allocate_caches(trace["caches"], device)
        config = dataclasses.replace(config, device=device.plugin_name)
        checks = _Checks(result, stored, loaded)
        checks.names = {g.group_id: g.layer_names for g in config.groups}
        worker = WorkerSide(config, traits=traits)
        worker.observer = checks
        try:
            worker.register(kv_caches, rank=reader(trace, "").get("rank", int), device=device)
        except KVHALError as exc:
            raise NotTested(
                f"the worker side refused the trace's KV cache on {device.plugin_name}: {exc}"
            ) from exc
        # the model's KV width from a page's bytes (K and V of block_size tokens), not from the
        # view's dims: vllm-ascend's [N, H, D] blocks read as heads = block size
        g = next(iter(worker.caches.values())).geometry
        itemsize = torch.empty(0, dtype=g.dtype).element_size()
        width = max(64, g.block_bytes // g.num_layers // (2 * config.block_size * itemsize))
        forward = _Forward(device.torch_device, width, tokens)
        threads = torch.get_num_threads()
        if device.torch_device.type == "cpu":  # one core computes, the plugin's threads copy:
            torch.set_num_threads(1)  # OpenMP's spinning threads beside them take 200x longer
        try:
            _drive(worker, events, checks, result, forward, catch_up_s)
        finally:
            torch.set_num_threads(threads)
    result.jobs = len(checks.outcomes)


def _drive(
    worker: WorkerSide,
    events: list[Any],
    checks: _Checks,
    result: ReplayResult,
    forward: _Forward,
    catch_up_s: float,
) -> None:
    timings: dict[str, list[float]] = {name: [] for name in ENGINE_CALLS}
    recorded_ended: dict[int, bool] = {}  # job -> ok, as the recording's worker reported them
    recorded_answers: dict[str, list[Any]] = {"collect": [[], [], []], "load_errors": []}
    meta: KVHALMetadata | None = None
    step_us = 0.0
    reads: list[Future[Any]] = []  # the scheduler side's reads, ended before the next step

    def timed(name: str, call: Any, *args: Any) -> Any:
        nonlocal step_us
        start = time.perf_counter()
        out = call(*args)
        elapsed = (time.perf_counter() - start) * 1e6
        timings[name].append(elapsed)
        step_us += elapsed
        return out

    for event in events:
        name, payload = event.value[0], event.value[1] if len(event.value) > 1 else None
        if name == "begin":
            _wait_reads(reads, checks, catch_up_s)
            if meta is not None:
                result.step_us.append(step_us)
            step_us = 0.0
            checks.step += 1
            meta = meta_from(reader(payload, f"{event.where}[1]"))
            timed("begin", worker.begin_step, meta)
        elif meta is None and name not in ("shutdown", "stored", "loaded", "read_tier"):
            raise TraceError(event.where, f"{name!r} before the first step's metadata")
        elif name == "read_tier":  # the scheduler side's prefetch of a local tier, in-process
            reads.append(worker.read_tier(read_from(reader(payload, f"{event.where}[1]"))))
        elif name == "loads":
            timed("loads", worker.start_loads, meta)
        elif name == "layer":
            timed("layer", worker.layer, payload)
            forward()
        elif name == "stores":
            assert meta is not None
            _write_patterns(worker, meta, checks)
            timed("stores", worker.start_stores, meta)
        elif name == "collect":
            answer = reader({"finished": payload}, f"{event.where}[1]").get("finished", list)
            if len(answer) != 3:
                raise TraceError(f"{event.where}[1]", "expected [finished, failed, sent]")
            for mine, theirs in zip(recorded_answers["collect"], answer, strict=True):
                mine.extend(theirs)
            _take(checks, collect=timed("collect", worker.collect))
        elif name == "load_errors":
            recorded_answers["load_errors"].extend(reader({"e": payload}, event.where).ints("e"))
            _take(checks, errors=timed("load_errors", worker.take_load_errors))
        elif name == "worker_meta":
            if payload:
                answer = reader(payload, f"{event.where}[1]")
                recorded_ended.update(dict.fromkeys(answer.ints("ok"), True))
                recorded_ended.update(dict.fromkeys(answer.ints("failed"), False))
            _take(checks, meta=timed("worker_meta", worker.worker_meta))
            _catch_up(worker, checks, recorded_ended, catch_up_s)
        elif name == "stats":
            timed("stats", worker.take_stats, bool(payload))
        elif name == "shutdown":
            worker.shutdown()
        elif name not in ("stored", "loaded"):
            raise TraceError(f"{event.where}[0]", f"unknown call {name!r}")
    if meta is not None:
        result.step_us.append(step_us)
    result.steps = checks.step
    result.timings_us = {k: v for k, v in timings.items() if v}
    _compare_outcomes(checks, recorded_ended, recorded_answers)


def _take(checks: _Checks, collect: Any = None, errors: Any = None, meta: Any = None) -> None:
    """Keep what the worker answered (to compare with the recording's answers at the end)."""
    if collect is not None:
        for mine, theirs in zip(checks.answers["collect"], collect, strict=True):
            mine.extend(theirs)
    if errors:
        checks.answers["load_errors"].extend(errors)
    if meta is not None:
        checks.outcomes.update(dict.fromkeys(meta.succeeded, True))
        checks.outcomes.update(dict.fromkeys(meta.failed, False))


def _compare_outcomes(checks: _Checks, recorded: dict[int, bool], answers: dict[str, list[Any]]) -> None:
    """Every job ended here as it did when recorded; vLLM was told the same, in all."""
    for job, ok in sorted(recorded.items()):
        mine = checks.outcomes.get(job)
        if mine is not None and mine != ok:
            here, then = ("succeeded" if x else "failed" for x in (mine, ok))
            checks.fail(f"job {job} {here} here, {then} when recorded")
    told = ("finished loads", "failed loads", "requests sent")
    for what, mine, theirs in zip(told, checks.answers["collect"], answers["collect"], strict=True):
        if sorted(mine) != sorted(theirs):
            extra, missing = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
            checks.fail(
                f"vLLM was told other {what}: {extra[:8]} only here, {missing[:8]} only when recorded"
            )
    if sorted(checks.answers["load_errors"]) != sorted(answers["load_errors"]):
        checks.fail(
            f"vLLM was told of {len(checks.answers['load_errors'])} blocks loads failed to fill, "
            f"{len(answers['load_errors'])} when recorded"
        )


def _wait_reads(reads: list[Future[Any]], checks: _Checks, catch_up_s: float) -> None:
    """The scheduler side's reads end before the next step (the recording's planned on them)."""
    for future in reads:
        try:
            future.result(timeout=catch_up_s)
        except Exception as exc:  # a failed read fails its loads, which the checks see
            checks.fail(f"step {checks.step}: a read of a tier below raised {type(exc).__name__}: {exc}")
    reads.clear()


def _write_patterns(worker: WorkerSide, meta: KVHALMetadata, checks: _Checks) -> None:
    """The forward's output, as the recording's digests stand for it: the stored blocks."""
    for job in meta.stores:
        recorded = checks.store_digests.get(job.job_id)
        if recorded is None:
            continue
        for group, digests in recorded.items():
            cache = worker.caches[int(group)]
            ids = job.groups[int(group)][0]
            for block, content in zip(ids, digests, strict=True):
                checks.store_step.setdefault(content, checks.step)
                _put_block(cache, block, pattern(content, cache.geometry.block_bytes))


def _put_block(cache: KVCache, block: int, data: bytes) -> None:
    """Write ``data`` (as :func:`~kvhal.vllm.trace.block_bytes` reads it) into ``block``."""
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    at = 0
    for layer in cache.layers:
        for part in layer:
            view = part[block]
            n = view.numel() * view.element_size()
            chunk = src[at : at + n].view(view.dtype).reshape(view.shape)
            view.copy_(chunk.to(view.device, non_blocking=False))
            at += n


def _catch_up(worker: WorkerSide, checks: _Checks, recorded: dict[int, bool], catch_up_s: float) -> None:
    """Wait until every job the recording had ended by now has ended here (polling the worker,
    as vLLM's next steps would): the trace's later steps reuse their host slots."""
    deadline = time.monotonic() + catch_up_s
    while True:
        missing = [job for job in recorded if job not in checks.outcomes]
        if not missing:
            return
        if time.monotonic() > deadline:
            checks.fail(
                f"step {checks.step}: jobs {sorted(missing)[:8]} had not ended {catch_up_s:.0f} s after "
                "the step in which the recording's worker reported them ended"
            )
            raise Stalled(f"the replay stalled at step {checks.step}")
        time.sleep(0.0005)
        _take(checks, collect=worker.collect(), errors=worker.take_load_errors(), meta=worker.worker_meta())

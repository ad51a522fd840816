"""The steps a scenario's engine runs (see :mod:`kvhal.vllm.testing.runner`): generate,
reset, settle, corrupt the host tier, read kvhal's state and vLLM's metrics, listen for KV
events, hand over to the test, count page faults per thread."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch


def generate(llm: Any, step: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0, max_tokens=step.get("max_tokens", 8), ignore_eos=True, detokenize=False
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in step["prompts"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "outputs": [
            {
                "tokens": list(out.outputs[0].token_ids),
                "num_cached_tokens": out.num_cached_tokens,
                "kvhal_loaded_tokens": (out.kv_transfer_params or {}).get("kvhal_loaded_tokens"),
            }
            for out in outputs
        ],
    }


def reset(llm: Any, step: dict) -> dict:
    """``reset_prefix_cache``; with ``drain`` (default) retried while the engine frees
    blocks that finished requests keep for their stores in flight (kvhal holds them)."""
    from vllm.v1.engine.core_client import InprocClient

    connector = step.get("connector", False)
    ok = llm.reset_prefix_cache(reset_connector=connector)
    attempts, deadline = 1, time.monotonic() + step.get("drain_timeout", 60)
    while not ok and step.get("drain", True) and time.monotonic() < deadline:
        if isinstance(llm.llm_engine.engine_core, InprocClient):
            if not llm.llm_engine.engine_core.engine_core.scheduler.has_requests():
                break  # nothing left that stepping could free
            llm.llm_engine.step()  # nothing steps a single-process engine between generate() calls
        else:
            time.sleep(0.01)  # the engine core process keeps stepping on its own
        ok = llm.reset_prefix_cache(reset_connector=connector)
        attempts += 1
    return {"ok": ok, "attempts": attempts}


def settle(llm: Any, step: dict) -> dict:
    """Step the engine until kvhal has nothing in flight (stores to the host tier, writes to
    the tiers below and to the store), within ``timeout``: what a fixed sleep only hoped for.
    Needs the scheduler in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    connector = scheduler.connector.scheduler_side
    start = time.monotonic()
    steps = 0
    # a finished store plans its writes below; they become jobs in the next step
    while connector.has_jobs_in_flight() or connector.chain.has_planned_writes():
        if time.monotonic() - start > step.get("timeout", 60):
            raise TimeoutError(f"settle: kvhal still had jobs in flight after {step.get('timeout', 60)} s")
        if scheduler.has_requests():
            llm.llm_engine.step()
        else:  # the scheduler hears of finished jobs in a step: a one-token prompt makes one
            generate(llm, {"prompts": [[1]], "max_tokens": 1})
        steps += 1
        time.sleep(0.005)
    return {"seconds": time.monotonic() - start, "steps": steps}


def write_file(step: dict) -> dict:
    """Write ``text`` to ``path`` whole (a temporary name, then renamed): a test's switch
    that the engine's processes read (the e2e fault plugin's modes, say)."""
    tmp = f"{step['path']}.tmp"
    with open(tmp, "w") as f:
        f.write(step["text"])
    os.replace(tmp, step["path"])
    return {}


def corrupt_host(seed: int) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker_side
    generator = torch.Generator().manual_seed(seed)
    buffers = {id(view.storage[0]): view.storage[0] for view in worker.host_views.values()}
    for buffer in buffers.values():
        raw = buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return {"bytes": sum(b.numel() for b in buffers.values())}


def kvhal_device() -> dict | None:
    """The device plugin the worker-side connector selected (single-process engines only)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    worker = get_kv_transfer_group().worker_side
    if worker is None or worker.device is None:
        return None
    return {"plugin": worker.device.plugin_name, "distribution": worker.device.distribution}


def kvhal_state(llm: Any) -> dict:
    """What kvhal holds and has in flight, on both sides (single-process engines only)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    worker = get_kv_transfer_group().worker_side
    manager = scheduler.manager
    return {
        "slots": manager.num_slots,
        "free_slots": manager.num_free,
        "blocks": len(manager),
        "storing": manager.num_storing,
        "scheduler_jobs_in_flight": scheduler.has_jobs_in_flight(),
        "worker_jobs_in_flight": worker.jobs_in_flight,
        "worker_busy_seconds": worker.busy_seconds,
        "lower_blocks": sum(len(t.index) for t in scheduler.chain.local) if scheduler.chain.local else None,
    }


def metrics(llm: Any, step: dict) -> dict:
    prefixes = tuple(
        step.get("prefixes", ("vllm:kvhal_", "vllm:external_prefix_cache", "vllm:prompt_tokens"))
    )
    found = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(prefixes):
            if metric.name.startswith("vllm:kvhal_") and type(metric).__name__ != "Counter":
                continue  # kvhal's histograms and gauges: a step's readers diff counters by tier
            value = getattr(metric, "value", None)
            if value is None:
                value = getattr(metric, "values", None)
            label = ",".join(
                f"{k}={v}" for k, v in sorted(metric.labels.items()) if k not in ("engine", "model_name")
            )
            found[metric.name + (f"{{{label}}}" if label else "")] = value
    return {"metrics": found}


class EventListener:
    """Subscribes to vLLM's ZMQ KV-event publisher and counts events by medium and type."""

    def __init__(self, port: int) -> None:
        import threading

        import zmq

        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(f"tcp://127.0.0.1:{port}")
        self.batches: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            if self.socket.poll(50):
                self.batches.append(self.socket.recv_multipart()[-1])

    def summary(self, settle: float) -> dict:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        time.sleep(settle)  # the publisher sends from its own thread
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        counts: dict[str, int] = {}
        for payload in list(self.batches):
            for event in decoder.decode(payload).events:
                key = f"{type(event).__name__}:{getattr(event, 'medium', None)}"
                counts[key] = counts.get(key, 0) + len(getattr(event, "block_hashes", ()) or [None])
        return {"events": counts}


def decode_kv_batch(payload: bytes) -> list[dict]:
    """The events of one published ``KVEventBatch``, decoded with msgpack alone, as a router
    (llm-d's indexer) decodes them: a batch is an array ``[ts, events, dp_rank?]``, an event a
    map whose ``type`` names its class (0.32 and 0.27.1; older vLLMs sent arrays, tag first)."""
    import msgpack

    batch = msgpack.unpackb(payload, raw=False)
    return [event if isinstance(event, dict) else {"type": event[0]} for event in batch[1]]


def tier_events(llm: Any, listener: EventListener, step: dict) -> dict:
    """The subscriber's view (the KV events received: which tier holds which block, by
    ``medium/locality/ownership``) against kvhal's own index: the host tier's manager, each
    local tier's index, each store asked. Needs ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``
    (a key is the block hash's bytes). Per tier: the blocks in the view, those kvhal holds
    of them, kvhal's count, and the blocks removed."""
    from kvhal.vllm.keys import offload_key

    time.sleep(step.get("settle", 1.0))  # the publisher sends from its own thread
    held: dict[str, set[bytes]] = {}
    removed: dict[str, int] = {}
    for payload in list(listener.batches):
        for event in decode_kv_batch(payload):
            if event["type"] not in ("BlockStored", "BlockRemoved"):
                continue
            where = "/".join(str(event.get(f)) for f in ("medium", "locality", "ownership"))
            keys = {offload_key(h, event.get("group_idx") or 0) for h in event["block_hashes"]}
            if event["type"] == "BlockStored":
                held.setdefault(where, set()).update(keys)
            else:
                held.setdefault(where, set()).difference_update(keys)
                removed[where] = removed.get(where, 0) + len(keys)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    out: dict[str, dict] = {}
    for where, keys in held.items():
        medium, locality, ownership = where.split("/")
        if medium not in ("CPU", "STORAGE"):  # vLLM's own GPU blocks
            continue
        if medium == "CPU":
            manager = scheduler.manager
            holds = [manager.state(k).name == "READY" for k in keys]
            count = len(manager)
        else:
            tiers = [t for t in scheduler.tiers if (t.shared == (locality == "REMOTE"))]
            tier = next((t for t in tiers if t.name == ownership), tiers[0])  # 0.27.1: no ownership
            if tier.shared:  # a store: asked; what it holds is what engines wrote
                holds, count = tier.store.exist(sorted(keys)).result(timeout=30), None
            else:
                holds = [tier.chain.index.state(k).name == "READY" for k in keys]
                count = len(tier.chain.index)
        out[where] = {"view": len(keys), "held": sum(holds), "index": count, "removed": removed.get(where, 0)}
    return {"tiers": out}


def handshake(step: dict) -> dict:
    """Create ``step["signal"]``, then wait until ``step["wait"]`` exists (the test's answer)."""
    from pathlib import Path

    Path(step["signal"]).touch()
    deadline = time.monotonic() + step.get("timeout", 120)
    while not Path(step["wait"]).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"handshake: no {step['wait']} after {step.get('timeout', 120)} s")
        time.sleep(0.05)
    return {}


def threads() -> dict:
    """Per thread of this process (by its Python name; the main thread as ``main:NAME``; a
    native thread, which Python does not know, as ``native:`` and its kernel name, which it
    inherits from the thread that started it unless it names itself): minor and major page
    faults, user and system CPU seconds, from ``/proc/self/task/*/stat`` (Linux). Threads of
    one name are summed."""
    import threading

    tick = os.sysconf("SC_CLK_TCK")
    # Python does not name its threads for the kernel: take their names from threading
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    threads: dict[str, dict[str, float]] = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                text = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = python_names.get(int(task)) or f"native:{text[text.index('(') + 1 : text.rindex(')')]}"
        if int(task) == os.getpid():  # the engine's (and the model's) thread
            name = f"main:{name}"
        fields = text[text.rindex(")") + 2 :].split()
        # after the name: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
        counts = {
            "minflt": int(fields[7]),
            "majflt": int(fields[9]),
            "utime_s": int(fields[11]) / tick,
            "stime_s": int(fields[12]) / tick,
            "count": 1,
        }
        mine = threads.setdefault(name, dict.fromkeys(counts, 0))
        for key, value in counts.items():
            mine[key] += value
    return {"threads": threads}


def serve_jobs(folder: str, timeout: float, handle: Callable[[dict], dict], poll_s: float = 0.005) -> int:
    """Serve jobs handed over in ``folder``: wait for ``job-K.json``, write ``handle(job)`` to
    ``result-K.json``; ``{"stop": true}`` ends (the number of jobs served). Files are written
    whole (a temporary name, then renamed), here and by whoever hands the jobs out; ``ready``
    says the engine is up. No job within ``timeout`` is an error (its giver is gone)."""
    from pathlib import Path

    where = Path(folder)
    (where / "ready").touch()
    count = 0
    while True:
        job_path = where / f"job-{count}.json"
        deadline = time.monotonic() + timeout
        while not job_path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {job_path} after {timeout} s")
            time.sleep(poll_s)
        job = json.loads(job_path.read_text())
        if job.get("stop"):
            return count
        tmp = where / f".result-{count}.tmp"
        tmp.write_text(json.dumps(handle(job)))
        tmp.rename(where / f"result-{count}.json")
        count += 1

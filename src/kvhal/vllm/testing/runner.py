"""Run a scenario on a real vLLM engine: ``python -m kvhal.vllm.testing.runner SPEC.json OUT.json``.

Each engine gets a fresh process (vLLM changes torch threads, environment and
seeds of the process it runs in, and keeps process-global connector state),
so tests, the demo and ``kvhal bench e2e`` describe what to do in a JSON spec
(see :mod:`kvhal.testing.scenario`) and read back a JSON result.

Steps: ``generate`` (prompts as token ids; records tokens, timing, cached and
kvhal-loaded tokens), ``reset`` (vLLM's prefix cache, optionally kvhal's; retried while
finished requests' blocks wait for their stores, unless ``drain`` is false),
``corrupt_host`` (overwrite kvhal's host tier with noise: the negative
control), ``kvhal_state`` (what kvhal holds and has in flight; both
single-process engines only), ``metrics`` (``LLM.get_metrics()``),
``kv_events`` (KV events received from vLLM's ZMQ publisher, by type and
medium; needs ``kv_events_port`` in the spec), ``sleep`` (``seconds``) and
``kill`` (SIGKILL of the engine's own process: a crash), ``threads`` (page faults and CPU
time per thread of the engine's process, so far), ``chat`` (a multi-turn workload:
each round's prompt is the conversation so far plus a new turn, served round-robin with a
few requests in flight; per-request TTFT and logprobs, metrics after each round),
``chat_jobs`` (serve ``chat`` jobs handed over in files until told to stop, so that two
live engines can take turns: ``kvhal bench chat``'s shared configuration) and ``serve``
(any steps handed over in files: one engine for many tests).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch

#: Engine arguments that worked on these 2-core machines (../shared/docs/vllm-cpu.md).
ENGINE_DEFAULTS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "dtype": "bfloat16",
    "max_model_len": 512,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "seed": 0,
    "block_size": 32,
    "kv_cache_memory_bytes": 64 << 20,
}


def kvhal_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    """The ``kv_transfer_config`` a user writes to turn kvhal on."""
    return {
        "kv_connector": "KVHALConnector",
        "kv_connector_module_path": "kvhal.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def api_server_command(
    model: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    kvhal: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    python: str | None = None,
) -> list[str]:
    """The command that serves ``model`` on vLLM's OpenAI-compatible server, with kvhal
    when ``kvhal`` (``kv_connector_extra_config``) is given.

    It runs ``python -m vllm.entrypoints.openai.api_server``, not the ``vllm``
    console script: under vllm-cpu that script fails (``PackageNotFoundError:
    vllm``, its distribution is named ``vllm-cpu``). Engine arguments are
    :data:`ENGINE_DEFAULTS` updated by ``engine``, written as flags (``True`` ->
    ``--name``, ``False`` -> ``--no-name``, dicts as JSON).
    """
    args = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    args += ["--host", host, "--port", str(port)]
    for name, value in {**ENGINE_DEFAULTS, **(engine or {})}.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + flag[2:])
        elif value is not None:
            args += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    if kvhal is not None:
        args += ["--kv-transfer-config", json.dumps(kvhal_transfer_config(kvhal))]
    return args


def _generate(llm: Any, step: dict) -> dict:
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


def _reset(llm: Any, step: dict) -> dict:
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


def _corrupt_host(seed: int) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker_side
    generator = torch.Generator().manual_seed(seed)
    buffers = {id(view.storage[0]): view.storage[0] for view in worker.host_views.values()}
    for buffer in buffers.values():
        raw = buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return {"bytes": sum(b.numel() for b in buffers.values())}


def _kvhal_device() -> dict | None:
    """The device plugin the worker-side connector selected (single-process engines only)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    worker = get_kv_transfer_group().worker_side
    if worker is None or worker.device is None:
        return None
    return {"plugin": worker.device.plugin_name, "distribution": worker.device.distribution}


def _kvhal_state(llm: Any) -> dict:
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
        "lower_blocks": len(scheduler.chain.lower) if scheduler.chain.lower is not None else None,
    }


def _metrics(llm: Any, step: dict) -> dict:
    prefixes = tuple(
        step.get("prefixes", ("vllm:kvhal_", "vllm:external_prefix_cache", "vllm:prompt_tokens"))
    )
    found = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(prefixes):
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


def _handshake(step: dict) -> dict:
    """Create ``step["signal"]``, then wait until ``step["wait"]`` exists (the test's answer)."""
    from pathlib import Path

    Path(step["signal"]).touch()
    deadline = time.monotonic() + step.get("timeout", 120)
    while not Path(step["wait"]).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"handshake: no {step['wait']} after {step.get('timeout', 120)} s")
        time.sleep(0.05)
    return {}


def _chat(llm: Any, step: dict) -> dict:
    """A multi-turn chat workload (``kvhal bench chat``), driven through ``LLMEngine.step``.

    ``histories``: each user's conversation so far (token ids); ``turns``: per round, each
    user's new turn. Round ``r``'s prompt is the history plus the turn; the history then
    becomes that prompt plus the output (or plus ``answers[r][i]``, when given). Users are
    served round-robin (list order), at most ``inflight`` requests at once; a round ends
    when all of its requests have. TTFT is the wall time from ``add_request`` to the end of
    the engine step whose output first holds a token (steps are synchronous in a
    single-process engine), beside vLLM's own ``first_token_latency``
    (``disable_log_stats=False``). ``trace`` also records every step's wall time and
    scheduled tokens (single-process engines only).
    """
    from collections import deque

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    top = step.get("logprobs", 2)
    params = SamplingParams(
        temperature=0,
        max_tokens=step.get("max_tokens", 32),
        ignore_eos=True,
        detokenize=False,
        logprobs=top or None,
    )
    histories = [list(h) for h in step["histories"]]
    answers = step.get("answers")
    users = step.get("users", list(range(len(histories))))
    tag = step.get("tag", "chat")
    limit = max(1, step.get("inflight", 4))
    trace: list[dict] | None = [] if step.get("trace") else None
    # the scheduler says which steps computed: steps are counted only where it can be read
    # (a single-process engine); elsewhere steps_to_first_token is None
    from vllm.v1.engine.core_client import InprocClient

    scheduler = None
    if isinstance(engine.engine_core, InprocClient):
        _trace_schedules(llm)
        scheduler = engine.engine_core.engine_core.scheduler
    rounds = []
    steps_taken = 0
    before_all = _metrics(llm, {})["metrics"] if step.get("metrics", True) else None
    for r, turns in enumerate(step["turns"]):
        queue = deque(range(len(histories)))
        live: dict[str, dict] = {}
        done: dict[int, dict] = {}
        round_start = time.perf_counter()
        round_steps: list[dict] = []
        while queue or live:
            while queue and len(live) < limit:
                i = queue.popleft()
                prompt = histories[i] + list(turns[i])
                rid = f"{tag}-r{r}-u{users[i]}"
                start = time.perf_counter()
                engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
                live[rid] = {"index": i, "prompt": prompt, "start": start, "added_step": steps_taken}
            before = time.perf_counter()
            scheduled = None
            if scheduler is not None and trace is not None:
                waiting_remote = sum(
                    1 for q in scheduler.requests.values() if q.status.name == "WAITING_FOR_REMOTE_KVS"
                )
            outputs = engine.step()
            now = time.perf_counter()
            if scheduler is not None:
                scheduled = getattr(scheduler, "_kvhal_chat_last", None)
            # a step that scheduled nothing (every request parked, loading) returns at once:
            # count the steps that computed, where the scheduler says so
            if scheduled is None or scheduled > 0:
                steps_taken += 1
            # steps that scheduled nothing (requests parked, loading) spin by the thousand:
            # the trace keeps the steps that computed
            if trace is not None and (scheduled is None or scheduled > 0 or outputs):
                round_steps.append(
                    {
                        "start_s": before - round_start,
                        "seconds": now - before,
                        "scheduled_tokens": scheduled,
                        "waiting_for_remote_kvs": waiting_remote if scheduler is not None else None,
                        "first_tokens": [],
                    }
                )
            for out in outputs:
                state = live.get(out.request_id)
                if state is None:
                    continue
                tokens = out.outputs[0].token_ids if out.outputs else []
                if "first" not in state and len(tokens) > 0:
                    state["first"] = now
                    state["first_step"] = steps_taken
                    state["first_step_seconds"] = now - before
                    if trace is not None and round_steps:
                        round_steps[-1]["first_tokens"].append(users[state["index"]])
                if not out.finished:
                    continue
                completion = out.outputs[0]
                chosen, best = [], []
                for token, entry in zip(completion.token_ids, completion.logprobs or [], strict=False):
                    ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)
                    chosen.append(entry[token].logprob if token in entry else None)
                    best.append([[t, lp.logprob] for t, lp in ranked[: max(top, 1)]])
                stats = getattr(out, "metrics", None)
                vllm_times = {}
                if stats is not None:
                    vllm_times = {
                        "vllm_ttft_s": stats.first_token_latency or None,
                        "queued_to_scheduled_s": (stats.scheduled_ts - stats.queued_ts)
                        if stats.scheduled_ts and stats.queued_ts
                        else None,
                        "scheduled_to_first_token_s": (stats.first_token_ts - stats.scheduled_ts)
                        if stats.first_token_ts and stats.scheduled_ts
                        else None,
                    }
                i = state["index"]
                # with ``answers`` (a reference run's outputs), every run sees the same prompts
                answer = answers[r][i] if answers is not None else completion.token_ids
                histories[i] = state["prompt"] + list(answer)
                done[i] = {
                    "user": users[i],
                    "prompt_tokens": len(state["prompt"]),
                    "tokens": list(completion.token_ids),
                    "ttft_s": state["first"] - state["start"],
                    "seconds": now - state["start"],
                    "steps_to_first_token": state["first_step"] - state["added_step"]
                    if scheduler is not None
                    else None,
                    "first_token_step_s": state["first_step_seconds"],
                    "num_cached_tokens": out.num_cached_tokens,
                    "kvhal_loaded_tokens": (out.kv_transfer_params or {}).get("kvhal_loaded_tokens"),
                    "logprobs": chosen,
                    "top_logprobs": best,
                    **vllm_times,
                }
                del live[out.request_id]
        record: dict[str, Any] = {
            "round": r,
            "seconds": time.perf_counter() - round_start,
            "requests": [done[i] for i in range(len(histories))],
            "load_avg": os.getloadavg(),
        }
        if step.get("metrics", True):
            record["metrics"] = _metrics(llm, {})["metrics"]
        if trace is not None:
            record["steps"] = round_steps
        rounds.append(record)
    return {"rounds": rounds, "histories": histories, "metrics_before": before_all}


def _trace_schedules(llm: Any) -> None:
    """Keep the last schedule's scheduled-token count on the scheduler (``chat``'s trace)."""
    from vllm.v1.engine.core_client import InprocClient

    if not isinstance(llm.llm_engine.engine_core, InprocClient):
        return
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    if getattr(scheduler, "_kvhal_chat_traced", False):
        return
    schedule = scheduler.schedule

    def traced(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        scheduler._kvhal_chat_last = output.total_num_scheduled_tokens
        return output

    scheduler.schedule = traced
    scheduler._kvhal_chat_traced = True


def _drain(llm: Any, step: dict) -> None:
    """A few engine steps and a pause: stores that finished start their writes below (a
    single-process engine steps only inside ``generate``), and the writes land."""
    prompt = step.get("drain_prompt")
    if prompt:
        _generate(llm, {"prompts": [prompt], "max_tokens": step.get("drain_tokens", 4)})
    time.sleep(step.get("settle", 0))


def _chat_jobs(llm: Any, step: dict) -> dict:
    """Serve ``chat`` jobs from ``folder``: wait for ``job-K.json``, run its ``chat`` step
    (then ``_drain``), write ``result-K.json``; ``{"stop": true}`` ends. Files are written
    whole (a temporary name, then renamed), by this engine and by whoever hands out jobs."""
    from pathlib import Path

    folder = Path(step["folder"])
    timeout = step.get("timeout", 1800)
    (folder / "ready").touch()
    count = 0
    while True:
        job_path = folder / f"job-{count}.json"
        deadline = time.monotonic() + timeout
        while not job_path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"chat_jobs: no {job_path} after {timeout} s")
            time.sleep(0.01)
        job = json.loads(job_path.read_text())
        if job.get("stop"):
            break
        result = _chat(llm, job["chat"])
        _drain(llm, job)
        result["load_avg_after_drain"] = os.getloadavg()
        tmp = folder / f".result-{count}.tmp"
        tmp.write_text(json.dumps(result))
        tmp.rename(folder / f"result-{count}.json")
        count += 1
    return {"jobs": count}


def _threads() -> dict:
    """Per thread of this process (by its Python name, else the kernel's; the main thread as
    ``main:NAME``): minor and major page faults, user and system CPU seconds, from
    ``/proc/self/task/*/stat`` (Linux). Threads of one name are summed."""
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
        name = python_names.get(int(task)) or text[text.index("(") + 1 : text.rindex(")")]
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


def run(spec: dict) -> dict:
    from vllm import LLM

    engine = {**ENGINE_DEFAULTS, **spec.get("engine", {})}
    listener = None
    if spec.get("kv_events_port"):
        port = spec["kv_events_port"]
        engine["kv_events_config"] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
        }
        listener = EventListener(port)
    if spec.get("kvhal") is not None:
        engine["kv_transfer_config"] = kvhal_transfer_config(spec["kvhal"])
    start = time.perf_counter()
    llm = LLM(model=spec["model"], **engine)
    result: dict[str, Any] = {"engine_start_seconds": time.perf_counter() - start, "steps": []}
    result["kvhal_device"] = _kvhal_device() if spec.get("kvhal") is not None else None
    for step in spec["steps"]:
        # serve: steps handed over in files, until told to stop
        record = _serve(llm, listener, step) if step["op"] == "serve" else _step(llm, listener, step)
        result["steps"].append({"op": step["op"], "name": step.get("name", step["op"]), **record})
    return result


def _step(llm: Any, listener: EventListener | None, step: dict) -> dict:
    """Run one step; its record."""
    op = step["op"]
    if op == "generate":
        return _generate(llm, step)
    if op == "reset":
        return _reset(llm, step)
    if op == "corrupt_host":
        return _corrupt_host(step.get("seed", 0))
    if op == "metrics":
        return _metrics(llm, step)
    if op == "kvhal_state":
        return _kvhal_state(llm)
    if op == "threads":  # page faults and CPU time per thread, so far
        return _threads()
    if op == "sleep":  # lets copies and tier writes in flight go on
        time.sleep(step["seconds"])
        return {}
    if op == "handshake":  # the test acts outside (stops a server, say) while the engine lives
        return _handshake(step)
    if op == "kill":  # a crash: SIGKILL, nothing flushed or shut down
        os.kill(os.getpid(), signal.SIGKILL)
    if op == "chat":  # a multi-turn workload (kvhal bench chat)
        return _chat(llm, step)
    if op == "chat_jobs":  # chat jobs handed over in files (two engines taking turns)
        return _chat_jobs(llm, step)
    if op == "kv_events":
        assert listener is not None, "kv_events needs kv_events_port in the spec"
        return listener.summary(step.get("settle", 1.0))
    raise ValueError(f"unknown step op {op!r}")


def _serve(llm: Any, listener: EventListener | None, step: dict) -> dict:
    """Serve jobs from ``folder`` (one engine for many tests: see
    :class:`kvhal.testing.scenario.ServedEngine`): wait for ``job-K.json`` (``{"steps":
    [...]}``), run its steps, write ``result-K.json`` (``{"steps": [records]}``, or
    ``{"error": ...}`` when a step raised); ``{"stop": true}`` ends. Files are written whole
    (a temporary name, then renamed)."""
    import traceback
    from pathlib import Path

    folder = Path(step["folder"])
    timeout = step.get("timeout", 3600)
    (folder / "ready").touch()
    count = 0
    while True:
        job_path = folder / f"job-{count}.json"
        deadline = time.monotonic() + timeout
        while not job_path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"serve: no {job_path} after {timeout} s")
            time.sleep(0.005)
        job = json.loads(job_path.read_text())
        if job.get("stop"):
            break
        try:
            answer: dict[str, Any] = {
                "steps": [
                    {"op": s["op"], "name": s.get("name", s["op"]), **_step(llm, listener, s)}
                    for s in job["steps"]
                ]
            }
        except Exception:
            answer = {"error": traceback.format_exc()}
        tmp = folder / f".result-{count}.tmp"
        tmp.write_text(json.dumps(answer))
        tmp.rename(folder / f"result-{count}.json")
        count += 1
    return {"jobs": count}


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    result = run(spec)
    result["pid"] = os.getpid()
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

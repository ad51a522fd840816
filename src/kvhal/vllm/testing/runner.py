"""Run a scenario on a real vLLM engine: ``python -m kvhal.vllm.testing.runner SPEC.json OUT.json``.

Each engine gets a fresh process (vLLM changes torch threads, environment and
seeds of the process it runs in, and keeps process-global connector state),
so tests, the demo and ``kvhal bench e2e`` describe what to do in a JSON spec
(see :mod:`kvhal.testing.scenario`) and read back a JSON result.

Steps: ``generate`` (prompts as token ids; records tokens, timing, cached and
kvhal-loaded tokens), ``reset`` (vLLM's prefix cache, optionally kvhal's; retried while
finished requests' blocks wait for their stores, unless ``drain`` is false),
``corrupt_host`` (overwrite kvhal's host tier with noise: the negative
control), ``settle`` (step until kvhal has nothing in flight), ``write_file``, ``kvhal_state`` (what kvhal
holds and has in flight; both single-process engines only), ``metrics`` (``LLM.get_metrics()``),
``kv_events`` (KV events received from vLLM's ZMQ publisher, by type and
medium; needs ``kv_events_port`` in the spec), ``tier_events`` (those events' view of every
tier against kvhal's own index), ``sleep`` (``seconds``) and
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

from kvhal.vllm.testing.chat_steps import chat, chat_jobs
from kvhal.vllm.testing.steps import (
    EventListener,
    corrupt_host,
    generate,
    handshake,
    kvhal_device,
    kvhal_state,
    metrics,
    reset,
    serve_jobs,
    settle,
    threads,
    tier_events,
    write_file,
)
from kvhal.vllm.versions import none_hash_is_random

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
    result["kvhal_device"] = kvhal_device() if spec.get("kvhal") is not None else None
    for step in spec["steps"]:
        # serve: steps handed over in files, until told to stop
        record = _serve(llm, listener, step) if step["op"] == "serve" else _step(llm, listener, step)
        result["steps"].append({"op": step["op"], "name": step.get("name", step["op"]), **record})
    return result


def _step(llm: Any, listener: EventListener | None, step: dict) -> dict:
    """Run one step; its record."""
    op = step["op"]
    if op == "generate":
        return generate(llm, step)
    if op == "reset":
        return reset(llm, step)
    if op == "corrupt_host":
        return corrupt_host(step.get("seed", 0))
    if op == "settle":  # until kvhal's stores and writes below have landed
        return settle(llm, step)
    if op == "write_file":  # a switch the test set up (fault modes, say)
        return write_file(step)
    if op == "metrics":
        return metrics(llm, step)
    if op == "kvhal_state":
        return kvhal_state(llm)
    if op == "threads":  # page faults and CPU time per thread, so far
        return threads()
    if op == "sleep":  # lets copies and tier writes in flight go on
        time.sleep(step["seconds"])
        return {}
    if op == "handshake":  # the test acts outside (stops a server, say) while the engine lives
        return handshake(step)
    if op == "kill":  # a crash: SIGKILL, nothing flushed or shut down
        os.kill(os.getpid(), signal.SIGKILL)
    if op == "chat":  # a multi-turn workload (kvhal bench chat)
        return chat(llm, step)
    if op == "chat_jobs":  # chat jobs handed over in files (two engines taking turns)
        return chat_jobs(llm, step)
    if op == "kv_events":
        assert listener is not None, "kv_events needs kv_events_port in the spec"
        return listener.summary(step.get("settle", 1.0))
    if op == "tier_events":  # the events' view of every tier against kvhal's index
        assert listener is not None, "tier_events needs kv_events_port in the spec"
        return tier_events(llm, listener, step)
    raise ValueError(f"unknown step op {op!r}")


def _serve(llm: Any, listener: EventListener | None, step: dict) -> dict:
    """Serve jobs from ``folder`` (one engine for many tests: see
    :class:`kvhal.testing.scenario.ServedEngine`): each job's ``steps`` run, their records
    answered (``{"steps": [...]}``, or ``{"error": TRACEBACK}`` when a step raised)."""
    import traceback

    def handle(job: dict) -> dict:
        try:
            return {
                "steps": [
                    {"op": s["op"], "name": s.get("name", s["op"]), **_step(llm, listener, s)}
                    for s in job["steps"]
                ]
            }
        except Exception:
            return {"error": traceback.format_exc()}

    return {"jobs": serve_jobs(step["folder"], step.get("timeout", 3600), handle)}


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    if none_hash_is_random("sha256"):
        # vLLM 0.27.1 seeds block hashes at random per process unless PYTHONHASHSEED is set
        # (then restarted and fleet engines never share a block): its users set it, so do we.
        os.environ.setdefault("PYTHONHASHSEED", "0")
    result = run(spec)
    result["pid"] = os.getpid()
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    from kvhal.vllm.testing.exiting import exit_now

    exit_now(main(sys.argv[1:]))

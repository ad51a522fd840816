"""The chat steps of a scenario (``kvhal bench chat``): a multi-turn workload driven through
``LLMEngine.step``, and chat jobs handed over in files so that two live engines take turns."""

from __future__ import annotations

import os
import time
from typing import Any

from kvhal.vllm.testing import step_clock
from kvhal.vllm.testing.steps import generate, metrics, serve_jobs, settle, threads


def chat(llm: Any, step: dict) -> dict:
    """A multi-turn chat workload (``kvhal bench chat``), driven through ``LLMEngine.step``.

    ``histories``: each user's conversation so far (token ids); ``turns``: per round, each
    user's new turn. Round ``r``'s prompt is the history plus the turn; the history then
    becomes that prompt plus the output (or plus ``answers[r][i]``, when given). Users are
    served round-robin (list order), at most ``inflight`` requests at once; a round ends
    when all of its requests have. TTFT is the wall time from ``add_request`` to the end of
    the engine step whose output first holds a token (steps are synchronous in a
    single-process engine), beside vLLM's own ``first_token_latency``
    (``disable_log_stats=False``). ``trace`` also records every step's wall time and
    scheduled tokens, and where the step's time went (:mod:`~kvhal.vllm.testing.step_clock`;
    single-process engines only).
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
    clock = None
    if isinstance(engine.engine_core, InprocClient):
        trace_schedules(llm)
        scheduler = engine.engine_core.engine_core.scheduler
        if trace is not None:
            clock = step_clock.install(llm)
    rounds = []
    steps_taken = 0
    before_all = metrics(llm, {})["metrics"] if step.get("metrics", True) else None
    for r, turns in enumerate(step["turns"]):
        queue = deque(range(len(histories)))
        live: dict[str, dict] = {}
        done: dict[int, dict] = {}
        round_start = time.perf_counter()
        threads_before = threads()
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
            if clock is not None:
                clock.take()  # what add_request cost belongs to no step
            outputs = engine.step()
            now = time.perf_counter()
            parts = clock.take() if clock is not None else None
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
                        "parts": parts,
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
            "thread_cpu_s": cpu_by_thread(threads_before, threads()),
        }
        if step.get("metrics", True):
            record["metrics"] = metrics(llm, {})["metrics"]
        if trace is not None:
            record["steps"] = round_steps
        rounds.append(record)
    return {"rounds": rounds, "histories": histories, "metrics_before": before_all}


def cpu_by_thread(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds (user and system) each thread name of this process spent between two
    :func:`~kvhal.vllm.testing.steps.threads` snapshots (a thread that ended meanwhile is lost).
    Native threads that carry the process's own kernel name were started by the main thread
    and named by nobody (torch's intra-op workers): they are ``workers:NAME`` here."""
    process = f"native:{_process_name()}"
    spent: dict[str, float] = {}
    for name, now in after["threads"].items():
        then = before["threads"].get(name, {})
        seconds = round(now["utime_s"] + now["stime_s"] - then.get("utime_s", 0) - then.get("stime_s", 0), 3)
        if seconds > 0:
            spent[name.replace("native:", "workers:", 1) if name == process else name] = seconds
    return spent


def _process_name() -> str:
    try:
        with open("/proc/self/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def trace_schedules(llm: Any) -> None:
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


def drain(llm: Any, step: dict) -> float:
    """A few engine steps and a pause: stores that finished start their writes below (a
    single-process engine steps only inside ``generate``), and the writes land. With
    ``land_writes``, then steps until kvhal has nothing in flight (within ``land_timeout``
    seconds): a store that writes slower than the pause allows would otherwise still be
    writing one engine's turns while the other engine reads them.
    The seconds that took beyond the pause."""
    prompt = step.get("drain_prompt")
    if prompt:
        generate(llm, {"prompts": [prompt], "max_tokens": step.get("drain_tokens", 4)})
    time.sleep(step.get("settle", 0))
    if step.get("land_writes"):
        return settle(llm, {"timeout": step.get("land_timeout", 300)})["seconds"]
    return 0.0


def chat_jobs(llm: Any, step: dict) -> dict:
    """Serve ``chat`` jobs from ``folder`` (:func:`~kvhal.vllm.testing.steps.serve_jobs`): run
    each job's ``chat`` step, then ``drain``."""

    def handle(job: dict) -> dict:
        result = chat(llm, job["chat"])
        result["writes_landed_s"] = drain(llm, job)
        result["load_avg_after_drain"] = os.getloadavg()
        return result

    return {"jobs": serve_jobs(step["folder"], step.get("timeout", 1800), handle, poll_s=0.01)}

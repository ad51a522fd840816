"""vLLM's own multi-turn serving benchmark (``benchmarks/multi_turn`` of vLLM's source) against
the OpenAI server, vLLM alone (the floor) and with kvhal's host tier, one server after the
other with identical settings (BENCHMARKS.md, "The OpenAI server path (issue 40, item 5)").

The model is the chat bench's (``ChatLlama``, float32) with 16 layers, and a byte-level BPE
tokenizer of its vocabulary trained here on the benchmark's text file, with a chat template
(the benchmark and the server's chat API need one; no hub). The workload: 16 conversations of
4 user turns, each starting with 1,024-2,048 tokens of the text, turns of 80-120 tokens,
answers of 32 tokens (greedy: ``temperature`` 0 by ``--override-generation-config``, so every
server sees the same conversations). The floor's device cache holds every conversation;
kvhal's holds a quarter, its host tier all of them (the chat bench's sizing).

Per run: client TTFT per turn (the benchmark's own figure, its per-request stats kept by
wrapping its ``process_statistics``), the server's own histograms (``/metrics`` before and
after: vLLM's TTFT, queue and prefill times, kvhal's counters), CPU seconds per thread group
of the server's processes and of the benchmark's clients, and the load average.

    .venv/bin/python scripts/probes/server_multi_turn.py --bench-dir DIR --out /tmp/smt \\
        [--order floor host floor host] [--num-clients 3] [--server-cpus 0,1 --client-cpus 0,1]

DIR holds vLLM's ``bench_dataset.py``, ``bench_utils.py``, ``benchmark_serving_multi_turn.py``
(``git show 49a986ecd:benchmarks/multi_turn/FILE`` of vLLM) and a text file (``pg1184.txt``,
as its README says). Needs pandas (``pip install pandas``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from kvhal.bench.chat.engines import CHAT_KVHAL
from kvhal.bench.chat.workload import CHAT_MODEL, ChatLlama
from kvhal.testing.ports import free_port
from kvhal.testing.scenario import BASE_ENV
from kvhal.vllm.testing.runner import api_server_command

MODEL = ChatLlama(**{**asdict(CHAT_MODEL), "num_hidden_layers": 16})
KV_PER_TOKEN = 2 * 4 * MODEL.num_hidden_layers * MODEL.num_key_value_heads * MODEL.head_dim  # float32
USERS, TURNS, CONTEXT, TURN, ANSWER = 16, 4, (1024, 2048), (80, 120), 32
#: tokens of a conversation at its end, with the template's few per message (an upper bound)
LONGEST = CONTEXT[1] + TURNS * (TURN[1] + ANSWER + 16)
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
#: The benchmark, with its per-request stats written to $SMT_REQUESTS (the rest unchanged).
WRAPPER = """
import asyncio, json, os, sys
sys.path.insert(0, sys.argv.pop(1))
import benchmark_serving_multi_turn as b
shown = b.process_statistics
def kept(client_metrics, *args, **kwargs):
    with open(os.environ["SMT_REQUESTS"], "w") as f:
        json.dump([m._asdict() for m in client_metrics], f)
    return shown(client_metrics, *args, **kwargs)
b.process_statistics = kept
asyncio.run(b.main())
"""


def blocks(tokens: int) -> int:
    return -(-tokens // 32) * 32


def build_model(root: Path, text: Path) -> Path:
    """The model's folder with a tokenizer of its vocabulary (trained once, then reused)."""
    weights = MODEL.build(root)
    served = root / f"served-{MODEL.tag}"
    if (served / "tokenizer.json").exists():
        return served
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    served.mkdir(exist_ok=True)
    for item in weights.iterdir():
        (served / item.name).unlink(missing_ok=True)
        (served / item.name).symlink_to(item)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|bos|>", "<|eos|>"]  # ids 0-2: LlamaConfig's bos 1, eos 2
    trainer = trainers.BpeTrainer(
        vocab_size=MODEL.vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train([str(text)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=specials[1], eos_token=specials[2], pad_token=specials[0]
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(served)
    return served


def workload(text: Path, path: Path) -> Path:
    spec = {
        "filetype": "generate_conversations",
        "num_conversations": USERS,
        "text_files": [str(text)],
        "print_stats": False,
        "prompt_input": {
            "num_turns": {"distribution": "constant", "value": 2 * TURNS},  # user and assistant
            "prefix_num_tokens": {"distribution": "uniform", "min": CONTEXT[0], "max": CONTEXT[1]},
            "num_tokens": {"distribution": "uniform", "min": TURN[0], "max": TURN[1]},
        },
        "prompt_output": {"num_tokens": {"distribution": "constant", "value": ANSWER}},
    }
    path.write_text(json.dumps(spec, indent=1))
    return path


def engine_args(device_tokens: int) -> dict[str, Any]:
    model_len = blocks(LONGEST) + 64
    return {
        "skip_tokenizer_init": False,
        "dtype": "float32",
        "max_model_len": model_len,
        "max_num_batched_tokens": max(2048, model_len),
        "max_num_seqs": 8,
        "kv_cache_memory_bytes": device_tokens * KV_PER_TOKEN,
        "override_generation_config": {"temperature": 0.0},
        "served_model_name": "model",
    }


def configs(inflight: int) -> dict[str, tuple[dict, dict | None]]:
    """name -> (engine arguments, kvhal's extra config or None): the chat bench's sizing."""
    total = USERS * blocks(LONGEST)
    small = blocks(max(total // 4, inflight * LONGEST + 64)) + 32
    big = blocks(total + inflight * LONGEST + 64) + 32
    host = {**CHAT_KVHAL, "cpu_bytes_to_use": blocks(total * 5 // 4) * KV_PER_TOKEN}
    return {"floor": (engine_args(big), None), "host": (engine_args(small), host)}


# ------------------------------------------------------------------ measuring


def thread_cpu(root: int) -> dict[str, float]:
    """CPU seconds so far per (process, thread group) of ``root``'s process tree: threads
    named alike (digits dropped: ``kvhal-copy-1`` -> ``kvhal-copy-#``) summed."""
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[str, float] = {}
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return found
    for proc in procs:
        try:
            role = "api_server" if proc.pid == root else proc.name()
        except psutil.NoSuchProcess:
            continue
        for task in Path(f"/proc/{proc.pid}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            key = f"{role}/{re.sub(r'[0-9]+', '#', name)}"
            found[key] = found.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return found


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("vllm:"):
                continue
            if s.name.endswith(("_sum", "_count", "_total")):
                out[s.name] = out.get(s.name, 0.0) + s.value
            elif s.name.startswith("vllm:kvhal_device_load") and "le" in s.labels:  # the sync waits
                key = f"{s.name}{{le={s.labels['le']}}}"
                out[key] = out.get(key, 0.0) + s.value
    return out


#: What a sampled stack is doing, by the first of these frames found in it (innermost first).
#: kvhal's synchronous load wait is its worker side's ``start_load_kv`` blocked on the copy.
ACTIVITIES = (
    ("kvhal: start_load_kv", "start_load_kv"),
    ("kvhal: wait_for_save", "wait_for_save"),
    ("kvhal: other hooks", "kvhal/vllm/"),
    ("kvhal threads", "kvhal/"),
    ("model forward", "_model_forward"),
    ("sampling", "sample_tokens"),
    ("execute_model, the rest", "execute_model"),
    ("scheduler", "schedule ("),
    ("scheduler: update", "update_from_output"),
    ("busy loop (shm queue)", "shm_broadcast.py"),
    ("output processing", "process_outputs"),
)


def spy(pid: int, binary: str, path: Path) -> subprocess.Popen:
    """py-spy sampling every thread of ``pid`` (idle ones too) until interrupted."""
    command = [binary, "record", "--pid", str(pid), "--idle", "--threads", "--rate", "100"]
    command += ["--format", "raw", "--nonblocking", "-o", str(path)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def spied(path: Path) -> dict[str, dict[str, int]]:
    """Samples per thread (by name: ``thread (TID): NAME``, digits dropped) and activity from a
    py-spy raw file. Waits are sampled too (``--idle``): a stack says what a thread waits in."""
    found: dict[str, dict[str, int]] = {}
    if not path.exists():
        return found
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        thread = re.sub(r"[0-9]+", "#", stack.split(";", 1)[0].partition(": ")[2])
        what = next((name for name, frame in ACTIVITIES if frame in stack), "other")
        by = found.setdefault(thread, {})
        by[what] = by.get(what, 0) + int(count)
    return found


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def pinned(cpus: str | None, command: list[str]) -> list[str]:
    return ["taskset", "-c", cpus, *command] if cpus else command


def serve(name: str, args: argparse.Namespace, model: Path, gen: Path, out: Path, k: int) -> dict:
    base, _, extra = name.partition(":")  # "host:K=V,K=V": host with these variables set
    engine, kvhal = configs(args.num_clients)[base]
    variables = dict(item.split("=", 1) for item in extra.split(",") if item)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, **BASE_ENV, "VLLM_PORT": str(free_port()), **dict(args.server_env), **variables}
    log = out / f"{k:02d}-{name}-server.log"
    command = pinned(args.server_cpus, api_server_command(str(model), port=port, kvhal=kvhal, engine=engine))
    with log.open("w") as sink:
        server = subprocess.Popen(
            command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{name}: the server did not start, see {log}")
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        requests = out / f"{k:02d}-{name}-requests.json"
        bench = [sys.executable, "-c", WRAPPER, str(args.bench_dir), "-m", str(model), "--served-model-name"]
        bench += ["model", "-u", base, "-i", str(gen), "--seed", str(args.seed), "-p", str(args.num_clients)]
        bench += ["-k", str(USERS), "--no-early-stop"]  # else it stops when one client has no work
        before_cpu, before_metrics, load_before = thread_cpu(server.pid), metrics(base), loadavg()
        spies = {}
        if args.py_spy:
            for proc in [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]:
                role = "api_server" if proc.pid == server.pid else proc.name().replace("VLLM::", "")
                spies[role] = spy(proc.pid, args.py_spy, out / f"{k:02d}-{name}-{role}.spy")
        start = time.perf_counter()
        with (out / f"{k:02d}-{name}-bench.log").open("w") as sink:
            client = subprocess.Popen(
                pinned(args.client_cpus, bench),
                env={**env, "SMT_REQUESTS": str(requests)},
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
            _, status, usage = os.wait4(client.pid, 0)  # rusage: the benchmark and its clients
        wall = time.perf_counter() - start
        for process in spies.values():
            process.send_signal(2)  # py-spy writes its file on SIGINT
            process.wait(60)
        after_cpu, after_metrics = thread_cpu(server.pid), metrics(base)
        if status != 0 or not requests.exists():
            raise SystemExit(f"{name}: the benchmark failed, see {out}/{k:02d}-{name}-bench.log")
        cpu = {key: after_cpu[key] - before_cpu.get(key, 0.0) for key in after_cpu}
        cpu["benchmark (clients)"] = usage.ru_utime + usage.ru_stime
        grew = {key: value - before_metrics.get(key, 0.0) for key, value in after_metrics.items()}
        return {
            "config": name,
            "wall_s": wall,
            "load_before": load_before,
            "load_after": loadavg(),
            "requests": json.loads(requests.read_text()),
            "cpu_s": {key: round(v, 3) for key, v in sorted(cpu.items()) if v > 0},
            "metrics": {key: v for key, v in grew.items() if v},
            "samples": {role: spied(out / f"{k:02d}-{name}-{role}.spy") for role in spies},
        }
    finally:
        if server.poll() is None:
            os.killpg(server.pid, 15)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, 9)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, 9)  # the engine core and worker, should they outlive it


# ------------------------------------------------------------------ report


def turn_of(q: dict) -> int:
    return (q["input_num_turns"] + 1) // 2  # messages sent: 1, 3, 5, 7


def summary(run: dict) -> dict:
    by_turn: dict[int, list[float]] = {}
    for q in run["requests"]:
        by_turn.setdefault(turn_of(q), []).append(q["ttft_ms"])
    returning = [t for turn, ts in by_turn.items() if turn >= 2 for t in ts]
    m = run["metrics"]

    def mean_ms(name: str) -> float | None:
        count = m.get(f"vllm:{name}_count")
        return 1000 * m.get(f"vllm:{name}_sum", 0.0) / count if count else None

    return {
        "turns": {t: statistics.mean(ts) for t, ts in sorted(by_turn.items())},
        "first_mean": statistics.mean(by_turn.get(1, [0])),
        "returning_mean": statistics.mean(returning),
        "returning_p50": statistics.median(returning),
        "returning_p90": statistics.quantiles(returning, n=10)[-1],
        "requests": len(run["requests"]),
        "server_ttft_ms": mean_ms("time_to_first_token_seconds"),
        "server_queue_ms": mean_ms("request_queue_time_seconds"),
        "server_prefill_ms": mean_ms("request_prefill_time_seconds"),
        "client_ttft_ms": statistics.mean(q["ttft_ms"] for q in run["requests"]),
    }


def report(runs: list[dict]) -> None:
    floors = [summary(r)["returning_mean"] for r in runs if r["config"] == "floor"]
    floor = statistics.mean(floors) if floors else None
    print(
        "\n| run | config | load (before / after) | TTFT turn 1 | 2 | 3 | 4 (ms) | returning mean, p50, p90 "
        "| vs floor | server TTFT, all turns | client TTFT, all turns | queue | prefill |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for k, run in enumerate(runs):
        s = summary(run)
        run["summary"] = s
        turns = " | ".join(f"{s['turns'].get(t, float('nan')):.1f}" for t in range(1, TURNS + 1))
        ratio = f"{s['returning_mean'] / floor:.3f}x" if floor else "-"
        server = " | ".join(
            f"{s[key]:.1f}" if s[key] is not None else "-"
            for key in ("server_ttft_ms", "client_ttft_ms", "server_queue_ms", "server_prefill_ms")
        )
        print(
            f"| {k + 1} | {run['config']} | {run['load_before']} / {run['load_after']} | {turns} | "
            f"{s['returning_mean']:.1f}, {s['returning_p50']:.1f}, {s['returning_p90']:.1f} "
            f"| {ratio} | {server} |"
        )
    print("\nCPU seconds per run (server's processes by thread group; the benchmark's clients):")
    for k, run in enumerate(runs):
        top = sorted(run["cpu_s"].items(), key=lambda kv: -kv[1])[:12]
        shown = ", ".join(f"{n} {v:.2f}" for n, v in top)
        print(f"  {k + 1} {run['config']} ({run['wall_s']:.1f} s, load {run['load_after']}): {shown}")
        for role, threads in run.get("samples", {}).items():
            for thread, acts in threads.items():
                busy = {a: n for a, n in sorted(acts.items(), key=lambda kv: -kv[1]) if a != "idle"}
                if sum(busy.values()) >= 100:  # a second of samples at least
                    parts = ", ".join(f"{a} {n / 100:.1f}" for a, n in busy.items())
                    print(
                        f"    {role} {thread}: s sampled busy: {parts} (idle {acts.get('idle', 0) / 100:.1f})"
                    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench-dir", type=Path, required=True, help="vLLM's benchmarks/multi_turn files")
    parser.add_argument("--text", type=Path, help="conversations' and tokenizer's text (DIR/pg1184.txt)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/server-multi-turn"))
    parser.add_argument("--models", type=Path, default=Path.home() / ".cache" / "kvhal-bench-models")
    parser.add_argument(
        "--order",
        nargs="+",
        default=["floor", "host"] * 2,
        help="runs: floor, host, or either with the server's variables set (host:K=V,K=V)",
    )
    parser.add_argument("--num-clients", type=int, default=3, help="the benchmark's clients (in flight)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--py-spy", metavar="BIN", help="py-spy: sample the server's processes (100 Hz)")
    parser.add_argument("--server-cpus", help="taskset -c list for the server (default: none)")
    parser.add_argument("--client-cpus", help="taskset -c list for the benchmark (default: none)")
    parser.add_argument(
        "--server-env", action="append", default=[], type=lambda s: tuple(s.split("=", 1)), metavar="K=V"
    )
    args = parser.parse_args()
    if bad := [n for n in args.order if n.partition(":")[0] not in ("floor", "host")]:
        parser.error(f"unknown runs {bad}: floor or host, with :K=V,... after it")
    text = (args.text or args.bench_dir / "pg1184.txt").resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    model = build_model(args.models, text)
    gen = workload(text, Path(tempfile.mkdtemp(prefix="smt-")) / "generate.json")
    header = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "argv": sys.argv,
        "model": asdict(MODEL),
        "configs": configs(args.num_clients),
    }
    runs: list[dict] = []
    for k, name in enumerate(args.order):
        print(f"run {k + 1}/{len(args.order)}: {name}, load {loadavg()}", flush=True)
        runs.append(serve(name, args, model, gen, args.out, k))
        print(f"  {runs[-1]['wall_s']:.0f} s, load {runs[-1]['load_after']}", flush=True)
        (args.out / "server_multi_turn.json").write_text(json.dumps({**header, "runs": runs}, indent=1))
    report(runs)
    (args.out / "server_multi_turn.json").write_text(json.dumps({**header, "runs": runs}, indent=1))
    print(f"\nwrote {args.out / 'server_multi_turn.json'}")


if __name__ == "__main__":
    main()

"""Multi-turn chat on a real vLLM engine: the workload offloading exists for, measured end to end.

The workload: ``--users`` users, each with a distinct context of random token ids
(``--context`` tokens, drawn per user), over ``--rounds`` rounds. Each round appends a user
turn of about ``--turn`` tokens (80-120% of it) to the conversation so far and generates
``--max-tokens`` tokens (greedy); the next round's prompt is the previous prompt, plus its
output, plus a new turn. Users are served round-robin, ``--inflight`` requests at a time; a
round ends when all of its users have their answer.

The engine: one process per engine (:func:`kvhal.testing.scenario.run_scenario`), the whole
workload inside it (the runner's ``chat`` op drives ``LLMEngine.add_request`` / ``step``
and builds each round's prompts from the outputs). TTFT is measured by the client: the
wall time from ``add_request`` to the end of the engine step whose output first holds a
token (a single-process engine steps synchronously, so this is what a streaming client
would see, less transport), beside vLLM's own ``first_token_latency``. Every engine first
serves a warm-up prompt of its own (not measured).

Configurations, each in its own process(es), run in alternating order (reversed every
repeat), the machine's load average recorded before and after each:

- ``floor``: vLLM alone with a device KV cache big enough for every user: its own prefix
  cache serves every return. The reference for the outputs and the floor for TTFT.
- ``vllm``: vLLM alone with a device KV cache that holds about a quarter of the users'
  contexts (at least ``--inflight`` of the longest conversations): returns recompute.
- ``host``: that small device cache plus kvhal with a host tier that holds every user.
- ``disk``: the small device cache, a kvhal host tier about as small, and a disk tier
  (``disk_path``, ``O_DIRECT``) that holds every user.
- ``shared``: two engines (A and B), each with the small device cache and a host tier
  that holds every user, sharing a remote tier (``remote_url``: a Redis server, a
  Mooncake master and store node, or SeaweedFS's S3 gateway with a bucket, ``--store``,
  started here on loopback, fresh for every run). User
  ``u`` is served in round ``r`` by engine ``(u + r) % 2``: every returning turn lands on
  the other engine than the turn before. Both engines stay alive for the whole workload
  (2 x a small device cache and a host tier fit in 24 GiB), and take turns: in each round
  A serves its half, then B serves its half (``--inflight`` requests at a time, never both
  engines computing at once on 2 cores). The runner's ``chat_jobs`` op hands the rounds
  over in files; the conversations cross processes there. After each half-round the
  engine takes a few steps and a short pause (a single-process engine only steps inside a
  call, and a store's write to the remote tier starts at a step), then steps until its
  writes landed (a store that writes slower than the pause; the report says how long),
  outside the measured time: the other engine finds what it wrote, and does not read while
  the first one's writes still load the store.

Reports: TTFT mean, p50, p90 per round, round 1 apart from rounds >= 2; output tokens/s
(output tokens over the workload's wall time, engine start and warm-up excluded); prompt
tokens per round served by vLLM's prefix cache (``num_cached_tokens`` less what kvhal
loaded), kvhal's host tier, its disk tier (``vllm:kvhal_tier_hit_tokens{tier="disk"}``, or
the slow configuration's tier), the remote tier (``vllm:kvhal_tier_hit_tokens`` of the store's
tier, ``tier="redis"``, ``"mooncake"`` or ``"s3"``), and computed; the check that greedy outputs
are the floor's; and the targets (the shared ones per store: :func:`~.checks.check_targets`).

The outputs check: every run's outputs are compared with the floor's first run, user by
user, round by round. Reused KV and recomputed KV, or KV computed in batches
of another shape, can differ in the last bits, and a greedy token then changes where the
two best logits are nearly tied. Each difference is explained by logprobs (the top
:data:`TOP_LOGPROBS` of every generated token): it is numerics when, at the first differing
token, both runs' top logprobs hold both runs' choices, each choice's logprob within
:data:`LOGPROB_TOLERANCE` of the other run's (so the two were nearly tied), and the tokens
before it within as much. The engines run in :data:`DTYPE`.
Anything else is wrong KV until shown otherwise: the benchmark fails (red line, exit
status 1), as do equal outputs whose logprobs differ by more. Every run after the first is
fed the first run's answers, so all see the same prompts in every round. The model
(:data:`CHAT_MODEL`, :class:`ChatLlama`) is built for clear margins between its best logits.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from rich.progress import Progress, TaskID

from kvhal.bench.chat.checks import (
    LOGPROB_TOLERANCE,
    check_outputs,
    check_targets,
    margins,
    reference_run,
    summarize,
)
from kvhal.bench.chat.engines import SHARED_STORES, run_config
from kvhal.bench.chat.report import plot, print_report
from kvhal.bench.chat.slow_tier import READ_BYTES_PER_S
from kvhal.bench.chat.spinner import share_of_a_core, spinning
from kvhal.bench.chat.workload import CHAT_MODEL, COLD, CONFIGS, cold_workload, sizing
from kvhal.bench.chat.workload import workload as make_workload
from kvhal.bench.common import console as make_console
from kvhal.bench.common import result_header, write_outputs
from kvhal.bench.e2e import MALLOC_ENV
from kvhal.vllm.config import LOAD_MODES

# ---------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--users", type=int, default=16, help="users, each with its own context (default 16)")
    parser.add_argument("--rounds", type=int, default=4, help="turns per user (default 4)")
    parser.add_argument(
        "--context",
        type=int,
        nargs="+",
        default=[1024, 2048],
        metavar="TOKENS",
        help="each user's context: MIN MAX tokens, or one length (default 1024 2048)",
    )
    parser.add_argument("--turn", type=int, default=100, help="tokens of a user turn, +-20%% (default 100)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn (default 32)")
    parser.add_argument("--inflight", type=int, default=3, help="requests in flight (default 3)")
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        default=list(CONFIGS),
        help="configurations to run (default all: " + ", ".join(CONFIGS) + ")",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each configuration, order reversed each time (default 2)",
    )
    parser.add_argument(
        "--store",
        choices=SHARED_STORES,
        default="redis",
        help="the shared store, started on loopback for each run (s3: SeaweedFS's S3 gateway)",
    )
    parser.add_argument(
        "--store-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a remote_* key of kvhal's extra config for the shared configuration's engines, VALUE as "
        "JSON or a string (remote_wait_policy=timeout: read the store whatever it costs); repeatable",
    )
    parser.add_argument(
        "--load-mode",
        choices=LOAD_MODES,
        default="auto",
        help="kvhal's load_mode in every kvhal configuration (default auto)",
    )
    parser.add_argument(
        "--slow-tier-mb-s",
        type=float,
        default=READ_BYTES_PER_S / 1e6,
        help=f"read bandwidth of the slow configuration's tier, MB/s (default {READ_BYTES_PER_S / 1e6:.0f})",
    )
    parser.add_argument(
        "--spin",
        type=share_of_a_core,
        default=None,
        metavar="SHARE",
        help="run every configuration beside a process that keeps SHARE of one core busy (0.07: 0.7 ms "
        "of every 10): what any work beside the forward costs its steps",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload's tokens")
    parser.add_argument(
        "--no-trace", dest="trace", action="store_false", help="do not record every engine step's time"
    )
    parser.add_argument("--models", type=Path, default=Path.home() / ".cache" / "kvhal-bench-models")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for JSON and PNG")


def run(args: argparse.Namespace) -> int:
    console = make_console()
    recipe = CHAT_MODEL
    context = (args.context[0], args.context[-1])
    if len(args.context) > 2 or context[0] > context[1] or context[0] < 1:
        raise SystemExit("--context takes MIN MAX (or one length), MIN <= MAX")
    for flag in ("users", "rounds", "repeats", "inflight", "max_tokens", "slow_tier_mb_s"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    args.store_options = store_options(args.store_option)
    with console.status("building the model"):
        model = str(recipe.build(args.models))
    work = make_workload(args.users, args.rounds, context, args.turn, recipe.vocab_size, args.seed)
    cold = cold_workload(work, recipe.vocab_size, args.seed)
    size = sizing(recipe, work, args.max_tokens, args.inflight)
    configs = [c for c in CONFIGS if c in args.configs]
    order = [configs if k % 2 == 0 else configs[::-1] for k in range(args.repeats)]
    steps = sum((2 * args.rounds if c == "shared" else 1) for c in configs) * args.repeats
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="kvhal-bench-chat-", dir=args.out))
    runs: list[dict] = []
    started = time.perf_counter()
    try:
        with Progress(console=console, transient=True) as progress:
            task: TaskID = progress.add_task("chat", total=steps)
            for repeat, names in enumerate(order):
                for name in names:
                    progress.update(task, description=f"run {repeat + 1}/{args.repeats}: {name}")

                    def advance(what: str, name: str = name, repeat: int = repeat) -> None:
                        progress.update(task, description=f"run {repeat + 1}/{args.repeats}: {name}: {what}")
                        progress.advance(task)

                    answers = None
                    same = [r for r in runs if (r["config"] in COLD) == (name in COLD)]  # same workload
                    if same:  # the reference's answers: every later run sees its prompts
                        answers = [
                            [q["tokens"] for q in rnd["requests"]] for rnd in reference_run(same)["rounds"]
                        ]
                    served = cold if name in COLD else work
                    with spinning(args.spin):  # (none without --spin)
                        runs.append(
                            run_config(name, model, served, size, scratch, repeat, args, advance, answers)
                        )
                    last = runs[-1]
                    console.print(
                        f"run {repeat + 1}/{args.repeats} {name}: {last['wall_s']:.0f} s, load "
                        f"{last['load_before'][0]:.2f} -> {last['load_after'][0]:.2f}"
                    )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(runs, args.inflight)
    result = {
        **result_header("chat"),
        "model": {"recipe": recipe.tag, "parameters": recipe.parameters, **asdict(recipe)},
        "workload": {
            "users": args.users,
            "rounds": args.rounds,
            "context": list(context),
            "turn": args.turn,
            "max_tokens": args.max_tokens,
            "spin": args.spin,
            "inflight": args.inflight,
            "seed": args.seed,
            "slow_tier_bytes_per_s": args.slow_tier_mb_s * 1e6,
            "load_mode": args.load_mode,
            "repeats": args.repeats,
            "order": order,
        },
        "sizing": size,
        "store": args.store if "shared" in configs else None,
        "store_options": args.store_options if "shared" in configs else None,
        "kvhal_device": next((r["kvhal_device"] for r in runs if r.get("kvhal_device")), None),
        "malloc_env": MALLOC_ENV,
        "seconds": time.perf_counter() - started,
        "summary": summary,
        "outputs": _outputs([r for r in runs if r["config"] not in COLD]),
        "outputs_cold": _outputs([r for r in runs if r["config"] in COLD]),
        "margins": margins(runs),
        "runs": runs,
    }
    result["targets"] = check_targets(summary, result["store"])
    print_report(console, result)
    json_path, png_path = write_outputs(args.out, "chat", result)
    plot(result, png_path)
    console.print(f"wrote {json_path} and {png_path} ({result['seconds']:.0f} s)")
    return 0 if result["outputs"]["passed"] and result["outputs_cold"]["passed"] else 1


def store_options(given: list[str]) -> dict[str, object]:
    """``--store-option KEY=VALUE`` as extra-config entries (VALUE parsed as JSON, else kept as a
    string); a malformed one or a key that is not a store's (``remote_*``) is refused here, before
    any engine starts (the engine checks the values)."""
    options: dict[str, object] = {}
    for option in given:
        key, equals, value = option.partition("=")
        if not equals or not key.startswith("remote_") or key == "remote_url":
            raise SystemExit(f"--store-option {option!r}: expected remote_KEY=VALUE (not remote_url)")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _outputs(runs: list[dict]) -> dict:
    """The outputs check of runs of one workload (trivially passed with fewer than two)."""
    if len(runs) > 1:
        return check_outputs(runs)
    return {
        "reference": {"config": runs[0]["config"], "repeat": 0} if runs else None,
        "comparisons": [],
        "max_logprob_difference_equal_outputs": 0.0,
        "passed": True,
        "all_equal": True,
        "logprob_tolerance": LOGPROB_TOLERANCE,
    }

"""``kvhal bench chat``'s report: the tables and the plot."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvhal.bench.chat.checks import LOGPROB_TOLERANCE, STEP_PARTS
from kvhal.bench.chat.cpu import GROUPS
from kvhal.bench.chat.workload import CONFIGS, TOP_LOGPROBS


def print_report(console: Console, result: dict) -> None:
    summary, runs = result["summary"], result["runs"]
    floor = summary.get("floor")
    floor_later = floor["ttft_later"]["mean"] if floor and floor["ttft_later"] else None
    w = result["workload"]
    table = Table(
        title=f"kvhal bench chat: {w['users']} users x {w['rounds']} rounds, TTFT in s (mean / p50 / p90), "
        f"{result['model']['parameters'] / 1e6:.0f}M-parameter model"
    )
    columns = ("configuration", "round 1", "rounds >= 2", "vs floor", "output tok/s", "device KV tokens")
    for column in (*columns, "load before -> after"):
        table.add_column(column, justify="right")
    for name, s in summary.items():
        later = s["ttft_later"]
        loads = [f"{r['load_before'][0]:.1f}->{r['load_after'][0]:.1f}" for r in runs if r["config"] == name]
        table.add_row(
            f"{name}: {CONFIGS[name]}",
            "{mean:.3f} / {p50:.3f} / {p90:.3f}".format(**s["ttft_round1"]),
            "{mean:.3f} / {p50:.3f} / {p90:.3f}".format(**later) if later else "-",
            f"{later['mean'] / floor_later:.2f}x" if later and floor_later else "-",
            f"{s['output_tokens_per_s']:.1f}",
            ", ".join(f"{t:,}" for t in s["kv_cache_tokens"]) or "?",
            ", ".join(loads),
        )
    console.print(table)
    rounds = Table(title="per round: TTFT (s) and where the prompt tokens came from (mean over repeats)")
    for column in ("configuration", "round", "TTFT mean", "p50", "p90", "prompt tokens", "vLLM prefix cache"):
        rounds.add_column(column, justify="right")
    for column in ("kvhal host", "disk", "remote", "computed"):
        rounds.add_column(column, justify="right")
    for name, s in summary.items():
        for k, row in enumerate(s["rounds"]):
            t, tiers = row["ttft"], row["tiers"]
            rounds.add_row(
                name if k == 0 else "",
                str(row["round"]),
                f"{t['mean']:.3f}",
                f"{t['p50']:.3f}",
                f"{t['p90']:.3f}",
                f"{tiers['prompt']:,.0f}",
                f"{tiers['vllm_prefix_cache']:,.0f}",
                f"{tiers['host']:,.0f}",
                f"{tiers['disk']:,.0f}",
                f"{tiers['remote']:,.0f}",
                f"{tiers['computed']:,.0f}",
            )
    console.print(rounds)
    for name, s in summary.items():
        # failed loads are recomputed, but their tokens are counted above as served by a tier
        for what in ("preemptions", "failed_loads", "remote_dropped_blocks"):
            total = sum(row["tiers"].get(what, 0) for row in s["rounds"])
            if total:
                console.print(
                    f"[yellow]{name}: {total:,.0f} {what.replace('_', ' ')} (mean per run)[/yellow]"
                )
    # the cold workload's runs against their own reference, then the chat's
    for outputs in filter(None, (result.get("outputs_cold"), result["outputs"])):
        ref = outputs["reference"]
        for c in outputs["comparisons"]:
            line = (
                f"outputs {c['config']} (run {c['repeat'] + 1}) vs {ref['config']} "
                f"(run {ref['repeat'] + 1}): "
                f"{c['equal']}/{c['compared']} equal"
            )
            if c["numerics"]:
                line += f", {c['numerics']} near-tie (numerics)"
            if c["not_comparable"]:
                line += f", {c['not_comparable']} later turns with other prompts"
            if c["unexplained"]:
                line = f"[red]{line}, {c['unexplained']} UNEXPLAINED[/red]"
            console.print(line)
            for m in c["mismatches"]:
                margins = (
                    f"margins {m['reference_margin']:.3f} / {m['margin']:.3f} nats, logprobs moved "
                    f"{m['logprob_moved']:.3f}"
                    if m["logprob_moved"] is not None
                    else f"not both in both runs' top {TOP_LOGPROBS}"
                )
                console.print(
                    f"  user {m['user']} round {m['round']} token {m['position']}: {m['reference_token']} -> "
                    f"{m['token']}, {margins}, {m['logprob_drift_before']:.3f} before -> "
                    + ("numerics" if m["numerics"] else "[red]UNEXPLAINED[/red]")
                )
            for d in c["equal_but_drifted"]:
                console.print(
                    f"  [red]user {d['user']} round {d['round']}: equal tokens, logprobs differ by "
                    f"{d['logprob_drift']:.4f} nats: UNEXPLAINED[/red]"
                )
    gap = result["margins"]
    if gap:
        console.print(
            f"model margins (floor): best minus second logprob, median {gap['median']:.3f} nats, p10 "
            f"{gap['p10']:.3f}, {gap['share_below_tolerance']:.2%} of {gap['tokens']} tokens within "
            f"{2 * LOGPROB_TOLERANCE}; equal outputs' logprobs differ by at most "
            f"{outputs['max_logprob_difference_equal_outputs']:.4f}"
        )
    for name, s in summary.items():
        if s["ttft_later"]:
            counts = ", ".join(f"{n}: {c}" for n, c in s["later_steps_to_first_token_counts"].items())
            steps, before = s["later_steps_to_first_token_mean"], s["later_before_first_token_step_s_mean"]
            counted = f"{steps:.2f} engine steps from arrival to first token ({counts}); " if steps else ""
            console.print(
                f"load path, rounds >= 2, {name}: {counted}{before:.3f} s in the steps before the one "
                "that computes it, "
                f"{s['later_first_token_step_s_mean']:.3f} s in that step"
            )
    landing = [
        sum(r.get("writes_landed_s", 0.0) for r in run["rounds"])
        for run in result["runs"]
        if run["config"] == "shared"
    ]
    if landing:
        console.print(
            "shared: the store's writes still landing after each half-round's pause (outside the measured "
            "time), summed per run: " + ", ".join(f"{s:.1f} s" for s in landing)
        )
    for name, s in summary.items():
        steps = [d for d in s.get("later_decode_steps_ms") or [] if d]
        if steps:
            console.print(
                f"decode-only steps of {result['workload']['inflight']} sequences, rounds >= 2, {name}: "
                + ", ".join(f"{d['median']:.2f} / {d['p90']:.2f} ms" for d in steps)
                + " (median / p90, per run)"
            )
    split = {name: s["later_first_token_step_parts_ms"] for name, s in summary.items()}
    split = {name: parts for name, parts in split.items() if parts}
    if split:
        table = Table(
            title="Where a step that computes returning turns' first tokens goes, rounds >= 2 "
            "(mean ms; forward: vLLM's model execution without kvhal's worker hooks)"
        )
        for column in ("configuration", "steps", *STEP_PARTS, "step", "of forward: model"):
            table.add_column(column, justify="right")
        for name, parts in split.items():
            shown = (*STEP_PARTS, "step", "model")
            table.add_row(name, str(parts["n"]), *(f"{parts.get(p, 0.0):.2f}" for p in shown))
        console.print(table)
        for name, parts in split.items():
            hooks = sorted((v, k[5:]) for k, v in parts.items() if k.startswith("hook:"))[::-1]
            if hooks:
                listed = ", ".join(f"{hook} {ms:.2f}" for ms, hook in hooks)
                console.print(f"  {name}'s hooks (mean ms a step): {listed}")
    busy = {name: s["later_cores_busy"] for name, s in summary.items() if s.get("later_cores_busy")}
    if busy:
        cpu = Table(
            title="CPU in rounds >= 2, in cores busy (CPU seconds / wall seconds; the machine has "
            f"{result['machine'].get('cpu_count', '?')} cores)"
        )
        groups = [g for g in (*GROUPS, "store server") if any(b.get(g) for b in busy.values())]
        for column in ("configuration", *groups):
            cpu.add_column(column, justify="right")
        for name, b in busy.items():
            cpu.add_row(name, *(f"{b.get(g, 0.0):.2f}" for g in groups))
        console.print(cpu)
    if outputs["passed"]:
        verdict = "all equal" if outputs["all_equal"] else "differences are numerics (near ties)"
        console.print(f"[green]outputs check passed: {verdict}[/green]")
    else:
        console.print(
            "[bold red]outputs check FAILED: outputs differ where logprobs do not explain it[/bold red]"
        )
    cold = result.get("outputs_cold")
    if cold and cold["comparisons"]:
        verdict = "all equal" if cold["all_equal"] else "differences are numerics (near ties)"
        if not cold["passed"]:
            verdict = "[bold red]FAILED: outputs differ where logprobs do not explain it[/bold red]"
        console.print(f"outputs check, cold workload (against cold-vllm): {verdict}")
    for check in result["targets"]:
        verdict = "met" if check["met"] else "[red]MISSED[/red]"
        console.print(f"target {check['target']}: {verdict} ({check['value']:.3f})")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    colors = {
        "floor": "C2",
        "vllm": "C3",
        "host": "C0",
        "disk": "C1",
        "shared": "C4",
        "slow": "C5",
        "cold-vllm": "C7",
        "cold-host": "C9",
    }
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for name, s in summary.items():
        xs = [row["round"] for row in s["rounds"]]
        means = [row["ttft"]["mean"] for row in s["rounds"]]
        lo = [row["ttft"]["p50"] for row in s["rounds"]]
        hi = [row["ttft"]["p90"] for row in s["rounds"]]
        left.plot(xs, means, "o-", color=colors[name], label=f"{name}: {CONFIGS[name]}")
        left.fill_between(xs, lo, hi, color=colors[name], alpha=0.12)
    left.set_yscale("log")
    left.set_xticks(range(1, result["workload"]["rounds"] + 1))
    left.set_xlabel("round (line: mean; band: p50 to p90)")
    left.set_ylabel("time to first token (s)")
    left.set_title("TTFT per round")
    left.legend(fontsize=7)
    names = [n for n, s in summary.items() if s["ttft_later"]]
    values = [summary[n]["ttft_later"]["mean"] for n in names]
    floor = summary.get("floor", {}).get("ttft_later")
    right.bar(names, values, color=[colors[n] for n in names])
    for i, v in enumerate(values):
        label = f"{v:.3f}s" + (f"\n{v / floor['mean']:.2f}x floor" if floor else "")
        right.text(i, v, label, ha="center", va="bottom", fontsize=7)
    right.set_yscale("log")
    right.set_ylabel("mean TTFT, rounds >= 2 (s)")
    right.set_title("returning turns")
    w = result["workload"]
    fig.suptitle(
        f"kvhal bench chat: {w['users']} users x {w['rounds']} rounds, contexts {w['context'][0]}-"
        f"{w['context'][1]} tokens, turns ~{w['turn']}, {w['max_tokens']} output tokens, "
        f"{w['inflight']} in flight ({result['machine'].get('git', '?')})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

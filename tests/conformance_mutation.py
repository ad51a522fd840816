"""The mutation batch in shards: the conformance suite against each mutant of
:mod:`kvhal_conformance.mutants` and each broken plugin of ``tests/broken_plugins.py`` (every one
must fail, pointing at its defect, and only where its defect explains).

The batch is dealt into :data:`SHARDS` test files (``tests/test_conformance_mutants_N.py``), each
one ``python -m kvhal_conformance.mutation --jobs 1`` over its share: with ``--dist loadfile``
the shards go to both xdist workers, between the other files, instead of one 14-minute item
(and two processes of its own) on one worker. :func:`shard_tests` makes each file's fixture and
tests; that every clause of the map is some mutant's to break is
``tests/test_conformance_selftest.py``'s.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.test_conformance_selftest import INSTALLED, contract, run

SHARDS = 4
#: One shard's batch must end within this (its file's timeout adds 300 s for the tests): about
#: 5 min in CI; 900 s was too little at load 12-18 on 2 cores.
SHARD_TIMEOUT_S = 1500
#: Contracts a defect in copying data also fails: the streams-and-events checks watch copied
#: bytes (and say "the copy itself is wrong"), and the throughput check verifies blocks first.
COPY_DATA = ("streams_events", "throughput")
#: broken plugin -> (the contract that must fail, a phrase its message must contain, the other
#: contracts the defect legitimately fails too; every contract not named must not fail)
BROKEN: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "CopiesWrongBlock": ("copies", "holds src block", COPY_DATA),
    "OffByOneLastBlock": ("copies", "(the last block) was not written", COPY_DATA),
    # kvhal's own checks refuse the layout: everything allocating in an offered layout fails
    "StrideOrderNotPermutation": (
        "layouts",
        "hook kvhal_kv_layouts returned a stride order that is not a permutation: layout 'LBHN-tiled'",
        ("allocation", "streams_events", "copies", "bad_input", "throughput"),
    ),
    # a copy's result read as soon as its event completes is missing its bytes
    "EventBeforeCopy": (
        "streams_events",
        "the event kvhal_copy_blocks returns must complete only after every byte is written",
        ("copies",),
    ),
    "IgnoresStream": ("streams_events", "kvhal_copy_blocks must run the copy on the stream it is given", ()),
    # kvhal's facade refuses the fp16 caches: every bf16 cache fails to allocate
    "WrongDtype": (
        "allocation",
        "returned a cache of dtype torch.float16; asked for torch.bfloat16",
        ("layouts", "streams_events", "copies", "bad_input", "throughput"),
    ),
    "TruncatesBatch": ("copies", "the batch was cut short", ("streams_events",)),
    "MutatesSource": ("copies", "changed: a copy must only read its source", COPY_DATA),
    "DirtyHostBuffer": ("host_memory", "non-zero bytes; expected zeroed memory", ()),
    # kvhal copies by the label's layout: blocks land in the wrong places
    "Mislabels": (
        "layouts",
        "returned views not laid out in the layout the cache is labelled with",
        ("copies",),
    ),
    # every check that writes distinct data to a cache reads back another layer's
    "SharedLayers": (
        "allocation",
        "read back different values: views share memory",
        ("layouts", "streams_events", "copies", "bad_input", "throughput"),
    ),
    "RecyclesDirty": ("host_memory", "a reused buffer came back with non-zero bytes", ()),
}

if INSTALLED:
    from kvhal_conformance.mutants import MUTANTS
    from kvhal_conformance.mutation import SLOW_FIRST, mutant_jobs
else:
    MUTANTS, SLOW_FIRST = {}, ()

#: Seconds of a run, roughly (tiny sizes, idle machine): 2 s for the cheap contracts, plus each
#: costly one run (kvhal_conformance.mutation.COSTLY); a mutant of SLOW_FIRST 20 s more, one the
#: worker path replays its traces for 10 s more; a broken plugin runs every contract.
COSTLY_SECONDS = {"TestStreamsEvents": 4.5, "TestCopies": 1.8, "TestDeviceFaults": 0.9}


@functools.cache
def shares() -> list[list[str]]:
    """The batch dealt into SHARDS shares of about equal cost (mutants by name, broken plugins
    as ``broken-NAME``): each item, the costliest first, to the share with the least so far."""
    skips = {j.name: j.skip for j in mutant_jobs()}
    costs = {
        name: 2.0
        + sum(s for c, s in COSTLY_SECONDS.items() if c not in skip)
        + (20.0 if name in SLOW_FIRST else 0.0)
        + (10.0 if "TestWorkerPath" not in skip else 0.0)
        for name, skip in skips.items()
    }
    costs |= {f"broken-{b}": 2.0 + sum(COSTLY_SECONDS.values()) for b in BROKEN}
    dealt: list[list[str]] = [[] for _ in range(SHARDS)]
    totals = [0.0] * SHARDS
    for name in sorted(costs, key=lambda n: -costs[n]):  # stable: ties keep the batch's order
        i = totals.index(min(totals))
        dealt[i].append(name)
        totals[i] += costs[name]
    return dealt


def run_shard(index: int, out: Path) -> Path:
    """Run share ``index`` of the batch into ``out``; print its verdicts (in CI's log)."""
    share = shares()[index]
    mutants = [n for n in share if n in MUTANTS]
    plugins = [
        f"--plugin={n}=tests.broken_plugins:{n.removeprefix('broken-')}" for n in share if n not in MUTANTS
    ]
    if not mutants:  # the batch runs every mutant when none is named: name one of no share
        raise AssertionError(f"shard {index} holds no mutant: {share}")
    proc = run(
        ["-m", "kvhal_conformance.mutation", "--out", str(out), "--jobs", "1", *mutants, *plugins],
        timeout=SHARD_TIMEOUT_S,
    )
    # the batch's last line lists the clauses none of *this shard's* mutants reaches: not
    # printed, the whole map's check is tests/test_conformance_selftest.py's
    print(f"shard {index + 1} of {SHARDS}:")
    print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("clauses no mutant")))
    assert (out / "mutation.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def verdicts(out: Path) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in json.loads((out / "mutation.json").read_text())["verdicts"]}


def check_mutant(out: Path, name: str) -> None:
    """The suite reports every clause the mutant breaks, and none its defect does not explain."""
    v = verdicts(out)[name]
    assert not v["error"], f"{name}: {v['error']}"
    pin_below = getattr(MUTANTS[name].plugin, "pin_below", 0)
    if v["missed"] == ["pinned.witness"] and pin_below:
        pinning = json.loads((out / f"{name}.json").read_text())["pinning"]
        checked = max(c["bytes"] for c in pinning["checked"])
        if checked < pin_below:  # the machine allowed no buffer large enough to reach the defect
            pytest.skip(
                f"{name} locks buffers under {pin_below} bytes; this machine allowed {checked} at most"
            )
    assert not v["missed"], (
        f"{name} ({v['defect']}): the suite missed {v['missed']}; it reported {v['broken']}"
    )
    assert not v.get("judged"), (
        f"{name} ({v['defect']}): must read 'not judged' (their checks rest on a clause it breaks), "
        f"but were judged: {v['judged']}"
    )
    assert not v["stray"], (
        f"{name} ({v['defect']}): clauses its defect does not explain failed: "
        + "; ".join(f"{c}: {v['messages'].get(c, '')}" for c in v["stray"])
    )


def check_broken_plugin(out: Path, broken: str) -> None:
    """The suite fails the broken plugin in the contract it breaks, with a message naming the
    defect, and in no contract its defect does not explain."""
    expected_contract, phrase, also = BROKEN[broken]
    name = f"broken-{broken}"
    path = out / f"{name}.json"
    assert path.exists(), (out / f"{name}.log").read_text()[-3000:]
    report = json.loads(path.read_text())
    assert report["returncode"] != 0
    assert report["verdict"] == "fail"
    failed = contract(report, expected_contract)
    messages = [t["message"] for t in failed["tests"] if t["outcome"] == "fail"]
    assert failed["status"] == "fail", f"{broken}: contract {expected_contract} did not fail: {failed}"
    pointing = [m for m in messages if phrase in m]
    assert pointing, f"{broken}: no failure of {expected_contract} says {phrase!r}: {messages}"
    if expected_contract in ("probe", "layouts"):  # hook contracts name the plugin too
        assert name in pointing[0]
    # a check that fires on a defect it is not about is a false alarm
    unexpected = {
        c["id"]: [t["message"][:300] for t in c["tests"] if t["outcome"] == "fail"]
        for c in report["contracts"]
        if c["status"] == "fail" and c["id"] != expected_contract and c["id"] not in also
    }
    assert not unexpected, f"{broken}: contracts other than {expected_contract} failed: {unexpected}"


def shard_tests(index: int) -> tuple[Any, list[Any], Callable[..., None], Callable[..., None]]:
    """A shard file's fixture ``mutation_run``, its ``pytestmark`` and its two tests,
    parametrized over its share."""
    share = shares()[index] if INSTALLED else []
    mutants = sorted(n for n in share if n in MUTANTS)
    broken = [n.removeprefix("broken-") for n in share if n not in MUTANTS]

    @pytest.fixture(scope="module")
    def mutation_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
        """Run the suite against this shard's mutants and broken plugins, once for the module."""
        return run_shard(index, tmp_path_factory.mktemp(f"mutation-shard{index + 1}-"))

    @pytest.mark.parametrize("name", mutants)
    def test_suite_catches_mutant(mutation_run: Path, name: str) -> None:
        check_mutant(mutation_run, name)

    @pytest.mark.parametrize("broken", broken)
    def test_suite_fails_broken_plugin(mutation_run: Path, broken: str) -> None:
        check_broken_plugin(mutation_run, broken)

    marks = [
        pytest.mark.skipif(
            not INSTALLED, reason="kvhal-conformance is not installed (pip install -e conformance)"
        ),
        pytest.mark.slow,  # the suite run many times over: minutes, in the full run only
        pytest.mark.timeout(SHARD_TIMEOUT_S + 300),  # the first test waits for the shard's batch
    ]
    return mutation_run, marks, test_suite_catches_mutant, test_suite_fails_broken_plugin

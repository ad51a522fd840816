"""``kvhal replay``: the kept worker traces (vLLM engines' connector calls) replayed on the CPU
plugin, every block checked; planted defects (a load that swaps two blocks, a store that drops
its last layer) named by step and block; refused trace files named by field; and the replay
run where vLLM cannot be imported (a device machine's case). Costs about 10 s (each kept trace
replays in about a second; the child without vLLM imports torch once)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvhal.copyplan import CopyPlan
from kvhal.cpu import CPUPlugin
from kvhal.cpu.streams import CPUEvent, CPUStream, InlineStream
from kvhal.hookspecs import hookimpl
from kvhal.registry import PluginRegistry
from kvhal.replay import replay
from kvhal.vllm.trace import TraceError, load, save
from kvhal_conformance.mutants import SwapsBlocksInEngineLoads
from kvhal_conformance.traces import KEPT

CHAT = KEPT["chat-host-sync"]


def _recorded(path: Path) -> tuple[int, int, int]:
    """The trace's steps, the blocks its successful loads filled, and the blocks it stored."""
    events = load(path)["events"]
    filled = sum(len(d) for e in events if e[0] == "loaded" and e[1]["ok"] for d in e[1]["digests"].values())
    stored = sum(len(d) for e in events if e[0] == "stored" for d in e[1]["digests"].values())
    return sum(e[0] == "begin" for e in events), filled, stored


@pytest.mark.parametrize("name", sorted(KEPT))
def test_every_kept_trace_replays_on_the_cpu_plugin(name: str) -> None:
    result = replay(KEPT[name], "cpu")
    assert result.status == "passed", result.failures
    # the checks ran on every block the recording loaded and stored (byte for byte), and every
    # loaded block could be; the smallest kept traces (TP=2's ranks) hold 137 loaded and 86 stored
    steps, filled, stored = _recorded(KEPT[name])
    assert result.blocks_loaded == filled > 50 and result.blocks_stored == stored > 50
    assert result.blocks_unchecked == 0
    assert result.steps == steps > 100 and result.timings_us["layer"]


def test_the_kept_traces_hold_the_geometries_they_are_named_for() -> None:
    """A hybrid model's two groups (one pool, both loaded and stored), TP=2's two ranks, MLA's
    latent cache, and the (K, V) pair form derived from the host chat (scripts/traces/split_kv.py)."""
    hybrid = load(KEPT["chat-hybrid"])
    assert [len(g["layer_names"]) for g in hybrid["config"]["groups"]] == [1, 1]
    assert len(hybrid["caches"]["storages"]) == 1  # vLLM's hybrid allocator: the groups share it
    for kind in ("loaded", "stored"):
        groups = {g for e in hybrid["events"] if e[0] == kind for g, d in e[1]["digests"].items() if d}
        assert groups == {"0", "1"}, (kind, groups)
    for rank in (0, 1):
        trace = load(KEPT[f"chat-tp2-rank{rank}"])
        assert trace["rank"] == rank and trace["config"]["world_size"] == 2
    mla = load(KEPT["chat-mla"])  # vLLM's CPU_MLA: [B, 1, 16, 576] a layer, kv_lora_rank + rope
    assert {tuple(v["shape"][1:]) for v in mla["caches"]["layers"].values()} == {(1, 16, 576)}
    pair, source = load(KEPT["chat-host-sync-kv-pair"]), load(KEPT["chat-host-sync"])
    assert pair["derived"].startswith("derived by scripts/traces/split_kv.py")
    assert all(len(v["parts"]) == 2 for v in pair["caches"]["layers"].values())
    assert len(pair["caches"]["storages"]) == 2  # K's and V's, as vllm-ascend allocates them
    assert (pair["config"], pair["events"]) == (source["config"], source["events"])


class _Defect(CPUPlugin):
    """The CPU plugin, told which copies are loads (host buffer -> KV cache) and stores."""

    def __init__(self) -> None:
        super().__init__()
        self.host: list[tuple[int, int]] = []  # host buffers' address ranges

    @hookimpl
    def kvhal_allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = super().kvhal_allocate_host_buffer(nbytes)
        self.host.append((buffer.data_ptr(), buffer.data_ptr() + nbytes))
        return buffer

    def _in_host(self, plan_side: object) -> bool:
        address = plan_side.layers[0][0].data_ptr()  # type: ignore[attr-defined]
        return any(lo <= address < hi for lo, hi in self.host)

    def damage(self, plan: CopyPlan, load: bool) -> None:
        raise NotImplementedError

    @hookimpl
    def kvhal_copy_blocks(self, plan: CopyPlan, stream: CPUStream | InlineStream) -> CPUEvent:
        engine, load = self.engine, self._in_host(plan.src)

        def copy() -> None:
            engine.run(*plan.descriptors)
            self.damage(plan, load)

        stream.submit(copy)
        done = CPUEvent()
        stream.record(done)
        return done


class DropsTheLastLayerOfAStore(_Defect):
    """A store leaves its last layer's bytes as they were in host memory (zeroed here)."""

    def damage(self, plan: CopyPlan, load: bool) -> None:
        if not load:
            for part in plan.dst.layers[-1]:
                for dst in plan.mapping[:, 1]:
                    part[int(dst)].zero_()


@pytest.mark.parametrize(
    ("defect", "named"),
    [
        (SwapsBlocksInEngineLoads, "load job"),  # the conformance suite's worker-path mutant
        (DropsTheLastLayerOfAStore, "store job"),
    ],
)
def test_a_planted_defect_fails_the_replay_naming_step_block_and_layer(defect: type, named: str) -> None:
    registry = PluginRegistry()
    registry.register(defect(), "defect")
    result = replay(CHAT, "defect", registry=registry)
    assert result.status == "failed"
    first = result.failures[0]
    assert first.startswith("step ") and named in first and "device block" in first, first
    assert "byte " in first and "expected 0x" in first
    if defect is DropsTheLastLayerOfAStore:  # the last layer, by index and by vLLM's name
        assert "layer 5 (model.layers.5.self_attn.attn)" in first, first
    # negative control: the same registry's own CPU plugin replays the trace clean
    assert replay(CHAT, "cpu", registry=registry).status == "passed"


def _rewrite(tmp_path: Path, change: object) -> Path:
    trace = load(CHAT)
    change(trace)  # type: ignore[operator]
    out = tmp_path / "changed.json.gz"
    save(out, trace)
    return out


def test_a_trace_of_another_version_is_refused_naming_the_field(tmp_path: Path) -> None:
    path = _rewrite(tmp_path, lambda t: t.update(version=99))
    with pytest.raises(TraceError, match=r"trace version: .*version 99.*record the trace again") as info:
        replay(path, "cpu")
    assert info.value.field == "version"


def test_an_altered_trace_is_refused_by_its_digest(tmp_path: Path) -> None:
    data = json.loads(gzip.decompress(CHAT.read_bytes()))
    data["events"][5][1] = "model.layers.9.self_attn.attn"  # one event changed, digest kept
    path = tmp_path / "altered.json.gz"
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    with pytest.raises(TraceError, match=r"trace digest: .*altered"):
        replay(path, "cpu")


def test_a_truncated_or_foreign_file_is_refused(tmp_path: Path) -> None:
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(CHAT.read_bytes()[:2000])
    with pytest.raises(TraceError, match=r"trace file: .*truncated"):
        replay(cut, "cpu")
    foreign = tmp_path / "foreign.json.gz"
    foreign.write_bytes(gzip.compress(json.dumps({"format": "something-else", "events": []}).encode()))
    with pytest.raises(TraceError, match=r"trace format: .*not a kvhal worker trace"):
        replay(foreign, "cpu")


def test_a_field_of_the_wrong_kind_is_named(tmp_path: Path) -> None:
    def change(trace: dict) -> None:
        begin = next(e for e in trace["events"] if e[0] == "begin" and e[1]["stores"])
        begin[1]["stores"][0]["groups"]["0"][0][0] = "seven"

    with pytest.raises(TraceError, match=r"stores\[0\]\.groups\.0.*expected an integer, found 'seven'"):
        replay(_rewrite(tmp_path, change), "cpu")


def test_a_geometry_the_device_cannot_allocate_is_not_tested(tmp_path: Path) -> None:
    path = _rewrite(tmp_path, lambda t: t["caches"].update(storages=[1 << 60]))
    result = replay(path, "cpu")
    assert result.status == "not tested"
    assert "cannot be allocated" in result.reason


def test_the_replay_runs_where_vllm_cannot_be_imported() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # import vllm raises, as on a device machine
        "from kvhal.replay import replay\n"
        f"r = replay({str(CHAT)!r}, 'cpu')\n"
        "assert 'vllm' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
        "print(r.status, r.blocks_loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "passed" and int(out.stdout.split()[1]) > 100

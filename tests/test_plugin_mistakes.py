"""Deliberate plugin mistakes (issue 16): each is an error naming the plugin and the hook at
fault, in ``kvhal devices``, ``select_device`` and the conformance suite alike."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from kvhal.cache import allocate_dense_kv_cache
from kvhal.copyplan import plan_copy
from kvhal.cpu import CPUPlugin
from kvhal.cpu.streams import CPUEvent
from kvhal.descriptor import DeviceDescriptor
from kvhal.errors import MalformedResultError, PluginLoadError, TransferError
from kvhal.geometry import KVGeometry
from kvhal.hookspecs import hookimpl
from kvhal.layouts import BLHNC, LBHNC
from kvhal.registry import PluginRegistry

base = pytest.importorskip("kvhal_conformance.base")
mutants = pytest.importorskip("kvhal_conformance.mutants")
timing = pytest.importorskip("kvhal_conformance.timing")
streamcase = pytest.importorskip("kvhal_conformance.streamcase")

pytest_plugins = ["pytester"]
REPO = Path(__file__).resolve().parents[1]

PYHOST = """
from kvhal.cpu import CPUPlugin
from kvhal.descriptor import DeviceDescriptor
from kvhal.hookspecs import hookimpl


class PyHostPlugin(CPUPlugin):
    @hookimpl
    def kvhal_probe(self):
        return DeviceDescriptor(name="pyhost", torch_device_type="cpu", vendor="tests", priority=5)
"""


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A distribution ``pyhost-plugin`` whose module defines a plugin class, on sys.path; its
    entry point is written by :func:`entry_point`."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "pyhost.py").write_text(textwrap.dedent(PYHOST))
    info = site / "pyhost_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pyhost-plugin\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(site))
    for var in ("KVHAL_DEVICE", "KVHAL_PLUGINS", "KVHAL_DISABLE_PLUGINS", "KVHAL_DISABLE_PLUGIN_AUTOLOAD"):
        monkeypatch.delenv(var, raising=False)
    return site


def entry_point(site: Path, target: str) -> None:
    (site / "pyhost_plugin-1.0.dist-info" / "entry_points.txt").write_text(
        f"[kvhal.plugins]\npyhost = {target}\n"
    )
    importlib.invalidate_caches()


def run_kvhal(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    command = [sys.executable, "-m", "kvhal.cli", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)


NO_HOOKS = (
    "plugin 'pyhost' (distribution pyhost-plugin 1.0): registers no kvhal hooks: it is the module 'pyhost'"
)
HINT = "name the plugin object in the entry point instead: 'pyhost:PyHostPlugin'"


# -- an entry point naming the module instead of the plugin ---------------------------------


def test_select_device_names_a_module_entry_point_and_the_object_meant(site: Path) -> None:
    entry_point(site, "pyhost")
    with pytest.raises(PluginLoadError) as raised:
        PluginRegistry().select("pyhost")
    assert (raised.value.plugin, raised.value.distribution) == ("pyhost", "pyhost-plugin 1.0")
    assert NO_HOOKS in str(raised.value) and HINT in str(raised.value)
    with pytest.raises(PluginLoadError, match="registers no kvhal hooks"):
        PluginRegistry().select()  # never a silent fall-back to the CPU


def test_the_entry_point_naming_the_class_works(site: Path) -> None:
    """Negative control: the same distribution, its entry point naming the plugin class."""
    entry_point(site, "pyhost:PyHostPlugin")
    assert PluginRegistry().select("pyhost").plugin_name == "pyhost"


def test_an_object_with_no_hooks_is_refused_naming_it() -> None:
    registry = PluginRegistry(autoload=False)
    info = registry.register(object(), "empty", "kvhal-empty 0.1")
    assert info.plugin is None and info.error is not None
    assert (
        "plugin 'empty' (distribution kvhal-empty 0.1): registers no kvhal hooks: object has no method"
        in str(info.error)
    )
    assert registry.register(CPUPlugin(), "fine").error is None  # negative control


def test_kvhal_devices_reports_a_module_entry_point_as_an_error(site: Path) -> None:
    entry_point(site, "pyhost")
    done = run_kvhal(site, "devices", "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    [row] = [r for r in report["plugins"] if r["plugin"] == "pyhost"]
    assert row["status"] == "error" and NO_HOOKS in row["reason"] and HINT in row["reason"]
    assert NO_HOOKS in report["error"]
    entry_point(site, "pyhost:PyHostPlugin")  # negative control
    assert run_kvhal(site, "devices", "--json").returncode == 0


def test_kvhal_conformance_reports_a_module_entry_point_and_writes_its_report(
    site: Path, tmp_path: Path
) -> None:
    entry_point(site, "pyhost")
    out = tmp_path / "report"
    done = run_kvhal(
        site,
        "conformance",
        "--device",
        "pyhost",
        "--report",
        str(out),
        "--kvhal-sizes",
        "tiny",
        "-k",
        "test_required_hooks_implemented",
    )
    assert done.returncode == 1, done.stdout + done.stderr  # a failed contract, no internal error (3)
    assert "INTERNALERROR" not in done.stdout + done.stderr
    assert NO_HOOKS in done.stdout and HINT in done.stdout
    report = json.loads((out / "pyhost.json").read_text())
    assert report["verdict"] != "pass" and NO_HOOKS in json.dumps(report)


# -- messages that name the hook at fault ---------------------------------------------------


def test_a_misnamed_hook_argument_is_explained_on_one_line() -> None:
    class Misnamed(CPUPlugin):
        @hookimpl
        def kvhal_copy_blocks(self, plan, strm):  # the spec's argument is 'stream'
            return None

    info = PluginRegistry(autoload=False).register(Misnamed(), "misnamed", "kvhal-misnamed 0.1")
    message = str(info.error)
    assert "\n" not in message and info.error.hook == "kvhal_copy_blocks"
    assert (
        "takes argument(s) 'strm', which the hookspec kvhal_copy_blocks(plan, stream) does not define"
        in message
    )


def test_a_copy_that_returns_nothing_is_told_an_event_was_expected() -> None:
    class ReturnsNothing(CPUPlugin):
        @hookimpl
        def kvhal_probe(self):
            return DeviceDescriptor("nothing", "cpu", "tests", priority=5)

        @hookimpl
        def kvhal_copy_blocks(self, plan, stream):
            return None

    registry = PluginRegistry(autoload=False)
    registry.register(ReturnsNothing(), "nothing", "kvhal-nothing 0.1")
    device = registry.select("nothing")
    g = KVGeometry(2, 8, 4, 2, 8, torch.float32)
    cache, host = device.allocate_kv_cache(g, LBHNC), device.allocate_host_cache(g, LBHNC, 4)
    with pytest.raises(
        MalformedResultError, match="hook kvhal_copy_blocks: returned None; expected an event"
    ):
        device.copy_blocks(cache, host, [(1, 0)])


def test_every_first_result_device_hook_says_what_it_expected() -> None:
    from kvhal.device import EXPECTED_RESULTS
    from kvhal.hookspecs import DEVICE_HOOKS

    registry = PluginRegistry(autoload=False)
    first_result = {h for h in DEVICE_HOOKS if getattr(registry.pm.hook, h).spec.opts.get("firstresult")}
    assert first_result - {"kvhal_probe"} == set(EXPECTED_RESULTS)


@pytest.fixture
def busy_of():
    def make(plugin: object):
        device = base.Target.of_plugin(plugin, "under-test").device
        return device, timing.Busy(device, device.kv_layouts()[0], base.TINY.scratch_bytes)

    return make


@pytest.mark.parametrize(
    ("plugin", "clause"),
    [
        (mutants.RecordFollowsRunningWork, "record.after_work"),  # queued work ignored by records
        (mutants.RecordCompletesAtOnce, "record.after_work"),
        (mutants.PrivateCopyStream, "copy.on_stream"),  # negative control: records are right
    ],
)
def test_an_early_event_after_a_copy_is_blamed_on_the_hook_at_fault(
    busy_of, plugin: type, clause: str
) -> None:
    device, busy = busy_of(plugin())
    assert {streamcase.early_record_clause(device, busy) for _ in range(3)} == {clause}


def test_a_chain_copy_never_delivered_names_kvhal_copy_blocks() -> None:
    from kvhal_conformance.streamrig import COPY_WRONG

    assert COPY_WRONG.startswith("kvhal_copy_blocks copied this batch wrong")


# -- an injected copy failure ---------------------------------------------------------------


class TensorCopies(CPUPlugin):
    """Copies block by block through the caches' views, on its stream; never reads the plan's
    descriptors, runs or families (as a plugin calling a block-table kernel would)."""

    swallow = False

    @hookimpl
    def kvhal_copy_blocks(self, plan, stream):
        swallow = self.swallow

        def copy() -> None:
            try:
                for src_layer, dst_layer in zip(plan.src.layers, plan.dst.layers, strict=True):
                    for src, dst in zip(src_layer, dst_layer, strict=True):
                        dst[torch.from_numpy(plan.dst_ids)] = src[torch.from_numpy(plan.src_ids)]
            except Exception:
                if not swallow:
                    raise

        stream.submit(copy)
        done = CPUEvent()
        stream.record(done)
        return done


class SwallowingTensorCopies(TensorCopies):
    """Catches its copy's failure and completes the event normally."""

    swallow = True


FAILURE_SUITE = """
import pytest
from kvhal_conformance import base
from tests.test_plugin_mistakes import SwallowingTensorCopies, TensorCopies


class Fixtures(base.ContractFixtures):
    plugin = TensorCopies

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_target(cls):
        return base.Target.of_plugin(cls.plugin(), "vendor")

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_sizes(cls):
        return base.TINY


class TestTensorCopies(base.StreamsEventsContract, Fixtures):
    pass


class TestSwallowing(base.StreamsEventsContract, Fixtures):
    plugin = SwallowingTensorCopies
"""


def test_the_injected_failure_reaches_a_plugin_that_copies_through_the_views(
    pytester: pytest.Pytester,
) -> None:
    """The failure check makes the copy fail whatever the plugin reads to locate the bytes: a
    plugin copying through the caches' views reports it as TransferError and passes; the same
    plugin swallowing it fails, naming copy.error."""
    pytester.syspathinsert(str(REPO))
    pytester.makepyfile(test_failure_vendor=FAILURE_SUITE)
    recorder = pytester.inline_run("-p", "no:cacheprovider", "-k", "test_failed_copy_reports_transfer_error")
    reports = [r for r in recorder.getreports("pytest_runtest_logreport") if r.when == "call"]
    outcome = {r.nodeid.split("::")[1]: r for r in reports}
    assert outcome["TestTensorCopies"].passed, outcome["TestTensorCopies"].longrepr
    assert outcome["TestSwallowing"].failed
    assert "[copy.error] a copy that failed" in str(outcome["TestSwallowing"].longrepr)


def test_an_accelerator_plugin_reports_an_unreadable_plan_through_its_event() -> None:
    """The CUDA/ROCm/NPU copy hook reads the plan on the caller's thread: a failure there goes to
    the event too, it does not raise from kvhal_copy_blocks."""
    from kvhal.testing.accel import FakeStreamModule
    from tests.test_accel_copies import Plugin, Spy

    g = KVGeometry(2, 8, 4, 2, 8, torch.float16)
    plan = plan_copy(
        allocate_dense_kv_cache(g, BLHNC, "cpu"), allocate_dense_kv_cache(g, BLHNC, "cpu"), [(1, 5)]
    )
    module = FakeStreamModule()
    plugin = Plugin(module, Spy(module))
    event = plugin.kvhal_copy_blocks(streamcase.failing_plan(plan), module.Stream())
    with pytest.raises(TransferError, match="InjectedCopyFailure"):
        plugin.kvhal_synchronize_event(event)
    ok = plugin.kvhal_copy_blocks(plan, module.Stream())  # negative control
    plugin.kvhal_synchronize_event(ok)


# -- pinning waits ----------------------------------------------------------------------------


def test_a_plugin_that_never_pins_is_waited_for_once_with_progress_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shown: list[str] = []
    monkeypatch.setattr(timing, "_reporter", shown.append)
    monkeypatch.setattr(timing, "PROGRESS_EVERY_S", 0.1)
    before = timing.PIN_TIMEOUT_S
    timing.set_pin_timeout(0.35)
    try:
        device = base.Target.of_plugin(mutants.NeverPins(), "neverpins").device
        buffer = device.allocate_host_buffer(4096)
        assert not timing.wait_pinned(device, buffer)
        assert (
            shown
            and "plugin 'neverpins' declares host.pinned; waiting for kvhal_host_buffer_is_pinned" in shown[0]
        )
        # another Device of the same plugin (a vendor suite binds one per class) is not waited for
        again = base.Target.of_plugin(mutants.NeverPins(), "neverpins").device
        count = len(shown)
        assert not timing.wait_pinned(again, again.allocate_host_buffer(4096), timeout=30)
        assert len(shown) == count
        cpu = base.Target.find("cpu").device  # negative control: a plugin that pins is not affected
        assert timing.wait_pinned(cpu, cpu.allocate_host_buffer(4096))
    finally:
        timing.set_pin_timeout(before)


def test_long_waits_show_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    shown: list[str] = []
    monkeypatch.setattr(timing, "_reporter", shown.append)
    monkeypatch.setattr(timing, "PROGRESS_EVERY_S", 0.05)
    device = base.Target.find("cpu").device
    busy = timing.Busy(device, device.kv_layouts()[0], base.TINY.scratch_bytes)
    # Busy estimates a copy's time by a torch copy's; the CPU plugin's native kernel copies
    # faster than that on some machines, and the waits below then end before they are long.
    # Measure this device's own rate first.
    stream = device.create_stream()
    start = time.perf_counter()
    event, estimate = busy.occupy(stream, 0.2)
    device.synchronize_event(event)
    if estimate > 0:  # 0: the calibration was so slow (a loaded machine) that no copy was queued
        busy.copy_seconds *= (time.perf_counter() - start) / estimate

    def occupy(seconds: float) -> object:
        # occupy() stops at MAX_BUSY_COPIES: when its calibration ran on a loaded machine,
        # one call can be far shorter than asked, so ask until the estimate adds up
        stream, total, event = device.create_stream(), 0.0, None
        while total < seconds:
            event, more = busy.occupy(stream, seconds - total)
            total += more
        return event

    event = occupy(0.5)
    timing.wait(device, event, "busy work for the test")
    assert any(
        "kvhal_synchronize_event has not returned after" in m and "busy work for the test" in m for m in shown
    )
    event = occupy(2.0)
    with pytest.raises(pytest.fail.Exception, match="kvhal_query_event still reports incomplete after"):
        timing.poll(device, event, "busy work that outlasts the limit", limit_s=0.3)
    assert any("kvhal_query_event still reports incomplete" in m for m in shown)
    timing.wait(device, event, "the rest of the busy work")

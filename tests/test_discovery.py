"""Plugin discovery through real entry points, selection rules, and errors that name the culprit."""

from __future__ import annotations

import importlib
import json
import textwrap

import pytest
import torch

from kvhal.cli import main as kvhal_main
from kvhal.cpu import CPUPlugin
from kvhal.descriptor import DeviceDescriptor
from kvhal.errors import (
    DeviceSelectionError,
    MalformedResultError,
    MissingHookError,
    PluginError,
    PluginLoadError,
)
from kvhal.geometry import KVGeometry
from kvhal.hookspecs import hookimpl
from kvhal.layouts import LBHNC
from kvhal.registry import PluginRegistry

FAKE_ACCEL = """
from kvhal.cpu import CPUPlugin
from kvhal.descriptor import DeviceDescriptor
from kvhal.hookspecs import hookimpl


class FakeAccelerator(CPUPlugin):
    # Serves CPU tensors but ranks like an accelerator.
    @hookimpl
    def kvhal_probe(self):
        return DeviceDescriptor(name="{name}", torch_device_type="cpu", vendor="tests", priority={priority})
"""

DECLINES = """
from kvhal.descriptor import Refusal
from kvhal.hookspecs import hookimpl


@hookimpl
def kvhal_probe():
    return Refusal("no fake hardware on this machine")
"""

BROKEN_IMPORT = """
raise ImportError("libfakedriver.so.3: cannot open shared object file")
"""

TYPO = """
from kvhal.hookspecs import hookimpl


@hookimpl
def kvhal_prob():
    return None
"""


@pytest.fixture
def install(tmp_path, monkeypatch):
    """Install a one-module distribution with a ``kvhal.plugins`` entry point onto sys.path."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    for var in ("KVHAL_DEVICE", "KVHAL_PLUGINS", "KVHAL_DISABLE_PLUGINS", "KVHAL_DISABLE_PLUGIN_AUTOLOAD"):
        monkeypatch.delenv(var, raising=False)

    def make(dist: str, entry: str, module: str, source: str, target: str | None = None) -> None:
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[kvhal.plugins]\n{entry} = {target or module}\n")
        importlib.invalidate_caches()

    return make


def install_fake_accel(install) -> None:
    """The distribution ``fake-accel`` with an accelerator plugin ``fakeaccel`` of priority 100."""
    install(
        "fake-accel",
        "fakeaccel",
        "fake_accel",
        FAKE_ACCEL.format(name="fakeaccel", priority=100),
        "fake_accel:FakeAccelerator",
    )


def test_entry_point_plugin_found_and_selected(install):
    install_fake_accel(install)
    registry = PluginRegistry()
    selection = registry.explain()
    assert selection.device.plugin_name == "fakeaccel"
    assert selection.device.distribution == "fake-accel 1.0"
    assert "highest priority (100)" in selection.why
    assert selection.others["cpu"] == "present, but priority 0 < 100 of 'fakeaccel'"


def test_override_by_env_and_argument(install, monkeypatch):
    install_fake_accel(install)
    monkeypatch.setenv("KVHAL_DEVICE", "cpu")
    selection = PluginRegistry().explain()
    assert selection.device.plugin_name == "cpu"
    assert selection.why == "named by KVHAL_DEVICE"
    assert PluginRegistry().select("fakeaccel").plugin_name == "fakeaccel"  # argument beats env


def test_declining_plugin_explains_itself(install):
    install("fake-absent", "absent", "fake_absent", DECLINES)
    registry = PluginRegistry()
    selection = registry.explain()
    assert selection.device.plugin_name == "cpu"
    assert selection.others["absent"] == "no fake hardware on this machine"
    with pytest.raises(DeviceSelectionError, match="'absent' was asked for but declined: no fake hardware"):
        registry.select("absent")


def test_import_failure_names_plugin_and_distribution_and_never_falls_back(install):
    install("fake-broken", "broken", "fake_broken", BROKEN_IMPORT)
    with pytest.raises(PluginLoadError) as info:
        PluginRegistry().select()
    message = str(info.value)
    assert "plugin 'broken'" in message
    assert "distribution fake-broken 1.0" in message
    assert "libfakedriver.so.3" in message
    # blocking it is the user's explicit choice; then the CPU is selected
    assert PluginRegistry(block="broken").select().plugin_name == "cpu"


def test_devices_cli_reports_every_plugin(install, capsys):
    install("fake-absent", "absent", "fake_absent", DECLINES)
    install("fake-broken", "broken", "fake_broken", BROKEN_IMPORT)
    assert kvhal_main(["devices", "--json"]) == 1  # the broken plugin stops selection
    report = json.loads(capsys.readouterr().out)
    status = {row["plugin"]: (row["status"], row["reason"]) for row in report["plugins"]}
    assert status["absent"] == ("declined", "no fake hardware on this machine")
    assert status["broken"][0] == "error" and "fake-broken 1.0" in status["broken"][1]
    assert report["selected"] is None and "broken" in report["error"]

    capsys.readouterr()
    assert kvhal_main(["devices", "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["selected"] == "cpu" and report["why"] == "named by argument"


def test_typo_hook_is_named(install):
    install("fake-typo", "typo", "fake_typo", TYPO)
    registry = PluginRegistry()
    info = next(p for p in registry.plugins if p.name == "typo")
    assert isinstance(info.error, PluginLoadError)
    assert info.error.hook == "kvhal_prob"
    assert "kvhal does not define" in str(info.error)


def test_allowlist_and_blocklist(install):
    install_fake_accel(install)
    registry = PluginRegistry(allow="cpu")
    assert registry.select().plugin_name == "cpu"
    skipped = next(p for p in registry.plugins if p.name == "fakeaccel")
    assert not skipped.loaded and "allowlist" in skipped.blocked_by
    registry = PluginRegistry(block=["fakeaccel"])
    assert registry.select().plugin_name == "cpu"
    with pytest.raises(DeviceSelectionError, match="blocked"):
        registry.select("fakeaccel")


def test_autoload_off_keeps_builtin_only(install, monkeypatch):
    install_fake_accel(install)
    monkeypatch.setenv("KVHAL_DISABLE_PLUGIN_AUTOLOAD", "1")
    names = [p.name for p in PluginRegistry().plugins]
    assert "cpu" in names and "fakeaccel" not in names
    assert all(p.distribution == "kvhal (built-in)" for p in PluginRegistry().plugins)


def test_tie_is_an_error(install):
    install(
        "fake-a", "accel-a", "fake_a", FAKE_ACCEL.format(name="a", priority=100), "fake_a:FakeAccelerator"
    )
    install(
        "fake-b", "accel-b", "fake_b", FAKE_ACCEL.format(name="b", priority=100), "fake_b:FakeAccelerator"
    )
    with pytest.raises(DeviceSelectionError, match="several device plugins are present with priority 100"):
        PluginRegistry().select()


def test_device_type_filter(registry):
    assert registry.select(device_type="cpu").plugin_name == "cpu"
    with pytest.raises(
        DeviceSelectionError, match=r"for torch device type 'cuda'\. Plugins found: cpu: present"
    ):
        registry.select(device_type="cuda")


# -- plugins registered directly: malformed results are named ---------------------------


class MalformedProbe:
    @hookimpl
    def kvhal_probe(self):
        return "yes, a GPU"


class RaisingProbe:
    @hookimpl
    def kvhal_probe(self):
        raise RuntimeError("driver version mismatch")


class NotAPermutation(CPUPlugin):
    @hookimpl
    def kvhal_probe(self):
        return DeviceDescriptor("badlayout", "cpu", "tests", priority=100)

    @hookimpl
    def kvhal_kv_layouts(self, attention_backend):
        from kvhal.layouts import KVLayout

        return [KVLayout("mine", (0, 0, 1, 2, 3))]


class TupleLayouts(NotAPermutation):
    @hookimpl
    def kvhal_kv_layouts(self, attention_backend):
        return [("LBHNC", (0, 1, 2, 3, 4))]


class WrongAllocation(NotAPermutation):
    @hookimpl
    def kvhal_kv_layouts(self, attention_backend):
        return [LBHNC]

    @hookimpl
    def kvhal_allocate_kv_cache(self, geometry, layout, device):
        from kvhal.cache import allocate_dense_kv_cache

        return allocate_dense_kv_cache(geometry.with_num_blocks(geometry.num_blocks - 1), layout, device)


class ProbeOnly:
    @hookimpl
    def kvhal_probe(self):
        return DeviceDescriptor("half", "cpu", "tests", priority=100)

    @hookimpl
    def kvhal_kv_layouts(self, attention_backend):
        return [LBHNC]


@pytest.mark.parametrize(
    ("plugin", "error", "hook", "text"),
    [
        (MalformedProbe(), MalformedResultError, "kvhal_probe", "returned str 'yes, a GPU'"),
        (RaisingProbe(), PluginError, "kvhal_probe", "RuntimeError: driver version mismatch"),
    ],
)
def test_bad_probe_is_named(registry, plugin, error, hook, text):
    registry.register(plugin, "vendorx", "kvhal-vendorx 2.1")
    with pytest.raises(error) as info:
        registry.select()
    assert (info.value.plugin, info.value.distribution, info.value.hook) == (
        "vendorx",
        "kvhal-vendorx 2.1",
        hook,
    )
    assert text in str(info.value)


def test_stride_order_not_a_permutation_is_named(registry):
    registry.register(NotAPermutation(), "badlayout", "kvhal-badlayout 0.1")
    device = registry.select()
    with pytest.raises(PluginError) as info:
        device.kv_layouts()
    assert info.value.hook == "kvhal_kv_layouts" and info.value.plugin == "badlayout"
    assert "not a permutation" in str(info.value)


def test_layouts_of_wrong_type_are_named(registry):
    registry.register(TupleLayouts(), "badlayout", "kvhal-badlayout 0.1")
    with pytest.raises(MalformedResultError, match=r"hook kvhal_kv_layouts: returned \('LBHNC'"):
        registry.select().kv_layouts()


def test_wrong_allocation_is_named(registry):
    registry.register(WrongAllocation(), "badalloc", "kvhal-badalloc 0.1")
    g = KVGeometry(2, 8, 4, 2, 8, torch.float32)
    with pytest.raises(MalformedResultError, match="hook kvhal_allocate_kv_cache: returned a LBHNC cache"):
        registry.select().allocate_kv_cache(g, LBHNC)


def test_missing_required_hook_is_named(registry):
    registry.register(ProbeOnly(), "half", "kvhal-half 0.1")
    with pytest.raises(MissingHookError) as info:
        registry.select("half")
    assert info.value.hook == "kvhal_allocate_kv_cache"
    assert "plugin 'half' (distribution kvhal-half 0.1), hook kvhal_allocate_kv_cache" in str(info.value)


def test_only_the_selected_device_plugin_answers(registry):
    """The CPU plugin's hooks must not run for another selected device; non-device wrappers do."""
    calls = []

    class Tracer:
        @hookimpl(wrapper=True)
        def kvhal_copy_blocks(self, plan, stream):
            calls.append(("tracer", plan.num_blocks))
            return (yield)

    class Accel(NotAPermutation):
        @hookimpl
        def kvhal_kv_layouts(self, attention_backend):
            return [LBHNC]

        @hookimpl
        def kvhal_copy_blocks(self, plan, stream):
            calls.append(("accel", plan.num_blocks))
            return super().kvhal_copy_blocks(plan, stream)

    class SpyCPU(CPUPlugin):
        @hookimpl
        def kvhal_probe(self):
            return DeviceDescriptor("spy", "cpu", "tests", priority=0)

        @hookimpl
        def kvhal_copy_blocks(self, plan, stream):
            calls.append(("spy", plan.num_blocks))
            return super().kvhal_copy_blocks(plan, stream)

    registry.register(Accel(), "accel", "kvhal-accel 0.1")
    # Registered later, so pluggy would call it first if kvhal did not exclude unselected devices.
    registry.register(SpyCPU(), "spy", "tests")
    registry.register(Tracer(), "tracer", "tests")
    device = registry.select()
    assert device.plugin_name == "accel"
    g = KVGeometry(2, 8, 4, 2, 8, torch.float32)
    cache = device.allocate_kv_cache(g)
    host = device.allocate_host_cache(g, LBHNC, 4)
    device.synchronize_event(device.copy_blocks(cache, host, [(1, 0), (2, 1)]))
    assert calls == [("tracer", 2), ("accel", 2)]


def test_probes_and_policy_offers_go_through_the_hook_caller(registry):
    """A non-device wrapper (tracing, fault injection) sees every probe and every policy offer."""
    seen = []

    class Tracer:
        @hookimpl(wrapper=True)
        def kvhal_probe(self):
            result = yield
            seen.append(("probe", [type(r).__name__ for r in result]))
            return result

        @hookimpl(wrapper=True)
        def kvhal_eviction_policies(self):
            result = yield
            seen.append(("policies", sorted(name for offer in result for name in offer)))
            return result

    registry.register(Tracer(), "tracer", "tests")
    assert registry.select().plugin_name == "cpu"
    from kvhal.offload.eviction import available_policies

    assert set(available_policies(registry)) == {"clock", "lru", "s3fifo"}
    assert ("probe", ["DeviceDescriptor"]) in seen
    assert ("policies", ["clock", "lru", "s3fifo"]) in seen


def test_a_refused_hook_signature_is_named_without_parsing_pluggys_message(registry):
    class Misnamed:
        @hookimpl
        def kvhal_probe(self):
            return DeviceDescriptor("misnamed", "cpu", "tests")

        @hookimpl
        def kvhal_copy_blocks(self, plan, stream, priority):  # 'priority' is no argument of the spec
            return None

    info = registry.register(Misnamed(), "misnamed", "kvhal-misnamed 0.1")
    assert info.error is not None and info.error.hook == "kvhal_copy_blocks"


def test_an_entry_point_whose_name_is_taken_is_reported_not_dropped(install, caplog):
    """A third party's ``cpu`` (kvhal's built-in name) and a second ``fakeaccel``: neither loads,
    each says why in the registry (what ``kvhal devices`` lists) and in one warning."""
    install_fake_accel(install)
    install(
        "third-party-cpu",
        "cpu",
        "third_cpu",
        FAKE_ACCEL.format(name="cpu", priority=5),
        "third_cpu:FakeAccelerator",
    )
    install(
        "other-accel",
        "fakeaccel",
        "other_accel",
        FAKE_ACCEL.format(name="fakeaccel", priority=7),
        "other_accel:FakeAccelerator",
    )
    with caplog.at_level("WARNING", logger="kvhal.registry"):
        registry = PluginRegistry()
    blocked = {p.distribution: p.blocked_by for p in registry.plugins if p.blocked_by}
    assert "taken by kvhal's built-in plugin" in blocked["third-party-cpu 1.0"]
    assert "taken by distribution " in blocked[next(d for d in blocked if d != "third-party-cpu 1.0")]
    assert len([r for r in caplog.records if "not loaded" in r.getMessage()]) == 2
    loaded = [p for p in registry.plugins if p.name == "fakeaccel" and p.loaded]
    assert len(loaded) == 1, "exactly one of the two fakeaccel entry points is loaded"

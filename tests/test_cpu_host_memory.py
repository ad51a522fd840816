"""The CPU plugin's host memory: it locks what it declares (``host.pinned``) and declares what it locks."""

from __future__ import annotations

import errno
import resource

import pytest

from kvhal.cpu import memory
from kvhal.cpu.plugin import CPUPlugin
from kvhal.errors import PluginError
from kvhal.registry import PluginRegistry

MiB = 1 << 20


@pytest.mark.parametrize(
    ("enabled", "limit", "cap", "locks", "reason"),
    [
        (True, resource.RLIM_INFINITY, False, True, "RLIMIT_MEMLOCK unlimited"),
        (True, 8 * MiB, True, True, "CAP_IPC_LOCK"),
        (True, 8 * MiB, False, False, "RLIMIT_MEMLOCK is 8 MiB"),
        (True, 64 * 1024, False, False, "RLIMIT_MEMLOCK is 65536 bytes"),
        (False, resource.RLIM_INFINITY, True, False, "KVHAL_CPU_MLOCK=0"),
    ],
)
def test_locking_is_promised_only_when_any_size_can_be_locked(enabled, limit, cap, locks, reason):
    policy = memory.decide_locking(enabled, limit, cap)
    assert policy.lock is locks
    assert reason in policy.reason


def plugin_with(policy: memory.LockPolicy) -> CPUPlugin:
    plugin = CPUPlugin()
    plugin._lock_policy = policy
    return plugin


def test_a_limited_memlock_means_no_host_pinned_and_devices_says_why():
    plugin = plugin_with(memory.decide_locking(True, 8 * MiB, False))
    descriptor = plugin.kvhal_probe()
    assert not descriptor.supports("host.pinned")
    assert "RLIMIT_MEMLOCK is 8 MiB" in descriptor.details["host_memory"]
    buffer = plugin.kvhal_allocate_host_buffer(nbytes=32 * MiB)  # larger than the limit: no attempt
    assert not plugin.kvhal_host_buffer_is_pinned(buffer=buffer)
    plugin.kvhal_free_host_buffer(buffer=buffer)


def test_declared_locking_locks_every_buffer():
    policy = memory.decide_locking(True, resource.RLIM_INFINITY, False)
    plugin = plugin_with(policy)
    assert plugin.kvhal_probe().supports("host.pinned")
    try:
        buffers = [plugin.kvhal_allocate_host_buffer(nbytes=n) for n in (4096, 3 * MiB + 5)]
    except OSError as exc:  # this machine really cannot lock: the promise is refused loudly
        pytest.skip(f"this process cannot mlock: {exc}")
    assert all(plugin.kvhal_host_buffer_is_pinned(buffer=b) for b in buffers)
    for buffer in buffers:
        plugin.kvhal_free_host_buffer(buffer=buffer)
        assert not plugin.kvhal_host_buffer_is_pinned(buffer=buffer)


def test_a_failed_mlock_under_a_promise_is_an_error_naming_the_plugin_and_hook(monkeypatch):
    monkeypatch.setattr(memory, "_mlock", lambda address, nbytes: errno.ENOMEM)
    plugin = plugin_with(memory.decide_locking(True, resource.RLIM_INFINITY, False))
    with pytest.raises(OSError, match=r"mlock of a 16 MiB host buffer failed .*KVHAL_CPU_MLOCK=0"):
        plugin.kvhal_allocate_host_buffer(nbytes=16 * MiB)
    # Through kvhal, the same failure names the plugin and the hook.
    registry = PluginRegistry(autoload=False, allow=None, block=())
    device = registry.select("cpu")
    registry.pm.get_plugin("cpu")._lock_policy = memory.decide_locking(True, resource.RLIM_INFINITY, False)
    with pytest.raises(PluginError) as info:
        device.allocate_host_buffer(16 * MiB)
    assert info.value.plugin == "cpu" and info.value.hook == "kvhal_allocate_host_buffer"


def test_probe_and_allocation_agree_for_this_process():
    plugin = CPUPlugin()
    declared = plugin.kvhal_probe().supports("host.pinned")
    try:
        buffer = plugin.kvhal_allocate_host_buffer(nbytes=MiB)
    except OSError:
        pytest.fail("host.pinned was declared but a 1 MiB buffer could not be locked")
    assert plugin.kvhal_host_buffer_is_pinned(buffer=buffer) is declared
    plugin.kvhal_free_host_buffer(buffer=buffer)

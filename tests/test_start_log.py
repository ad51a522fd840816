"""The engine's start line: kvhal's version and its plugins', the device plugin, the C
extensions, and every tier with its size; and a warning per C extension not built."""

from __future__ import annotations

import logging
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvhal import build_info
from kvhal.cpu import memory
from kvhal.descriptor import Capability, DeviceDescriptor
from kvhal.vllm.config import ConnectorConfig, GroupInfo, LowerTierConfig, RemoteTierConfig
from kvhal.vllm.start_log import host_memory, log_start, size, start_line
from tests.test_build_info import run_refusing

GROUP = GroupInfo(group_id=0, layer_names=("l0", "l1"), page_bytes=64 << 10, head_size=64)


def config(**tiers: object) -> ConnectorConfig:
    return ConnectorConfig(
        cpu_bytes_to_use=8 << 30,
        device=None,
        eviction_policy="lru",
        offload_prompt_only=True,
        block_size=16,
        groups=(GROUP,),
        world_size=2,
        layout="LBHNC",
        **tiers,
    )


ALL_BUILT = dict.fromkeys(e.module for e in build_info.EXTENSIONS)
VERSIONS = {"kvhal": "0.1.0", "kvhal-cuda": "0.1.0"}


def test_sizes_read_as_people_write_them() -> None:
    assert (size(100), size(512 << 10), size(8 << 30), size(3 << 40)) == (
        "100 B",
        "512.0 KiB",
        "8.0 GiB",
        "3072.0 GiB",
    )


def test_the_line_names_version_device_extensions_and_every_tier_with_its_size() -> None:
    lower = LowerTierConfig("disk", {"path": "/var/lib/kvhal", "bytes_to_use": 200 << 30}, "through", "clock")
    remote = RemoteTierConfig("redis://user:hunter2@store:6379/0")
    line = start_line(
        config(lower_tier=lower, remote_tier=remote), "'cpu' (kvhal (built-in))", VERSIONS, ALL_BUILT
    )
    assert line.startswith("kvhal 0.1.0 (kvhal-cuda 0.1.0): device plugin 'cpu' (kvhal (built-in)); ")
    assert "C extensions 4 of 4 built;" in line and "missing" not in line
    host = "host 8.0 GiB per engine (2 workers, 32768 slots of 128.0 KiB each, lru)"
    disk = "disk 200.0 GiB at /var/lib/kvhal (write-through, clock)"
    store = "redis redis://user:***@store:6379/0 (lookup 200 ms, load 5000 ms, auth hmac)"
    assert line.endswith(f"tiers: {host} > {disk} > {store}")
    assert "hunter2" not in line and "\n" not in line


def test_the_line_names_a_missing_extension() -> None:
    status = {**ALL_BUILT, "kvhal._copyplan": "ModuleNotFoundError: No module named 'kvhal._copyplan'"}
    line = start_line(config(), "'cpu' (kvhal (built-in))", VERSIONS, status)
    assert "C extensions 3 of 4 built (missing: kvhal._copyplan; slower paths run, see the warnings)" in line
    assert line.endswith("tiers: host 8.0 GiB per engine (2 workers, 32768 slots of 128.0 KiB each, lru)")


def test_log_start_logs_one_line_with_the_selected_plugin_and_no_warning_here(caplog) -> None:
    logger = logging.getLogger("kvhal.test.start")
    with caplog.at_level(logging.INFO, logger="kvhal.test.start"):
        log_start(logger, config(), None)
    record, *warnings = caplog.records  # every extension is built here: no warning of them
    assert record.levelno == logging.INFO
    assert record.getMessage().startswith(f"kvhal {build_info.kvhal_version()} (")
    assert "device plugin 'cpu' (kvhal (built-in))" in record.getMessage()
    if memory.lock_policy().lock:  # root, or CAP_IPC_LOCK, or ulimit -l unlimited
        assert "; host memory pinned; tiers: " in record.getMessage() and warnings == []
    else:  # this process cannot lock: said once
        assert "; host memory pageable (see the warning); tiers: " in record.getMessage()
        assert [w.getMessage().split(":")[1] for w in warnings] == [" host memory cannot be pinned here"]


def test_log_start_warns_of_a_missing_extension_with_its_cost_and_the_fix() -> None:
    code = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='%(levelname)s %(message)s')\n"
        "from tests.test_start_log import config\n"
        "from kvhal.vllm.start_log import log_start\n"
        "import os; os.environ['KVHAL_CPU_MLOCK'] = '0'\n"  # pageable on purpose: no warning of it
        "log_start(logging.getLogger('kvhal.test'), config(), None)\n"
    )
    lines = run_refusing("kvhal.offload._keyindex", code).stdout.splitlines()
    assert len(lines) == 2, lines
    assert (
        lines[0].startswith("INFO kvhal ")
        and "C extensions 3 of 4 built (missing: kvhal.offload._keyindex" in lines[0]
    )
    assert lines[1].startswith(
        "WARNING kvhal: the C extension kvhal.offload._keyindex (the manager's key index)"
    )
    assert "with a dict" in lines[1] and f"Fix: {build_info.FIX}." in lines[1]


def test_the_tiers_are_listed_in_their_order_by_name() -> None:
    lower = LowerTierConfig("disk", {"path": "/d", "bytes_to_use": 1 << 30}, "back", "lru", name="ssd")
    remote = RemoteTierConfig("mooncake://m:50051?metadata=http://m:8080/metadata", lookup_timeout_ms=50)
    line = start_line(config(tiers=(remote, lower)), "'cpu' (x)", VERSIONS, ALL_BUILT)
    below = line.split(" > ", 1)[1]
    assert below == (
        "mooncake mooncake://m:50051?metadata=http://m:8080/metadata (lookup 50 ms, load 5000 ms, auth hmac)"
        " > ssd 1.0 GiB at /d (write-back, lru)"
    )


def test_every_logger_of_the_vllm_adapter_is_under_vllms() -> None:
    # vLLM gives handlers and a level to the "vllm" logger only: a logger outside it dropped
    # INFO, and the connector's start line never reached the engine's log
    root = Path(__file__).resolve().parents[1] / "src" / "kvhal" / "vllm"
    calls = {
        f"{path.relative_to(root)}: {call}"
        for path in root.rglob("*.py")
        for call in re.findall(r"(?:init_logger|getLogger)\(([^)]*)\)", path.read_text())
    }
    assert any(call.startswith("connector.py: ") for call in calls)
    assert {call for call in calls if not call.endswith(': "vllm." + __name__')} == set()


def test_host_memory_pageable_on_purpose_is_said_in_the_line_without_a_warning(caplog, monkeypatch) -> None:
    monkeypatch.setenv("KVHAL_CPU_MLOCK", "0")
    logger = logging.getLogger("kvhal.test.start")
    with caplog.at_level(logging.INFO, logger="kvhal.test.start"):
        log_start(logger, config(), None)
    [record] = caplog.records
    assert "; host memory pageable (KVHAL_CPU_MLOCK=0); tiers: " in record.getMessage()


def test_a_plugin_that_cannot_pin_for_want_of_a_limit_is_warned_of_even_with_another_setting(
    monkeypatch,
) -> None:
    limited = DeviceDescriptor(
        name="cpu",
        torch_device_type="cpu",
        vendor="generic",
        capabilities=frozenset(),
        details={"host_memory": "pageable: RLIMIT_MEMLOCK is 8 MiB"},
    )
    monkeypatch.setenv("KVHAL_PIN_HOST", "off")  # the accelerators' setting: the CPU's reason is the limit
    found = host_memory(limited)
    assert found.pinned is False and found.turned_off is None
    assert found.text() == "host memory pageable (see the warning)"
    pinned = DeviceDescriptor(
        name="cpu",
        torch_device_type="cpu",
        vendor="generic",
        capabilities=frozenset({Capability.PINNED_HOST.value}),
    )
    assert host_memory(pinned).text() == "host memory pinned" and host_memory(None).pinned is None
    # a plugin that gives no reason, with pinning turned off: on purpose, no warning
    silent = DeviceDescriptor(
        name="cuda", torch_device_type="cuda", vendor="nvidia", capabilities=frozenset()
    )
    assert host_memory(silent).turned_off == "KVHAL_PIN_HOST=off"
    monkeypatch.delenv("KVHAL_PIN_HOST")
    assert host_memory(silent).turned_off is None


LIMIT = 64 << 10  # RLIMIT_MEMLOCK of a container without settings (Docker's default)

STARTS = """
import logging, sys
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(levelname)s %(message)s")
from kvhal.vllm.start_log import log_start
from kvhal.vllm.worker_side import WorkerSide
from tests.test_start_log import config
from tests.test_worker_side import connector_config, kv_caches
log_start(logging.getLogger("kvhal.test"), config(), None)
worker = WorkerSide(connector_config(slots=1024))
worker.register(kv_caches(split=False))  # the host tier, larger than the limit, allocated
print("HOST", worker.host_tier.capacity_bytes, worker.host_tier.is_pinned)
worker.shutdown()
"""


def _limited(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))


def test_without_memlock_rights_the_start_warns_once_and_the_engine_runs_on_pageable_memory() -> None:
    """A container's rights: RLIMIT_MEMLOCK of 64 KiB, no CAP_IPC_LOCK (dropped with
    util-linux's setpriv where this process has it, as root does). The decision is the CPU
    plugin's own (kvhal.cpu.memory.decide_locking, read in the child); nothing is mocked."""
    command = [sys.executable, "-c", STARTS]
    if memory._has_cap_ipc_lock():
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("this process has CAP_IPC_LOCK and util-linux's setpriv is not here to drop it")
        command = [setpriv, "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", *command]
    env = {k: v for k, v in os.environ.items() if k not in ("KVHAL_CPU_MLOCK", "KVHAL_PIN_HOST")}
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        preexec_fn=lambda: _limited(LIMIT),
    )
    assert done.returncode == 0, done.stderr  # nothing refused: the engine's worker side runs
    lines = done.stdout.splitlines()
    starts = [line for line in lines if line.startswith("INFO kvhal ")]
    warnings = [line for line in lines if "host memory cannot be pinned" in line]
    assert len(starts) == 1 and len(warnings) == 1, done.stdout
    assert "; host memory pageable (see the warning); tiers: host " in starts[0]
    [warning] = warnings
    assert warning.startswith("WARNING kvhal: host memory cannot be pinned here: the device plugin 'cpu'")
    assert "RLIMIT_MEMLOCK is 65536 bytes" in warning  # the plugin's reason: the limit it read
    # what kvhal does instead, what it costs, and the fix
    for said in (
        "pageable host memory instead; nothing is refused",
        "copies between the KV cache and the host tier are slower",
        "swap host-tier pages out",
        'securityContext.capabilities.add: ["IPC_LOCK"]',
        "--cap-add IPC_LOCK",
        "`ulimit -l unlimited`",
        "--ulimit memlock=-1",
        "docs/deploy.md",
    ):
        assert said in warning, said
    [host] = [line for line in lines if line.startswith("HOST ")]
    capacity, pinned = host.split()[1:]
    assert int(capacity) > LIMIT and pinned == "False"


def test_cpu_binding_is_warned_of_where_vllm_reserves_no_core_for_its_frontend() -> None:
    from kvhal.vllm.start_log import cpu_binding_warning

    warned = cpu_binding_warning("cpu", 1, 2, {})
    assert warned is not None and "VLLM_CPU_NUM_OF_RESERVED_CPU=1" in warned
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=2" in (cpu_binding_warning("cpu", 2, 4, {}) or "")
    # vLLM keeps cores for its frontend, the user chose, one process, or not the CPU: no warning
    assert cpu_binding_warning("cpu", 1, 3, {}) is None
    assert cpu_binding_warning("cpu", 1, 2, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}) is None
    assert cpu_binding_warning("cpu", 1, 2, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}) is None
    assert cpu_binding_warning("cpu", 1, 2, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}) is None
    assert cpu_binding_warning("cuda", 1, 2, {}) is None

"""The engine's start line: kvhal's version and its plugins', the device plugin, the C
extensions, and every tier with its size; and a warning per C extension not built."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from kvhal import build_info
from kvhal.vllm.config import ConnectorConfig, GroupInfo, LowerTierConfig, RemoteTierConfig
from kvhal.vllm.start_log import log_start, size, start_line
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
    [record] = caplog.records  # every extension is built here: no warning
    assert record.levelno == logging.INFO
    assert record.getMessage().startswith(f"kvhal {build_info.kvhal_version()} (")
    assert "device plugin 'cpu' (kvhal (built-in))" in record.getMessage()


def test_log_start_warns_of_a_missing_extension_with_its_cost_and_the_fix() -> None:
    code = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='%(levelname)s %(message)s')\n"
        "from tests.test_start_log import config\n"
        "from kvhal.vllm.start_log import log_start\n"
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

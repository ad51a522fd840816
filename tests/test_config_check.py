"""``kvhal config check`` and the connector refuse every bad input of issue 36 the same way:
non-zero, naming the key, and nothing written anywhere (the disk tier's directory included)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvhal.cli import main
from kvhal.errors import ValidationError
from kvhal.vllm.config_check import TRANSFER_KEYS, machine_memory, refuse_early

EXTRA = "kv_connector_extra_config"


def transfer(extra: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    """A kv-transfer-config as the README writes it, with ``top`` and ``extra`` changed."""
    config: dict[str, Any] = {
        "kv_connector": "KVHALConnector",
        "kv_connector_module_path": "kvhal.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        EXTRA: {"cpu_bytes_to_use": "64MiB", **(extra or {})},
    }
    config.update(top)
    return {k: v for k, v in config.items() if v is not None}


def files_under(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["config", "check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_good_configuration_passes_inline_and_from_a_file_and_creates_nothing(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    disk = workdir / "not-yet" / "kvhal"
    config = transfer(
        {
            "cpu_bytes_to_use": "8MiB",
            "disk_path": str(disk),
            "disk_bytes_to_use": "200GB",
            "remote_url": "redis://h:6379/0",
        }
    )
    (workdir / "c.json").write_text(json.dumps(config))
    before = files_under(workdir)
    for argv in ([json.dumps(config)], ["@c.json"], ["--file", "c.json"]):
        code, out, err = check(capsys, *argv)
        assert code == 0, err
        assert "ok:" in out and "200000000000" in out and "redis://h:6379/0" in out
    assert files_under(workdir) == before  # the disk tier's directory is checked, not made


# (the kv-transfer-config, or its text; the key the error must name; words it must say)
BAD: dict[str, tuple[Any, str, str]] = {
    "malformed JSON": ('{"kv_connector": "KVHALConnector",', "kv-transfer-config", "not JSON"),
    "not an object": ("[1, 2]", "kv-transfer-config", "JSON object"),
    "unknown top-level key": (transfer(kv_conector="x"), "kv_conector", "did you mean kv_connector"),
    "unknown extra key": (transfer({"cpu_byte_to_use": 1}), EXTRA, "did you mean cpu_bytes_to_use"),
    "another connector": (transfer(kv_connector="OffloadingConnector"), "kv_connector", "'KVHALConnector'"),
    "another module": (transfer(kv_connector_module_path="kvhal"), "kv_connector_module_path", "kvhal.vllm"),
    "a producer": (transfer(kv_role="kv_producer"), "kv_role", "kv_both"),
    "failure policy fail": (transfer(kv_load_failure_policy="fail"), "kv_load_failure_policy", "recompute"),
    "failure policy absent": (transfer(kv_load_failure_policy=None), "kv_load_failure_policy", '"fail"'),
    "negative size": (transfer({"cpu_bytes_to_use": -1}), f"{EXTRA}.cpu_bytes_to_use", "not positive"),
    "unknown unit": (transfer({"cpu_bytes_to_use": "8XB"}), f"{EXTRA}.cpu_bytes_to_use", "'8XB'"),
    "absurd size": (transfer({"cpu_bytes_to_use": 10**30}), f"{EXTRA}.cpu_bytes_to_use", "more than 1 EiB"),
    "absurd disk size": (
        transfer({"disk_path": "d", "disk_bytes_to_use": 10**30}),
        f"{EXTRA}.disk_bytes_to_use",
        "more than 1 EiB",
    ),
    "more than the machine's memory": (
        transfer({"cpu_bytes_to_use": "1PiB"}),
        f"{EXTRA}.cpu_bytes_to_use",
        "more than this machine's memory",
    ),
    "unknown store scheme": (
        transfer({"remote_url": "memcached://h:11211"}),
        f"{EXTRA}.remote_url",
        "'memcached'",
    ),
    "unknown store scheme in tiers": (
        transfer({"tiers": [{"url": "gs://bucket/kv"}]}),  # (s3:// is a built-in store)
        f"{EXTRA}.tiers[0].url",
        "'gs'",
    ),
    "unknown tier backend": (
        transfer({"tier_backend": "nvme", "tier_options": {}}),
        f"{EXTRA}.tier_backend",
        "nvme",
    ),
    "unknown tier backend in tiers": (
        transfer({"tiers": [{"url": "redis://h:6379/0"}, {"backend": "nvme"}]}),
        f"{EXTRA}.tiers[1].backend",
        "'nvme'",
    ),
    "disk path under a file": (
        transfer({"disk_path": "a-file/kvhal", "disk_bytes_to_use": "1GiB"}),
        f"{EXTRA}.disk_path",
        "is not a directory",
    ),
    "disk path is a file": (
        transfer({"disk_path": "a-file", "disk_bytes_to_use": "1GiB"}),
        f"{EXTRA}.disk_path",
        "not a directory",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_kvhal_config_check_refuses_naming_the_key_and_writes_nothing(
    case: str, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, key, words = BAD[case]
    (workdir / "a-file").write_text("")
    text = config if isinstance(config, str) else json.dumps(config)
    (workdir / "c.json").write_text(text)
    before = files_under(workdir)
    for argv in ([text], ["@c.json"]):
        code, out, err = check(capsys, *argv)
        assert code == 1, (out, err)
        source = "c.json" if argv[0].startswith("@") and key == "kv-transfer-config" else key
        assert err.startswith(f"kvhal config check: {source}: "), err
        assert words in err, err
        assert out == ""
    assert files_under(workdir) == before


@pytest.mark.parametrize("case", [c for c in BAD if not isinstance(BAD[c][0], str) and "top-level" not in c])
def test_the_connector_refuses_the_same_on_vllms_own_config(case: str, workdir: Path) -> None:
    """The connector's check (refuse_early, run by vLLM's lookup of the class, by the layout
    question and by __init__) on vLLM's KVTransferConfig: the same key named, nothing written."""
    kv_transfer = pytest.importorskip("vllm.config.kv_transfer")
    config, key, words = BAD[case]
    (workdir / "a-file").write_text("")
    before = files_under(workdir)
    vllm_config = kv_transfer.KVTransferConfig(**config)
    with pytest.raises(ValidationError) as info:
        refuse_early(vllm_config)
    assert info.value.argument == key
    assert words in str(info.value)
    assert files_under(workdir) == before


def test_vllms_connector_factory_meets_the_refusal_when_it_looks_the_class_up(workdir: Path) -> None:
    """vLLM's VllmConfig looks the class up through this factory call before any engine starts:
    a bad configuration fails there; a good one gets the class."""
    pytest.importorskip("vllm")
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with pytest.raises(ValidationError, match="kv_load_failure_policy"):
        KVConnectorFactory.get_connector_class(KVTransferConfig(**transfer(kv_load_failure_policy="fail")))
    with pytest.raises(ValidationError, match="cpu_bytes_to_use"):
        KVConnectorFactory.get_connector_class(KVTransferConfig(**transfer({"cpu_bytes_to_use": "8XB"})))
    good = KVConnectorFactory.get_connector_class(KVTransferConfig(**transfer()))
    assert good.__name__ == "KVHALConnector"


def test_transfer_keys_cover_the_installed_vllms() -> None:
    kv_transfer = pytest.importorskip("vllm.config.kv_transfer")
    fields = set(kv_transfer.KVTransferConfig.__dataclass_fields__)
    assert fields <= TRANSFER_KEYS, fields - TRANSFER_KEYS


def test_machine_memory_is_the_machines() -> None:
    meminfo = Path("/proc/meminfo").read_text().split()
    total = int(meminfo[meminfo.index("MemTotal:") + 1]) * 1024
    assert 0.9 * machine_memory() <= total <= machine_memory()


# In a mount namespace of its own (unshare), a read-only tmpfs: kvhal config check and the
# connector's check both refuse a disk_path there, and nothing is created.
READ_ONLY = """
import json, os, sys, types
from kvhal.cli import main
from kvhal.errors import ValidationError
from kvhal.vllm.config_check import refuse_early
config = json.loads(sys.argv[1])
code = main(["config", "check", json.dumps(config)])
try:
    refuse_early(types.SimpleNamespace(**config))
except ValidationError as exc:
    print("connector:", exc)
print("created:", os.path.exists(config["kv_connector_extra_config"]["disk_path"]))
sys.exit(code)
"""


@pytest.mark.skipif(
    shutil.which("unshare") is None, reason="needs unshare (util-linux) for a read-only mount"
)
def test_a_disk_path_on_a_read_only_file_system_is_refused(tmp_path: Path) -> None:
    mount = tmp_path / "ro"
    mount.mkdir()
    disk = mount / "kvhal"
    config = transfer({"disk_path": str(disk), "disk_bytes_to_use": "1GiB"})
    script = f'mount -t tmpfs -o ro kvhal-test {mount} && exec {sys.executable} -c "$0" "$1"'
    argv = ["unshare", "--mount", "--map-root-user", "sh", "-c", script, READ_ONLY, json.dumps(config)]
    if os.geteuid() == 0:
        argv.remove("--map-root-user")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if "mount" in done.stderr and "Operation not permitted" in done.stderr:
        pytest.skip(f"this machine does not let unshare mount: {done.stderr.strip()}")
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"kvhal config check: {EXTRA}.disk_path: {disk} is on a read-only file system" in done.stderr
    assert f"connector: {EXTRA}.disk_path: {disk} is on a read-only file system" in done.stdout
    assert "created: False" in done.stdout
    assert not disk.exists()


def test_kvhal_config_check_runs_without_vllm() -> None:
    from tests.test_cli_without_vllm import run_without_vllm

    done = run_without_vllm("config", "check", json.dumps(transfer()))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok: ")

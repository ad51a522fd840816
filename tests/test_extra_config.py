"""``kv_connector_extra_config`` checked by its one declaration, without vLLM: typed keys,
sizes with units, the ordered ``tiers`` and their short forms, errors naming the key, and the
reference table in the docs generated from the same declaration."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from kvhal.errors import ValidationError
from kvhal.vllm import settings
from kvhal.vllm.extra_config import LowerTierConfig, RemoteTierConfig, check_extra_config

ROOT = Path(__file__).resolve().parents[1]
HOST = {"cpu_bytes_to_use": 1 << 30}
DISK = {"backend": "disk", "options": {"path": "/d", "bytes_to_use": "8GiB"}}


def refused(extra: dict) -> ValidationError:
    with pytest.raises(ValidationError) as raised:
        check_extra_config(extra)
    return raised.value


def test_a_typod_key_is_refused_naming_it_the_keys_taken_and_the_nearest() -> None:
    error = refused({**HOST, "disk_pth": "/d"})
    assert error.argument == "kv_connector_extra_config"
    for named in ("'disk_pth'", "did you mean disk_path?", "'remote_url'", "'tiers'"):
        assert named in str(error)
    error = refused({**HOST, "tiers": [{"url": "redis://h", "lookup_timeout": 5}]})
    assert error.argument == "kv_connector_extra_config.tiers[0]"
    assert "did you mean lookup_timeout_ms?" in str(error) and "a store takes" in str(error)


@pytest.mark.parametrize(
    ("extra", "argument", "phrase"),
    [
        ({**HOST, "offload_prompt_only": "false"}, "offload_prompt_only", "a JSON boolean"),
        ({"cpu_bytes_to_use": "1073741824.5x"}, "cpu_bytes_to_use", "could not interpret"),
        ({"cpu_bytes_to_use": 1.5}, "cpu_bytes_to_use", "got 1.5"),
        (
            {**HOST, "remote_url": "redis://h", "remote_lookup_timeout_ms": "200"},
            "remote_lookup_timeout_ms",
            "'200'",
        ),
        ({**HOST, "tiers": [{**DISK, "wait_ms": "1000"}]}, "tiers[0].wait_ms", "milliseconds"),
        ({**HOST, "tiers": [{"url": "redis://h", "strict": 1}]}, "tiers[0].strict", "a JSON boolean"),
        ({**HOST, "tiers": [DISK, {"url": "redis://h", "auth": "off"}]}, "tiers[1].auth", "['hmac', 'none']"),
        ({**HOST, "tiers": {"url": "redis://h"}}, "tiers", "a list of tiers"),
        ({**HOST, "tiers": [{"path": "/d"}]}, "tiers[0]", '"backend" (a local tier) or "url"'),
    ],
)
def test_a_wrong_type_is_refused_never_coerced(extra: dict, argument: str, phrase: str) -> None:
    error = refused(extra)
    assert error.argument == f"kv_connector_extra_config.{argument}"
    assert phrase in str(error)


@pytest.mark.parametrize(
    ("given", "size"),
    [("8GiB", 8 << 30), ("200GB", 200 * 10**9), ("1.5 TiB", 3 << 39), (4096, 4096), ("4096", 4096)],
)
def test_sizes_take_units(given: object, size: int) -> None:
    short = check_extra_config({"cpu_bytes_to_use": given, "disk_path": "/d", "disk_bytes_to_use": given})
    disk = {"backend": "disk", "options": {"path": "/d", "bytes_to_use": given}}
    listed = check_extra_config({"cpu_bytes_to_use": given, "tiers": [disk]})
    assert short.cpu_bytes_to_use == size and short.tiers[0].options["bytes_to_use"] == size
    assert listed.tiers[0].options == {"path": "/d", "bytes_to_use": size}


#: Where a size goes: the extra config holding ``value`` there, and the key an error names.
PLACES = {
    "cpu_bytes_to_use": lambda v: {"cpu_bytes_to_use": v},
    "disk_bytes_to_use": lambda v: {**HOST, "disk_path": "/d", "disk_bytes_to_use": v},
    "tier_options.bytes_to_use": lambda v: {**HOST, "tier_options": {"path": "/d", "bytes_to_use": v}},
    "tiers[0].options.bytes_to_use": lambda v: {
        **HOST,
        "tiers": [{"backend": "disk", "options": {"path": "/d", "bytes_to_use": v}}],
    },
}


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("8XB", "could not interpret byte unit: XB"),
        (-1, "not positive"),
        (0, "not positive"),
        ("0GiB", "not positive"),
        ("-8GiB", "could not parse"),
        (10**30, "more than 1 EiB"),
        ("2EiB", "more than 1 EiB"),
        (True, ""),
        ([8], ""),
    ],
)
@pytest.mark.parametrize("argument", list(PLACES))
def test_a_malformed_size_is_refused_naming_the_key(value: object, why: str, argument: str) -> None:
    error = refused(PLACES[argument](value))
    assert error.argument == f"kv_connector_extra_config.{argument}"
    assert f"got {value!r}" in str(error) and why in str(error)
    assert '"8GiB"' in str(error), "the error shows a size that would do"


def test_tiers_stack_in_the_order_given() -> None:
    extra = {
        **HOST,
        "tiers": [
            DISK,
            {"url": "redis://h:6379/0", "lookup_timeout_ms": 50, "auth": "none"},
            {
                "name": "ram",
                "backend": "ramdisk",
                "options": {"size": "1GiB"},
                "write": "back",
                "wait_ms": None,
            },
        ],
    }
    tiers = check_extra_config(extra).tiers
    assert [type(t) for t in tiers] == [LowerTierConfig, RemoteTierConfig, LowerTierConfig]
    assert [t.name for t in tiers] == ["disk", "redis", "ram"]
    disk, store, ram = tiers
    assert disk.options == {"path": "/d", "bytes_to_use": 8 << 30}
    assert disk.config_keys["bytes_to_use"] == "kv_connector_extra_config.tiers[0].options.bytes_to_use"
    assert (disk.write, disk.eviction_policy, disk.wait_ms, disk.wait_policy) == (
        "through",
        "clock",
        1000,
        "auto",
    )
    assert (store.url, store.lookup_timeout_ms, store.load_timeout_ms, store.auth) == (
        "redis://h:6379/0",
        50,
        5000,
        "none",
    )
    assert store.key("url") == "kv_connector_extra_config.tiers[1].url"
    # a plugin's options are its own: passed as given, named by their place
    assert (ram.backend, ram.options, ram.write, ram.wait_ms) == ("ramdisk", {"size": "1GiB"}, "back", None)
    assert ram.config_keys == {"size": "kv_connector_extra_config.tiers[2].options.size"}


def test_the_short_forms_are_a_list_of_the_local_tier_then_the_store() -> None:
    short = {
        **HOST,
        "remote_url": "mooncake://m:50051",
        "remote_strict": True,
        "disk_path": "/d",
        "disk_bytes_to_use": "8GiB",
        "disk_write": "back",
        "lower_tier_wait_policy": "timeout",
    }
    listed = {
        **HOST,
        "tiers": [
            {**DISK, "write": "back", "wait_policy": "timeout"},
            {"url": "mooncake://m:50051", "strict": True},
        ],
    }
    got, want = check_extra_config(short).tiers, check_extra_config(listed).tiers
    assert [(t.name, type(t)) for t in got] == [("disk", LowerTierConfig), ("mooncake", RemoteTierConfig)]

    def same(tier: LowerTierConfig | RemoteTierConfig) -> object:  # where the user wrote it aside
        where = {"config_keys": {}} if isinstance(tier, LowerTierConfig) else {"key_prefix": ""}
        return dataclasses.replace(tier, **where)

    assert [same(t) for t in got] == [same(t) for t in want]
    assert got[0].config_keys == {
        "path": "kv_connector_extra_config.disk_path",
        "bytes_to_use": "kv_connector_extra_config.disk_bytes_to_use",
    }
    assert got[1].key("url") == "kv_connector_extra_config.remote_url"
    assert check_extra_config(HOST).tiers == ()


def test_the_disk_lock_wait_s_short_form_reaches_the_disk_tier_s_options() -> None:
    """It was dropped (every short form of an option but the path and the size was): a
    rolling update's wait was then always the disk tier's default."""
    short = {**HOST, "disk_path": "/d", "disk_bytes_to_use": "8GiB", "disk_lock_wait_s": 0}
    [tier] = check_extra_config(short).tiers
    assert tier.options["lock_wait_s"] == 0
    assert tier.config_keys["lock_wait_s"] == "kv_connector_extra_config.disk_lock_wait_s"
    error = refused({**short, "disk_lock_wait_s": -1})
    assert error.argument == "kv_connector_extra_config.disk_lock_wait_s"


def test_every_tier_has_its_own_name() -> None:
    second = {"backend": "disk", "options": {"path": "/e", "bytes_to_use": 1 << 30}}
    error = refused({**HOST, "tiers": [DISK, {"url": "redis://h"}, second]})
    assert error.argument == "kv_connector_extra_config.tiers[2].name"
    assert "tiers[0] and tiers[2] are both named 'disk'" in str(error)
    named = check_extra_config({**HOST, "tiers": [DISK, {"url": "redis://h"}, {**second, "name": "hdd"}]})
    assert [t.name for t in named.tiers] == ["disk", "redis", "hdd"]
    assert refused({**HOST, "tiers": [{**DISK, "name": "a b"}]}).argument.endswith("tiers[0].name")


def test_tiers_and_a_short_form_together_are_refused_naming_both() -> None:
    error = refused({**HOST, "tiers": [{"url": "redis://h"}], "disk_path": "/d"})
    assert error.argument == "kv_connector_extra_config.tiers"
    assert "disk_path" in str(error)


def test_several_problems_are_named_together() -> None:
    error = refused({**HOST, "tiers": [{**DISK, "write": "later", "wait_ms": -1}]})
    assert error.argument == "kv_connector_extra_config.tiers[0].write"
    assert "also wrong: tiers[0].wait_ms" in str(error)


def test_the_docs_reference_is_the_declarations() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert settings.generated_part(doc) == settings.markdown_table()
    # every key, short forms too, has its row
    for key in settings.KNOWN_KEYS:
        assert f"| `{key}` |" in doc, key


def test_the_reference_is_regenerated_in_place(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "configuration.md"
    doc.write_text(f"# head\n\n{settings.BEGIN}\n| stale |\n{settings.END}\ntail\n")
    assert settings.main(["--write", str(doc)]) == 0
    text = doc.read_text()
    assert settings.generated_part(text) == settings.markdown_table()
    assert text.startswith("# head\n\n") and text.endswith(f"{settings.END}\ntail\n")


def test_the_checks_import_without_vllm() -> None:
    code = (
        "import sys; from kvhal.vllm.extra_config import check_extra_config; "
        "check_extra_config({'cpu_bytes_to_use': '8GiB', 'remote_url': 'redis://h'}); "
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

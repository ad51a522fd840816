"""KVHALConnector's configuration checks, on vLLM's config attributes (no engine started)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from kvhal.errors import ValidationError

pytest.importorskip("vllm")
from kvhal.vllm.config import ConnectorConfig

PAGE = 2 * 16 * 4 * 64 * 2  # K and V, 16 tokens, 4 heads, head size 64, fp16


def configs(extra: dict, pipeline: int = 1, tensor: int = 1) -> tuple[SimpleNamespace, SimpleNamespace]:
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        cache_config=SimpleNamespace(block_size=16),
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=pipeline, world_size=pipeline * tensor, tensor_parallel_size=tensor
        ),
    )
    spec = SimpleNamespace(page_size_bytes=PAGE, head_size=64)
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1", "l2"])
    kv_cache_config = SimpleNamespace(
        prefix_cacheable_group_ids=[0], kv_cache_groups=[group], kv_cache_layout=None
    )
    return vllm_config, kv_cache_config


def test_slots_follow_from_bytes_layers_and_workers() -> None:
    config = ConnectorConfig.from_vllm(*configs({"cpu_bytes_to_use": 100 * 3 * PAGE}, tensor=2))
    assert (config.slot_bytes, config.num_slots, config.eviction_policy) == (3 * PAGE, 50, "lru")


@pytest.mark.parametrize(
    ("extra", "argument"),
    [
        ({"cpu_bytes_to_use": 1 << 20, "cpu_byts": 1}, "kv_connector_extra_config"),
        ({}, "kv_connector_extra_config.cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": True}, "kv_connector_extra_config.cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": PAGE}, "kv_connector_extra_config.cpu_bytes_to_use"),
    ],
)
def test_bad_extra_config_names_the_key(extra: dict, argument: str) -> None:
    with pytest.raises(ValidationError) as raised:
        ConnectorConfig.from_vllm(*configs(extra))
    assert raised.value.argument == argument


def test_pipeline_parallelism_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="pipeline_parallel_size 1 only, got 2") as raised:
        ConnectorConfig.from_vllm(*configs({"cpu_bytes_to_use": 1 << 30}, pipeline=2))
    assert raised.value.argument == "parallel_config.pipeline_parallel_size"


@pytest.mark.parametrize(
    ("key", "value", "phrase"),
    [
        ("offload_prompt_only", "false", "must be a JSON boolean"),
        ("offload_prompt_only", 0, "must be a JSON boolean"),
        ("eviction_policy", 3, "must be an eviction policy's name"),
        ("eviction_policy", None, "must be an eviction policy's name"),
        ("device", 0, "must be a device plugin's name"),
        ("device", ["cpu"], "must be a device plugin's name"),
        ("load_mode", "eager", "must be one of \\['auto', 'sync', 'layerwise', 'async'\\]"),
        ("load_mode", True, "must be one of"),
    ],
)
def test_mistyped_extra_config_value_is_refused_by_name(key: str, value: object, phrase: str) -> None:
    """``bool("false")`` is True: a value of the wrong type is refused, never coerced."""
    with pytest.raises(ValidationError, match=phrase) as raised:
        ConnectorConfig.from_vllm(*configs({"cpu_bytes_to_use": 1 << 30, key: value}))
    assert raised.value.argument == f"kv_connector_extra_config.{key}"
    assert repr(value) in str(raised.value)


def test_well_typed_extra_config_values_are_kept() -> None:
    extra = {"cpu_bytes_to_use": 1 << 30, "offload_prompt_only": False, "eviction_policy": "s3fifo"}
    config = ConnectorConfig.from_vllm(*configs({**extra, "device": "cpu"}))
    assert (config.offload_prompt_only, config.eviction_policy, config.device) == (False, "s3fifo", "cpu")
    config = ConnectorConfig.from_vllm(*configs({"cpu_bytes_to_use": 1 << 30, "device": None}))
    assert (config.offload_prompt_only, config.eviction_policy, config.device) == (True, "lru", None)


def test_no_prefix_cacheable_group_is_refused() -> None:
    vllm_config, kv_cache_config = configs({"cpu_bytes_to_use": 1 << 30})
    kv_cache_config.prefix_cacheable_group_ids = []
    with pytest.raises(ValidationError, match="no prefix-cacheable KV cache group") as raised:
        ConnectorConfig.from_vllm(vllm_config, kv_cache_config)
    assert raised.value.argument == "kv_cache_config"


def test_groups_with_unequal_bytes_per_block_are_refused() -> None:
    vllm_config, kv_cache_config = configs({"cpu_bytes_to_use": 1 << 30})
    window = SimpleNamespace(
        kv_cache_spec=SimpleNamespace(page_size_bytes=PAGE, head_size=64), layer_names=["w0", "w1"]
    )
    kv_cache_config.kv_cache_groups.append(window)
    kv_cache_config.prefix_cacheable_group_ids = [0, 1]
    with pytest.raises(
        ValidationError, match=rf"equal bytes per block .*\[{2 * PAGE}, {3 * PAGE}\]"
    ) as raised:
        ConnectorConfig.from_vllm(vllm_config, kv_cache_config)
    assert raised.value.argument == "kv_cache_config"


# -- the tier below host memory ----------------------------------------------------------------


def with_model(vllm_config: SimpleNamespace, algo: str = "sha256") -> SimpleNamespace:
    vllm_config.model_config = SimpleNamespace(model="/m", revision=None, dtype="bfloat16", quantization=None)
    vllm_config.load_config = SimpleNamespace(download_dir=None)  # where vLLM fetched a hub model
    vllm_config.cache_config.cache_dtype = "auto"
    vllm_config.cache_config.prefix_caching_hash_algo = algo
    return vllm_config


def disk_config(extra: dict, algo: str = "sha256", tensor: int = 1) -> ConnectorConfig:
    vllm_config, kv_cache_config = configs({"cpu_bytes_to_use": 1 << 20, **extra}, tensor=tensor)
    return ConnectorConfig.from_vllm(with_model(vllm_config, algo), kv_cache_config)


def test_disk_keys_become_the_disk_backends_options() -> None:
    config = disk_config({"disk_path": "/d", "disk_bytes_to_use": 1 << 30, "disk_write": "back"})
    tier = config.lower_tier
    assert (tier.backend, tier.options, tier.write, tier.eviction_policy) == (
        "disk",
        {"path": "/d", "bytes_to_use": 1 << 30},
        "back",
        "clock",
    )
    assert tier.config_keys["path"] == "kv_connector_extra_config.disk_path"
    assert (tier.wait_ms, tier.wait_policy) == (1000, "auto")
    assert (
        disk_config(
            {"disk_path": "/d", "disk_bytes_to_use": 1, "lower_tier_wait_policy": "timeout"}
        ).lower_tier.wait_policy
        == "timeout"
    )
    assert config.fingerprint["model"] == {"name": "/m", "revision": None}
    assert config.fingerprint["hash_seed"] == "vllm-default"
    assert disk_config({}).lower_tier is None


@pytest.mark.parametrize(
    ("extra", "argument"),
    [
        ({"disk_path": "/d"}, "disk_bytes_to_use"),
        ({"disk_bytes_to_use": 1 << 30}, "disk_path"),
        ({"disk_path": "", "disk_bytes_to_use": 1 << 30}, "disk_path"),
        ({"disk_path": "/d", "disk_bytes_to_use": -1}, "disk_bytes_to_use"),
        ({"disk_path": "/d", "disk_bytes_to_use": True}, "disk_bytes_to_use"),
        ({"disk_path": "/d", "disk_bytes_to_use": 1 << 30, "disk_write": "later"}, "disk_write"),
        ({"disk_path": "/d", "disk_bytes_to_use": 1, "disk_eviction_policy": 3}, "disk_eviction_policy"),
        ({"disk_write": "back"}, "disk_write"),
        ({"lower_tier_wait_policy": "auto"}, "lower_tier_wait_policy"),
        (
            {"disk_path": "/d", "disk_bytes_to_use": 1, "lower_tier_wait_policy": "eager"},
            "lower_tier_wait_policy",
        ),
        ({"disk_path": "/d", "disk_bytes_to_use": 1, "lower_tier_wait_ms": -1}, "lower_tier_wait_ms"),
        (
            {"disk_path": "/d", "disk_bytes_to_use": 1, "lower_tier_prefetch_blocks": 0},
            "lower_tier_prefetch_blocks",
        ),
        ({"tier_backend": "s3", "tier_options": []}, "tier_options"),
        ({"tier_backend": ""}, "tier_backend"),
    ],
)
def test_bad_disk_keys_are_refused_by_name(extra: dict, argument: str) -> None:
    with pytest.raises(ValidationError) as raised:
        disk_config(extra)
    assert raised.value.argument == f"kv_connector_extra_config.{argument}"


def test_fingerprint_tells_reproducible_hashes_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    disk = {"disk_path": "/d", "disk_bytes_to_use": 1 << 30}
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert disk_config(disk, algo="xxhash").fingerprint["hash_seed"] == "random-per-process"
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    seeded = disk_config(disk, algo="xxhash").fingerprint["hash_seed"]
    assert seeded not in ("7", "random-per-process"), "the seed is kept as a digest only"
    monkeypatch.setenv("PYTHONHASHSEED", "8")
    assert disk_config(disk, algo="xxhash").fingerprint["hash_seed"] != seeded


def test_opening_the_lower_tier_names_the_users_keys(tmp_path, monkeypatch) -> None:
    import logging

    from kvhal.errors import TierError
    from kvhal.vllm import lower_tier
    from kvhal.vllm.lower_tier import open_lower_tier

    class Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    records = Records()
    lower_tier.logger.addHandler(records)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    small = disk_config({"disk_path": str(tmp_path / "d"), "disk_bytes_to_use": 100}, algo="xxhash")
    try:
        with pytest.raises(ValidationError) as raised:
            open_lower_tier(small, small.lower_tier, role="index", rank=0)
    finally:
        lower_tier.logger.removeHandler(records)
    assert raised.value.argument == "kv_connector_extra_config.disk_bytes_to_use"
    assert any("set PYTHONHASHSEED" in m for m in records.messages), records.messages
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    linked = disk_config({"disk_path": str(tmp_path / "link"), "disk_bytes_to_use": 1 << 20})
    with pytest.raises(TierError, match="symbolic link"):
        open_lower_tier(linked, linked.lower_tier, role="index", rank=0)
    fine = disk_config({"disk_path": str(tmp_path / "ok"), "disk_bytes_to_use": 1 << 20})
    tier = open_lower_tier(fine, fine.lower_tier, "index", 0)
    assert tier.num_slots > 0
    tier.close()


# -- the remote tier ----------------------------------------------------------------------------


def test_remote_keys_configure_the_remote_tier() -> None:
    config = disk_config(
        {"remote_url": "redis://h:1/0", "remote_strict": True, "remote_lookup_timeout_ms": 50}
    )
    remote = config.remote_tier
    assert (remote.url, remote.strict, remote.lookup_timeout_ms) == ("redis://h:1/0", True, 50)
    assert (remote.load_timeout_ms, remote.max_inflight_blocks) == (5000, 512)  # the documented defaults
    assert config.lower_tier is None and config.fingerprint["model"] == {"name": "/m", "revision": None}
    assert disk_config({}).remote_tier is None


@pytest.mark.parametrize(
    ("extra", "argument"),
    [
        ({"remote_url": "localhost:6379"}, "remote_url"),
        ({"remote_url": 6379}, "remote_url"),
        ({"remote_url": "redis://h:1", "remote_strict": "yes"}, "remote_strict"),
        ({"remote_url": "redis://h:1", "remote_lookup_timeout_ms": 0}, "remote_lookup_timeout_ms"),
        ({"remote_url": "redis://h:1", "remote_load_timeout_ms": 1.5}, "remote_load_timeout_ms"),
        ({"remote_url": "redis://h:1", "remote_max_inflight_blocks": True}, "remote_max_inflight_blocks"),
        ({"remote_strict": True}, "remote_strict"),
        ({"remote_url": "redis://h:1", "remote_auth": "off"}, "remote_auth"),
        ({"remote_url": "redis://h:1", "remote_secret_file": ""}, "remote_secret_file"),
        ({"remote_url": "redis://h:1", "remote_wait_policy": "never"}, "remote_wait_policy"),
    ],
)
def test_bad_remote_keys_are_refused_by_name(extra: dict, argument: str) -> None:
    with pytest.raises(ValidationError) as raised:
        disk_config(extra)
    assert raised.value.argument == f"kv_connector_extra_config.{argument}"


# -- the tiers as one list ----------------------------------------------------------------------


def test_tiers_configure_the_lower_and_remote_tier() -> None:
    disk = {"backend": "disk", "options": {"path": "/d", "bytes_to_use": "1GiB"}, "write": "back"}
    config = disk_config({"tiers": [disk, {"url": "redis://h:1/0", "strict": True}]})
    assert [t.name for t in config.tiers] == ["disk", "redis"]
    assert config.lower_tier is config.tiers[0] and config.remote_tier is config.tiers[1]
    assert (config.lower_tier.options["bytes_to_use"], config.lower_tier.write) == (1 << 30, "back")
    assert config.remote_tier.strict and config.fingerprint["model"] == {"name": "/m", "revision": None}
    short = disk_config({"disk_path": "/d", "disk_bytes_to_use": 1 << 30, "remote_url": "redis://h:1/0"})
    assert [t.name for t in short.tiers] == ["disk", "redis"]
    assert short.lower_tier is short.tiers[0] and short.remote_tier is short.tiers[1]
    assert disk_config({"cpu_bytes_to_use": "8GiB"}).cpu_bytes_to_use == 8 << 30


@pytest.mark.parametrize(
    "kinds",
    [["disk", "disk"], ["redis", "disk"], ["redis", "redis"], ["disk", "redis", "disk", "redis"]],
)
def test_any_list_of_tiers_is_taken_in_its_order(kinds: list[str]) -> None:
    entries = {
        "disk": lambda i: {
            "name": f"d{i}",
            "backend": "disk",
            "options": {"path": f"/d{i}", "bytes_to_use": 1},
        },
        "redis": lambda i: {"name": f"r{i}", "url": "redis://h:1/0"},
    }
    config = disk_config({"tiers": [entries[kind](i) for i, kind in enumerate(kinds)]})
    assert [t.name for t in config.tiers] == [f"{kind[0]}{i}" for i, kind in enumerate(kinds)]
    assert [hasattr(t, "url") for t in config.tiers] == [kind == "redis" for kind in kinds]


def test_lower_and_remote_tier_given_alone_are_the_tiers() -> None:
    from kvhal.vllm.config import LowerTierConfig, RemoteTierConfig

    base = disk_config({})
    lower = LowerTierConfig("disk", {"path": "/d", "bytes_to_use": 1}, "through", "clock")
    remote = RemoteTierConfig("redis://h:1/0")
    config = dataclasses.replace(base, lower_tier=lower, remote_tier=remote)
    assert config.tiers == (lower, remote) and (lower.name, remote.name) == ("disk", "redis")
    listed = dataclasses.replace(base, tiers=(remote,))
    assert (listed.lower_tier, listed.remote_tier) == (None, remote)
    with pytest.raises(ValueError, match="give the tiers in tiers only"):
        dataclasses.replace(listed, tiers=(RemoteTierConfig("redis://other:1/0"),))
    replaced = dataclasses.replace(listed, tiers=(lower,), remote_tier=None)
    assert (replaced.lower_tier, replaced.remote_tier) == (lower, None)


def test_opening_a_listed_lower_tier_names_its_place(tmp_path) -> None:
    from kvhal.vllm.lower_tier import open_lower_tier

    disk = {"backend": "disk", "options": {"path": str(tmp_path / "d"), "bytes_to_use": 100}}
    with pytest.raises(ValidationError) as raised:
        listed = disk_config({"tiers": [disk]})
        open_lower_tier(listed, listed.tiers[0], role="index", rank=0)
    assert raised.value.argument == "kv_connector_extra_config.tiers[0].options.bytes_to_use"

"""What KVHALConnector reads from vLLM's configuration, computed the same way on both sides.

The scheduler-side connector (the manager) and the worker-side one (the host
tier's memory) may live in different processes; both derive the host tier's
slot size and count from the same ``KVCacheConfig``, so they agree without
talking.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kvhal.errors import ValidationError
from kvhal.offload.wait_policy import POLICIES as WAIT_POLICIES
from kvhal.tiers.backend import TierSpec
from kvhal.vllm.model_identity import model_identity

if TYPE_CHECKING:  # annotations only: the names here (LOAD_MODES, ...) import without vLLM
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: The keys a user may put in ``kv_connector_extra_config``.
KNOWN_KEYS = {
    "cpu_bytes_to_use",
    "device",
    "eviction_policy",
    "offload_prompt_only",
    "load_mode",
    "disk_path",
    "disk_bytes_to_use",
    "disk_write",
    "disk_eviction_policy",
    "lower_tier_wait_ms",
    "lower_tier_prefetch_blocks",
    "lower_tier_wait_policy",
    "tier_backend",
    "tier_options",
    "remote_url",
    "remote_strict",
    "remote_lookup_timeout_ms",
    "remote_load_timeout_ms",
    "remote_max_inflight_blocks",
    "remote_wait_policy",
    "remote_auth",
    "remote_secret_file",
    "model_version",
}
#: ``load_mode``'s values (see :class:`ConnectorConfig`).
LOAD_MODES = ("auto", "sync", "layerwise", "async")
#: The keys that configure the remote tier besides ``remote_url``.
REMOTE_KEYS = (
    "remote_strict",
    "remote_lookup_timeout_ms",
    "remote_load_timeout_ms",
    "remote_max_inflight_blocks",
    "remote_wait_policy",
    "remote_auth",
    "remote_secret_file",
)
#: ``remote_auth``'s values: values carry an HMAC of the fleet's secret, or (said in so many
#: words) nothing protects them from whoever can write to the store.
REMOTE_AUTH = ("hmac", "none")
#: The tier backend option each disk key fills.
DISK_OPTIONS = {"disk_path": "path", "disk_bytes_to_use": "bytes_to_use"}


@dataclass(frozen=True)
class LowerTierConfig:
    """The tier below the host tier, from ``kv_connector_extra_config``.

    :param backend: the tier backend's name (``"disk"``, or a plugin's).
    :param options: the backend's options (``path``, ``bytes_to_use`` for ``disk``).
    :param write: ``"through"`` (default) or ``"back"``.
    :param eviction_policy: the lower tier's policy (default ``"clock"``: one byte a block).
    :param config_keys: backend option -> the user's key, to name it in errors.
    :param wait_ms: how long a request waits for its blocks to be read from the lower tier
        into host memory (a prefetch, started at lookup); past it, the part already in host
        memory is loaded and the rest recomputed. ``None``: the prefetch is off, and such a
        hit is one asynchronous load that reads, then copies.
    :param prefetch_blocks: blocks being read by prefetches at most (every group's); a hit
        past the budget is loaded asynchronously, as with the prefetch off.
    :param wait_policy: ``"auto"`` (default): a request waits at most about as long as
        recomputing its blocks would take, and a tier measured slower than recomputing is
        not read (:mod:`kvhal.offload.wait_policy`); ``"timeout"``: always up to ``wait_ms``.
    """

    backend: str
    options: dict[str, Any]
    write: str
    eviction_policy: str
    config_keys: dict[str, str] = field(default_factory=dict)
    wait_ms: int | None = 1000
    prefetch_blocks: int | None = None  # None: half the host tier's slots
    wait_policy: str = "auto"


@dataclass(frozen=True)
class RemoteTierConfig:
    """The shared tier below the others, from ``kv_connector_extra_config``.

    :param url: ``remote_url``: the store (``mooncake://...``, ``redis://...``).
    :param strict: an unreachable store fails engine start (default: a warning,
        and the tier starts down and keeps trying to connect).
    :param lookup_timeout_ms: how long a request waits for the store to say
        whether it holds its blocks (it is asked again meanwhile); a miss after.
    :param load_timeout_ms: how long a request waits for its blocks from the store
        (read into host memory at lookup, or by a parked load) before it is recomputed.
    :param max_inflight_blocks: blocks being written to the store at once;
        stores beyond it are dropped and counted (a lagging store never queues
        without bound).
    :param wait_policy: ``"auto"`` (default): a request waits for the store at most about
        as long as recomputing would take, and a store slower than that is not read
        (:mod:`kvhal.offload.wait_policy`); ``"timeout"``: always up to ``load_timeout_ms``.
    :param auth: ``"hmac"`` (default): every value carries an HMAC of the fleet's secret
        (``KVHAL_REMOTE_SECRET`` or ``secret_file``), and the engine does not start without
        one; ``"none"``: the operator's explicit opt-out, warned of at every start.
    :param secret_file: ``remote_secret_file``: a file holding the secret (its first line).
    """

    url: str
    strict: bool = False
    lookup_timeout_ms: int = 200
    load_timeout_ms: int = 5000
    max_inflight_blocks: int = 512
    wait_policy: str = "auto"
    auth: str = "hmac"
    secret_file: str | None = None


@dataclass(frozen=True)
class GroupInfo:
    """One KV cache group kvhal offloads.

    :param page_bytes: what one block of one layer holds, K and V together
        (whether the engine keeps them in one tensor or a (K, V) pair).
    """

    group_id: int
    layer_names: tuple[str, ...]
    page_bytes: int
    head_size: int

    @property
    def slot_bytes(self) -> int:
        """One block of every layer of the group: one host-tier slot."""
        return self.page_bytes * len(self.layer_names)


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` checked, plus what follows from the engine's config.

    :param cpu_bytes_to_use: host memory for offloaded KV, per engine (split
        evenly between its workers).
    :param device: a kvhal device plugin to use instead of the auto-selected one.
    :param eviction_policy: ``"lru"`` (default), ``"s3fifo"``, or a plugin's.
    :param offload_prompt_only: store prompt blocks only (vLLM's default), not decode ones.
    :param load_mode: ``"auto"`` (default): a hit held whole in the host tier is loaded in the
        step that schedules it (a synchronous load), where vLLM can recompute a failed one
        block by block (one KV cache group); other hits asynchronously. A large synchronous
        load is copied layer by layer where vLLM waits per layer (each layer's attention waits
        for its own copy) and the device plugin's copies run beside compute
        (``copy.overlapped``: a GPU's, not the CPU's). ``"sync"``: as ``"auto"``, every
        synchronous load copied whole; ``"layerwise"``: every one layer by layer. ``"async"``:
        every hit asynchronously (vLLM parks the request for a step).
    """

    cpu_bytes_to_use: int
    device: str | None
    eviction_policy: str
    offload_prompt_only: bool
    block_size: int
    groups: tuple[GroupInfo, ...]
    world_size: int
    layout: str
    lower_tier: LowerTierConfig | None = None
    remote_tier: RemoteTierConfig | None = None
    load_mode: str = "auto"
    #: vLLM's id of the engine (its scheduler and workers share it)
    engine_id: str | None = None
    #: what the KV is, for the tiers below (see :func:`kv_fingerprint`)
    fingerprint: dict[str, Any] = field(default_factory=dict)

    @property
    def slot_bytes(self) -> int:
        return self.groups[0].slot_bytes

    def tier_spec(
        self, role: Literal["index", "io"], rank: int, options: dict[str, Any] | None = None
    ) -> TierSpec:
        """What a tier below the host tier is opened for, by the scheduler or worker ``rank``."""
        return TierSpec(
            options=dict(options or {}),
            slot_bytes=self.slot_bytes,
            fingerprint=self.fingerprint,
            role=role,
            rank=rank,
            world_size=self.world_size,
        )

    @property
    def sync_host_loads(self) -> bool:
        """Whether host hits load in the step that schedules them: vLLM reports a failed
        synchronous load by block ids, which it refuses with more than one KV cache group."""
        return self.load_mode != "async" and len(self.groups) == 1

    @property
    def num_slots(self) -> int:
        return self.cpu_bytes_to_use // self.world_size // self.slot_bytes

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> ConnectorConfig:
        extra: dict[str, Any] = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - KNOWN_KEYS)
        if unknown:
            raise ValidationError(
                "kv_connector_extra_config",
                f"unknown keys {unknown}; KVHALConnector takes {sorted(KNOWN_KEYS)}",
            )
        cpu_bytes = extra.get("cpu_bytes_to_use")
        if isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, int) or cpu_bytes <= 0:
            raise ValidationError(
                "kv_connector_extra_config.cpu_bytes_to_use",
                f"must be a positive number of bytes of host memory, got {cpu_bytes!r}",
            )
        from kvhal.vllm.versions import kv_cache_layout, prefix_cacheable_group_ids  # imports vLLM

        groups = []
        for group_id in prefix_cacheable_group_ids(kv_cache_config):
            group = kv_cache_config.kv_cache_groups[group_id]
            spec = group.kv_cache_spec
            # vLLM's page covers K and V of a block (2 x, or head_size + head_size_v);
            # it may be padded so that groups share one block pool, while copies
            # move the real bytes only: a slot holds those.
            page_bytes = getattr(spec, "real_page_size_bytes", None) or spec.page_size_bytes
            groups.append(
                GroupInfo(
                    group_id=group_id,
                    layer_names=tuple(group.layer_names),
                    page_bytes=page_bytes,
                    head_size=getattr(spec, "head_size", 0),
                )
            )
        if not groups:
            raise ValidationError(
                "kv_cache_config", "the model has no prefix-cacheable KV cache group to offload"
            )
        sizes = {g.slot_bytes for g in groups}
        if len(sizes) != 1:
            raise ValidationError(
                "kv_cache_config",
                f"KV cache groups need equal bytes per block to share the host tier, got {sorted(sizes)}",
            )
        parallel = vllm_config.parallel_config
        stages = parallel.pipeline_parallel_size
        if stages > 1:
            # Stages hold different layers, so per-worker block bytes differ from
            # what the scheduler computes; untested, hence refused rather than guessed.
            raise ValidationError(
                "parallel_config.pipeline_parallel_size",
                f"KVHALConnector supports pipeline_parallel_size 1 only, got {stages}",
            )
        device = extra.get("device")
        if device is not None and not isinstance(device, str):
            raise ValidationError(
                "kv_connector_extra_config.device",
                f"must be a device plugin's name (a str) or null, got {device!r}",
            )
        eviction_policy = extra.get("eviction_policy", "lru")
        if not isinstance(eviction_policy, str):
            raise ValidationError(
                "kv_connector_extra_config.eviction_policy",
                f"must be an eviction policy's name (a str), got {eviction_policy!r}",
            )
        offload_prompt_only = extra.get("offload_prompt_only", True)
        if not isinstance(offload_prompt_only, bool):
            # bool("false") is True: a string or number here is refused, not guessed.
            raise ValidationError(
                "kv_connector_extra_config.offload_prompt_only",
                f"must be a JSON boolean (true or false), got {offload_prompt_only!r}",
            )
        load_mode = extra.get("load_mode", "auto")
        if load_mode not in LOAD_MODES:
            raise ValidationError(
                "kv_connector_extra_config.load_mode", f"must be one of {list(LOAD_MODES)}, got {load_mode!r}"
            )
        layout = kv_cache_layout(kv_cache_config) or "LBHNC"
        lower_tier = _lower_tier(extra)
        remote_tier = _remote_tier(extra)
        model_version = extra.get("model_version")
        if model_version is not None and (not isinstance(model_version, str) or not model_version):
            raise ValidationError(
                "kv_connector_extra_config.model_version",
                f"must be a non-empty string, got {model_version!r}",
            )
        block_size = vllm_config.cache_config.block_size
        config = cls(
            cpu_bytes_to_use=cpu_bytes,
            device=device,
            eviction_policy=eviction_policy,
            offload_prompt_only=offload_prompt_only,
            block_size=block_size,
            groups=tuple(groups),
            world_size=parallel.world_size,
            layout=layout,
            lower_tier=lower_tier,
            remote_tier=remote_tier,
            load_mode=load_mode,
            engine_id=getattr(vllm_config.kv_transfer_config, "engine_id", None),
            fingerprint=kv_fingerprint(vllm_config, tuple(groups), layout, block_size, model_version)
            if lower_tier or remote_tier
            else {},
        )
        if config.num_slots < 1:
            raise ValidationError(
                "kv_connector_extra_config.cpu_bytes_to_use",
                f"{cpu_bytes} bytes hold no block of {config.slot_bytes} bytes per worker",
            )
        return config


def _lower_tier(extra: dict[str, Any]) -> LowerTierConfig | None:
    """The lower tier the user asked for, checked; ``None`` if none."""
    prefix = "kv_connector_extra_config."
    asked = [
        key for key in ("disk_path", "disk_bytes_to_use", "tier_backend", "tier_options") if key in extra
    ]
    if not asked:
        lower_keys = (
            "disk_write",
            "disk_eviction_policy",
            *(k for k in KNOWN_KEYS if k.startswith("lower_tier_")),
        )
        for key in sorted(lower_keys):
            if key in extra:
                raise ValidationError(prefix + key, "configures a lower tier, but none is set (disk_path)")
        return None
    backend = extra.get("tier_backend", "disk")
    if not isinstance(backend, str) or not backend:
        raise ValidationError(prefix + "tier_backend", f"must be a tier backend's name, got {backend!r}")
    options = extra.get("tier_options", {})
    if not isinstance(options, dict):
        raise ValidationError(prefix + "tier_options", f"must be a JSON object, got {options!r:.60}")
    options = dict(options)
    config_keys = {name: f"{prefix}tier_options.{name}" for name in options}
    for key, option in DISK_OPTIONS.items():
        if key in extra:
            options[option] = extra[key]
            config_keys[option] = prefix + key
    if backend == "disk":
        for key, option in DISK_OPTIONS.items():
            if option not in options:
                raise ValidationError(prefix + key, "is required for the disk tier")
        path = options["path"]
        if not isinstance(path, str) or not path:
            raise ValidationError(prefix + "disk_path", f"must be a directory's path, got {path!r}")
        size = options["bytes_to_use"]
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValidationError(
                prefix + "disk_bytes_to_use", f"must be a positive number of bytes of disk, got {size!r}"
            )
    write = extra.get("disk_write", "through")
    if write not in ("through", "back"):
        raise ValidationError(prefix + "disk_write", f'must be "through" or "back", got {write!r}')
    policy = extra.get("disk_eviction_policy", "clock")
    if not isinstance(policy, str):
        raise ValidationError(
            prefix + "disk_eviction_policy", f"must be an eviction policy's name (a str), got {policy!r}"
        )
    wait_ms = extra.get("lower_tier_wait_ms", 1000)
    if wait_ms is not None and (isinstance(wait_ms, bool) or not isinstance(wait_ms, int) or wait_ms < 0):
        raise ValidationError(
            prefix + "lower_tier_wait_ms",
            f"must be a number of milliseconds (0 or more), or null for no prefetch, got {wait_ms!r}",
        )
    budget = extra.get("lower_tier_prefetch_blocks")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise ValidationError(
            prefix + "lower_tier_prefetch_blocks", f"must be a positive number of blocks, got {budget!r}"
        )
    wait_policy = extra.get("lower_tier_wait_policy", "auto")
    if wait_policy not in WAIT_POLICIES:
        raise ValidationError(
            prefix + "lower_tier_wait_policy",
            f"must be one of {', '.join(WAIT_POLICIES)}, got {wait_policy!r}",
        )
    return LowerTierConfig(backend, options, write, policy, config_keys, wait_ms, budget, wait_policy)


def _remote_tier(extra: dict[str, Any]) -> RemoteTierConfig | None:
    """The shared tier the user asked for, checked; ``None`` if none."""
    prefix = "kv_connector_extra_config."
    url = extra.get("remote_url")
    if url is None:
        for key in REMOTE_KEYS:
            if key in extra:
                raise ValidationError(prefix + key, "configures a remote tier, but none is set (remote_url)")
        return None
    if not isinstance(url, str) or "://" not in url:
        raise ValidationError(
            prefix + "remote_url",
            "must be a store's URL (mooncake://HOST:PORT?metadata=..., redis://HOST:PORT/DB), "
            f"got {url!r:.80}",
        )
    strict = extra.get("remote_strict", False)
    if not isinstance(strict, bool):
        raise ValidationError(prefix + "remote_strict", f"must be a JSON boolean, got {strict!r}")
    numbers = {}
    defaults = RemoteTierConfig(url)
    for key in ("remote_lookup_timeout_ms", "remote_load_timeout_ms", "remote_max_inflight_blocks"):
        value = extra.get(key, getattr(defaults, key.removeprefix("remote_")))
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValidationError(prefix + key, f"must be a positive integer, got {value!r}")
        numbers[key.removeprefix("remote_")] = value
    wait_policy = extra.get("remote_wait_policy", "auto")
    if wait_policy not in WAIT_POLICIES:
        raise ValidationError(
            prefix + "remote_wait_policy", f"must be one of {', '.join(WAIT_POLICIES)}, got {wait_policy!r}"
        )
    auth = extra.get("remote_auth", "hmac")
    if auth not in REMOTE_AUTH:
        raise ValidationError(
            prefix + "remote_auth", f"must be one of {', '.join(REMOTE_AUTH)}, got {auth!r}"
        )
    secret_file = extra.get("remote_secret_file")
    if secret_file is not None and (not isinstance(secret_file, str) or not secret_file):
        raise ValidationError(prefix + "remote_secret_file", f"must be a file path, got {secret_file!r}")
    return RemoteTierConfig(
        url, strict, **numbers, wait_policy=wait_policy, auth=auth, secret_file=secret_file
    )


#: ``PYTHONHASHSEED``: what makes vLLM's block hashes the same in every process.
HASH_SEED_VARIABLE = "PYTHONHASHSEED"


def kv_fingerprint(
    vllm_config: VllmConfig,
    groups: tuple[GroupInfo, ...],
    layout: str,
    block_size: int,
    model_version: str | None = None,
) -> dict[str, Any]:
    """What the offloaded KV is: blocks stored under another fingerprint are never loaded.

    The model by what it is (:mod:`kvhal.vllm.model_identity`: a digest of its config and
    weights, or the operator's ``model_version``), not where it lies; dtypes and
    quantization, layout and block geometry, the KV cache groups, the tensor-parallel size
    (each rank's share is told apart by the tier), and vLLM's block-hash algorithm and seed
    (the seed only as a digest: vLLM keeps a non-cryptographic one secret).
    """
    from kvhal.vllm.versions import none_hash_is_random  # imports vLLM

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    seed = os.environ.get(HASH_SEED_VARIABLE)
    if seed is not None:
        seed_id = hashlib.blake2b(seed.encode(), digest_size=8).hexdigest()
    elif none_hash_is_random(cache.prefix_caching_hash_algo):
        seed_id = "random-per-process"
    else:
        seed_id = "vllm-default"
    return {
        "model": model_identity(str(model.model), model.revision, model_version),
        "dtype": str(model.dtype),
        "kv_cache_dtype": str(cache.cache_dtype),
        "quantization": model.quantization,
        "layout": layout,
        "block_size": block_size,
        "groups": [
            {
                "id": g.group_id,
                "layers": list(g.layer_names),
                "page_bytes": g.page_bytes,
                "head_size": g.head_size,
            }
            for g in groups
        ],
        "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
        "hash_algo": cache.prefix_caching_hash_algo,
        "hash_seed": seed_id,
    }

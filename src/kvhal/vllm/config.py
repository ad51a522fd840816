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
from typing import TYPE_CHECKING, Any, Literal, get_args

from kvhal.errors import ValidationError
from kvhal.tiers.backend import TierSpec
from kvhal.vllm.extra_config import (
    ExtraSettings,
    LowerTierConfig,
    RemoteTierConfig,
    TierConfig,
    check_extra_config,
)
from kvhal.vllm.model_identity import model_identity
from kvhal.vllm.settings import KNOWN_KEYS, ExtraConfigSettings, StoreTierSettings
from kvhal.vllm.tenants import DEFAULT_TENANT_LABELS

if TYPE_CHECKING:  # annotations only: the names here (LOAD_MODES, ...) import without vLLM
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "HASH_SEED_VARIABLE",
    "KNOWN_KEYS",
    "LOAD_MODES",
    "REMOTE_AUTH",
    "ConnectorConfig",
    "ExtraSettings",
    "GroupInfo",
    "LowerTierConfig",
    "RemoteTierConfig",
    "TierConfig",
    "check_extra_config",
    "kv_fingerprint",
]

#: ``load_mode``'s values (see :class:`ConnectorConfig`), from the declaration (:mod:`kvhal.vllm.settings`).
LOAD_MODES: tuple[str, ...] = get_args(ExtraConfigSettings.model_fields["load_mode"].annotation)
#: ``remote_auth``'s values: values carry an HMAC of the fleet's secret, or (said in so many
#: words) nothing protects them from whoever can write to the store.
REMOTE_AUTH: tuple[str, ...] = get_args(StoreTierSettings.model_fields["auth"].annotation)


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
    :param tiers: the tiers below the host tier, in order (``kv_connector_extra_config.tiers``,
        or its short forms).
    :param lower_tier: the first local tier of ``tiers``; :param remote_tier: its first store.
        Both are kept while the chain reads them; given without ``tiers`` (as tests do), they
        are ``tiers``. With ``tiers``, they are derived, and if given must agree with it.
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
    tiers: tuple[TierConfig, ...] = ()
    #: salts counted apart in the ``tenant_*`` counters (:mod:`kvhal.vllm.tenants`); 0: none
    tenant_labels: int = DEFAULT_TENANT_LABELS

    def __post_init__(self) -> None:
        if not self.tiers:
            short = (self.lower_tier, self.remote_tier)
            object.__setattr__(self, "tiers", tuple(t for t in short if t is not None))
            return
        local = next((t for t in self.tiers if isinstance(t, LowerTierConfig)), None)
        store = next((t for t in self.tiers if isinstance(t, RemoteTierConfig)), None)
        for name, given, derived in (
            ("lower_tier", self.lower_tier, local),
            ("remote_tier", self.remote_tier, store),
        ):
            if given is None:
                object.__setattr__(self, name, derived)
            elif given != derived:
                raise ValueError(
                    f"ConnectorConfig: {name} is the first of its kind in tiers; give the tiers in "
                    f"tiers only (dataclasses.replace: pass {name}=None with new tiers)"
                )

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
        """The user's keys checked (:func:`check_extra_config`), with what the engine says:
        KV cache groups, block size, workers, layout, and the tiers' fingerprint."""
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        settings = check_extra_config(extra)
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
        layout = kv_cache_layout(kv_cache_config) or "LBHNC"
        block_size = vllm_config.cache_config.block_size
        fingerprint = (
            kv_fingerprint(vllm_config, tuple(groups), layout, block_size, settings.model_version)
            if settings.tiers
            else {}
        )
        config = cls(
            cpu_bytes_to_use=settings.cpu_bytes_to_use,
            device=settings.device,
            eviction_policy=settings.eviction_policy,
            offload_prompt_only=settings.offload_prompt_only,
            block_size=block_size,
            groups=tuple(groups),
            world_size=parallel.world_size,
            layout=layout,
            load_mode=settings.load_mode,
            engine_id=getattr(vllm_config.kv_transfer_config, "engine_id", None),
            fingerprint=fingerprint,
            tiers=settings.tiers,
            tenant_labels=settings.tenant_labels,
        )
        if config.num_slots < 1:
            raise ValidationError(
                "kv_connector_extra_config.cpu_bytes_to_use",
                f"{config.cpu_bytes_to_use} bytes hold no block of {config.slot_bytes} bytes per worker",
            )
        return config


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

    The model by what it is (:mod:`kvhal.vllm.model_identity`: a digest of every byte of its
    config and weights, a hub model's commit, or the operator's ``model_version``), not where
    it lies; dtypes and
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
        "model": model_identity(
            str(model.model),
            model.revision,
            model_version,
            download_dir=vllm_config.load_config.download_dir,
            weights_at=getattr(model, "model_weights", None),
        ),
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

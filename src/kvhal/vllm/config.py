"""What KVHALConnector reads from vLLM's configuration, computed the same way on both sides.

The scheduler-side connector (the manager) and the worker-side one (the host
tier's memory) may live in different processes; both derive the host tier's
slot size and count from the same ``KVCacheConfig``, so they agree without
talking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvhal.errors import ValidationError

#: The keys a user may put in ``kv_connector_extra_config``.
KNOWN_KEYS = {"cpu_bytes_to_use", "device", "eviction_policy", "offload_prompt_only"}


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
    """

    cpu_bytes_to_use: int
    device: str | None
    eviction_policy: str
    offload_prompt_only: bool
    block_size: int
    groups: tuple[GroupInfo, ...]
    world_size: int
    layout: str

    @property
    def slot_bytes(self) -> int:
        return self.groups[0].slot_bytes

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
        groups = []
        for group_id in kv_cache_config.prefix_cacheable_group_ids:
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
        config = cls(
            cpu_bytes_to_use=cpu_bytes,
            device=device,
            eviction_policy=eviction_policy,
            offload_prompt_only=offload_prompt_only,
            block_size=vllm_config.cache_config.block_size,
            groups=tuple(groups),
            world_size=parallel.world_size,
            layout=kv_cache_config.kv_cache_layout or "LBHNC",
        )
        if config.num_slots < 1:
            raise ValidationError(
                "kv_connector_extra_config.cpu_bytes_to_use",
                f"{cpu_bytes} bytes hold no block of {config.slot_bytes} bytes per worker",
            )
        return config


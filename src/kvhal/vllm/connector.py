"""KVHALConnector: vLLM's KV connector for kvhal offloading, through the kvhal plugin for vLLM's device.

Users write::

    kv_transfer_config={
        "kv_connector": "KVHALConnector",
        "kv_connector_module_path": "kvhal.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 8 << 30},
    }

It implements ``KVConnectorBase_V1`` directly (docs/vllm-integration.md says
why, rather than vLLM's ``OffloadingSpec`` plug point) and declares
``SupportsHMA``, so hybrid models keep vLLM's hybrid KV cache manager.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvhal.vllm.arrivals import arrived
from kvhal.vllm.config import ConnectorConfig
from kvhal.vllm.config_check import refuse_early
from kvhal.vllm.hit_sources import vllm_sources
from kvhal.vllm.kv_events import kv_events_enabled
from kvhal.vllm.local import in_process_worker
from kvhal.vllm.metadata import KVHALMetadata, KVHALWorkerMetadata
from kvhal.vllm.prom_metrics import KVHALPromMetrics
from kvhal.vllm.scheduler_side import SchedulerSide
from kvhal.vllm.start_log import log_start
from kvhal.vllm.stats import KVHALStats
from kvhal.vllm.versions import HIT_SOURCE, KVConnectorTransferResults, check_supported, describe
from kvhal.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


logger = logging.getLogger("vllm." + __name__)  # under "vllm": its handlers and level (INFO was dropped)


class KVHALConnector(KVConnectorBase_V1, SupportsHMA):
    """Offloads vLLM's KV cache to host memory through the kvhal device plugin for its device."""

    if HIT_SOURCE is not None:  # vLLM 0.32 labels hits by source
        _cache_hit_source = HIT_SOURCE

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        refuse_early(vllm_config.kv_transfer_config)  # kvhal config check's checks (once a process)
        self.config = ConnectorConfig.from_vllm(vllm_config, kv_cache_config)
        check_supported(len(self.config.groups))
        logger.info("kvhal: %s", describe())
        if role is KVConnectorRole.SCHEDULER:  # once an engine: kvhal's version, device, extensions, tiers
            log_start(logger, self.config, vllm_config)
        self.scheduler_side = (
            SchedulerSide(
                self.config,
                local=in_process_worker(self.config),
                kv_events=kv_events_enabled(vllm_config.kv_events_config),
            )
            if role is KVConnectorRole.SCHEDULER
            else None
        )
        self.worker_side = WorkerSide(self.config) if role is KVConnectorRole.WORKER else None

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache, not a hand-off: a dropped store is a future miss.
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # vLLM 0.32 asks before it sizes and allocates the KV cache (after the model loads; the
        # class lookup in VllmConfig refused a bad configuration earlier: kvhal.vllm.__getattr__)
        refuse_early(vllm_config.kv_transfer_config)
        # kvhal copies any layout the engine picks (copies follow real strides).
        return None

    # -- worker side ---------------------------------------------------------------

    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "worker-side call on the scheduler-side connector"
        return self.worker_side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        # vllm-ascend passes (k_cache, v_cache) pairs, 1-tuples and Mamba lists too:
        # kvhal.vllm.cache_shapes says which WorkerSide offloads and which it refuses
        self._worker().register(kv_caches, _tensor_parallel_rank())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # called at the start of every step, before its compute
        if isinstance(kv_connector_metadata, KVHALMetadata):
            self._worker().begin_step(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVHALMetadata):
            self._worker().start_loads(meta)
            if meta.no_forward:  # vLLM 0.27.1 calls no wait_for_save in such a step
                self._worker().start_stores(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # large synchronous loads go layer by layer: this layer's copies first; the others
        # were waited for whole in start_load_kv, and asynchronous ones' requests are parked
        if self.worker_side is not None:
            self.worker_side.layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None  # stores are whole blocks of every layer, submitted in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVHALMetadata):
            self._worker().start_stores(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # vLLM 0.27.1 asks this only: a failed load's blocks go to get_block_ids_with_load_errors
        finished, _failed, sent = self._worker().collect()
        return sent, finished

    if KVConnectorTransferResults is not None:  # vLLM 0.32 asks this, with request-level failures

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            finished, failed, sent = self._worker().collect()
            return KVConnectorTransferResults(
                finished_sending=sent, finished_recving=finished, failed_recving=failed
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        # a failed synchronous load: vLLM recomputes these blocks
        return self.worker_side.take_load_errors() if self.worker_side is not None else set()

    def build_connector_worker_meta(self) -> KVHALWorkerMetadata | None:
        return self.worker_side.worker_meta() if self.worker_side is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.scheduler_side is not None:
            return self.scheduler_side.take_stats()
        if self.worker_side is None:
            return None
        meta = self._connector_metadata
        return self.worker_side.take_stats(meta.send_stats if isinstance(meta, KVHALMetadata) else True)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.scheduler_side is not None:
            self.scheduler_side.close()

    # -- scheduler side ------------------------------------------------------------

    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "scheduler-side call on the worker-side connector"
        return self.scheduler_side

    def on_new_request(self, request: Request) -> None:
        arrived(self._scheduler(), request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().lookup(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler().after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        # vLLM 0.32 asks right after update_state_after_alloc: the hit by the kind of tier
        # that served it (vllm:prompt_tokens_cached_by_source); 0.27.1 never asks
        return vllm_sources(self._scheduler().hit_sources(request, num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().on_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request)

    def take_events(self) -> list[KVCacheEvent]:
        return self._scheduler().take_events()

    def has_pending_block_frees(self) -> bool:
        # a request short of blocks waits for held ones instead of preempting another
        return self._scheduler().has_held_blocks()

    def has_pending_push_work(self) -> bool:
        # keeps an idle engine stepping until the workers reported every job, so
        # that the manager learns of finished stores (and a connector reset can run)
        return self._scheduler().has_jobs_in_flight()

    def reset_cache(self) -> bool | None:
        return self._scheduler().reset()

    # -- metrics -------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVHALStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVHALPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _tensor_parallel_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

    return get_tensor_model_parallel_rank() if model_parallel_is_initialized() else 0

"""What differs between the vLLM versions kvhal runs on: 0.27.1 (the one vllm-ascend pins)
and 0.32. Every difference kvhal knows of is answered here, by what the installed vLLM has,
and the rest of ``kvhal.vllm`` imports the answers (../shared/docs/vllm-connector-versions.md
has the file:line facts).

- Finished transfers: 0.32 asks ``get_transfer_results`` (with ``failed_recving``, a
  request-level failure); 0.27.1 asks only ``get_finished``, and a failed load can be told
  to it only as invalid blocks, which its scheduler cannot take with more than one KV cache
  group (a hybrid model). kvhal refuses hybrid models there, before any byte moves.
- ``wait_for_save``: 0.27.1 calls none in a step without a forward; kvhal submits such a
  step's stores in ``start_load_kv`` (the scheduler side marks the step, any version).
- Stats: 0.27.1's ``LLMEngine.step`` records a step's stats only when the step has request
  outputs: kvhal sends its counters only in a step in which a request samples a token, and
  not in one whose load failed (:data:`STATS_NEED_REQUEST_OUTPUTS`).
- Block hashes without ``PYTHONHASHSEED``: 0.32 seeds them at random per process only for
  its non-cryptographic algorithms (xxhash); 0.27.1 for every algorithm, so there a restarted
  or another engine computes other hashes unless ``PYTHONHASHSEED`` is set.
- ``CacheHitSource`` (which tier a hit came from, on ``/metrics``: kvhal splits each hit by
  kind of tier, :mod:`kvhal.vllm.hit_sources`) exists on 0.32 only.
- Which KV cache groups a connector stores: 0.32 says (``prefix_cacheable_group_ids``);
  on 0.27.1 every group but Mamba state. The layout of the KV cache: 0.32 says
  (``kv_cache_layout``); 0.27.1 does not (the standard layout).
- A scheduled request's device blocks: 0.32 hands connectors the block table
  (``kv_connector_block_state``); on 0.27.1 kvhal keeps it from the scheduler's output as
  vLLM's model runner does (:class:`BlockTables`).
"""

from __future__ import annotations

import re
from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1 import base

from kvhal.errors import ValidationError

VLLM_VERSION: str = vllm.__version__
_RELEASE = tuple(int(part) for part in re.findall(r"\d+", VLLM_VERSION)[:2])

#: Whether vLLM may drop the stats of a step without request outputs (0.27.1's
#: ``vllm/v1/engine/llm_engine.py`` records stats only ``if len(outputs.outputs) > 0``; 0.31
#: no longer does, where holding only delays kvhal's counters; cut at 0.32, what was tested).
STATS_NEED_REQUEST_OUTPUTS: bool = _RELEASE < (0, 32)

#: vLLM's ``KVConnectorTransferResults`` (0.32), or None where vLLM asks ``get_finished`` only.
KVConnectorTransferResults: Any = getattr(base, "KVConnectorTransferResults", None)

#: Whether a failed asynchronous load is reported per request (``failed_recving``); where
#: not, its blocks are reported as load errors with the request in ``finished_recving``.
REQUEST_LEVEL_LOAD_FAILURES: bool = KVConnectorTransferResults is not None

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    #: the label vLLM's ``prompt_tokens_cached_by_source`` counter gives a kvhal hit by default
    HIT_SOURCE: Any = CacheHitSource.HOST
    #: kvhal's kinds of tier -> vLLM's sources (:mod:`kvhal.vllm.hit_sources`): a store is
    #: vLLM's "remote store" source, ``external_unspecified``
    HIT_SOURCES: dict[str, Any] | None = {
        "host": CacheHitSource.HOST,
        "local": CacheHitSource.DISK,
        "shared": CacheHitSource.EXTERNAL_UNSPECIFIED,
    }
except ImportError:  # 0.27.1: no hit sources
    HIT_SOURCE = None
    HIT_SOURCES = None


def prefix_cacheable_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """The KV cache groups whose blocks are addressed by prefix hashes (what kvhal stores)."""
    ids = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
    if ids is not None:
        return tuple(ids)
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = kv_cache_config.kv_cache_groups
    return tuple(i for i, g in enumerate(groups) if not isinstance(g.kv_cache_spec, MambaSpec))


#: vLLM's non-cryptographic block-hash algorithms
NON_CRYPTO_HASHES = ("xxhash", "xxhash_cbor")


def none_hash_is_random(hash_algo: str) -> bool:
    """Whether, without ``PYTHONHASHSEED``, vLLM seeds ``hash_algo``'s block hashes at random
    in every process (then no restarted or other engine finds them)."""
    from vllm.v1.core import kv_cache_utils

    if hasattr(kv_cache_utils, "resolve_none_hash_seed"):  # 0.32: a fixed seed for sha256
        return hash_algo in NON_CRYPTO_HASHES
    return True  # 0.27.1: os.urandom(32) for every algorithm


def seed_advice() -> str:
    """What makes block hashes the same in every engine, for a warning."""
    return "" if none_hash_is_random("sha256") else " (or use sha256)"


def kv_cache_layout(kv_cache_config: Any) -> str | None:
    """The KV cache's layout name, as vLLM 0.32 gives it; None where vLLM does not."""
    return getattr(kv_cache_config, "kv_cache_layout", None)


class BlockTables:
    """Each running request's device block ids per KV cache group, as of this step's schedule.

    On vLLM 0.32, :meth:`update` returns vLLM's own block state. Elsewhere it follows the
    scheduler's output as the model runner does: a new request brings its whole table, a
    running one the blocks it gained, a resumed one (preempted before) its whole table anew.
    """

    def __init__(self) -> None:
        self._tables: dict[str, list[list[int]]] = {}

    def update(self, scheduler_output: Any) -> Any:
        """Take this step's schedule; returns what answers ``get_block_ids(req_id)``."""
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        if state is not None:  # vLLM 0.32 sets it for every step of an engine with a connector
            return state
        for req_id in (*scheduler_output.finished_req_ids, *(scheduler_output.preempted_req_ids or ())):
            self._tables.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._tables[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            table = self._tables.get(req_id)
            if req_id in cached.resumed_req_ids or table is None:
                if new_ids is None:
                    self._tables.pop(req_id, None)  # nothing known: stores of it are skipped
                else:
                    self._tables[req_id] = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for ids, more in zip(table, new_ids, strict=True):
                    ids.extend(more)
        return self

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...] | None:
        table = self._tables.get(req_id)
        return None if table is None else tuple(table)


def failed_recving(output: Any) -> set[str]:
    """Requests whose asynchronous loads failed, from a ``KVConnectorOutput`` (none on 0.27.1)."""
    return set(getattr(output, "failed_recving", None) or ())


def check_supported(num_kv_cache_groups: int) -> None:
    """Refuse, naming the version, what the installed vLLM cannot run safely with kvhal."""
    if num_kv_cache_groups > 1 and not REQUEST_LEVEL_LOAD_FAILURES:
        raise ValidationError(
            "kv_transfer_config",
            f"the model has {num_kv_cache_groups} KV cache groups (a hybrid model), and vLLM "
            f"{VLLM_VERSION} can be told of a failed load only block by block, which its scheduler "
            "refuses with more than one group; kvhal offloads hybrid models on vLLM 0.32 and later "
            "(where a model's layers can share one group, disable_hybrid_kv_cache_manager=True "
            "gives it one)",
        )


def describe() -> str:
    """One line for the engine's log: which version's paths kvhal uses."""
    failures = "per request (failed_recving)" if REQUEST_LEVEL_LOAD_FAILURES else "per block (invalid blocks)"
    return f"vLLM {VLLM_VERSION}: failed asynchronous loads reported {failures}"

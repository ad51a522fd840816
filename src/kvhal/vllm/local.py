"""The worker side of an engine whose scheduler runs in the same process, found once.

With one worker (no tensor parallelism) vLLM runs the scheduler and the worker in one
process (the engine core), so the scheduler side can read the tiers below into host slots
itself, at lookup, and wait a few milliseconds for it, instead of sending the read to the
worker and learning that it ended from the next step's output (docs/tiers.md, "Prefetch at
lookup"). vLLM builds the worker's connector first (with the KV caches) and keeps it as the
process's KV transfer agent; the scheduler side is handed it at construction
(:func:`in_process_worker`), or ``None`` where there is none to read with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer import kv_transfer_state

if TYPE_CHECKING:
    from kvhal.vllm.config import ConnectorConfig
    from kvhal.vllm.worker_side import WorkerSide


def in_process_worker(config: ConnectorConfig) -> WorkerSide | None:
    """The worker side of ``config``'s engine if it runs in this process, its only worker.

    ``None`` with several workers (each reads its own share of a block: the scheduler sends
    its reads to all of them), in a process without a worker (the scheduler in another
    process than its workers), or where this process's agent is another engine's.
    """
    if config.world_size != 1 or config.engine_id is None or not kv_transfer_state.has_kv_transfer_group():
        return None
    agent = kv_transfer_state.get_kv_transfer_group()
    worker = getattr(agent, "worker_side", None)
    if worker is None or worker.config.engine_id != config.engine_id:
        return None
    return worker


def waits_whole(local: WorkerSide | None) -> bool:
    """Whether a lookup waits for its stores' answers and its prefetch's read whole rather than
    answer ``None`` and let the engine take a step meanwhile: where the engine's one worker
    shares this process and computes on the host's cores (the CPU plugin). There a forward
    beside a read takes the cores the store's client and a local server read with (a returning
    user's 9 MiB read from SeaweedFS took 100-900 ms between forwards, 40 ms alone), and the
    read slows the forward; a GPU's forward leaves the host's cores to the read."""
    return local is not None and local.device is not None and local.device.computes_on_host

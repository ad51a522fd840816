"""Which stores in flight a step must fence: those whose source blocks vLLM may rewrite in it.

A store reads its request's device blocks while later steps compute. vLLM may hand such a
block out again meanwhile (a preempted request's, or a sliding-window block allocated again
while its request runs), and the step that writes it must wait for the store: the step's
metadata names it (``KVHALMetadata.fence``) for the workers to fence. No other store delays
a step.
"""

from __future__ import annotations

from vllm.v1.core.sched.output import SchedulerOutput

from kvhal.vllm.request_state import RequestState
from kvhal.vllm.stats import KVHALStats


class StoreFences:
    """The store jobs in flight per device block they read, and the fences they need."""

    def __init__(self, block_size: int, stats: KVHALStats) -> None:
        self.block_size, self.stats = block_size, stats
        # store job in flight -> the block ids it reads (ids are shared by every group's
        # layers in vLLM's one block pool, so groups are not told apart); per job, not per
        # block: a step checks its few allocated blocks against a few stores
        self._reads: dict[int, frozenset[int]] = {}
        self.load_blocks: set[int] = set()  # blocks this step's loads write

    def add(self, job_id: int, blocks: frozenset[int]) -> None:
        """Store ``job_id`` reads ``blocks`` until it ends."""
        if blocks:
            self._reads[job_id] = blocks

    def remove(self, job_id: int, blocks: frozenset[int]) -> None:
        """Store ``job_id`` ended: it reads ``blocks`` no more."""
        self._reads.pop(job_id, None)

    def take(self, scheduler_output: SchedulerOutput, requests: dict[str, RequestState]) -> list[int]:
        """Store jobs in flight whose source blocks this step may rewrite; this step's load
        blocks are forgotten (the next step's loads write others)."""
        jobs: set[int] = set()
        if self._reads:
            allocated = self._allocated_blocks(scheduler_output)
            if allocated:
                jobs.update(job for job, blocks in self._reads.items() if not blocks.isdisjoint(allocated))
        for req_id in scheduler_output.preempted_req_ids or ():
            state = requests.get(req_id)
            if state is not None:
                # vLLM freed its blocks; once fenced, those stores no longer
                # hold back the request's end (its new blocks are other ones)
                jobs.update(state.store_jobs)
                state.store_jobs.clear()
        self.stats.add("fenced_stores", len(jobs))
        self.load_blocks = set()
        return sorted(jobs)

    def _allocated_blocks(self, scheduler_output: SchedulerOutput) -> set[int]:
        """Blocks vLLM handed out this step: the ones this step may write."""
        bs = self.block_size
        blocks = set(self.load_blocks)
        for new in scheduler_output.scheduled_new_reqs:
            first = new.num_computed_tokens // bs  # before it: prefix-cache hits, only read
            for ids in new.block_ids:
                blocks.update(ids[first:])
        for ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            for group_ids in ids or ():  # appended blocks, or a resumed request's whole table
                blocks.update(group_ids)
        for copy in scheduler_output.kv_cache_block_copies or ():
            blocks.add(copy.dst_block_id)
        blocks.update(scheduler_output.new_block_ids_to_zero or ())
        blocks.discard(0)  # the null block is never written
        return blocks

"""What one worker has to report since it last did: the jobs that ended, for the scheduler
side (:class:`~kvhal.vllm.metadata.KVHALWorkerMetadata`), and for vLLM the asynchronous
loads that finished and failed, the device blocks loads failed to fill (recomputed), and
the finished requests the scheduler held whose blocks no store of this worker reads now
(``finished_sending``)."""

from __future__ import annotations

from kvhal.vllm.engine_traits import EngineTraits
from kvhal.vllm.metadata import KVHALWorkerMetadata, LoadJob, StoreJob


class WorkerReports:
    """The outcomes one worker has yet to report, and the stores its held requests wait for."""

    def __init__(self, traits: EngineTraits | None = None) -> None:
        self.traits = traits or EngineTraits()
        self._succeeded: dict[int, int] = {}
        self._failed: dict[int, int] = {}
        self._finished_loads: set[str] = set()
        self._failed_loads: set[str] = set()
        self._load_errors: set[int] = set()  # device blocks loads failed to fill
        self._load_failed_in_step = False  # see WorkerSide.take_stats
        self._stores_of: dict[str, set[int]] = {}  # request -> its store jobs running here
        self._held: set[str] = set()  # held by the scheduler until their stores finish
        self._finished_sending: set[str] = set()

    # -- what happened -------------------------------------------------------------

    def ended(self, job_id: int, ok: bool) -> None:
        """Job ``job_id`` ended on this worker (``ok``: it succeeded), for the scheduler side."""
        outcome = self._succeeded if ok else self._failed
        outcome[job_id] = outcome.get(job_id, 0) + 1

    def load_ended(self, job: LoadJob, ok: bool, sync: bool) -> None:
        """A load's copy ended: a synchronous one (``sync``, vLLM is not waiting for it in
        ``finished_recving``) fails as load errors, an asynchronous one is finished."""
        if sync:
            if not ok:
                self._load_errors.update(b for ids, _ in job.groups.values() for b in ids)
                self._load_failed_in_step = True
        else:
            self._finished_loads.add(job.req_id)
            if not ok:
                self._fail_load(job)

    def give_up(self, job: LoadJob) -> None:
        """Report ``job``'s load failed to vLLM now (its request is recomputed); the job
        itself ends later, once its reads into host slots end."""
        self._finished_loads.add(job.req_id)
        self._fail_load(job)

    def _fail_load(self, job: LoadJob) -> None:
        """Tell vLLM an asynchronous load failed: per request where it takes that, else its
        blocks as load errors (vLLM recomputes from the first; one KV cache group, checked at
        start)."""
        self._load_failed_in_step = True
        if self.traits.request_level_load_failures:
            self._failed_loads.add(job.req_id)
        else:
            self._load_errors.update(b for ids, _ in job.groups.values() for b in ids)

    def store_started(self, job: StoreJob) -> None:
        """Store ``job`` reads its request's blocks until :meth:`store_ended`."""
        self._stores_of.setdefault(job.req_id, set()).add(job.job_id)

    def store_ended(self, job: StoreJob) -> None:
        """Store ``job`` ended: a held request none of whose stores runs now is sent."""
        stores = self._stores_of[job.req_id]
        stores.discard(job.job_id)
        if not stores:
            del self._stores_of[job.req_id]
            if job.req_id in self._held:  # failed stores too: the blocks are read no more
                self._held.discard(job.req_id)
                self._finished_sending.add(job.req_id)

    def hold(self, req_id: str) -> None:
        """The scheduler holds finished ``req_id``'s blocks until its stores finish."""
        if self._stores_of.get(req_id):
            self._held.add(req_id)
        else:  # its stores finished here already (or it had none on this worker)
            self._finished_sending.add(req_id)

    # -- reporting it ----------------------------------------------------------------

    def has_news(self) -> bool:
        """Whether a job ended since the last report (to vLLM or to the scheduler side)."""
        return bool(self._finished_loads or self._finished_sending or self._succeeded or self._failed)

    def take_requests(self) -> tuple[set[str], set[str], set[str]]:
        """Requests whose loads finished, whose loads failed (a subset), and whose held blocks
        the stores read no more, since the last call."""
        finished, failed, sent = self._finished_loads, self._failed_loads, self._finished_sending
        self._finished_loads, self._failed_loads, self._finished_sending = set(), set(), set()
        return finished, failed, sent

    def take_load_errors(self) -> set[int]:
        """Device blocks loads failed to fill since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_load_failed(self) -> bool:
        """Whether a load failed in vLLM's view since the last call."""
        failed, self._load_failed_in_step = self._load_failed_in_step, False
        return failed

    def worker_meta(self) -> KVHALWorkerMetadata | None:
        """The jobs finished since the last call, for the scheduler side (``None`` if none)."""
        if not self._succeeded and not self._failed:
            return None
        meta = KVHALWorkerMetadata(succeeded=self._succeeded, failed=self._failed)
        self._succeeded, self._failed = {}, {}
        return meta

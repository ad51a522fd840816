"""A worker's trace: what vLLM's worker handed kvhal's worker side, step by step, and what it
answered, so that ``kvhal replay`` can run the same calls on another device without vLLM.

Recorded where ``KVHAL_TRACE_DIR`` is set (one file per worker:
``<dir>/kvhal-trace-<engine>-<pid>-rank<r>.json.gz``): the KV cache tensors' structure (shapes,
strides, dtypes, which storage each view lies in), the connector's configuration, and every
call of the worker side in order, each step's metadata and answers included. Block contents
are kept as digests: of every device block a store copied (taken before the copy), and of
every device block a load filled (taken when the load ended). The replay writes a pattern
derived from the store's digest into the block it stores, and expects a load to fill its
blocks with the pattern of the digest the recording saw: the engine's bytes never travel.

The file is gzip'd JSON with a header (format, version, kvhal's version) and a digest of its
body: a truncated, altered or foreign file is refused naming the field (:class:`TraceError`).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvhal.cache import KVCache
from kvhal.tiers.chain import TierRead
from kvhal.vllm.config import ConnectorConfig
from kvhal.vllm.engine_traits import EngineTraits
from kvhal.vllm.metadata import KVHALMetadata, KVHALWorkerMetadata, LoadJob, StoreJob
from kvhal.vllm.trace_format import TraceError, caches_json, config_json, meta_json, read_json, reader

FORMAT = "kvhal-worker-trace"
#: bumped whenever a field's meaning changes; a trace of another version is refused
VERSION = 1
#: where a worker writes its trace (read when the worker registers its caches)
TRACE_DIR_VARIABLE = "KVHAL_TRACE_DIR"
#: the most a trace file may unpack to (a chat workload's is a few MiB)
MAX_BYTES = 256 << 20
DIGEST_BYTES = 16


# -- block contents ---------------------------------------------------------------------------


def block_bytes(cache: KVCache, block: int) -> bytes:
    """One block's bytes across every layer and part of ``cache``, in layer order."""
    parts = [
        part[block].contiguous().view(torch.uint8).reshape(-1) for layer in cache.layers for part in layer
    ]
    return torch.cat(parts).cpu().numpy().tobytes()


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).hexdigest()


@functools.lru_cache(maxsize=4096)
def pattern(content: str, nbytes: int) -> bytes:
    """The bytes the replay stands in for the content whose digest is ``content`` (written and
    checked in one process: numpy's generator, seeded by the digest)."""
    seed = int.from_bytes(hashlib.blake2b(content.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).bytes(nbytes)


class WorkerObserver:
    """What a worker side tells whoever watches it (the recorder; the replay's checks): every
    call, the blocks a store is about to copy, and each load's and store's end. This base
    ignores them all."""

    def registered(self, config: ConnectorConfig, kv_caches: Mapping[str, Any], rank: int) -> None:
        pass

    def call(self, name: str, payload: Any = None) -> None:
        pass

    def begin(self, meta: KVHALMetadata) -> None:
        """A step begins (``handle_preemptions``) with this metadata."""
        self.call("begin", meta)

    def stored(self, job: StoreJob, caches: Mapping[int, KVCache]) -> None:
        pass

    def ended(
        self, job: Any, ok: bool, caches: Mapping[int, KVCache], host_views: Mapping[int, KVCache]
    ) -> None:
        """A job ended on the worker (any kind): a load's or a store's blocks may be looked at."""
        if isinstance(job, LoadJob):
            self.loaded(job, ok, caches)
        elif isinstance(job, StoreJob):
            self.store_ended(job, ok, host_views)

    def loaded(self, job: LoadJob, ok: bool, caches: Mapping[int, KVCache]) -> None:
        pass

    def store_ended(self, job: StoreJob, ok: bool, host_views: Mapping[int, KVCache]) -> None:
        pass

    def close(self) -> None:
        pass


# -- recording --------------------------------------------------------------------------------


class TraceRecorder(WorkerObserver):
    """Records a worker side's calls (:class:`~kvhal.vllm.worker_side.WorkerSide` calls it) and
    writes the trace at shutdown, or every ``flush_every`` steps (an engine killed in a test
    leaves the trace up to its last flush)."""

    def __init__(self, path: Path, traits: EngineTraits, flush_every: int = 64) -> None:
        self.path = path
        self.traits = traits
        self.flush_every = flush_every
        self.header: dict[str, Any] = {}
        self.events: list[list[Any]] = []
        self.steps = 0
        self._lock = threading.Lock()  # collect runs on vLLM's thread, digests of loads too

    @classmethod
    def from_env(cls, traits: EngineTraits, engine_id: str | None, rank: int) -> TraceRecorder | None:
        from kvhal import env

        where = env.read(TRACE_DIR_VARIABLE)
        if not where:
            return None
        name = f"kvhal-trace-{(engine_id or 'engine')[:12]}-{os.getpid()}-rank{rank}.json.gz"
        return cls(Path(where) / name, traits)

    def registered(self, config: ConnectorConfig, kv_caches: Mapping[str, Any], rank: int) -> None:
        from kvhal import __version__

        self.header = {
            "format": FORMAT,
            "version": VERSION,
            "kvhal": __version__,
            "vllm": dataclasses.asdict(self.traits),
            "rank": rank,
            "config": config_json(config),
            "caches": caches_json(kv_caches),
        }

    def begin(self, meta: KVHALMetadata) -> None:
        self.call("begin", meta_json(meta))

    def call(self, name: str, payload: Any = None) -> None:
        with self._lock:
            self.events.append([name, _jsonable(payload)])
        if name == "begin":
            self.steps += 1
            if self.steps % self.flush_every == 0:
                self.write()

    def stored(self, job: StoreJob, caches: Mapping[int, KVCache]) -> None:
        """A store is about to copy these device blocks: their digests, by group."""
        self.call("stored", {"job_id": job.job_id, "digests": _digests(job.groups, caches)})

    def loaded(self, job: LoadJob, ok: bool, caches: Mapping[int, KVCache]) -> None:
        """A load ended: what it left in its device blocks (if it succeeded)."""
        digests = _digests(job.groups, caches) if ok else {}
        self.call("loaded", {"job_id": job.job_id, "ok": ok, "digests": digests})

    def close(self) -> None:
        self.write()

    def write(self) -> None:
        if not self.header:
            return
        with self._lock:
            events = list(self.events)
        save(self.path, {**self.header, "events": events})


def _jsonable(payload: Any) -> Any:
    """A call's answer as JSON: sets sorted, the worker's report as the job ids it names."""
    if isinstance(payload, (set, frozenset)):
        return sorted(payload)
    if isinstance(payload, tuple):
        return [_jsonable(p) for p in payload]
    if isinstance(payload, TierRead):
        return read_json(payload)
    if isinstance(payload, KVHALWorkerMetadata):
        return {"ok": sorted(payload.succeeded), "failed": sorted(payload.failed)}
    return payload


def _digests(
    groups: Mapping[int, tuple[list[int], list[int]]], caches: Mapping[int, KVCache]
) -> dict[str, list[str]]:
    return {str(g): [digest(block_bytes(caches[g], b)) for b in ids] for g, (ids, _) in groups.items()}


# -- the file ---------------------------------------------------------------------------------


def _body_digest(trace: Mapping[str, Any]) -> str:
    body = {k: v for k, v in trace.items() if k != "digest"}
    return hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=16).hexdigest()


def save(path: Path, trace: Mapping[str, Any]) -> None:
    """Write ``trace`` with the digest of its body (atomically: a reader never sees half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps({**trace, "digest": _body_digest(trace)}, separators=(",", ":")).encode()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(gzip.compress(data, compresslevel=6))
    tmp.replace(path)


def load(path: Path) -> dict[str, Any]:
    """Read and check a trace file: format, version, digest, and its size bounded.

    :raises TraceError: naming the field at fault (``file`` for one that is not a trace).
    """
    try:
        with gzip.open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except (OSError, EOFError) as exc:
        raise TraceError("file", f"{path}: not a gzip'd trace, or truncated ({exc})") from None
    if len(data) > MAX_BYTES:
        raise TraceError("file", f"{path}: unpacks to more than {MAX_BYTES >> 20} MiB")
    try:
        trace = json.loads(data)
    except ValueError as exc:
        raise TraceError("file", f"{path}: not JSON ({exc})") from None
    r = reader(trace, "")
    if not isinstance(trace, dict) or trace.get("format") != FORMAT:
        found = trace.get("format") if isinstance(trace, dict) else type(trace).__name__
        raise TraceError("format", f"{path}: expected {FORMAT!r}, found {found!r}: not a kvhal worker trace")
    if r.get("version", int) != VERSION:
        raise TraceError(
            "version",
            f"{path}: version {trace['version']} (kvhal {trace.get('kvhal')}); this kvhal replays "
            f"version {VERSION}: record the trace again with this kvhal",
        )
    if r.get("digest", str) != _body_digest(trace):
        raise TraceError("digest", f"{path}: the body does not match its digest: the file was altered")
    return trace


def traits_from(trace: Mapping[str, Any]) -> EngineTraits:
    r = reader(trace, "").sub("vllm")
    return EngineTraits(
        request_level_load_failures=r.get("request_level_load_failures", bool),
        stats_need_request_outputs=r.get("stats_need_request_outputs", bool),
        vllm_version=r.get("vllm_version", (str, type(None))),
    )

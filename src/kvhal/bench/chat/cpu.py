"""Where the CPU went in ``kvhal bench chat``: each engine's threads by group, and the store's
server processes, in rounds >= 2 (what competes with the forward on a machine's cores)."""

from __future__ import annotations

#: thread-name fragments of the stores' client libraries (glide's Rust runtime names its threads;
#: obstore's tokio runtime names its ``tokio-rt-worker``) and of the S3 store's event loop
STORE_CLIENT_THREADS = ("glide", "mooncake", "transfer", "tokio-rt", "kvhal-s3")
GROUPS = ("engine", "kvhal", "store client", "other")


def thread_group(name: str) -> str:
    """``engine``: the main thread (``main:NAME``, it runs the model) and the native threads it
    started unnamed (``workers:NAME``: torch's intra-op workers); ``store client``: native
    threads a store client started while kvhal opened it or from kvhal's remote tier (they
    inherit its kernel name, ``native:kvhal-store`` / ``native:kvhal-remote_N``) or named its
    own; ``kvhal``: kvhal's threads; else ``other``."""
    if name.startswith(("main:", "workers:")):
        return "engine"
    native = name.startswith("native:")
    started_by_kvhal = native and ("kvhal-remote" in name or "kvhal-store" in name)
    if started_by_kvhal or any(part in name.lower() for part in STORE_CLIENT_THREADS):
        return "store client"
    if name.removeprefix("native:").startswith("kvhal"):
        return "kvhal"
    return "other"


def by_group(thread_cpu_s: dict[str, float]) -> dict[str, float]:
    """CPU seconds per :data:`GROUPS` member, from one round's seconds per thread name."""
    groups = dict.fromkeys(GROUPS, 0.0)
    for name, seconds in thread_cpu_s.items():
        groups[thread_group(name)] += seconds
    return groups


def cores_busy_later(runs: list[dict]) -> dict[str, float] | None:
    """Rounds >= 2 of ``runs`` (one configuration's): CPU seconds per group divided by the
    rounds' wall seconds (1.0: one core all the time), and the store's server processes'
    (``store server``) over the time they were measured (each engine's half-round and its
    settle). None where the runs recorded no thread times."""
    spent: dict[str, float] = {}
    wall = store_wall = 0.0
    for run in runs:
        for rnd in run["rounds"][1:]:
            if not rnd.get("thread_cpu_s"):
                return None
            wall += rnd["seconds"]
            for group, seconds in by_group(rnd["thread_cpu_s"]).items():
                spent[group] = spent.get(group, 0.0) + seconds
            store_wall += rnd.get("store_wall_s", 0.0)
            spent["store server"] = spent.get("store server", 0.0) + rnd.get("store_cpu_s", 0.0)
    if not wall:
        return None
    busy = {group: seconds / wall for group, seconds in spent.items() if group != "store server"}
    if store_wall:
        busy["store server"] = spent["store server"] / store_wall
    return busy

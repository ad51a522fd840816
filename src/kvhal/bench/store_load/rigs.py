"""The stores ``kvhal bench store-load`` starts on loopback, and the faults each can be dealt.

A rig starts its servers and a :class:`~kvhal.testing.stall_proxy.StallProxy` in front of each
address the clients talk to (so a stall is the clients' network path, not the servers'):

- ``redis``: one ``redis-server`` (persistence off) behind a proxy;
- ``cluster``: a Redis Cluster of 3 masters, each behind its own proxy, which each master
  announces as its address (``cluster-announce-port``), so the clients' slot map leads them
  through the proxies;
- ``mooncake``: a Mooncake master and a store node; the proxy is in front of the master's RPC
  port (the metadata server and the store node's transfers go straight).

Faults: ``restart`` (``redis``: the server killed, ``SIGKILL``, and started again on its port;
``cluster``: one master, its slots' values lost; ``mooncake``: the master, which keeps no
state: every name is gone), ``pause`` (``CLIENT PAUSE ... ALL`` on every Redis master) and
``stall`` (every proxy stops delivering). ``kill`` (a client killed mid-write) is the fleet's.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from kvhal.testing.stall_proxy import StallProxy

STORES = ("redis", "cluster", "mooncake")
FAULTS = ("kill", "pause", "stall", "restart")
#: what each store's ``restart`` loses: the report says so beside its lost values
RESTART_LOSES = {
    "redis": "every value (no persistence)",
    "cluster": "the restarted master's values (no persistence)",
    "mooncake": "every value (the master keeps no state across a restart)",
}


class Rig:
    """Servers on loopback and the proxies in front of them; see the module."""

    kind = ""
    proxies: list[StallProxy]

    @property
    def url(self) -> str:
        raise NotImplementedError

    def faults(self) -> tuple[str, ...]:
        return ("kill", "stall", "restart")

    def restart(self) -> None:
        raise NotImplementedError

    def pause(self, seconds: float) -> None:
        raise NotImplementedError(f"{self.kind} has no CLIENT PAUSE")

    def stall(self) -> None:
        for proxy in self.proxies:
            proxy.stall()

    def resume(self) -> None:
        for proxy in self.proxies:
            proxy.resume()

    def pids(self) -> list[int]:
        return []

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.close()

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _pause(client: Any, seconds: float) -> None:
    client.execute_command("CLIENT", "PAUSE", str(int(seconds * 1000)), "ALL")


class RedisRig(Rig):
    kind = "redis"

    def __init__(self) -> None:
        from kvhal.testing.redis_servers import RedisServer

        self.server = RedisServer()
        try:
            self.proxies = [StallProxy(self.server.port)]
        except BaseException:
            self.server.close()
            raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.proxies[0].port}/0"

    def faults(self) -> tuple[str, ...]:
        return FAULTS

    def restart(self) -> None:
        self.server.stop()
        self.server.start()

    def pause(self, seconds: float) -> None:
        with contextlib.closing(self.server.client()) as client:
            _pause(client, seconds)

    def pids(self) -> list[int]:
        return self.server.pids

    def close(self) -> None:
        super().close()
        self.server.close()


class ClusterRig(Rig):
    kind = "cluster"

    def __init__(self) -> None:
        from kvhal.testing.redis_servers import RedisCluster

        self.cluster = RedisCluster(3)
        self.proxies = []
        try:
            self.proxies = [StallProxy(node.port) for node in self.cluster.nodes]
            for node in self.cluster.nodes:
                self._announce(node)
            self._wait_announced()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.proxies[0].port}"

    def faults(self) -> tuple[str, ...]:
        return FAULTS

    def _announce(self, node: Any) -> None:
        proxy = self.proxies[self.cluster.nodes.index(node)]
        with contextlib.closing(node.client()) as client:
            client.config_set("cluster-announce-port", proxy.port)
            client.config_set("cluster-announce-bus-port", node.port + 10000)

    def _wait_announced(self, timeout: float = 30.0) -> None:
        """Until every master's slot map names the proxies only."""
        wanted = {proxy.port for proxy in self.proxies}
        deadline = time.monotonic() + timeout
        while True:
            seen: set[int] = set()
            for node in self.cluster.nodes:
                with contextlib.closing(node.client()) as client:
                    seen |= {int(entry[2][1]) for entry in client.execute_command("CLUSTER", "SLOTS")}
            if seen == wanted:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster announces ports {sorted(seen)}, not its proxies' {wanted}")
            time.sleep(0.05)

    def restart(self) -> None:
        node = self.cluster.nodes[-1]  # not the seed: the clients' slot maps must find it again
        node.stop()
        node.start()
        self._announce(node)
        self.cluster.wait_ok()
        self._wait_announced()

    def pause(self, seconds: float) -> None:
        for node in self.cluster.nodes:
            with contextlib.closing(node.client()) as client:
                _pause(client, seconds)

    def pids(self) -> list[int]:
        return [pid for node in self.cluster.nodes for pid in node.pids]

    def close(self) -> None:
        super().close()
        self.cluster.close()


class MooncakeRig(Rig):
    kind = "mooncake"

    def __init__(self, segment_bytes: int, discard_s: int | None) -> None:
        from kvhal.testing.mooncake_servers import MooncakeCluster

        # a put whose writer died holds its name until the master discards it (default 30 s)
        args = [] if discard_s is None else [f"--put_start_discard_timeout_sec={discard_s}"]
        segment = f"{max(256, -(-segment_bytes // (1 << 20)))}MB"
        self.cluster = MooncakeCluster(segment=segment, master_args=args)
        try:
            self.proxies = [StallProxy(self.cluster.rpc_port)]
        except BaseException:
            self.cluster.stop()
            raise

    @property
    def url(self) -> str:
        metadata = self.cluster.metadata_url
        return f"mooncake://127.0.0.1:{self.proxies[0].port}?metadata={metadata}&protocol=tcp&segment=0"

    def restart(self) -> None:
        self.cluster.stop_master()
        self.cluster.start_master()  # returns once a put works again

    def pids(self) -> list[int]:
        return self.cluster.pids

    def close(self) -> None:
        super().close()
        self.cluster.stop()


def open_rig(kind: str, segment_bytes: int, discard_s: int | None = None) -> Rig:
    """Start ``kind``'s servers (one of :data:`STORES`); ``segment_bytes``: Mooncake's store
    node; ``discard_s``: its master's ``put_start_discard_timeout_sec`` (None: Mooncake's)."""
    if kind == "redis":
        return RedisRig()
    if kind == "cluster":
        return ClusterRig()
    if kind == "mooncake":
        return MooncakeRig(segment_bytes, discard_s)
    raise ValueError(f"store must be one of {STORES}, got {kind!r}")

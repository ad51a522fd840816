"""The ``remote_url`` of the Redis store (:mod:`kvhal.tiers.stores.redis`), parsed and checked
without connecting.

URL forms (``remote_url``)::

    redis://[USER[:PASSWORD]@]HOST[:PORT][/DB]     one server (port 6379, DB 0 by default)
    rediss://...                                    the same over TLS
    redis+cluster://[USER[:PASSWORD]@]HOST[:PORT]   a Redis Cluster, through one seed node (no DB)
    rediss+cluster://...                            a cluster over TLS

Query options read here: ``ttl=SECONDS`` (values expire after that long; default never) and
``timeout=SECONDS`` (connect and read timeout, default 2.0, at most 86400). Passed on to redis-py:
``ssl_ca_certs``, ``ssl_ca_path``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``
(``none``/``optional``/``required``), ``ssl_check_hostname``, ``max_connections``,
``health_check_interval``, ``socket_keepalive``; the ``ssl_*`` ones need ``rediss``.

Credentials: the user and password in the URL (percent-encoded), else ``KVHAL_REDIS_USERNAME``
and ``KVHAL_REDIS_PASSWORD``. The password never appears in a message or a repr.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

from kvhal import env
from kvhal.errors import ValidationError

__all__ = ["RedisTarget", "parse_url", "unchecked_tls"]

ARGUMENT = "remote_url"
SCHEMES = {"redis": (False, False), "rediss": (True, False), "redis+cluster": (False, True)}
SCHEMES["rediss+cluster"] = (True, True)
DEFAULT_PORT = 6379
DEFAULT_TIMEOUT = 2.0
#: The longest ``timeout=`` taken (a day), in seconds.
MAX_TIMEOUT = 86400.0


def _to_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _cert_reqs(text: str) -> str:
    if text.lower() not in ("none", "optional", "required"):
        raise ValueError(text)
    return text.lower()


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


#: query options handed to redis-py, with their parsers
_PASSED_ON: dict[str, Callable[[str], object]] = {
    "ssl_ca_certs": str,
    "ssl_ca_path": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_cert_reqs": _cert_reqs,
    "ssl_check_hostname": _to_bool,
    "max_connections": _positive_int,
    "health_check_interval": _positive_int,
    "socket_keepalive": _to_bool,
}

_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


@dataclass(frozen=True)
class RedisTarget:
    """A parsed ``remote_url`` (the password is kept out of the repr)."""

    tls: bool
    cluster: bool
    host: str
    port: int
    db: int
    username: str | None
    password: str | None = field(repr=False)
    password_source: str  # "from the URL", "from KVHAL_REDIS_PASSWORD" or "none"
    ttl: int | None
    timeout: float
    options: dict[str, object]

    @property
    def where(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def scheme(self) -> str:
        return ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")


def parse_url(url: str) -> RedisTarget:
    """Parse and check ``url``; nothing is connected. Messages never quote the password."""
    if not isinstance(url, str) or "://" not in url:
        raise ValidationError(
            ARGUMENT, f"must be a URL such as redis://HOST:PORT/0, got a {type(url).__name__}"
        )
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValidationError(
            ARGUMENT, f"unknown Redis scheme {scheme!r}; use one of {', '.join(s + '://' for s in SCHEMES)}"
        )
    tls, cluster = SCHEMES[scheme]
    hostport = parts.netloc.rpartition("@")[2]  # what follows the credentials, safe to quote
    if not parts.hostname:
        raise ValidationError(ARGUMENT, f"names no host ({scheme}://HOST:PORT)")
    try:
        port = parts.port
    except ValueError:
        raise ValidationError(ARGUMENT, f"bad port in {hostport!r}: must be an integer in 1..65535") from None
    if port is None:
        if hostport.endswith(":"):
            raise ValidationError(ARGUMENT, f"empty port in {hostport!r}")
        port = DEFAULT_PORT
    if port == 0:
        raise ValidationError(ARGUMENT, f"bad port in {hostport!r}: must be an integer in 1..65535")
    path = parts.path.strip("/")
    if cluster and path:
        raise ValidationError(ARGUMENT, f"a Redis cluster has only database 0; drop /{path} from the URL")
    db = 0
    if path:
        if not path.isdigit():
            raise ValidationError(ARGUMENT, f"the database must be a number (/0, /1, ...), got /{path}")
        db = int(path)
    if parts.fragment:
        raise ValidationError(ARGUMENT, "must not have a #fragment")

    ttl: int | None = None
    timeout = DEFAULT_TIMEOUT
    options: dict[str, object] = {}
    seen: set[str] = set()
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in seen:
            raise ValidationError(ARGUMENT, f"option {name} is given twice")
        seen.add(name)
        if name == "ttl":
            try:
                ttl = _positive_int(value)
            except ValueError:
                raise ValidationError(
                    ARGUMENT, f"ttl must be a positive number of seconds, got {value!r}"
                ) from None
        elif name == "timeout":
            try:
                timeout = float(value)
            except ValueError:
                timeout = -1.0
            # at most a day: sockets and the native reader take no more (1e10 s overflowed
            # socket.settimeout); nan and inf fail the comparison too
            if not 0 < timeout <= MAX_TIMEOUT:
                raise ValidationError(
                    ARGUMENT,
                    f"timeout must be a positive number of seconds, at most {MAX_TIMEOUT:.0f}, got {value!r}",
                )
        elif name in _PASSED_ON:
            if name.startswith("ssl_") and not tls:
                raise ValidationError(
                    ARGUMENT, f"option {name} needs TLS: use {scheme.replace('redis', 'rediss')}://"
                )
            try:
                options[name] = _PASSED_ON[name](value)
            except ValueError:
                raise ValidationError(ARGUMENT, f"bad value {value!r} for option {name}") from None
            # a missing file would otherwise surface as a connection failure
            if name in _FILES and not os.path.isfile(value):
                raise ValidationError(ARGUMENT, f"option {name}: no file {value!r}")
            if name == "ssl_ca_path" and not os.path.isdir(value):
                raise ValidationError(ARGUMENT, f"option ssl_ca_path: no directory {value!r}")
        else:
            known = ", ".join(["ttl", "timeout", *_PASSED_ON])
            raise ValidationError(ARGUMENT, f"unknown option {name!r}; known: {known}")

    # credentials: the URL's, else the settings'; an empty user or password counts as none given
    username = unquote(parts.username) if parts.username else None
    if parts.password:
        password, source = unquote(parts.password), "from the URL"
    elif (password := env.read("KVHAL_REDIS_PASSWORD")) is not None:
        source = "from KVHAL_REDIS_PASSWORD"
    else:
        source = "none"
    if username is None:
        username = env.read("KVHAL_REDIS_USERNAME")
    return RedisTarget(
        tls, cluster, parts.hostname, port, db, username, password, source, ttl, timeout, options
    )


def unchecked_tls(target: RedisTarget) -> str | None:
    """The options of a ``rediss`` URL that turn the server certificate's check off, or None."""
    said = [
        f"{name}={target.options[name]!r}".replace("'", "")
        # ("optional" still checks the server's certificate: a client always asks for one)
        for name, off in (("ssl_cert_reqs", ("none",)), ("ssl_check_hostname", (False,)))
        if target.options.get(name, "required") in off
    ]
    return " and ".join(said) if target.tls and said else None

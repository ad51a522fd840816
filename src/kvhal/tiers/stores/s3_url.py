"""The ``remote_url`` of the S3 store (:mod:`kvhal.tiers.stores.s3`), parsed and checked without
connecting.

URL form (``remote_url``)::

    s3://BUCKET[/PREFIX][?OPTION=VALUE&...]

``BUCKET`` must exist (kvhal never creates one); kvhal's objects are named ``PREFIX/kvhal/v2/
NAMESPACE/KEY`` inside it, so one bucket can hold several fleets under prefixes of their own.
Options:

* ``endpoint``: the server, ``http(s)://HOST[:PORT]``, for anything but AWS S3 (MinIO, Ceph
  RGW, SeaweedFS, S3 Express's zonal endpoint, a VPC endpoint). Default: ``AWS_ENDPOINT_URL``
  where set, else AWS S3's endpoint for the region. An ``http://`` endpoint is plain TCP.
* ``region``: the region requests are signed for. Default: ``AWS_REGION`` or
  ``AWS_DEFAULT_REGION``, else ``us-east-1`` (MinIO's and SeaweedFS's default; Ceph RGW
  takes any name its zone group has, often ``default``).
* ``addressing``: ``virtual`` (``BUCKET.HOST/KEY``, AWS's) or ``path`` (``HOST/BUCKET/KEY``,
  what MinIO, Ceph RGW and SeaweedFS serve without wildcard DNS). Default: ``path`` with an
  ``endpoint``, ``virtual`` without.
* ``ca_file``: PEM certificates to trust beside the system's (a private CA), ``https`` only.
* ``tls_verify``: ``false`` accepts any certificate (logged as a warning; values still prove
  their blocks, and with a remote secret none can be forged). Default ``true``.
* ``timeout``: seconds one request may take, connecting included (default 5, at most 86400).
* ``retries``: how often a request that failed for a connection error, a 5xx or 503
  ``SlowDown`` (and, for reads, a timeout) is tried again, with backoff (0-10, default 2).
* ``max_requests``: requests one client keeps in flight (1-1024, default 32).
* ``conditional``: ``true`` (default) writes with ``If-None-Match: *`` and replaces a refused
  value with ``If-Match`` on its ETag; ``false`` for a server that refuses those headers
  (then a write overwrites: two engines may both upload a block, the same bytes).
* ``run_blocks``: how many blocks of a request one object holds (:mod:`kvhal.tiers.remote.runs`):
  ``auto`` (default) as many as make about 1 MiB (a power of two, at most 16; 1 for blocks of
  1 MiB or more), or 1-16. Engines of another value share only the blocks stored alone.
* ``profile``: take the credentials from this profile of the AWS config files, through boto3
  (SSO, assume-role, ``credential_process`` and static keys alike; ``pip install boto3``).

Credentials are never in the URL: an ``s3://`` URL with a user or a key option is refused.
They come from the standard places, in AWS's order: ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` (/ ``AWS_SESSION_TOKEN``); else a profile (``profile=`` or
``AWS_PROFILE``); else a web-identity token (``AWS_WEB_IDENTITY_TOKEN_FILE`` and
``AWS_ROLE_ARN``, as Kubernetes' IRSA or pod identity gives them); else ECS's container
credentials; else the instance metadata service (EC2's IMDSv2).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from kvhal.errors import ValidationError
from kvhal.tiers.remote.runs import MAX_RUN_BLOCKS
from kvhal.tiers.remote.urls import SECRET_OPTIONS

__all__ = ["S3Target", "credentials_source", "parse_url"]

ARGUMENT = "remote_url"
DEFAULT_REGION = "us-east-1"
DEFAULT_TIMEOUT = 5.0
MAX_TIMEOUT = 86400.0
DEFAULT_RETRIES = 2
DEFAULT_MAX_REQUESTS = 32
OPTIONS = (
    "endpoint", "region", "addressing", "ca_file", "tls_verify", "timeout", "retries",
    "max_requests", "conditional", "profile", "run_blocks",
)  # fmt: skip
#: S3's bucket names (3-63 of lower-case letters, digits, dots and hyphens; an underscore too,
#: which some servers allow), starting and ending with a letter or digit
BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")
#: a prefix's segments: what S3 keys hold without percent-encoding
SEGMENT = re.compile(r"[A-Za-z0-9._=+-]+")
REGION = re.compile(r"[A-Za-z0-9_-]{1,64}")
PROFILE = re.compile(r"[A-Za-z0-9_.@+-]{1,128}")
MAX_PREFIX = 512


@dataclass(frozen=True)
class S3Target:
    """A parsed ``s3://`` URL (see the module's docstring); it holds no credentials."""

    bucket: str
    prefix: str
    endpoint: str | None
    region: str
    addressing: str
    ca_file: str | None
    tls_verify: bool
    timeout: float
    retries: int
    max_requests: int
    conditional: bool
    profile: str | None
    #: blocks per object, 0: ``auto`` (:func:`kvhal.tiers.remote.runs.run_blocks_for`)
    run_blocks: int = 0

    @property
    def where(self) -> str:
        """The store, for messages: ``s3://BUCKET/PREFIX at ENDPOINT``."""
        server = self.endpoint or f"AWS S3 ({self.region})"
        return f"s3://{self.bucket}/{self.prefix} at {server}".replace("/ at", " at")


def _bool(name: str, text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValidationError(ARGUMENT, f"{name} must be true or false, got {text!r}")


def _count(name: str, text: str, low: int, high: int) -> int:
    if not text.isdigit() or not low <= int(text) <= high:
        raise ValidationError(ARGUMENT, f"{name} must be an integer in {low}..{high}, got {text!r}")
    return int(text)


def _endpoint(text: str) -> str:
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port in (-1, 0):
        raise ValidationError(
            ARGUMENT, f"endpoint must be an http:// or https:// URL such as https://HOST:PORT, got {text!r}"
        )
    if parts.username is not None or parts.password is not None:
        raise ValidationError(ARGUMENT, "endpoint must not hold credentials (they come from AWS_* variables)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValidationError(ARGUMENT, f"endpoint must be a server's root, without a path, got {text!r}")
    return text.rstrip("/")


def _prefix(path: str) -> str:
    prefix = path.strip("/")
    if len(prefix) > MAX_PREFIX:
        raise ValidationError(ARGUMENT, f"the prefix is longer than {MAX_PREFIX} characters")
    for segment in prefix.split("/") if prefix else ():
        if not SEGMENT.fullmatch(segment) or segment in (".", ".."):
            raise ValidationError(
                ARGUMENT,
                f"the prefix's part {segment!r} is not a plain name (letters, digits and ._=+-, "
                "parts separated by single slashes)",
            )
    return prefix


def parse_url(url: str, environ: dict[str, str] | None = None) -> S3Target:
    """Parse and check ``url``; nothing is connected. ``environ`` (default ``os.environ``)
    gives the region's and the profile's defaults.

    :raises ValidationError: (``remote_url``) a malformed URL or option, naming it.
    """
    env = os.environ if environ is None else environ
    if not isinstance(url, str) or "://" not in url:
        raise ValidationError(ARGUMENT, f"must be an s3://BUCKET/PREFIX URL, got a {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme.lower() != "s3":
        raise ValidationError(ARGUMENT, f"scheme {parts.scheme!r} is not s3")
    if "@" in parts.netloc:
        raise ValidationError(
            ARGUMENT,
            "an s3:// URL takes no credentials: give them in AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, a profile, a web-identity token or the instance's role",
        )
    bucket = parts.netloc
    if not BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ValidationError(
            ARGUMENT, f"bucket {bucket!r} is not an S3 bucket name (3-63 of a-z, 0-9, '.', '-', '_')"
        )
    if parts.fragment:
        raise ValidationError(ARGUMENT, "must not have a #fragment")
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise ValidationError(ARGUMENT, "malformed query (OPTION=VALUE&...)") from None
    options: dict[str, str] = {}
    for name, value in pairs:
        if any(word in name.lower() for word in SECRET_OPTIONS):
            raise ValidationError(
                ARGUMENT,
                f"option {name!r}: credentials are never taken from the URL (AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, a profile, a web-identity token or the instance's role)",
            )
        if name not in OPTIONS:
            raise ValidationError(ARGUMENT, f"unknown option {name!r}; known: {', '.join(OPTIONS)}")
        if name in options:
            raise ValidationError(ARGUMENT, f"option {name} is given twice")
        options[name] = value
    endpoint = options.get("endpoint") or env.get("AWS_ENDPOINT_URL") or None
    if endpoint is not None:
        endpoint = _endpoint(endpoint)
    region = options.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or DEFAULT_REGION
    if not REGION.fullmatch(region):
        raise ValidationError(ARGUMENT, f"region {region!r} is not a region name")
    addressing = options.get("addressing", "path" if endpoint else "virtual")
    if addressing not in ("path", "virtual"):
        raise ValidationError(ARGUMENT, f"addressing must be path or virtual, got {addressing!r}")
    https = endpoint is None or endpoint.startswith("https://")
    ca_file = options.get("ca_file")
    tls_verify = _bool("tls_verify", options.get("tls_verify", "true"))
    for name, given in (("ca_file", ca_file is not None), ("tls_verify", "tls_verify" in options)):
        if given and not https:
            raise ValidationError(ARGUMENT, f"option {name} needs an https:// endpoint")
    if ca_file is not None and not os.path.isfile(ca_file):
        raise ValidationError(ARGUMENT, f"option ca_file: no file {ca_file!r}")
    try:
        timeout = float(options.get("timeout", DEFAULT_TIMEOUT))
    except ValueError:
        timeout = -1.0
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT):
        raise ValidationError(
            ARGUMENT,
            f"timeout must be a positive number of seconds, at most {MAX_TIMEOUT:.0f}, "
            f"got {options.get('timeout')!r}",
        )
    profile = options.get("profile")
    if profile is None and not env.get("AWS_ACCESS_KEY_ID"):
        profile = env.get("AWS_PROFILE") or None
    if profile is not None and not PROFILE.fullmatch(profile):
        raise ValidationError(ARGUMENT, f"profile {profile!r} is not a profile name")
    return S3Target(
        bucket=bucket,
        prefix=_prefix(parts.path),
        endpoint=endpoint,
        region=region,
        addressing=addressing,
        ca_file=ca_file,
        tls_verify=tls_verify,
        timeout=timeout,
        retries=_count("retries", options.get("retries", str(DEFAULT_RETRIES)), 0, 10),
        max_requests=_count("max_requests", options.get("max_requests", str(DEFAULT_MAX_REQUESTS)), 1, 1024),
        conditional=_bool("conditional", options.get("conditional", "true")),
        profile=profile,
        run_blocks=_run_blocks(options.get("run_blocks", "auto")),
    )


def _run_blocks(text: str) -> int:
    return 0 if text == "auto" else _count("run_blocks", text, 1, MAX_RUN_BLOCKS)


def credentials_source(target: S3Target, environ: dict[str, str] | None = None) -> str:
    """Where the credentials come from, for messages (never a secret): the first of AWS's
    places that is set, as :mod:`obstore` (or boto3, for a profile) will look."""
    env = os.environ if environ is None else environ
    if env.get("AWS_ACCESS_KEY_ID"):
        return f"access key {env['AWS_ACCESS_KEY_ID'][:4]}... from AWS_ACCESS_KEY_ID"
    if target.profile:
        return f"profile {target.profile!r}"
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return "a web-identity token (AWS_WEB_IDENTITY_TOKEN_FILE, AWS_ROLE_ARN)"
    if env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return "the container's credentials (AWS_CONTAINER_CREDENTIALS_*)"
    return "the instance metadata service (no AWS_* credentials set)"

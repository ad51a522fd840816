"""Every key of ``kv_connector_extra_config``, declared once: name, type, unit, default, check.

The pydantic models below are the declaration. :mod:`kvhal.vllm.extra_config` validates a
user's dict with them (and words their errors: the key, what it takes); :func:`markdown_table`
renders them as the reference table ``docs/configuration.md`` holds (``python -m
kvhal.vllm.settings --write`` regenerates it; a test keeps the two equal).

The tiers below the host tier are one ordered list, ``tiers``: each entry a local tier
(``backend``: ``disk`` or a plugin's) or a store the fleet shares (``url``), told apart by
which of the two keys it has. The old flat keys (``disk_path``, ``remote_url``, ...) stay as
short forms of a one- or two-element list: :data:`LOCAL_SHORT_FORMS`, :data:`STORE_SHORT_FORMS`.

Nothing here imports vLLM: ``kvhal config check`` runs these checks without it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    Tag,
    TypeAdapter,
    WithJsonSchema,
)
from pydantic import ValidationError as PydanticError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError, PydanticUndefined

from kvhal.offload.wait_policy import POLICIES as WAIT_POLICIES
from kvhal.vllm.tenants import DEFAULT_TENANT_LABELS

#: The largest size a key takes: 1 EiB (a typo'd exponent is refused, not allocated).
MAX_BYTES = 1 << 60
_BYTE_SIZE = TypeAdapter(ByteSize)  # pydantic's reading of "8GiB", "200GB", "1.5 TiB"
SIZE_EXPECTS = 'a positive number of bytes: an integer, or a string with a unit ("8GiB", "200GB")'


def _size(value: object) -> int:
    """A size in bytes: an int, or a string with a unit; positive, at most :data:`MAX_BYTES`."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise PydanticCustomError("size_type", "not an integer or a string")
    size = value
    if isinstance(value, str):
        try:
            size = int(_BYTE_SIZE.validate_python(value))
        except PydanticError as exc:
            raise PydanticCustomError("size", "{why}", {"why": exc.errors()[0]["msg"]}) from None
    if size <= 0:
        raise PydanticCustomError("size", "{why}", {"why": "not positive"})
    if size > MAX_BYTES:
        raise PydanticCustomError("size", "{why}", {"why": "more than 1 EiB"})
    return size


#: A number of bytes: ``8589934592``, ``"8GiB"``, ``"200GB"`` (units as pydantic's ``ByteSize``).
Size = Annotated[int, PlainValidator(_size), WithJsonSchema({"type": ["integer", "string"]})]
#: A tier's name: what logs and errors call it.
TierName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")]


def key(
    default: Any = PydanticUndefined,
    *,
    doc: str,
    expects: str | None = None,
    unit: str = "",
    shown_default: str | None = None,
    **constraints: Any,
) -> Any:
    """One key: its default, its one-line description (``doc``), what an error says it takes
    (``expects``; a ``Literal``'s values by default), its unit, and how the docs show its default."""
    extra = {"unit": unit, "expects": expects, "shown_default": shown_default}
    return Field(default, description=doc, json_schema_extra=extra, **constraints)


class _Keys(BaseModel):
    # Strict: bool("false") is True, so a string or number where a bool goes is refused, never coerced.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class LocalTierSettings(_Keys):
    """A tier on this machine below the host tier: ``disk``, or a plugin's tier backend."""

    name: TierName | None = key(
        None,
        doc="The tier's name in logs and errors; unique among the tiers.",
        expects="a name of letters, digits and _.+- (at most 64)",
        shown_default="the backend",
    )
    backend: str = key(
        doc="`disk`, or a tier backend a plugin offers through `kvhal_tier_backends`.",
        expects="a tier backend's name",
        min_length=1,
    )
    options: dict[str, Any] = key(
        default_factory=dict,
        doc="The backend's own options (the `disk` backend's: below).",
        expects="a JSON object",
        shown_default="`{}`",
    )
    write: Literal["through", "back"] = key(
        "through",
        doc="`through`: written as the host tier stores a block; `back`: as the host tier evicts it.",
    )
    eviction_policy: str = key(
        "clock",
        doc="The tier's eviction policy: `clock`, `lru`, `s3fifo`, or a plugin's.",
        expects="an eviction policy's name (a str)",
    )
    wait_ms: int | None = key(
        1000,
        doc="The longest a request waits for its blocks to be prefetched into host memory; "
        "`null`: no prefetch (the load reads, then copies).",
        expects="a number of milliseconds (0 or more), or null for no prefetch",
        unit="ms",
        ge=0,
    )
    prefetch_blocks: int | None = key(
        None,
        doc="Blocks being prefetched at most (every KV cache group's); a hit past it loads without one.",
        expects="a positive number of blocks",
        unit="blocks",
        shown_default="half the host tier's slots",
        gt=0,
    )
    wait_policy: Literal[WAIT_POLICIES] = key(  # type: ignore[valid-type]
        "auto",
        doc="`auto`: wait about as long as recomputing would take, and skip a tier measured slower; "
        "`timeout`: always up to `wait_ms`.",
    )


class DiskTierOptions(_Keys):
    """The ``disk`` backend's ``options`` (:mod:`kvhal.tiers.disk.directory` reads them)."""

    path: str = key(
        doc="The tier's directory (created 0700), not a symbolic link; where other users can write "
        "it (an emptyDir), a private `kvhal-<uid>` (0700) under it.",
        expects="a directory's path",
        min_length=1,
    )
    bytes_to_use: Size = key(
        doc="Disk space for everything kvhal keeps under `path` (models sharing the path share it).",
        expects=SIZE_EXPECTS,
        unit="bytes",
    )
    io_threads: int = key(
        8, doc="Reads and writes in flight per worker, each.", expects="a positive integer", gt=0
    )
    direct: bool | Literal["auto"] = key(
        "auto",
        doc='O_DIRECT I/O: `"auto"` where the file system takes it, `true` (or an error), `false`.',
        expects='"auto", true or false',
    )
    lock_wait_s: int = key(
        60,
        doc="How long the tier waits for another engine of the model on `path` (one being replaced, "
        "draining) to release it; the engine serves without the tier meanwhile (`tier_up` 0), then it "
        "joins with what the other left, or past the wait stays out. 0: the start fails at once, "
        "naming its pid.",
        expects="a number of seconds (0 or more)",
        unit="s",
        ge=0,
    )


class StoreTierSettings(_Keys):
    """A store the fleet shares: Mooncake Store, Redis, or a plugin's."""

    name: TierName | None = key(
        None,
        doc="The tier's name in logs and errors; unique among the tiers.",
        expects="a name of letters, digits and _.+- (at most 64)",
        shown_default="the URL's scheme",
    )
    url: str = key(
        doc="The store; its scheme picks the store plugin: `mooncake`, `redis`, `rediss`, "
        "`redis+cluster`, `rediss+cluster`, `s3`, or a plugin's.",
        expects="a store's URL (mooncake://HOST:PORT?metadata=..., redis://HOST:PORT/DB, s3://BUCKET/PREFIX)",
        pattern=r"^[A-Za-z][A-Za-z0-9+.-]*://",
    )
    strict: bool = key(
        False,
        doc="A store unreachable at engine start fails the start (else a warning, and it keeps trying).",
        expects="a JSON boolean (true or false)",
    )
    lookup_timeout_ms: int = key(
        200,
        doc="How long a request waits for the store to say whether it holds its blocks.",
        expects="a positive integer",
        unit="ms",
        gt=0,
    )
    load_timeout_ms: int = key(
        5000,
        doc="How long a request waits for its blocks from the store before they are recomputed.",
        expects="a positive integer",
        unit="ms",
        gt=0,
    )
    max_inflight_blocks: int = key(
        512,
        doc="Blocks being written to the store at once; more are dropped and counted.",
        expects="a positive integer",
        unit="blocks",
        gt=0,
    )
    wait_policy: Literal[WAIT_POLICIES] = key(  # type: ignore[valid-type]
        "auto",
        doc="As a local tier's, for the store: `timeout` always waits up to `load_timeout_ms`.",
    )
    auth: Literal["hmac", "none"] = key(
        "hmac",
        doc="`hmac`: values carry an HMAC of the fleet's secret (the engine does not start without "
        "one); `none`: the explicit opt-out, warned of at every start.",
    )
    secret_file: str | None = key(
        None,
        doc="A file whose first line is the secret (where `KVHAL_REMOTE_SECRET` is unset); later "
        "lines are previous secrets, still accepted during a rotation.",
        expects="a file path",
        min_length=1,
    )


def _tier_kind(entry: Any) -> str | None:
    """A tier entry's kind: a store has ``url``, a local tier ``backend``."""
    if isinstance(entry, dict):
        if "url" in entry:
            return "store"
        if "backend" in entry:
            return "local"
    return None


#: The models of a tier entry, by kind.
TIER_KINDS: dict[str, type[_Keys]] = {"local": LocalTierSettings, "store": StoreTierSettings}
TierEntry = Annotated[
    Union[Annotated[LocalTierSettings, Tag("local")], Annotated[StoreTierSettings, Tag("store")]],  # noqa: UP007
    Discriminator(
        _tier_kind,
        custom_error_type="tier_kind",
        custom_error_message='a tier is an object with "backend" (a local tier) or "url" (a store)',
    ),
]


class ExtraConfigSettings(_Keys):
    """``kv_connector_extra_config``, short forms aside (they expand into ``tiers``)."""

    cpu_bytes_to_use: Size = key(
        doc="Pinned host memory for offloaded KV, per engine (split evenly between its workers).",
        expects=SIZE_EXPECTS.replace("bytes", "bytes of host memory", 1),
        unit="bytes",
    )
    device: str | None = key(
        None,
        doc="A kvhal device plugin to use instead of the one serving the KV cache's device.",
        expects="a device plugin's name (a str) or null",
        shown_default="auto-selected",
    )
    eviction_policy: str = key(
        "lru",
        doc="The host tier's eviction policy: `lru`, `s3fifo`, `clock`, or a plugin's.",
        expects="an eviction policy's name (a str)",
    )
    offload_prompt_only: bool = key(
        True,
        doc="Store prompt blocks only (vLLM's default), not decode ones.",
        expects="a JSON boolean (true or false)",
    )
    load_mode: Literal["auto", "sync", "layerwise", "async"] = key(
        "auto",
        doc="How hits load: `auto`, `sync`, `layerwise` or `async` (docs/vllm-integration.md).",
    )
    model_version: str | None = key(
        None,
        doc="A name for the model's weights in the tiers' fingerprint.",
        expects="a non-empty string",
        shown_default="a digest of its files",
        min_length=1,
    )
    tenant_labels: int = key(
        DEFAULT_TENANT_LABELS,
        doc="Tenants (`cache_salt`s) counted apart in the `tenant_*` counters, the first seen; "
        'later ones count as `"other"`. 0: no tenant counters (docs/tenants.md).',
        expects="a number of tenants from 0 to 1024",
        ge=0,
        le=1024,
    )
    # lax: a tuple from Python is a list; each entry's keys are as strict as the rest
    tiers: Annotated[list[TierEntry], Field(strict=False)] | None = key(
        None,
        doc="The tiers below the host tier, in order (highest first): local tiers and stores.",
        expects="a list of tiers",
        shown_default="none (or the short forms')",
    )


#: Short forms of the one local tier: key -> the tier's key it sets (``options.x``: an option).
LOCAL_SHORT_FORMS: dict[str, str] = {
    "tier_backend": "backend",
    "tier_options": "options",
    "disk_path": "options.path",
    "disk_bytes_to_use": "options.bytes_to_use",
    "disk_write": "write",
    "disk_eviction_policy": "eviction_policy",
    "disk_lock_wait_s": "options.lock_wait_s",
    "lower_tier_wait_ms": "wait_ms",
    "lower_tier_prefetch_blocks": "prefetch_blocks",
    "lower_tier_wait_policy": "wait_policy",
}
#: The keys that open the local tier (the others only configure it).
LOCAL_OPENERS = ("disk_path", "disk_bytes_to_use", "tier_backend", "tier_options")
#: Short forms of the one store: ``remote_<key>``, every key of a store's but its name.
STORE_SHORT_FORMS: dict[str, str] = {
    f"remote_{name}": name for name in StoreTierSettings.model_fields if name != "name"
}
SHORT_FORMS = {**LOCAL_SHORT_FORMS, **STORE_SHORT_FORMS}
#: Every key ``kv_connector_extra_config`` takes.
KNOWN_KEYS = frozenset(ExtraConfigSettings.model_fields) | frozenset(SHORT_FORMS)


def expects(info: FieldInfo) -> str:
    """What an error says a key takes."""
    if _extra(info).get("expects"):
        return str(_extra(info)["expects"])
    return f"one of {list(get_args(info.annotation))}"


# -- the reference table ------------------------------------------------------------------------

BEGIN = "<!-- kv_connector_extra_config: generated by python -m kvhal.vllm.settings --write -->"
END = "<!-- end of the generated reference -->"


def _extra(info: FieldInfo) -> dict[str, Any]:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def _type(annotation: Any, metadata: list[Any] = ()) -> str:  # type: ignore[assignment]
    """A key's type as the table shows it."""
    origin, args = get_origin(annotation), get_args(annotation)
    if any(isinstance(m, PlainValidator) and m.func is _size for m in metadata):
        return "size"
    if origin is Annotated:
        return _type(args[0], list(args[1:]))
    if origin is Literal:
        return " or ".join(f"`{v}`" if isinstance(v, str) else str(v).lower() for v in args)
    if origin is list:
        return "list of tiers"
    if origin is dict or annotation is dict:
        return "object"
    if args:  # a union
        return " or ".join(_type(arg) for arg in args)
    return {bool: "bool", int: "int", str: "str", type(None): "null"}[annotation]


def _default(info: FieldInfo) -> str:
    if _extra(info).get("shown_default"):
        return str(_extra(info)["shown_default"])
    if info.is_required():
        return "(required)"
    value = info.get_default(call_default_factory=True)
    if value is None or isinstance(value, bool):
        return "`null`" if value is None else f"`{str(value).lower()}`"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value}`"


def _row(name: str, info: FieldInfo, description: str | None = None) -> str:
    kind = _type(info.annotation, info.metadata)
    unit = _extra(info).get("unit") or ""
    return f"| `{name}` | {kind} | {unit} | {_default(info)} | {description or info.description} |"


def _short_row(short: str, target: str, model: type[BaseModel], kind: str) -> str:
    owner, name = (DiskTierOptions, target.split(".")[1]) if "." in target else (model, target)
    row = _row(short, owner.model_fields[name], f"The {kind}'s `{target}`.")
    # a key the tier needs is not needed in short: none given, no such tier (tier_backend: disk)
    return row.replace("(required)", '`"disk"`' if short == "tier_backend" else "(none)")


def markdown_table() -> str:
    """The reference ``docs/configuration.md`` holds, from the models above."""
    head = "| key | type | unit | default | description |\n| --- | --- | --- | --- | --- |\n"

    def table(rows: list[str]) -> str:
        return head + "\n".join(rows)

    def rows(model: type[BaseModel], prefix: str = "") -> list[str]:
        return [_row(prefix + name, info) for name, info in model.model_fields.items()]

    shorts = [_short_row(k, t, LocalTierSettings, "local tier") for k, t in LOCAL_SHORT_FORMS.items()]
    shorts += [_short_row(k, t, StoreTierSettings, "store") for k, t in STORE_SHORT_FORMS.items()]
    return "\n\n".join(
        [
            table(rows(ExtraConfigSettings)),
            'A local tier (an entry of `tiers` with `"backend"`):',
            table(rows(LocalTierSettings)),
            "The `disk` backend's `options`:",
            table(rows(DiskTierOptions, "options.")),
            'A store the fleet shares (an entry of `tiers` with `"url"`):',
            table(rows(StoreTierSettings)),
            "Short forms of a `tiers` of one local tier, one store, or the local tier then the store:",
            table(shorts),
        ]
    )


def generated_part(doc: str) -> str:
    """The part of ``doc`` between the markers (:func:`markdown_table`'s place)."""
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    return doc[start:end].strip("\n")


def main(argv: list[str]) -> int:
    """``python -m kvhal.vllm.settings``: print the table; ``--write [DOC]``: put it in ``DOC``."""
    if not argv:
        print(markdown_table())
        return 0
    path = Path(argv[1] if len(argv) > 1 else Path(__file__).parents[3] / "docs" / "configuration.md")
    doc = path.read_text()
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    path.write_text(doc[:start] + "\n" + markdown_table() + "\n" + doc[end:])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

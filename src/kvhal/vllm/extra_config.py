"""``kv_connector_extra_config`` checked against :mod:`kvhal.vllm.settings`, without vLLM.

:func:`check_extra_config` takes the user's dict and returns :class:`ExtraSettings`: the
typed keys, and the tiers below the host tier in order (short forms expanded). A bad
value is a :class:`~kvhal.errors.ValidationError` whose argument is the user's key
(``kv_connector_extra_config.disk_path``, ``kv_connector_extra_config.tiers[1].url``) and
whose message says what the key takes and what it got.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic import ValidationError as PydanticError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from kvhal.errors import ValidationError
from kvhal.vllm.settings import (
    KNOWN_KEYS,
    LOCAL_OPENERS,
    LOCAL_SHORT_FORMS,
    SHORT_FORMS,
    STORE_SHORT_FORMS,
    TIER_KINDS,
    DiskTierOptions,
    ExtraConfigSettings,
    LocalTierSettings,
    StoreTierSettings,
    expects,
)
from kvhal.vllm.tenants import DEFAULT_TENANT_LABELS

PREFIX = "kv_connector_extra_config"


@dataclass(frozen=True)
class LowerTierConfig:
    """A tier below the host tier on this machine (``disk``, or a plugin's).

    :param backend: the tier backend's name (``"disk"``, or a plugin's).
    :param options: the backend's options (``path``, ``bytes_to_use`` for ``disk``).
    :param write: ``"through"`` (default) or ``"back"``.
    :param eviction_policy: the lower tier's policy (default ``"clock"``: one byte a block).
    :param config_keys: backend option -> the user's key, to name it in errors.
    :param wait_ms: how long a request waits for its blocks to be read from the lower tier
        into host memory (a prefetch, started at lookup); past it, the part already in host
        memory is loaded and the rest recomputed. ``None``: the prefetch is off, and such a
        hit is one asynchronous load that reads, then copies.
    :param prefetch_blocks: blocks being read by prefetches at most (every group's); a hit
        past the budget is loaded asynchronously, as with the prefetch off.
    :param wait_policy: ``"auto"`` (default): a request waits at most about as long as
        recomputing its blocks would take, and a tier measured slower than recomputing is
        not read (:mod:`kvhal.offload.wait_policy`); ``"timeout"``: always up to ``wait_ms``.
    :param name: the tier's name, unique among the tiers (default: ``backend``).
    """

    backend: str
    options: dict[str, Any]
    write: str
    eviction_policy: str
    config_keys: dict[str, str] = field(default_factory=dict)
    wait_ms: int | None = 1000
    prefetch_blocks: int | None = None  # None: half the host tier's slots
    wait_policy: str = "auto"
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.backend)


@dataclass(frozen=True)
class RemoteTierConfig:
    """A store the fleet shares, below the host tier.

    :param url: the store (``mooncake://...``, ``redis://...``).
    :param strict: an unreachable store fails engine start (default: a warning,
        and the tier starts down and keeps trying to connect).
    :param lookup_timeout_ms: how long a request waits for the store to say
        whether it holds its blocks (it is asked again meanwhile); a miss after.
    :param load_timeout_ms: how long a request waits for its blocks from the store
        (read into host memory at lookup, or by a parked load) before it is recomputed.
    :param max_inflight_blocks: blocks being written to the store at once;
        stores beyond it are dropped and counted (a lagging store never queues
        without bound).
    :param wait_policy: ``"auto"`` (default): a request waits for the store at most about
        as long as recomputing would take, and a store slower than that is not read
        (:mod:`kvhal.offload.wait_policy`); ``"timeout"``: always up to ``load_timeout_ms``.
    :param auth: ``"hmac"`` (default): every value carries an HMAC of the fleet's secret
        (``KVHAL_REMOTE_SECRET`` or ``secret_file``), and the engine does not start without
        one; ``"none"``: the operator's explicit opt-out, warned of at every start.
    :param secret_file: a file holding the secret (its first line).
    :param name: the tier's name, unique among the tiers (default: the URL's scheme).
    :param key_prefix: the user's keys of this store are ``key_prefix + field``
        (``kv_connector_extra_config.remote_url``; ``kv_connector_extra_config.tiers[1].url``).
    """

    url: str
    strict: bool = False
    lookup_timeout_ms: int = 200
    load_timeout_ms: int = 5000
    max_inflight_blocks: int = 512
    wait_policy: str = "auto"
    auth: str = "hmac"
    secret_file: str | None = None
    name: str = ""
    key_prefix: str = f"{PREFIX}.remote_"

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.url.split("://", 1)[0])

    def key(self, name: str) -> str:
        """The user's key of field ``name`` (``url``, ``auth``, ...), for errors."""
        return self.key_prefix + name


#: A tier below the host tier.
TierConfig = LowerTierConfig | RemoteTierConfig


@dataclass(frozen=True)
class ExtraSettings:
    """``kv_connector_extra_config``, checked and typed (see :mod:`kvhal.vllm.settings`)."""

    cpu_bytes_to_use: int
    device: str | None = None
    eviction_policy: str = "lru"
    offload_prompt_only: bool = True
    load_mode: str = "auto"
    model_version: str | None = None
    tenant_labels: int = DEFAULT_TENANT_LABELS
    #: the tiers below the host tier, in order: the short forms give the local tier, then the store
    tiers: tuple[TierConfig, ...] = ()


def check_extra_config(extra: Mapping[str, Any] | None) -> ExtraSettings:
    """``extra`` (a ``kv_connector_extra_config``) checked: every key known, typed, in range.

    :raises ValidationError: naming the key (``kv_connector_extra_config.KEY``, or
        ``kv_connector_extra_config.tiers[I].KEY``), what it takes and what it got.
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ValidationError(PREFIX, f"must be a JSON object, got {extra!r:.80}")
    extra = dict(extra)
    short = [k for k in extra if k in SHORT_FORMS]
    if short and "tiers" in extra:
        raise ValidationError(
            f"{PREFIX}.tiers",
            f"and its short form{'s' if len(short) > 1 else ''} {', '.join(short)} are both given: "
            "give the tiers one way",
        )
    body = {k: v for k, v in extra.items() if k not in SHORT_FORMS}
    origins: list[_ShortForm | None] = [None] * len(extra.get("tiers") or ())
    if short:
        body["tiers"], origins = _expand(extra)
    try:
        settings = ExtraConfigSettings.model_validate(body)
    except PydanticError as exc:
        raise _error(exc.errors(), ExtraConfigSettings, (), origins) from None
    tiers = tuple(_tier(entry, i, origins) for i, entry in enumerate(settings.tiers or ()))
    _check_names(tiers, origins)
    return ExtraSettings(
        cpu_bytes_to_use=settings.cpu_bytes_to_use,
        device=settings.device,
        eviction_policy=settings.eviction_policy,
        offload_prompt_only=settings.offload_prompt_only,
        load_mode=settings.load_mode,
        model_version=settings.model_version,
        tenant_labels=settings.tenant_labels,
        tiers=tiers,
    )


@dataclass(frozen=True)
class _ShortForm:
    """A tier given by short forms: its field (``write``, ``options.path``) -> the user's key."""

    keys: dict[str, str]


def _expand(extra: dict[str, Any]) -> tuple[list[Any], list[_ShortForm | None]]:
    """The short forms as ``tiers`` entries (the local tier, then the store), and their keys."""
    entries: list[Any] = []
    origins: list[_ShortForm | None] = []
    local = {k: v for k, v in extra.items() if k in LOCAL_SHORT_FORMS}
    if local and not any(k in local for k in LOCAL_OPENERS):
        raise ValidationError(
            f"{PREFIX}.{sorted(local)[0]}", "configures a lower tier, but none is set (disk_path)"
        )
    if local:
        entry: dict[str, Any] = {"backend": extra.get("tier_backend", "disk")}
        options = extra.get("tier_options", {})
        keys = {"options": f"{PREFIX}.tier_options"}
        if isinstance(options, dict):
            keys |= {f"options.{name}": f"{PREFIX}.tier_options.{name}" for name in options}
            options = dict(options)
            for short, option in LOCAL_SHORT_FORMS.items():  # every option's short form
                name = option.removeprefix("options.")
                if name == option:
                    continue
                if short in extra or (short in LOCAL_OPENERS and name not in options):
                    keys[option] = f"{PREFIX}.{short}"  # a missing option is asked for by its short form
                if short in extra:
                    options[name] = extra[short]
        entry["options"] = options
        for short, target in LOCAL_SHORT_FORMS.items():
            if "." not in target and target != "options":
                keys[target] = f"{PREFIX}.{short}"
                if short in extra and short != "tier_backend":
                    entry[target] = extra[short]
        entries.append(entry)
        origins.append(_ShortForm(keys))
    store = {k: v for k, v in extra.items() if k in STORE_SHORT_FORMS}
    if store and "remote_url" not in store:
        raise ValidationError(
            f"{PREFIX}.{sorted(store)[0]}", "configures a remote tier, but none is set (remote_url)"
        )
    if store:
        entries.append({STORE_SHORT_FORMS[k]: v for k, v in store.items()})
        origins.append(
            _ShortForm({target: f"{PREFIX}.{short}" for short, target in STORE_SHORT_FORMS.items()})
        )
    return entries, origins


def _tier(entry: BaseModel, index: int, origins: list[_ShortForm | None]) -> TierConfig:
    """One checked ``tiers`` entry as the tier's config."""
    origin = origins[index]
    where = f"{PREFIX}.tiers[{index}]"
    if isinstance(entry, StoreTierSettings):
        prefix = f"{PREFIX}.remote_" if origin is not None else f"{where}."
        values = entry.model_dump(exclude={"name"})
        return RemoteTierConfig(**values, name=entry.name or "", key_prefix=prefix)
    assert isinstance(entry, LocalTierSettings)
    options = dict(entry.options)
    if origin is not None:
        config_keys = {
            name.removeprefix("options."): key
            for name, key in origin.keys.items()
            if name.startswith("options.")
        }
    else:
        config_keys = {name: f"{where}.options.{name}" for name in (*options, "path", "bytes_to_use")}
    if entry.backend == "disk":
        try:
            options = DiskTierOptions.model_validate(options).model_dump(exclude_unset=True)
        except PydanticError as exc:
            loc = ("tiers", index, "local", "options")
            raise _error(exc.errors(), DiskTierOptions, loc, origins) from None
    return LowerTierConfig(
        backend=entry.backend,
        options=options,
        write=entry.write,
        eviction_policy=entry.eviction_policy,
        config_keys={name: config_keys[name] for name in options if name in config_keys},
        wait_ms=entry.wait_ms,
        prefetch_blocks=entry.prefetch_blocks,
        wait_policy=entry.wait_policy,
        name=entry.name or "",
    )


def _check_names(tiers: tuple[TierConfig, ...], origins: list[_ShortForm | None]) -> None:
    """Every tier's name is its own (a local tier's defaults to its backend, a store's to its scheme)."""
    seen: dict[str, int] = {}
    for i, tier in enumerate(tiers):
        if tier.name in seen:
            first, origin = seen[tier.name], origins[i]
            if origin is not None:  # short forms name no tier: the list does
                raise ValidationError(
                    origin.keys["url"],
                    f"names the store {tier.name!r}, as tier_backend names the local tier: give the "
                    'two in "tiers", each with a "name"',
                )
            raise ValidationError(
                f"{PREFIX}.tiers[{i}].name",
                f"tiers[{first}] and tiers[{i}] are both named {tier.name!r} (a local tier is named "
                "after its backend, a store after its URL's scheme): give each a unique name",
            )
        seen[tier.name] = i


#: Who takes which keys, for an unknown key's error.
_TAKERS = {
    ExtraConfigSettings: "KVHALConnector takes",
    LocalTierSettings: "a local tier takes",
    StoreTierSettings: "a store takes",
    DiskTierOptions: "the disk backend's options are",
}


def _error(
    errors: list[ErrorDetails],
    model: type[BaseModel],
    base: tuple[str | int, ...],
    origins: list[_ShortForm | None],
) -> ValidationError:
    """pydantic's ``errors`` (of ``model``, found at ``base``) as one ValidationError naming the key."""
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    if unknown:  # a typo first: it explains what follows (a key "missing" under its right name)
        parent = tuple(unknown[0]["loc"][:-1])
        names = [str(e["loc"][-1]) for e in unknown if tuple(e["loc"][:-1]) == parent]
        owner = _model_at(model, parent)
        taken = sorted(KNOWN_KEYS if owner is ExtraConfigSettings else owner.model_fields)
        close = [m for n in names for m in difflib.get_close_matches(n, taken, n=1)]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        return ValidationError(
            _key(base + parent, origins), f"unknown keys {names}{hint}; {_TAKERS[owner]} {taken}"
        )
    problems: dict[str, str] = {}  # the user's key -> its first problem (a union fails once a member)
    for error in errors:
        key, message = _problem(error, model, base, origins)
        problems.setdefault(key, message)
    (key, message), *others = problems.items()
    also = f" (also wrong: {', '.join(k.removeprefix(PREFIX + '.') for k, _ in others)})" if others else ""
    return ValidationError(key, message + also)


def _problem(
    error: ErrorDetails, model: type[BaseModel], base: tuple[str | int, ...], origins: list[_ShortForm | None]
) -> tuple[str, str]:
    """One pydantic error as ``(the user's key, what is wrong)``."""
    loc = tuple(error["loc"])
    if error["type"] == "tier_kind":
        return _key(base + loc, origins), f"{error['msg']}, got {error['input']!r:.80}"
    info, loc = _field_at(model, loc)
    if error["type"] == "missing":
        return _key(base + loc, origins), f"is required: {expects(info)}"
    why = f" ({error['ctx']['why']})" if error["type"] == "size" else ""
    return _key(base + loc, origins), f"must be {expects(info)}, got {error['input']!r:.80}{why}"


def _model_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> type[BaseModel]:
    """The model whose field ``loc`` leads to (``("tiers", 1, "store")``: a store's)."""
    for part in loc:
        if isinstance(part, str) and part in TIER_KINDS:
            model = TIER_KINDS[part]
    return model


def _field_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> tuple[FieldInfo, tuple[str | int, ...]]:
    """The field an error's ``loc`` is in, and ``loc`` up to it (a union member's name dropped)."""
    info = None
    for i, part in enumerate(loc):
        if isinstance(part, str) and part in TIER_KINDS:
            model = TIER_KINDS[part]
        elif isinstance(part, str) and part in model.model_fields:
            info, end = model.model_fields[part], i + 1
            if part != "tiers":
                break
    assert info is not None, loc
    return info, loc[:end]


def _key(loc: tuple[str | int, ...], origins: list[_ShortForm | None]) -> str:
    """The user's key at ``loc``: ``tiers[1].url``, or the short form it came from."""
    parts = [p for p in loc if not (isinstance(p, str) and p in TIER_KINDS)]
    if len(parts) >= 2 and parts[0] == "tiers" and isinstance(parts[1], int):
        origin = origins[parts[1]] if parts[1] < len(origins) else None
        if origin is not None and len(parts) > 2:
            path = ".".join(str(p) for p in parts[2:])
            if path in origin.keys:
                return origin.keys[path]
            head = str(parts[2])  # an option's own key under tier_options
            if head in origin.keys:
                return ".".join([origin.keys[head], *(str(p) for p in parts[3:])])
    text = PREFIX
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text

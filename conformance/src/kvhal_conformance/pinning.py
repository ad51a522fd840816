"""Which pinning witness judges the plugin under test, and how large a buffer this machine allows.

Witnesses come from every plugin the target's registry holds, through the optional hook
``kvhal_pinning_witnesses`` (the built-in CPU plugin is always there). One of the plugin's
torch device type is chosen, preferring one another plugin offers over the plugin's own, and
the first available in this process. Buffers are checked up to the preset's sizes, bounded by
a quarter of the memory available now and by the witness's own limit (``RLIMIT_MEMLOCK`` for
``mlock``), so the suite never pushes a machine into swapping; the report says what was checked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from kvhal.device import HOST_ALIGNMENT as PAGE
from kvhal.witness import PinningWitness
from kvhal_conformance.target import Target

HOOK = "kvhal_pinning_witnesses"
#: A witnessed buffer takes at most this share of the memory available when the check starts.
MEMORY_SHARE = 4
GiB = 1 << 30


@dataclass(frozen=True)
class Offer:
    """A witness and the plugin that offered it."""

    witness: PinningWitness
    plugin: str
    owner: object = field(default=None, repr=False, compare=False)

    @property
    def label(self) -> str:
        return f"{self.witness.name!r} (offered by plugin {self.plugin!r})"


@dataclass
class Choice:
    """The witness chosen for a target, or why there is none."""

    device_type: str
    offer: Offer | None
    why_none: str = ""
    #: The buffers witnessed so far in this run: ``{"bytes", "pinned", "how", "bounded"}`` each.
    checked: list[dict[str, Any]] = field(default_factory=list)

    def as_report(self) -> dict[str, Any]:
        return {
            "device_type": self.device_type,
            "witness": self.offer.witness.name if self.offer else None,
            "offered_by": self.offer.plugin if self.offer else None,
            "not_witnessed": self.why_none or None,
            "checked": self.checked,
            "summary": self.summary(),
        }

    def summary(self) -> str:
        """The report's row: ``pinning: witnessed by ...`` or ``pinning: not witnessed (...)``."""
        if self.offer is None:
            return f"pinning: not witnessed ({self.why_none})"
        sizes = ", ".join(_size(c["bytes"]) for c in self.checked) or "no buffer yet"
        return f"pinning: witnessed by {self.offer.label}; buffers checked: {sizes}"


def _size(nbytes: int) -> str:
    if nbytes >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes} bytes"


def offers(target: Target) -> tuple[list[Offer], list[str]]:
    """Every witness every plugin of the target's registry offers, and what went wrong asking
    (a hook that raised, an offer that is no :class:`~kvhal.witness.PinningWitness`)."""
    caller = getattr(target.registry.pm.hook, HOOK, None)
    found: list[Offer] = []
    problems: list[str] = []
    for impl in caller.get_hookimpls() if caller is not None else ():
        if impl.hookwrapper or getattr(impl, "wrapper", False):
            continue
        try:
            result = impl.function()
        except Exception as exc:
            problems.append(f"plugin {impl.plugin_name!r}'s {HOOK} raised {type(exc).__name__}: {exc}")
            continue
        for witness in result or ():
            if isinstance(witness, PinningWitness):
                found.append(Offer(witness, impl.plugin_name, impl.plugin))
            else:
                problems.append(
                    f"plugin {impl.plugin_name!r}'s {HOOK} offered {witness!r:.60}, not a PinningWitness"
                )
    return found, problems


def chosen(target: Target) -> Choice:
    """:func:`choose`, once per target and run (kept in ``target.metrics["pinning"]`` for the report)."""
    choice = target.metrics.get("pinning")
    if not isinstance(choice, Choice):
        choice = target.metrics["pinning"] = choose(target)
    return choice


def choose(target: Target) -> Choice:
    """The witness for ``target``'s torch device type: another plugin's before the target's own,
    the first whose :meth:`~kvhal.witness.PinningWitness.unavailable` says None."""
    device_type = target.descriptor.torch_device_type if target.descriptor else "unknown"
    own = target.info.plugin
    seen: set[str] = set()
    candidates: list[Offer] = []
    all_offers, problems = offers(target)
    ignored = f" (ignored: {'; '.join(problems)})" if problems else ""
    # another plugin's witness first: the plugin under test vouches for no one, itself included
    ranked = [o for o in all_offers if o.owner is not own] + [o for o in all_offers if o.owner is own]
    for offer in ranked:
        if offer.witness.device_type == device_type and offer.witness.name not in seen:
            seen.add(offer.witness.name)
            candidates.append(offer)
    if not candidates:
        return Choice(device_type, None, f"no witness for device type {device_type!r}{ignored}")
    reasons = []
    for offer in candidates:
        try:
            reason = offer.witness.unavailable()
        except Exception as exc:
            reason = f"unavailable() raised {type(exc).__name__}: {exc}"
        if reason is None:
            return Choice(device_type, offer)
        reasons.append(f"{offer.label}: {reason}")
    return Choice(
        device_type,
        None,
        f"no witness available for device type {device_type!r}: {'; '.join(reasons)}{ignored}",
    )


def memory_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (else free pages), or None when unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def bounded(nbytes: int, witness: PinningWitness) -> tuple[int, str]:
    """``nbytes``, or less where this machine allows less: the size to check, and why it is
    smaller (empty when it is not)."""
    limits: list[tuple[int, str]] = []
    available = memory_available()
    if available is not None:
        limits.append((available // MEMORY_SHARE, f"1/{MEMORY_SHARE} of MemAvailable ({_size(available)})"))
    own = witness.size_limit()
    if own is not None:
        limits.append((own, f"{witness.name}'s limit ({_size(own)}, e.g. RLIMIT_MEMLOCK)"))
    limit, why = min(limits, default=(nbytes, ""))
    if nbytes <= limit:
        return nbytes, ""
    return max(limit // PAGE * PAGE, PAGE), f"asked {_size(nbytes)}, bounded by {why}"

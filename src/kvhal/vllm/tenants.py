"""Tenants as vLLM tells them apart: by a request's ``cache_salt``, as a bounded metric label.

vLLM puts ``cache_salt`` into the extra keys of a request's first block hash, so every block
hash of a salted prompt (each chains its parent's) differs from the same prompt's under another
salt or none; kvhal's keys are those hashes (:mod:`kvhal.vllm.keys`), so tenants' blocks are
apart in every tier without kvhal doing anything (docs/tenants.md).

What kvhal adds is figures per tenant: :class:`TenantLabels` names a salt by a short digest,
the first ``limit`` distinct salts each their own, every later one :data:`OTHER`, so that a
fleet's series stay bounded whatever its tenants send.
"""

from __future__ import annotations

import hashlib

#: The label of a salt past the first ``limit`` (not a digest: those are hex).
OTHER = "other"
#: Hex characters of a salt's label: 32 bits, enough to tell a few hundred tenants apart.
LABEL_CHARS = 8
#: How many salts get a label of their own unless ``tenant_labels`` says otherwise.
DEFAULT_TENANT_LABELS = 16
_PERSON = b"kvhal-tenant"  # domain separation: the label is no digest of anything else


def tenant_label(salt: str) -> str:
    """The label of ``salt``: 32 bits of its BLAKE2b, the same in every engine and restart (a
    fleet's series add up), and no more of the salt than a guess can already check."""
    digest = hashlib.blake2b(salt.encode(), digest_size=LABEL_CHARS // 2, person=_PERSON)
    return digest.hexdigest()


class TenantLabels:
    """The label of each request's salt, for at most ``limit`` distinct salts.

    :param limit: salts that get a label of their own (the first seen); 0: no tenant figures.
    """

    def __init__(self, limit: int = DEFAULT_TENANT_LABELS) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"tenant_labels must be an int >= 0, got {limit!r:.40}")
        self.limit = limit
        self._labels: dict[str, str] = {}  # salt -> label: at most ``limit`` entries

    def label(self, salt: str | None) -> str | None:
        """``salt``'s label; ``None`` for no salt (vLLM ignores an empty one too) or with a
        limit of 0: such requests count in the engine-wide counters only."""
        if not salt or not self.limit:
            return None
        label = self._labels.get(salt)
        if label is None:
            if len(self._labels) >= self.limit:
                return OTHER
            label = self._labels[salt] = tenant_label(salt)
        return label

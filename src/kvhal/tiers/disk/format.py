"""The ``disk`` tier's on-disk format: slot geometry, the 64-byte slot record, ``meta.json``.

Everything here is pure (no I/O beyond what a caller hands in) so that the
format is defined in one place; :mod:`kvhal.tiers.disk` does the I/O.

Slot record (``index.bin`` holds one per slot, slot ``s`` at byte ``64 * s``;
all integers little-endian)::

    offset  size  field
         0     4  magic b"KVHB"
         4     2  format version (1)
         6     2  key length (0..40)
         8     8  fingerprint digest (TierSpec.digest(): KV fingerprint, rank, world size, slot bytes)
        16     4  crc32c of the slot's payload (its slot_bytes bytes, not the padding)
        20    40  key, zero-padded
        60     4  crc32c of bytes 0..59

An all-zero record is an empty slot. Because the record crc sits right after
the bytes it covers, ``crc32c(record) == RESIDUE`` for every intact record;
and since a crc's running state after an intact record is then always the
same, the crc32c of ``k`` intact records laid end to end is a constant too
(:func:`group_residue`). Recovery checks records :data:`CHECK_GROUP` at a time
with one call over the group, and one by one only in a group that fails: a
damaged record changes its group's crc like any error in a 16 KiB message.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np

from kvhal.tiers.backend import CORRUPT, FOREIGN, MISSING

#: Directory under the user's path holding kvhal's tree (its name carries the format version).
TREE = "kvhal-tier-v1"
FORMAT_VERSION = 1
#: O_DIRECT alignment of offsets, lengths and addresses; also the slot stride's unit.
ALIGN = 4096
RECORD_BYTES = 64
MAX_KEY_BYTES = 40
MAGIC = b"KVHB"
#: crc32c of any intact record (the crc of bytes 0..59 appended little-endian).
RESIDUE = 0x48674BC7
#: A data file is at least this big before the slots are spread over a second one.
MIN_FILE_BYTES = 256 << 20
MAX_FILES = 8
#: Records whose crc recovery checks in one call (16 KiB).
CHECK_GROUP = 256

_HEAD = struct.Struct("<4sHH8sI40s")  # the 60 bytes the record crc covers
_EMPTY = bytes(RECORD_BYTES)
assert _HEAD.size == RECORD_BYTES - 4


def round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def pack_record(key: bytes, digest: bytes, payload_crc: int) -> bytes:
    """The 64-byte record naming ``key`` (at most :data:`MAX_KEY_BYTES`) and its payload's crc."""
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, len(key), digest, payload_crc, key)
    return head + struct.pack("<I", crc32c.crc32c(head))


def check_record(record: bytes | memoryview, key: bytes, digest: bytes) -> tuple[str | None, int]:
    """``(outcome, payload_crc)`` for a slot read as ``key`` under ``digest``.

    ``outcome`` is ``None`` when the record names ``key`` and the payload may be
    read (its crc then still has to match ``payload_crc``), else the read
    outcome: :data:`MISSING` (empty slot, another key), :data:`CORRUPT` (garbage,
    a damaged record) or :data:`FOREIGN` (another format version or fingerprint).
    """
    if record == _EMPTY:
        return MISSING, 0
    magic, version, key_len, their_digest, payload_crc, padded_key = _HEAD.unpack_from(record)
    if magic != MAGIC:
        return CORRUPT, 0
    if version != FORMAT_VERSION:
        return FOREIGN, 0
    if crc32c.crc32c(record) != RESIDUE or key_len > MAX_KEY_BYTES:
        return CORRUPT, 0
    if their_digest != digest:
        return FOREIGN, 0
    if key_len != len(key) or padded_key[:key_len] != key:
        return MISSING, 0
    return None, payload_crc


def valid_records(raw: np.ndarray, digest: bytes, within: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask over ``raw`` (``(n, 64)`` uint8 records): intact records under ``digest``.

    The field checks run over all rows in numpy, the crc only over the rows
    that passed them (and are in ``within``, a mask, when given), a group at a time.
    """
    words = raw.view("<u2")
    mask = (
        (raw.view("<u4")[:, 0] == int.from_bytes(MAGIC, "little"))
        & (words[:, 2] == FORMAT_VERSION)
        & (words[:, 3] <= MAX_KEY_BYTES)
        & (raw.view("<u8")[:, 1] == int.from_bytes(digest, "little"))
    )
    if within is not None:
        mask &= within
    rows = np.flatnonzero(mask)
    if rows.size:
        chosen = raw if rows.size == len(raw) else raw[rows]  # a full index needs no copy
        flat = memoryview(np.ascontiguousarray(chosen).reshape(-1))
        bad = []
        for start in range(0, rows.size, CHECK_GROUP):
            k = min(CHECK_GROUP, rows.size - start)
            if crc32c.crc32c(flat[start * RECORD_BYTES : (start + k) * RECORD_BYTES]) != group_residue(k):
                bad += [
                    i
                    for i in range(start, start + k)
                    if crc32c.crc32c(flat[i * RECORD_BYTES : (i + 1) * RECORD_BYTES]) != RESIDUE
                ]
        mask[rows[bad]] = False
    return mask


@functools.cache
def group_residue(k: int) -> int:
    """crc32c of any ``k`` intact records laid end to end."""
    return crc32c.crc32c(pack_record(b"", bytes(8), 0) * k)


def record_keys(raw: np.ndarray, rows: np.ndarray) -> list[bytes]:
    """The keys of the records ``raw[rows]`` (already known intact)."""
    if rows.size == 0:
        return []
    every = rows.size == len(raw)
    lengths = raw.view("<u2")[:, 3] if every else raw.view("<u2")[rows, 3]
    padded = raw[:, 20 : 20 + MAX_KEY_BYTES] if every else raw[rows, 20 : 20 + MAX_KEY_BYTES]
    if (lengths == lengths[0]).all():  # the usual case: one key length, no per-key slicing
        width = int(lengths[0])
        if width == 0:
            return [b""] * rows.size
        return np.ascontiguousarray(padded[:, :width]).view(f"V{width}").ravel().tolist()
    whole = np.ascontiguousarray(padded).view(f"V{MAX_KEY_BYTES}").ravel().tolist()
    return [key[:n] for key, n in zip(whole, lengths.tolist(), strict=True)]


@dataclass(frozen=True)
class Geometry:
    """Where slots live: slot ``s`` is in data file ``s // slots_per_file`` at
    ``(s % slots_per_file) * stride``, so ascending slots are contiguous on disk."""

    slot_bytes: int
    stride: int
    num_slots: int
    slots_per_file: int

    @classmethod
    def plan(cls, slot_bytes: int, bytes_per_rank: int) -> Geometry:
        """The geometry fitting ``bytes_per_rank`` (payload plus records); ``num_slots`` may be 0."""
        stride = round_up(slot_bytes, ALIGN)
        num_slots = bytes_per_rank // (stride + RECORD_BYTES)
        num_files = max(1, min(MAX_FILES, num_slots * stride // MIN_FILE_BYTES))
        slots_per_file = max(1, -(-num_slots // num_files))
        return cls(slot_bytes, stride, num_slots, slots_per_file)

    @property
    def num_files(self) -> int:
        return -(-self.num_slots // self.slots_per_file)

    def file_bytes(self, i: int) -> int:
        return min(self.slots_per_file, self.num_slots - i * self.slots_per_file) * self.stride

    @property
    def index_bytes(self) -> int:
        return self.num_slots * RECORD_BYTES

    def locate(self, slot: int) -> tuple[int, int]:
        """``(file number, byte offset)`` of ``slot``."""
        f, i = divmod(slot, self.slots_per_file)
        return f, i * self.stride

    def fields(self) -> dict[str, int]:
        return {
            "format": FORMAT_VERSION,
            "slot_bytes": self.slot_bytes,
            "stride": self.stride,
            "num_slots": self.num_slots,
            "slots_per_file": self.slots_per_file,
            "num_files": self.num_files,
            "record_bytes": RECORD_BYTES,
        }


def meta_text(geometry: Geometry, rank: int, world_size: int, fingerprint: Any, digest: bytes) -> bytes:
    """``meta.json``: the geometry (checked when reopened) and, for humans, what KV it holds."""
    meta = {
        **geometry.fields(),
        "rank": rank,
        "world_size": world_size,
        "digest": digest.hex(),
        "fingerprint": fingerprint,
    }
    return (json.dumps(meta, indent=1, sort_keys=True, default=str) + "\n").encode()


def meta_mismatches(meta: dict[str, Any], geometry: Geometry) -> list[str]:
    """``"field: on disk X, asked Y"`` for each geometry field ``meta`` disagrees on."""
    return [
        f"{name}: on disk {meta.get(name)!r}, asked {value!r}"
        for name, value in geometry.fields().items()
        if meta.get(name) != value
    ]

"""What a model is, for the fingerprint of the KV the tiers keep: never where it lies.

A path names a place, and a fine-tune redeployed in place would be served the old model's KV.
So a model in a local directory is named by a digest of its files: ``config.json`` and each
weight file's name, size and three samples of 64 KiB (start, middle, end). Training changes
every weight, so every sample; reading 192 KiB a file costs milliseconds at start. A model
named otherwise (a hub id vLLM resolved elsewhere) is named by its id and revision. An
operator's ``model_version`` replaces both (say, for weights kvhal cannot read).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["SAMPLE_BYTES", "WEIGHT_SUFFIXES", "model_identity", "weights_digest"]

#: Files whose bytes are the model: its config and its weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
SAMPLE_BYTES = 64 << 10
#: The most files sampled (a model split in more shards is still told apart by the first ones
#: and by every file's name and size).
MAX_FILES = 4096


def weights_digest(directory: str | os.PathLike[str]) -> str:
    """A digest of ``directory``'s config and weight files (names, sizes, sampled bytes)."""
    root = Path(directory)
    files = sorted(
        path
        for path in root.rglob("*")
        if path.is_file() and (path.name == "config.json" or path.suffix in WEIGHT_SUFFIXES)
    )[:MAX_FILES]
    digest = hashlib.blake2b(digest_size=16)
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.relative_to(root)}\0{size}\0".encode())
        with open(path, "rb") as f:
            for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def model_identity(model: str, revision: str | None, version: str | None = None) -> dict[str, str | None]:
    """The fingerprint's ``model`` entry (see the module)."""
    if version is not None:
        return {"version": version}
    if os.path.isdir(model):
        return {"weights": weights_digest(model)}
    return {"name": model, "revision": revision}

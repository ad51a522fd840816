"""What a model is, for the fingerprint of the KV the tiers keep: never where it lies.

A path names a place, and a fine-tune redeployed in place would be served the old model's KV.
So a model in a local directory is named by a digest of every byte of its files:
``config.json`` and each weight file (``*.safetensors``, ``*.bin``, ... under it), by its path
in the directory and its bytes; a model given as one file (a GGUF) by its bytes. Any byte
changed is another model, whichever layers a fine-tune left alone. The first start on the
files reads them all, in parallel (:mod:`kvhal.vllm.file_digests`: at the disk's pace, or the
cores' where vLLM's load left them in the page cache; BENCHMARKS.md); each file's digest is
then kept under the file's identity (:mod:`kvhal.vllm.digest_cache`), so a restart on the same
files reads none of them.

A model vLLM fetched from the Hugging Face Hub is named by the commit its revision resolved to
(the snapshot vLLM loaded, found in the hub's cache as vLLM finds it, without the network):
a commit names every byte of the repository. Where none is found (another hub, weights
streamed from object storage), by its name and revision, with a warning: a new version under
the same revision would keep the name. An operator's ``model_version`` replaces all of these.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import blake3

from kvhal.errors import ValidationError
from kvhal.vllm.digest_cache import DigestCache, FileId
from kvhal.vllm.file_digests import digest_files

__all__ = ["WEIGHT_SUFFIXES", "hub_commit", "model_identity", "weight_files", "weights_digest"]

log = logging.getLogger("vllm." + __name__)  # under "vllm": its handlers and level

#: Files whose bytes are the model: its config and its weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
#: How long a process waits for another reading the same weights: this plus their bytes at
#: :data:`SLOWEST_READ` bytes per second; past it, it reads them too.
WAIT_S = 60.0
SLOWEST_READ = 100 << 20
#: A file changed this recently is not kept: a write within the file system's timestamp
#: granularity of the read could leave its identity as it was (git's "racily clean" entries).
SETTLE_NS = 2 * 10**9
_COMMIT = re.compile(r"[0-9a-f]{40}")


def weight_files(directory: str | os.PathLike[str]) -> list[Path]:
    """``directory``'s ``config.json`` and weight files, at any depth, in path order."""
    root = Path(directory)
    return sorted(
        path
        for path in root.rglob("*")
        if (path.name == "config.json" or path.suffix in WEIGHT_SUFFIXES) and path.is_file()
    )


def weights_digest(
    path: str | os.PathLike[str], cache: DigestCache | None = None, threads: int | None = None
) -> str:
    """A digest of every byte of a model: a directory's config and weight files (each by its
    path in the directory and its bytes), or one file's bytes.

    :param cache: where each file's digest is kept between calls (default: kvhal's cache
        directory, :func:`~kvhal.vllm.digest_cache.cache_dir`).
    :raises OSError: a file could not be read.
    """
    root = Path(path)
    files = weight_files(root) if root.is_dir() else [root]
    names = [p.relative_to(root).as_posix() if p != root else "" for p in files]
    if root.is_dir() and all(p.name == "config.json" for p in files):
        _warn_once(
            f"kvhal: {root} holds no weight file ({', '.join(WEIGHT_SUFFIXES)}): the model is told "
            "apart by its config only; set kv_connector_extra_config.model_version to name its weights"
        )
    ids = [FileId.of(p) for p in files]
    model = os.path.realpath(root)
    own = cache is None
    cache = DigestCache() if cache is None else cache
    try:
        digests = _digests(ids, model, cache, threads, str(root))
    finally:
        if own:
            cache.close()
    whole = blake3.blake3(b"kvhal model v2\0")
    for name, identity in zip(names, ids, strict=True):
        whole.update(f"{name}\0{identity.size}\0{digests[identity]}\n".encode())
    return whole.hexdigest(length=16)


def _digests(
    ids: list[FileId], model: str, cache: DigestCache, threads: int | None, label: str
) -> dict[FileId, str]:
    kept = cache.load(model)
    digests = {i: kept[i] for i in ids if i in kept}
    missing = [i for i in dict.fromkeys(ids) if i not in digests]
    if not missing:
        return digests
    wait_s = WAIT_S + sum(i.size for i in missing) / SLOWEST_READ
    with cache.reading(model, wait_s):
        kept = cache.load(model)  # another process may have read them meanwhile
        digests.update({i: kept[i] for i in missing if i in kept})
        missing = [i for i in missing if i not in digests]
        if not missing:
            return digests
        settled = time.time_ns() - SETTLE_NS
        read = digest_files(missing, threads, label)
        digests.update({i: digest for i, (digest, _) in read.items()})
        kept_now = {
            i: digests[i]
            for i in dict.fromkeys(ids)
            if i not in read or (read[i][1] and max(i.mtime_ns, i.ctime_ns) < settled)
        }
        cache.store(model, kept_now)
    return digests


def hub_commit(model: str, revision: str | None, download_dir: str | None = None) -> str | None:
    """The commit ``revision`` (default ``main``) of hub model ``model`` resolved to, as vLLM
    resolved it into the Hugging Face cache (``download_dir`` or the hub's default), without
    the network; ``None`` where the cache holds no snapshot of it."""
    if revision is not None and _COMMIT.fullmatch(revision):
        return revision
    try:
        from huggingface_hub import snapshot_download  # vLLM's dependency: there with vLLM

        found = snapshot_download(
            repo_id=model,
            revision=revision,
            cache_dir=download_dir,
            local_files_only=True,
            ignore_patterns="*",
        )
    except (ImportError, OSError, ValueError) as exc:
        log.debug("kvhal: no snapshot of %s@%s in the hub's cache: %s", model, revision, exc)
        return None
    commit = os.path.basename(os.path.normpath(found))
    return commit if _COMMIT.fullmatch(commit) else None


def model_identity(
    model: str,
    revision: str | None,
    version: str | None = None,
    download_dir: str | None = None,
    weights_at: str | None = None,
) -> dict[str, str | None]:
    """The fingerprint's ``model`` entry (see the module).

    :param model: vLLM's ``model_config.model``: a directory, a file, or a hub id.
    :param download_dir: vLLM's ``load_config.download_dir`` (the hub cache it fetched into).
    :param weights_at: vLLM's ``model_config.model_weights``: where weights streamed from object
        storage come from (``model`` is then a directory of their config only).
    """
    if version is not None:
        return {"version": version}
    if weights_at and weights_at != model:
        _warn_unnamed(weights_at, revision, "its weights are streamed from object storage")
        return {"name": weights_at, "revision": revision}
    if os.path.isdir(model) or os.path.isfile(model):
        try:
            return {"weights": weights_digest(model)}
        except OSError as exc:
            raise ValidationError(
                "model",
                f"{model}'s weights cannot be read to tell them apart ({exc}); let this process read "
                "them, or name them with kv_connector_extra_config.model_version",
            ) from exc
    commit = hub_commit(model, revision, download_dir)
    if commit is not None:
        return {"name": model, "commit": commit}
    _warn_unnamed(model, revision, "no snapshot of it is in the Hugging Face cache")
    return {"name": model, "revision": revision}


def _warn_unnamed(model: str, revision: str | None, why: str) -> None:
    _warn_once(
        f"kvhal: model {model} (revision {revision or 'main'}) is named in the KV fingerprint by its "
        f"name and revision only ({why}): new weights under that name would be served the old "
        "ones' KV; set kv_connector_extra_config.model_version to name its weights"
    )


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)

"""The fingerprint names a model by what it is: any byte of its weights changed (a fine-tune
redeployed in place, whichever layers it left alone) is another model, the same files at another
path are the same one, a hub model is its resolved commit, and an operator's model_version
names it outright. Each file's digest is kept between starts under the file's identity: the
second start reads no weight (counted by the kernel: /proc/self/io's rchar), a changed file is
read again, and a damaged or planted entry is never taken."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvhal.errors import ValidationError
from kvhal.vllm import model_identity as identity_module
from kvhal.vllm.digest_cache import DigestCache, FileId
from kvhal.vllm.model_identity import hub_commit, model_identity, weights_digest

#: The old fingerprint read three 64 KiB windows a file: start, middle, end.
SAMPLE = 64 << 10
WEIGHTS_BYTES = 4 * SAMPLE


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """kvhal's cache directory for this test only (its default is the user's)."""
    monkeypatch.setenv("KVHAL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def model_dir(path: Path, seed: int, shards: int = 1) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"hidden_size": 64}')
    rng = np.random.default_rng(seed)
    for i in range(shards):
        weights = rng.standard_normal(WEIGHTS_BYTES // 4, dtype=np.float32)
        (path / f"model-{i:05d}.safetensors").write_bytes(weights.tobytes())
    (path / "tokenizer.json").write_text("{}")  # not a weight: not read
    return path


@pytest.fixture(scope="module")
def settled_model(tmp_path_factory) -> Path:
    """A model whose files are old enough to be kept, shared by the tests that only read it."""
    base = model_dir(tmp_path_factory.mktemp("settled") / "m", seed=5, shards=2)
    settle()
    return base


def settle() -> None:
    """Wait until files written now are old enough to be kept (model_identity.SETTLE_NS)."""
    time.sleep(identity_module.SETTLE_NS / 1e9 + 0.1)


def flip(path: Path, offset: int, keep_mtime: bool = False) -> None:
    """A fine-tune of one byte, in place, the file's size (and, asked, its mtime) kept."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    with open(path, "r+b") as f:
        f.write(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def bytes_read() -> int:
    """Bytes this process has read through read(2) and its kin, every thread counted."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def digest_and_reads(path: Path, **kw) -> tuple[str, int]:
    before = bytes_read()
    digest = weights_digest(path, **kw)
    return digest, bytes_read() - before


# offsets outside the old windows ([0, 64K), [96K, 160K), [192K, 256K)) and inside them
@pytest.mark.parametrize("offset", [SAMPLE + 1000, 3 * SAMPLE - 1, 0, WEIGHTS_BYTES // 2, WEIGHTS_BYTES - 1])
def test_one_byte_changed_anywhere_is_another_model(tmp_path, offset):
    base = model_dir(tmp_path / "m", seed=1, shards=2)
    before = weights_digest(base)
    moved = shutil.copytree(base, tmp_path / "elsewhere")
    assert weights_digest(moved) == before, "the same files at another path are the same model"
    flip(base / "model-00001.safetensors", offset)  # a layer of the second shard, fine-tuned
    tuned = weights_digest(base)
    assert tuned != before, f"a byte changed at {offset} kept the old identity"
    (base / "tokenizer.json").write_text('{"changed": true}')
    assert model_identity(str(base), None) == {"weights": tuned}, "a file that is not a weight counted"


def test_the_cache_spares_a_restart_every_read_and_a_changed_file_is_read_again(tmp_path):
    base = model_dir(tmp_path / "m", seed=2, shards=2)
    settle()
    first, cold = digest_and_reads(base)
    assert cold >= 2 * WEIGHTS_BYTES, "the first call read less than the weights"
    again, warm = digest_and_reads(base)
    assert again == first
    assert warm < WEIGHTS_BYTES // 4, f"the second call read {warm} bytes: the cache was not used"

    shard = base / "model-00000.safetensors"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # touched: read again, same bytes
    touched, reread = digest_and_reads(base)
    assert touched == first and WEIGHTS_BYTES <= reread < 2 * WEIGHTS_BYTES, reread

    flip(shard, SAMPLE + 1000, keep_mtime=True)  # new bytes, the old size and mtime
    assert weights_digest(base) != first, "a change that kept size and mtime kept the digest"
    with open(shard, "ab") as f:
        f.write(b"\0")  # a size change
    grown, reread = digest_and_reads(base)
    assert reread >= WEIGHTS_BYTES and grown != first


def test_a_file_written_just_now_is_not_kept(tmp_path):
    """Within the file system's timestamp granularity, a second write could keep the identity."""
    base = model_dir(tmp_path / "m", seed=3)
    weights_digest(base)
    _, reread = digest_and_reads(base)
    assert reread >= WEIGHTS_BYTES, "a digest of a file changed just now was kept"


def test_without_a_private_cache_directory_every_start_reads_the_weights(
    tmp_path, monkeypatch, caplog, settled_model
):
    """The negative control of the reads counted above: no cache, every call reads."""
    shared = tmp_path / "shared"
    (shared / "weights").mkdir(parents=True)
    os.chmod(shared / "weights", 0o777)  # others could plant digests: not used
    monkeypatch.setenv("KVHAL_CACHE_DIR", str(shared))
    base = settled_model
    with caplog.at_level(logging.WARNING, logger="vllm.kvhal.vllm"):
        first, _ = digest_and_reads(base)
        again, reread = digest_and_reads(base)
    assert again == first and reread >= WEIGHTS_BYTES
    assert list((shared / "weights").iterdir()) == []
    assert any("not trusted" in r.getMessage() for r in caplog.records)


def cache_file(cache: Path) -> Path:
    (found,) = (cache / "weights").glob("*.json")
    return found


@pytest.mark.parametrize(
    "damage",
    ["digit of a digest", "digest of another file", "check removed", "garbage", "not an object", "huge"],
)
def test_a_damaged_cache_entry_is_never_taken_and_the_file_is_rewritten(private_cache, settled_model, damage):
    base = settled_model
    truth = weights_digest(base)
    path = cache_file(private_cache)
    record = json.loads(path.read_text())
    entries = record["files"]
    if damage == "digit of a digest":
        d = entries[1]["digest"]
        entries[1]["digest"] = d[:10] + ("0" if d[10] != "0" else "1") + d[11:]
    elif damage == "digest of another file":  # a wrong digest, planted, the check not recomputed
        entries[1]["digest"] = entries[0]["digest"]
    elif damage == "check removed":
        del entries[1]["check"]
    if damage == "garbage":
        path.write_bytes(os.urandom(300))
    elif damage == "not an object":
        path.write_text("[1, 2]")
    elif damage == "huge":
        path.write_text(" " * (17 << 20) + json.dumps(record))
    else:
        path.write_text(json.dumps(record))
    digest, reread = digest_and_reads(base)
    assert digest == truth, "a damaged entry was taken"
    assert reread >= WEIGHTS_BYTES, "nothing was read again"
    if damage in ("garbage", "not an object", "huge"):
        assert reread >= 2 * WEIGHTS_BYTES
    rewritten = DigestCache(private_cache).load(os.path.realpath(base))
    assert len(rewritten) == 3, "the cache was not rewritten whole"  # config and two shards
    _, after = digest_and_reads(base)
    assert after < WEIGHTS_BYTES // 4


def test_a_process_reading_the_weights_is_waited_for_and_its_digests_taken(
    tmp_path, private_cache, settled_model
):
    base = settled_model
    model = os.path.realpath(base)
    cache = DigestCache(private_cache)
    result: list[str] = []
    with cache.reading(model, wait_s=5) as held:  # another process reading them
        assert held
        thread = threading.Thread(target=lambda: result.append(weights_digest(base)))
        thread.start()
        time.sleep(0.5)
        assert result == [], "the lock was not waited for"
        reference = weights_digest(base, cache=DigestCache(tmp_path / "elsewhere"))
        cache.store(model, DigestCache(tmp_path / "elsewhere").load(model))
        before = bytes_read()
    thread.join(10)
    assert result == [reference]
    assert bytes_read() - before < WEIGHTS_BYTES // 4, "the waiting call read the weights itself"


def test_past_its_deadline_the_wait_ends_and_the_weights_are_read(tmp_path, private_cache, monkeypatch):
    base = model_dir(tmp_path / "m", seed=7)
    monkeypatch.setattr(identity_module, "WAIT_S", 0.3)
    cache = DigestCache(private_cache)
    with cache.reading(os.path.realpath(base), wait_s=5):
        start = time.monotonic()
        digest, reread = digest_and_reads(base)
        waited = time.monotonic() - start
    assert 0.3 <= waited < 5 and reread >= WEIGHTS_BYTES
    assert digest == weights_digest(base, cache=DigestCache(tmp_path / "other"))


def test_a_file_given_as_the_model_is_named_by_its_bytes(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(WEIGHTS_BYTES))
    named = model_identity(str(gguf), None)
    renamed = shutil.copy(gguf, tmp_path / "copy.gguf")
    assert model_identity(str(renamed), None) == named
    flip(gguf, SAMPLE + 1000)
    assert model_identity(str(gguf), None) != named


def hub_cache(root: Path, repo: str, commit: str, ref: str = "main") -> Path:
    """The Hugging Face cache's layout after vLLM fetched ``repo`` at ``ref`` (refs name commits)."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    return snapshot


def test_a_hub_model_is_named_by_the_commit_its_revision_resolved_to(tmp_path, caplog):
    old, new = "a" * 40, "b" * 40
    hub_cache(tmp_path / "hub", "org/model", old)
    first = model_identity("org/model", None, download_dir=str(tmp_path / "hub"))
    assert first == {"name": "org/model", "commit": old}
    hub_cache(tmp_path / "hub", "org/model", new)  # main moved on: a new download
    assert model_identity("org/model", None, download_dir=str(tmp_path / "hub")) == {
        "name": "org/model",
        "commit": new,
    }
    hub_cache(tmp_path / "hub", "org/model", "c" * 40, ref="v2")
    assert hub_commit("org/model", "v2", str(tmp_path / "hub")) == "c" * 40
    assert hub_commit("org/model", old, None) == old, "a commit is its own resolution"
    with caplog.at_level(logging.WARNING, logger="vllm.kvhal.vllm"):
        unresolved = model_identity("org/other", "main", download_dir=str(tmp_path / "hub"))
    assert unresolved == {"name": "org/other", "revision": "main"}
    assert any("model_version" in r.getMessage() for r in caplog.records)


def test_an_operators_version_names_it_and_object_storage_weights_by_their_url(tmp_path):
    base = model_dir(tmp_path / "m", seed=8)
    assert model_identity(str(base), None, version="v7") == {"version": "v7"}
    streamed = model_identity(str(base), None, weights_at="s3://bucket/model")
    assert streamed == {"name": "s3://bucket/model", "revision": None}


def test_file_identity_follows_links_to_the_file(tmp_path):
    """A hub snapshot's weights are links to blobs: the blob is what is read and kept."""
    blob = tmp_path / "blob"
    blob.write_bytes(b"x" * 10)
    (tmp_path / "link.safetensors").symlink_to(blob)
    assert FileId.of(tmp_path / "link.safetensors") == FileId.of(blob)


def test_a_directory_without_weights_is_said_and_unreadable_weights_are_a_clear_error(tmp_path, caplog):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="vllm.kvhal.vllm"):
        model_identity(str(config_only), None)
    assert any("holds no weight file" in r.getMessage() for r in caplog.records)
    if os.geteuid() == 0:
        return  # root reads a file of mode 000: the refusal below cannot be made here
    base = model_dir(tmp_path / "m", seed=9)
    (base / "model-00000.safetensors").chmod(0)
    with pytest.raises(ValidationError, match=r"model: .*cannot be read.*model_version"):
        model_identity(str(base), None)

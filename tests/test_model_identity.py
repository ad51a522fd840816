"""The fingerprint names a model by what it is: new weights at an old path (a fine-tune
redeployed in place) are another model, the same files at another path are the same one,
and an operator's model_version names it outright."""

from __future__ import annotations

import shutil

import numpy as np

from kvhal.vllm.model_identity import SAMPLE_BYTES, model_identity, weights_digest


def model_dir(path, seed: int):
    path.mkdir()
    (path / "config.json").write_text('{"hidden_size": 64}')
    weights = np.random.default_rng(seed).standard_normal(4 * SAMPLE_BYTES // 4, dtype=np.float32)
    (path / "model.safetensors").write_bytes(weights.tobytes())
    (path / "tokenizer.json").write_text("{}")  # not a weight: not read
    return path


def test_a_fine_tune_in_place_is_another_model_and_a_moved_one_the_same(tmp_path):
    base = model_dir(tmp_path / "m", seed=1)
    before = weights_digest(base)
    moved = shutil.copytree(base, tmp_path / "elsewhere")
    assert weights_digest(moved) == before, "the same files at another path are the same model"
    data = bytearray((base / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 1  # one weight of the middle changed: fine-tuned, same size
    (base / "model.safetensors").write_bytes(bytes(data))
    tuned = weights_digest(base)
    assert tuned != before, "new weights at the old path kept the old identity"
    (base / "tokenizer.json").write_text('{"changed": true}')
    assert model_identity(str(base), None) == {"weights": tuned}, "a file that is not a weight counted"


def test_a_hub_name_or_an_operators_version_names_it(tmp_path):
    assert model_identity("org/model", "abc123") == {"name": "org/model", "revision": "abc123"}
    base = model_dir(tmp_path / "m", seed=2)
    assert model_identity(str(base), None, version="v7") == {"version": "v7"}

"""One disk path, many models, on real vLLM engines: each model keeps its blocks in a namespace
of its own, so a second model (same geometry, other weights: a fine-tune beside its base)
neither serves nor destroys the first's cache."""

from __future__ import annotations

from kvhal.testing.models import TinyLlama
from tests.e2e.common import MODEL_CACHE, prompts
from tests.e2e.test_vllm_connector import LENGTH, SERVED, baseline, loaded, tokens
from tests.e2e.test_vllm_disk_tier import AMPLE_DISK, BLOCKS_PER_PROMPT, engine, metrics, populate, roomy


def test_two_models_share_one_disk_path(model, tmp_path):
    other = str(TinyLlama(seed=1).build(MODEL_CACHE))
    batch = prompts(2, LENGTH, seed=27)
    assert baseline(other, batch) != baseline(model, batch), "the control: the models' outputs differ"
    populate(model, tmp_path, batch)
    # the same prompts (the same block hashes) on the other model, with a budget for both
    steps = [{"op": "generate", "prompts": batch}, {"op": "settle"}, {"op": "metrics"}]
    second = engine(other, roomy(tmp_path, disk_bytes_to_use=2 * AMPLE_DISK), steps)
    assert tokens(second[0]) == baseline(other, batch), "the second model was served the first's KV"
    assert loaded(second[0]) == [0, 0]
    found = metrics(second[2])
    assert found.get("tier_recovered_blocks", 0) == 0, found
    assert found["tier_written_blocks"] == 2 * BLOCKS_PER_PROMPT, "the second model stored nothing"
    # the first model, restarted with its own budget: its cache is whole
    third = engine(model, roomy(tmp_path), [{"op": "generate", "prompts": batch}, {"op": "metrics"}])
    assert tokens(third[0]) == baseline(model, batch)
    assert loaded(third[0]) == [SERVED] * 2, "the first model's cache was lost to the second"
    assert metrics(third[1])["tier_recovered_blocks"] == 2 * BLOCKS_PER_PROMPT

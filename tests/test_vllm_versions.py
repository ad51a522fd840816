"""kvhal.vllm.versions: the answers for the vLLM installed here, and the 0.27.1 paths run
against that version's shapes (vLLM 0.27.1 itself runs the vllm_compat end-to-end subset)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
from kvhal.errors import ValidationError
from kvhal.vllm import versions
from kvhal.vllm.versions import BlockTables


def step(new=(), cached=(), resumed=(), finished=(), preempted=(), block_state=None):
    """A scheduler output as vLLM 0.27.1 shapes it (no block state) unless ``block_state``."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=ids) for r, ids in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            new_block_ids=[ids for _, ids in cached],
            resumed_req_ids=set(resumed),
        ),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
        kv_connector_block_state=block_state,
    )


def test_block_tables_follow_the_schedule_as_the_model_runner_does() -> None:
    tables = BlockTables()
    state = tables.update(step(new=[("a", ([1, 2], [7])), ("b", ([3], [8]))]))
    assert state.get_block_ids("a") == ([1, 2], [7])
    tables.update(step(cached=[("a", ([4], [])), ("b", None)]))
    assert tables.get_block_ids("a") == ([1, 2, 4], [7]), "a running request's new blocks are appended"
    assert tables.get_block_ids("b") == ([3], [8]), "no new blocks: the table stays"
    tables.update(step(preempted={"a"}))
    assert tables.get_block_ids("a") is None, "a preempted request's blocks were freed"
    tables.update(step(cached=[("a", ([9, 10, 11], [12]))], resumed={"a"}))
    assert tables.get_block_ids("a") == ([9, 10, 11], [12]), "a resumed request brings its whole table"
    tables.update(step(finished={"b"}))
    assert tables.get_block_ids("b") is None
    assert tables.get_block_ids("never") is None


def test_vllm_0_32s_block_state_is_used_when_handed() -> None:
    handed = object()
    assert BlockTables().update(step(block_state=handed)) is handed


def test_a_hybrid_model_is_refused_where_load_failures_are_per_block(monkeypatch) -> None:
    monkeypatch.setattr(versions, "REQUEST_LEVEL_LOAD_FAILURES", False)
    monkeypatch.setattr(versions, "VLLM_VERSION", "0.27.1")
    versions.check_supported(1)  # one group: fine
    with pytest.raises(ValidationError) as info:
        versions.check_supported(2)
    assert "2 KV cache groups (a hybrid model), and vLLM 0.27.1" in str(info.value)
    assert info.value.argument == "kv_transfer_config"
    monkeypatch.setattr(versions, "REQUEST_LEVEL_LOAD_FAILURES", True)
    versions.check_supported(2)


def test_failed_recving_reads_outputs_of_both_versions() -> None:
    assert versions.failed_recving(SimpleNamespace()) == set()  # 0.27.1: no such field
    assert versions.failed_recving(SimpleNamespace(failed_recving=None)) == set()
    assert versions.failed_recving(SimpleNamespace(failed_recving={"r"})) == {"r"}


def test_the_installed_version_is_described() -> None:
    line = versions.describe()
    assert line.startswith(f"vLLM {versions.VLLM_VERSION}: failed asynchronous loads reported per ")
    # vLLM 0.32 has request-level failures and a fixed seed for sha256 block hashes
    if versions.KVConnectorTransferResults is not None:
        assert versions.REQUEST_LEVEL_LOAD_FAILURES and not versions.none_hash_is_random("sha256")
    assert versions.none_hash_is_random("xxhash")

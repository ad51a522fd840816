"""The conformance suite's verdicts on synthetic copies: each kind of damage is named."""

from __future__ import annotations

import pytest
import torch

copycheck = pytest.importorskip("kvhal_conformance.copycheck")
np = pytest.importorskip("numpy")


def snapshot(values: list[int]) -> tuple[torch.Tensor, ...]:
    """One layer, one part; block b holds ``values[b]`` in each of its 4 elements."""
    blocks = torch.tensor(values, dtype=torch.int16).reshape(1, -1, 1, 1, 1)
    return (blocks.expand(1, len(values), 1, 1, 4).clone(),)


SRC = snapshot([10, 11, 12, 13, 14, 15])
DST_BEFORE = snapshot([0, 1, 2, 3, 4, 5])


def problems(mapping: list[tuple[int, int]], dst_after: list[int], src_after: list[int] | None = None) -> str:
    src_after_snapshot = SRC if src_after is None else snapshot(src_after)
    found = copycheck.copy_problems(
        np.array(mapping), SRC, src_after_snapshot, DST_BEFORE, snapshot(dst_after)
    )
    return "; ".join(found)


def test_a_correct_copy_has_no_problems() -> None:
    assert problems([(0, 5), (3, 1)], [0, 13, 2, 3, 4, 10]) == ""


def test_a_block_from_the_wrong_source_is_named() -> None:
    message = problems([(0, 1), (2, 4)], [0, 12, 2, 3, 10, 5])
    assert "dst block 1 holds src block 2's data; expected src block 0 (the first block)'s data" in message


def test_a_missing_last_block_is_named() -> None:
    message = problems([(1, 5), (2, 3)], [0, 1, 2, 12, 4, 5])
    assert "dst block 5 (the last block) was not written (expected src block 1's data)" in message


def test_a_cut_short_batch_is_recognised() -> None:
    message = problems([(0, 0), (1, 1), (2, 2), (3, 3)], [10, 11, 2, 3, 4, 5])
    assert "2 of 4 mapped dst blocks are wrong" in message
    assert "the first 2 of 4 pairs (in src-id order) arrived and the remaining 2 were not written" in message


def test_a_garbled_block_says_where() -> None:
    after = snapshot([0, 10, 2, 3, 4, 5])
    after[0][0, 1, 0, 0, 3] = 99
    found = copycheck.copy_problems(np.array([(0, 1)]), SRC, SRC, DST_BEFORE, after)
    assert "1 of 4 elements differ (first at layer 0 head 0 token 0 element 3)" in found[0]


def test_writes_outside_the_mapping_and_source_changes_are_named() -> None:
    message = problems([(0, 0)], [10, 1, 2, 99, 4, 5], src_after=[0, 11, 12, 13, 14, 15])
    assert "dst blocks [3] are not in the mapping but were written" in message
    assert "src blocks [0] changed: a copy must only read its source" in message


def test_every_device_hook_has_a_contract() -> None:
    """A hook added to the hookspecs fails here until the suite checks it."""
    from kvhal.hookspecs import DEVICE_HOOKS
    from kvhal_conformance.contracts import CONTRACTS

    covered = {hook for contract in CONTRACTS for hook in contract.hooks}
    assert set(DEVICE_HOOKS) <= covered, sorted(set(DEVICE_HOOKS) - covered)


def _backend_check(plugin: object, backends: tuple[str, ...] = ()) -> None:
    from kvhal_conformance.base import LayoutsContract, Target

    target = Target.of_plugin(plugin, "probed")
    LayoutsContract().test_backend_layouts_are_offered(target, target.require_device(), backends)


def test_backend_layouts_pass_for_the_cpu_plugin_and_unknown_names() -> None:
    from kvhal.cpu import CPUPlugin

    _backend_check(CPUPlugin(), ("MY_ATTN",))


def test_a_declared_backend_answering_an_unoffered_layout_is_named() -> None:
    """The plugin's own backend is found through ATTENTION_BACKENDS; the layout allocates."""
    from kvhal_conformance.mutants import MUTANTS

    with pytest.raises(pytest.fail.Exception) as failure:
        _backend_check(MUTANTS["BackendAnswersUnoffered"].plugin())
    message = str(failure.value)
    assert message.startswith("[layouts.backend] ")
    assert "kvhal_kv_layouts('MUTANT_ATTN') answers layout LHNBC" in message
    assert "add it to the default answer" in message and "cannot be allocated" not in message


def test_a_backend_layout_that_cannot_be_allocated_is_named() -> None:
    """The allocation half: ValidationError from the raw allocation hook is reported."""
    from kvhal_conformance.mutants import MUTANTS

    with pytest.raises(pytest.fail.Exception) as failure:
        _backend_check(MUTANTS["BackendAnswersUnallocatable"].plugin())
    message = str(failure.value)
    assert "kvhal_kv_layouts('FLASH_ATTN') answers layout LHNBC" in message
    assert "cannot be allocated either" in message and "raised ValidationError" in message


def test_a_malformed_backend_declaration_is_named() -> None:
    from kvhal.cpu import CPUPlugin

    class Malformed(CPUPlugin):
        ATTENTION_BACKENDS = "FLASH_ATTN"  # a str, not a sequence of names

    declared = r"\[layouts\.backend\] .*ATTENTION_BACKENDS = 'FLASH_ATTN'"
    with pytest.raises(pytest.fail.Exception, match=declared):
        _backend_check(Malformed())


def test_backend_names_from_the_command_line() -> None:
    from kvhal_conformance.cli import pytest_args
    from kvhal_conformance.settings import parse_backends

    assert parse_backends(["FLASH_ATTN, MY_ATTN", "X,,FLASH_ATTN"]) == ("FLASH_ATTN", "MY_ATTN", "X")
    assert parse_backends(None) == ()
    args = pytest_args(["--device", "cpu", "--backends", "FLASH_ATTN,MY_ATTN"])
    assert args[args.index("--kvhal-backends") + 1] == "FLASH_ATTN,MY_ATTN"

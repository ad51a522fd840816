"""The plugins' fallback layout tables cover every vLLM backend that declares fixed layouts.

Read from the installed vLLM's source (tests/vllm_backend_sources.py), so a vLLM
upgrade that adds a backend with its own layouts fails here until a table has it.
"""

from __future__ import annotations

import pytest

from kvhal.cpu.plugin import VLLM_CPU_BACKEND_LAYOUTS
from kvhal.layouts import layout_by_name
from kvhal_cuda.layouts import CUDA_BACKEND_LAYOUTS
from kvhal_rocm.layouts import ROCM_BACKEND_LAYOUTS
from tests import vllm_backend_sources as sources

TABLES = {"cpu": VLLM_CPU_BACKEND_LAYOUTS, "cuda": CUDA_BACKEND_LAYOUTS, "rocm": ROCM_BACKEND_LAYOUTS}

#: Fixed declarations no table holds, and why.
NOT_IN_A_TABLE = {
    # MiniMax M3's NVFP4 MSA class reports the same name as its base, whose answer depends
    # on a setting: vLLM's own answer (in an engine) is the only reliable one.
    "MINIMAX_M3_SPARSE": "shares its name with a conditional declaration",
}


@pytest.fixture(scope="module")
def fixed_declarations() -> dict[str, set[tuple[str, ...]]]:
    if sources.vllm_root() is None:
        pytest.skip("vLLM is not installed")
    found: dict[str, set[tuple[str, ...]]] = {}
    for key in sources.index():
        declared, name = sources.declared(key), sources.reported_name(key)
        if sources.is_backend(key) and name and isinstance(declared, tuple):
            found.setdefault(name.upper(), set()).add(declared)
    return found


def test_the_source_reader_sees_known_declarations(fixed_declarations):
    # Guards the reader itself: these are in vLLM 0.32 (cpu_attn.py:73, b12x.py:248, indexer.py:313).
    assert fixed_declarations["CPU_ATTN"] == {("LBHNC",)}
    assert fixed_declarations["B12X"] == {("LBHNC", "BLHNC")}
    assert fixed_declarations["KPOOL_TAIL"] == {("BLHNC",)}
    assert fixed_declarations["ULTRAQUANT"] == {("LBNHC",)}  # inherited from TURBOQUANT


def test_every_fixed_declaration_is_in_a_table_and_agrees(fixed_declarations):
    missing, wrong = [], []
    for name, answers in sorted(fixed_declarations.items()):
        holders = {plugin: table[name] for plugin, table in TABLES.items() if name in table}
        if name in NOT_IN_A_TABLE:
            continue
        if not holders:
            missing.append(f"{name} {sorted(answers)}")
        for plugin, layouts in holders.items():
            expected = {tuple(layout_by_name(x) for x in answer) for answer in answers}
            if expected != {layouts}:
                wrong.append(f"{plugin}: {name} is {[str(x) for x in layouts]}, vLLM says {sorted(answers)}")
    assert not missing, "vLLM backends with fixed layouts that no plugin table holds: " + "; ".join(missing)
    assert not wrong, "; ".join(wrong)

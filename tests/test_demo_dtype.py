"""``kvhal demo`` computes in the dtype the CPU runs natively (bf16 emulated drowns every
difference the table exists to show), takes ``--dtype``, and names the dtype in its title."""

from __future__ import annotations

import pytest

from kvhal.bench.common import cpu_flags, native_dtype
from kvhal.cli import build_parser

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN4 = "flags\t\t: avx2 avx512f avx512_bf16\n"


@pytest.mark.parametrize(
    ("cpuinfo", "dtype"),
    [(AVX2_ONLY, "float32"), (SAPPHIRE_RAPIDS, "bfloat16"), (ZEN4, "bfloat16"), ("", "float32")],
    ids=["avx2", "amx", "avx512-bf16", "unreadable"],
)
def test_the_native_dtype_follows_the_cpus_bf16_instructions(cpuinfo, dtype):
    assert native_dtype(cpu_flags(cpuinfo)) == dtype


@pytest.mark.parametrize(("argv", "dtype"), [([], "auto"), (["--dtype", "float32"], "float32")])
def test_the_demo_takes_a_dtype(argv, dtype):
    assert build_parser().parse_args(["demo", *argv]).dtype == dtype


def test_the_demo_refuses_a_dtype_it_cannot_run():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--dtype", "int8"])

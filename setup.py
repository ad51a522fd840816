"""Builds kvhal's optional native parts (the CPU plugin's copy kernel, copy plans, the
manager's key index, the Redis reader that receives values into host slots); everything
else is in pyproject.toml.

Each is optional: without a C compiler kvhal still installs and a slower Python path runs.
A build that fails is named at the end of the build (pip shows it with ``-v``; ``python -m
build`` always), and at run time ``kvhal --version`` and the vLLM engine's start log warn of
each one missing, with what it costs (kvhal.build_info).
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

FIX = (
    "install a C compiler and Python's headers (Debian/Ubuntu: apt-get install gcc python3-dev), "
    "then reinstall kvhal"
)


class BuildOptionalExt(build_ext):
    """build_ext that says loudly which optional extension failed to build, not one line among many."""

    def run(self) -> None:
        self.failed: list[tuple[str, str]] = []
        super().run()
        if self.failed:
            rule = "=" * 78
            lines = [rule, f"kvhal: {len(self.failed)} optional C extension(s) failed to build:"]
            lines += [f"  {name}: {error}" for name, error in self.failed]
            lines += [
                "kvhal installs without them and runs slower Python paths instead",
                "(`kvhal --version` names each one missing and what it costs).",
                f"Fix: {FIX}.",
                rule,
            ]
            print("\n".join(lines), file=sys.stderr, flush=True)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # recorded, then setuptools decides (optional: a warning)
            self.failed.append((ext.name, " ".join(str(exc).split())))
            raise


setup(
    cmdclass={"build_ext": BuildOptionalExt},
    ext_modules=[
        Extension(
            "kvhal.cpu._memcpy",
            ["src/kvhal/cpu/_memcpy.c"],
            extra_compile_args=["-O3"],
            # Without a compiler kvhal still installs; the CPU plugin then copies with ctypes.
            optional=True,
        ),
        Extension(
            "kvhal._copyplan",
            ["src/kvhal/_copyplan.c"],
            extra_compile_args=["-O2"],
            # Without a compiler copies are checked and planned with numpy (slower with cold caches).
            optional=True,
        ),
        Extension(
            "kvhal.offload._keyindex",
            ["src/kvhal/offload/_keyindex.c", "src/kvhal/offload/_slots.c"],
            depends=["src/kvhal/offload/_slots.h"],
            extra_compile_args=["-O2"],
            # Without a compiler the manager indexes keys with a dict (more memory per block),
            # and its LRU order and slot states are Python loops a block.
            optional=True,
        ),
        Extension(
            "kvhal.tiers.stores._resp",
            ["src/kvhal/tiers/stores/_resp.c"],
            extra_compile_args=["-O2"],
            # Without a compiler Redis values are read through valkey-glide or redis-py.
            optional=True,
        ),
    ],
)

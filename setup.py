"""Builds kvhal's optional native parts (the CPU plugin's copy kernel, copy plans, the
manager's key index, the Redis reader that receives values into host slots); everything
else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
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
            ["src/kvhal/offload/_keyindex.c"],
            extra_compile_args=["-O2"],
            # Without a compiler the manager indexes keys with a dict (more memory per block).
            optional=True,
        ),
        Extension(
            "kvhal.tiers.stores._resp",
            ["src/kvhal/tiers/stores/_resp.c"],
            extra_compile_args=["-O2"],
            # Without a compiler Redis values are read through valkey-glide or redis-py.
            optional=True,
        ),
    ]
)

"""Builds the CPU plugin's optional native copy kernel; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvhal.cpu._memcpy",
            ["src/kvhal/cpu/_memcpy.c"],
            extra_compile_args=["-O3"],
            # Without a compiler kvhal still installs; the CPU plugin then copies with ctypes.
            optional=True,
        )
    ]
)

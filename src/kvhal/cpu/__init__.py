"""The built-in CPU device plugin."""

from kvhal.cpu.plugin import CPUPlugin

__all__ = ["CPUPlugin"]

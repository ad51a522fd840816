"""Benchmarks behind ``kvhal bench``: each prints a table and writes JSON (and a PNG)."""

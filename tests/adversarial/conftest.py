"""Fixtures of the adversarial store tests: the remote tier's tests' Redis server (one per
module) and host tier of random slots, shared."""

from tests.test_remote_tier import host, server

__all__ = ["host", "server"]

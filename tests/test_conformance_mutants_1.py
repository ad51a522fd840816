"""The conformance suite against the mutants and broken plugins of shard 1 of the mutation batch
(tests/conformance_mutation.py: how the batch is dealt, and what each test asserts)."""

from tests.conformance_mutation import shard_tests

mutation_run, pytestmark, test_suite_catches_mutant, test_suite_fails_broken_plugin = shard_tests(0)

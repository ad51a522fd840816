"""Test and benchmark harness that imports vLLM (the rest is :mod:`kvhal.testing`).

- :mod:`kvhal.vllm.testing.runner`: runs a scenario on a real vLLM engine
  (``python -m kvhal.vllm.testing.runner SPEC.json OUT.json``), started by
  :func:`kvhal.testing.scenario.run_scenario`;
- :mod:`kvhal.vllm.testing.baseline_manager`: vLLM's own CPU offloading manager,
  driven the way ``kvhal bench manager`` drives kvhal's, for comparison.
"""

"""Test and benchmark harness, kept out of kvhal's core (as pandas keeps ``_testing``).

- :mod:`kvhal.testing.models`: small Llama-architecture models built locally, for tests
  and benchmarks that run a real engine without downloading weights;
- :mod:`kvhal.testing.scenario`: a scenario (prompts, engine arguments, kvhal's
  configuration) run on a real vLLM engine in its own process, with a JSON result;
- :mod:`kvhal.testing.accel`: a CPU stand-in for a torch stream module
  (``torch.cuda``, ``torch.npu``), so an accelerator plugin's logic is tested without its device;
- :mod:`kvhal.testing.redis_servers`, :mod:`kvhal.testing.mooncake_servers`,
  :mod:`kvhal.testing.seaweedfs_servers`: real ``redis-server`` processes (standalone, TLS, a
  cluster), a real Mooncake master with a store node, and SeaweedFS's S3 gateway, on loopback
  ports, for the remote tier's tests and ``kvhal bench shared``.

The parts that import vLLM live in :mod:`kvhal.vllm.testing` (every vLLM import stays
inside :mod:`kvhal.vllm`): the engine runner a scenario starts, and vLLM's own offloading
manager driven for comparison.
"""

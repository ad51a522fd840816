"""vLLM adapter: every vLLM import in kvhal lives in this package."""

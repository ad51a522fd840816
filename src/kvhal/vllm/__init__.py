"""vLLM adapter: every vLLM import in kvhal lives in this package.

``kv_connector_module_path: "kvhal.vllm"`` with ``kv_connector: "KVHALConnector"``
loads :class:`~kvhal.vllm.connector.KVHALConnector`.
"""

from kvhal.vllm.connector import KVHALConnector

__all__ = ["KVHALConnector"]

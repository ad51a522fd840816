"""vLLM adapter: every vLLM import in kvhal lives in this package.

``kv_connector_module_path: "kvhal.vllm"`` with ``kv_connector: "KVHALConnector"``
loads :class:`~kvhal.vllm.connector.KVHALConnector`.
"""

from kvhal.layouts import answer_layouts_from
from kvhal.vllm.backends import declared_layouts
from kvhal.vllm.connector import KVHALConnector

# Device plugins ask kvhal.layouts for the engine's layouts; inside vLLM, vLLM's own classes answer.
answer_layouts_from(declared_layouts)

__all__ = ["KVHALConnector"]

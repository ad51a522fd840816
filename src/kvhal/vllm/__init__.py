"""vLLM adapter: every vLLM import in kvhal lives in this package.

``kv_connector_module_path: "kvhal.vllm"`` with ``kv_connector: "KVHALConnector"``
loads :class:`~kvhal.vllm.connector.KVHALConnector`.
"""

from typing import TYPE_CHECKING, Any

from kvhal.layouts import answer_layouts_from
from kvhal.vllm.backends import declared_layouts

if TYPE_CHECKING:
    from kvhal.vllm.connector import KVHALConnector

# Device plugins ask kvhal.layouts for the engine's layouts; inside vLLM, vLLM's own classes answer.
answer_layouts_from(declared_layouts)

__all__ = ["KVHALConnector"]


def __getattr__(name: str) -> Any:
    # The connector (and vLLM with it) is imported when vLLM asks for it: the rest of the
    # package (config names, the model identity) and the CLI work where vLLM is not installed.
    if name == "KVHALConnector":
        from kvhal.vllm.config_check import refuse_from_caller
        from kvhal.vllm.connector import KVHALConnector

        # vLLM's factory looks the class up while it builds the configuration, before any
        # engine starts: a configuration kvhal would refuse fails there, in seconds
        refuse_from_caller()

        return KVHALConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

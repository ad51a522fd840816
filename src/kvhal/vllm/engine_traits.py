"""What the worker side must know of the vLLM it serves, as one value: read from the installed
vLLM inside an engine (:mod:`kvhal.vllm.versions`), from a trace's header in ``kvhal replay``,
which runs the worker side where no vLLM is installed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineTraits:
    """:param request_level_load_failures: vLLM takes a failed asynchronous load per request
        (``failed_recving``, 0.32); else its blocks are reported as load errors.
    :param stats_need_request_outputs: vLLM drops the connector stats of a step without
        request outputs (before 0.32): a worker keeps them for a later step.
    :param vllm_version: the version these were read from (None: not read from a vLLM).
    """

    request_level_load_failures: bool = True
    stats_need_request_outputs: bool = False
    vllm_version: str | None = None

    @classmethod
    def installed(cls) -> EngineTraits:
        """The installed vLLM's (imports it)."""
        from kvhal.vllm import versions

        return cls(
            request_level_load_failures=versions.REQUEST_LEVEL_LOAD_FAILURES,
            stats_need_request_outputs=versions.STATS_NEED_REQUEST_OUTPUTS,
            vllm_version=versions.VLLM_VERSION,
        )

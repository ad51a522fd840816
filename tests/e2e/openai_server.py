"""vLLM's OpenAI-compatible server in a subprocess on loopback, for the end-to-end tests.

Started as ``python -m vllm.entrypoints.openai.api_server`` (see
:func:`kvhal.vllm.testing.runner.api_server_command`), in its own process group so that
stopping it also stops its engine-core process; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvhal.testing.ports import free_port
from kvhal.testing.scenario import BASE_ENV
from kvhal.vllm.testing.runner import api_server_command


class ServerError(RuntimeError):
    """The server did not start or answer; the message ends with its log."""


class OpenAIServer:
    """One server: :meth:`start` waits for ``/health``, :meth:`stop` always ends it."""

    def __init__(
        self,
        model: str,
        *,
        kvhal: dict[str, Any] | None,
        env: dict[str, str] | None = None,
        engine: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.command = api_server_command(model, port=self.port, kvhal=kvhal, engine=engine)
        # VLLM_SERVER_DEV_MODE=1 adds POST /reset_prefix_cache
        self.env = {**os.environ, **BASE_ENV, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        self.env.setdefault("VLLM_PORT", str(free_port()))  # see kvhal.testing.ports
        self._tmp = tempfile.TemporaryDirectory(prefix="kvhal-server-")
        self.log_path = Path(self._tmp.name) / "server.log"
        self.proc: subprocess.Popen | None = None
        self.client = httpx.Client(base_url=self.base, timeout=60)

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def start(self, timeout: float = 300) -> OpenAIServer:
        with self.log_path.open("w") as sink:  # a file, not a pipe: the server never waits on its reader
            self.proc = subprocess.Popen(
                self.command, env=self.env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()  # a server that failed to start is stopped too, engine core included
            raise
        return self

    def _wait_healthy(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.client.get("/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.5)
        raise ServerError(f"no answer on {self.base}/health within {timeout} s:\n{self.log_tail()}")

    def stop(self, grace: float = 30) -> None:
        self.client.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own group: the engine core goes too
                self.proc.wait(grace)
        if self.proc is not None:
            # the engine core may outlive a server that exited on SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._tmp.cleanup()

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests --------------------------------------------------------------

    def complete(self, prompt: list[int], max_tokens: int = 8, cache_salt: str | None = None) -> dict:
        """Greedy completion of a token-id prompt; returns the JSON response. ``cache_salt``:
        vLLM's request field that salts the prompt's block hashes (a tenant's)."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        response = self.client.post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()

    def reset_prefix_cache(self, timeout: float = 30) -> bool:
        """``POST /reset_prefix_cache`` (vLLM's own cache), retried while vLLM refuses it
        (blocks still held, e.g. by stores in flight)."""
        deadline = time.monotonic() + timeout
        while True:
            response = self.client.post("/reset_prefix_cache")
            response.raise_for_status()
            if response.json().get("success") or time.monotonic() > deadline:
                return bool(response.json().get("success"))
            time.sleep(0.1)

    def metrics(self, prefix: str = "vllm:kvhal_") -> dict[str, float]:
        """``/metrics`` samples whose name starts with ``prefix``, summed over labels."""
        found: dict[str, float] = {}
        for sample in self._samples():
            if sample.name.startswith(prefix):
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
        return found

    def metrics_by(self, label: str, prefix: str = "vllm:kvhal_") -> dict[str, dict[str, float]]:
        """``/metrics`` samples whose name starts with ``prefix`` and that carry ``label``:
        ``{name: {label's value: value summed over the other labels}}``."""
        found: dict[str, dict[str, float]] = {}
        for sample in self._samples():
            if sample.name.startswith(prefix) and label in sample.labels:
                by_value = found.setdefault(sample.name, {})
                value = sample.labels[label]
                by_value[value] = by_value.get(value, 0.0) + sample.value
        return found

    def _samples(self) -> list[Any]:
        response = self.client.get("/metrics")
        response.raise_for_status()
        return [s for family in text_string_to_metric_families(response.text) for s in family.samples]

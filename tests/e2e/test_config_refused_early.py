"""A configuration kvhal refuses fails vLLM's OpenAI server in seconds, before the engine
starts or the model loads: vLLM looks the connector class up while it builds its
configuration (kvhal.vllm.__getattr__ -> kvhal.vllm.config_check.refuse_from_caller)."""

from __future__ import annotations

import json
import os
import subprocess
import time

from kvhal.testing.ports import free_port
from kvhal.testing.scenario import BASE_ENV
from kvhal.vllm.testing.runner import api_server_command

#: what the engine would log once it started or loaded the model
LATER = ("Starting to load model", "Loading weights", "EngineCore", "Model loading took")


def test_a_refused_configuration_fails_the_server_before_the_model_loads(model, tmp_path):
    change, key = {"kv_load_failure_policy": "fail"}, "kv_load_failure_policy"  # vLLM takes "fail"
    command = api_server_command(model, port=free_port(), kvhal={"cpu_bytes_to_use": 64 << 20})
    at = command.index("--kv-transfer-config") + 1
    command[at] = json.dumps({**json.loads(command[at]), **change})
    log = tmp_path / "server.log"
    start = time.monotonic()
    with log.open("w") as sink:
        done = subprocess.run(
            command,
            env={**os.environ, **BASE_ENV},
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=120,
        )
    took = time.monotonic() - start
    text = log.read_text(errors="replace")
    assert done.returncode != 0, text[-3000:]
    assert f"{key}: " in text, text[-3000:]
    assert not [line for line in LATER if line in text], text[-3000:]
    # no engine process started: the time is the server's imports (10-20 s here, 76 s once on
    # two cores shared with a pip install), not an engine's start, which is not bounded here
    print(f"refused in {took:.1f} s: {text.splitlines()[-1]}")

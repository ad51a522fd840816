"""Helpers for the end-to-end tests (prompts, the fault plugin's environment)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from kvhal.testing.scenario import ServedEngine


def hybrid_models_offloaded() -> bool:
    """Whether kvhal offloads hybrid models on the installed vLLM (kvhal.vllm.versions: it
    needs request-level load failures, which vLLM 0.27.1 lacks)."""
    from kvhal.vllm.versions import REQUEST_LEVEL_LOAD_FAILURES  # imports vLLM

    return REQUEST_LEVEL_LOAD_FAILURES


FAULT_PLUGIN = Path(__file__).parent / "fault_plugin"
#: Where the e2e tests' models are built once (each is rebuilt only when its recipe changes).
MODEL_CACHE = Path(os.environ.get("KVHAL_TEST_MODELS", Path.home() / ".cache" / "kvhal-test-models"))


def prompts(count: int, length: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    """Random token-id prompts of ``length`` (vocabulary 1..1023), optionally sharing ``prefix``."""
    rng = random.Random(seed)
    head = list(prefix or [])
    return [head + [rng.randrange(1, 1024) for _ in range(length - len(head))] for _ in range(count)]


def fault_env(modes: str, ranks: list[int] | None = None, modes_file: Path | None = None) -> dict[str, str]:
    """Environment that installs the fault-injection plugin and turns on ``modes``
    (on the ``torch.distributed`` ``ranks`` only, when given). With ``modes_file``, the
    modes are that file's, written here first: a ``write_file`` step switches them."""
    path = os.pathsep.join(filter(None, [str(FAULT_PLUGIN), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "KVHAL_TEST_FAULTS": modes}
    if modes_file is not None:
        modes_file.write_text(modes)
        env["KVHAL_TEST_FAULTS_FILE"] = str(modes_file)
    if ranks is not None:
        env["KVHAL_TEST_FAULT_RANKS"] = ",".join(str(r) for r in ranks)
    return env


#: Engines without kvhal kept running for the whole session, by (model, engine arguments):
#: every test's baseline comes from one of them (closed by tests/e2e/conftest.py).
BASELINE_ENGINES: dict[tuple[str, str], ServedEngine] = {}


def baseline_tokens(model: str, batch: list[list[int]], engine: dict | None = None) -> list[list[int]]:
    """Greedy tokens of ``batch`` on an engine without kvhal, its prefix cache reset first: what
    a fresh engine computes (a shared engine saves an engine start per baseline)."""
    key = (model, json.dumps(engine or {}, sort_keys=True))
    if key not in BASELINE_ENGINES:
        BASELINE_ENGINES[key] = ServedEngine({"model": model, "kvhal": None, "engine": engine or {}})
    _, generated = BASELINE_ENGINES[key].submit([{"op": "reset"}, {"op": "generate", "prompts": batch}])
    return [o["tokens"] for o in generated["outputs"]]

"""Worker traces kept with the suite: vLLM engines' connector calls, recorded with
``KVHAL_TRACE_DIR`` (docs/replay.md) and replayed on a device by ``kvhal replay`` and the
suite's worker-path contract. :data:`KEPT` lists them, by name."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
#: every kept trace, by name (the file's stem without ``.json``)
KEPT: dict[str, Path] = {p.name.removesuffix(".json.gz"): p for p in sorted(HERE.glob("*.json.gz"))}

"""What every benchmark writes next to its table."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console

#: Bytes of the keys the benches index: a vLLM 0.32 OffloadKey (32-byte hash + 4-byte group).
KEY_BYTES = 36


def parse_size(text: str) -> int:
    """``"64K"``, ``"4M"``, ``"1G"`` (binary units) or plain bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def size_name(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0 else f"{nbytes >> 10} KiB"


def machine_info() -> dict:
    """Enough about the machine to tell two runs apart."""
    info = {
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    with contextlib.suppress(OSError):
        info["git"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        ).stdout.strip()
    with contextlib.suppress(OSError):
        info["load_avg"] = os.getloadavg()
    return info


#: CPU flags (``/proc/cpuinfo``) under which torch computes bf16 natively on the CPU.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags, from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def native_dtype(flags: set[str] | None = None) -> str:
    """The dtype a CPU engine computes fastest: bf16 where the CPU has bf16 instructions
    (AVX512-BF16, AMX), else float32 (bf16 emulated runs about 30x slower, and compute
    would drown every difference a benchmark exists to show)."""
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if any(flag in flags for flag in NATIVE_BF16_FLAGS) else "float32"


def write_outputs(folder: Path, name: str, result: dict) -> tuple[Path, Path]:
    """Write ``result`` as ``folder/name.json``; return it and the PNG path beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=2, default=str))
    return json_path, folder / f"{name}.png"


def console() -> Console:
    """A console wide enough for benchmark tables when output is not a terminal (CI logs, files)."""
    width = None if sys.stdout.isatty() else 160
    return Console(width=width)


def result_header(benchmark: str) -> dict:
    """What every benchmark's JSON starts with: its name, the command, the machine."""
    invoked = sys.argv and "kvhal" in os.path.basename(sys.argv[0])
    return {
        "benchmark": benchmark,
        "command": "kvhal " + " ".join(sys.argv[1:]) if invoked else f"kvhal bench {benchmark}",
        "machine": machine_info(),
        "python": platform.python_version(),
    }

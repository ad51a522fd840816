"""Small helpers shared by the tests (no fixtures: those live in conftest.py)."""

from __future__ import annotations

import torch
from hypothesis import settings

from kvhal.cache import KVCache

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def examples(full: int) -> int:
    """``full`` hypothesis examples under the ``full`` profile, proportionally fewer under
    ``quick`` (tests/conftest.py): a property keeps its strategy, only its sample shrinks."""
    return max(2, round(full * settings().max_examples / 100))


def fill_random_bytes(cache: KVCache, seed: int) -> None:
    """Fill every byte of ``cache``'s buffers with seeded noise (any dtype, any layout)."""
    generator = torch.Generator().manual_seed(seed)
    for buffer in cache.storage:
        raw = buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def block_bytes(kv: torch.Tensor | tuple[torch.Tensor, ...]) -> bytes:
    """A block's KV as raw bytes, so that NaN patterns of fp8/bf16 compare exactly."""
    parts = kv if isinstance(kv, tuple) else (kv,)
    return b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)


def snapshot(cache: KVCache) -> list[bytes]:
    """Every buffer of ``cache`` as bytes."""
    return [b.view(torch.uint8).numpy().tobytes() for b in cache.storage]


def drain(device, *streams) -> None:
    """Wait for everything queued on ``streams`` (default: the device's default stream), so a
    "nothing moved" check also sees a copy that was queued before an error was raised."""
    for stream in streams or (device.default_stream,):
        event = device.create_event()
        device.record_event(event, stream)
        device.synchronize_event(event)

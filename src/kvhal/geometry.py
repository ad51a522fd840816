"""The shape of a KV cache: what a device plugin allocates and the core copies."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch

from kvhal.errors import ValidationError, check_int


class KVFormat(str, enum.Enum):
    """How K and V are kept per layer."""

    #: K and V packed in the content dimension of one tensor (vLLM 0.32).
    STACKED = "stacked"
    #: A separate (K, V) pair of tensors per layer (vllm-ascend).
    SPLIT = "split"


@dataclass(frozen=True)
class KVGeometry:
    """Sizes of a KV cache.

    :param num_layers: attention layers sharing one block table (``L``).
    :param num_blocks: blocks per layer (``B``).
    :param block_size: tokens per block (``N``).
    :param num_kv_heads: KV heads (``H``).
    :param head_size: K head size in elements.
    :param dtype: element type.
    :param kv_format: :class:`KVFormat`; STACKED packs K and V in one content dim.
    :param head_size_v: V head size; defaults to ``head_size``. ``0`` with
        STACKED describes an MLA latent cache (one latent, no separate V).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kv_format: KVFormat = KVFormat.STACKED
    head_size_v: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            check_int(name, value)
        if not isinstance(self.dtype, torch.dtype):
            raise ValidationError("dtype", f"must be a torch.dtype, got {self.dtype!r}")
        try:
            object.__setattr__(self, "kv_format", KVFormat(self.kv_format))
        except ValueError:
            raise ValidationError(
                "kv_format", f"must be one of {[f.value for f in KVFormat]}, got {self.kv_format!r}"
            ) from None
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        v = self.head_size_v
        check_int("head_size_v", v, minimum=0)
        if v == 0 and self.kv_format is KVFormat.SPLIT:
            raise ValidationError("head_size_v", "a SPLIT cache needs a V head size > 0")

    @property
    def num_parts(self) -> int:
        """Tensors per layer: 1 (stacked) or 2 (a (K, V) pair)."""
        return 1 if self.kv_format is KVFormat.STACKED else 2

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def content_size(self, part: int = 0) -> int:
        """Elements in the content dimension ``C`` of ``part``."""
        if self.kv_format is KVFormat.STACKED:
            return self.head_size + self.head_size_v  # type: ignore[operator]
        return (self.head_size, self.head_size_v)[part]  # type: ignore[return-value]

    def layer_shape(self, part: int = 0) -> tuple[int, int, int, int]:
        """Logical per-layer shape ``[B, H, N, C]`` of ``part``."""
        return (self.num_blocks, self.num_kv_heads, self.block_size, self.content_size(part))

    def page_bytes(self, part: int = 0) -> int:
        """Bytes of one block of one layer of ``part``."""
        return self.num_kv_heads * self.block_size * self.content_size(part) * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every layer and part: what offloading moves."""
        return self.num_layers * sum(self.page_bytes(p) for p in range(self.num_parts))

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def with_num_blocks(self, num_blocks: int) -> KVGeometry:
        """The same geometry with another block count (a host tier's, say)."""
        return dataclasses.replace(self, num_blocks=num_blocks)

    def mismatch(self, other: KVGeometry) -> str | None:
        """Why blocks of ``self`` and ``other`` cannot be copied into each other, or None."""
        for field in dataclasses.fields(self):
            if field.name == "num_blocks":
                continue
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                return f"{field.name}: {mine} vs {theirs}"
        return None

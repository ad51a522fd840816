"""KV cache layouts, in vLLM 0.32's vocabulary (without importing vLLM).

A KV cache has five logical dimensions ``[L, B, H, N, C]``: layers, blocks,
heads, tokens per block, content (K and V packed: ``head_size + head_size_v``
elements, or one of K / V for caches kept as a separate (K, V) pair). A layout
is the physical order of those dimensions, outermost first, written as a
permutation of ``(0, 1, 2, 3, 4)`` (``LBHNC`` is ``(0, 1, 2, 3, 4)``,
``BLHNC`` is ``(1, 0, 2, 3, 4)``). Layouts that put ``B`` outermost keep one
block of every layer in one contiguous region ("cross-layer blocks").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvhal.errors import LayoutError

log = logging.getLogger(__name__)

LOGICAL_DIMS = "LBHNC"
LAYER_DIM, BLOCK_DIM = 0, 1


@dataclass(frozen=True)
class KVLayout:
    """A physical order of the logical KV dimensions ``[L, B, H, N, C]``.

    :param name: a label; when it is a permutation of the letters ``LBHNC`` it
        must spell the stride order.
    :param stride_order: the logical dimension at each physical position,
        outermost first; a permutation of ``range(5)``.
    """

    name: str
    stride_order: tuple[int, ...]

    def __post_init__(self) -> None:
        order = tuple(self.stride_order)
        object.__setattr__(self, "stride_order", order)
        if sorted(order) != list(range(len(LOGICAL_DIMS))) or not all(isinstance(d, int) for d in order):
            raise LayoutError(
                "stride_order",
                f"layout {self.name!r}: {order!r} is not a permutation of "
                f"{tuple(range(len(LOGICAL_DIMS)))} (logical dims {LOGICAL_DIMS})",
            )
        if sorted(self.name) == sorted(LOGICAL_DIMS) and self.name != self.letters:
            raise LayoutError(
                "name",
                f"layout name {self.name!r} spells a different order than its "
                f"stride_order {order!r} ({self.letters})",
            )

    @classmethod
    def from_name(cls, name: str) -> KVLayout:
        """Parse a name such as ``"BLHNC"`` (case-insensitive)."""
        letters = name.upper()
        if sorted(letters) != sorted(LOGICAL_DIMS):
            raise LayoutError("name", f"{name!r} is not a permutation of the letters {LOGICAL_DIMS}")
        return cls(letters, tuple(LOGICAL_DIMS.index(c) for c in letters))

    @property
    def letters(self) -> str:
        """The stride order spelled with the letters ``LBHNC``."""
        return "".join(LOGICAL_DIMS[d] for d in self.stride_order)

    @property
    def is_cross_layer(self) -> bool:
        """``B`` is outermost: each block of all layers is one contiguous region."""
        return self.stride_order[0] == BLOCK_DIM

    @property
    def is_layer_compact(self) -> bool:
        """``L`` is outermost: each layer is one contiguous region."""
        return self.stride_order[0] == LAYER_DIM

    @property
    def layer_view_order(self) -> tuple[int, ...]:
        """The stride order without the layers dimension, over ``[B, H, N, C]``."""
        return tuple(d - 1 for d in self.stride_order if d != LAYER_DIM)

    def __str__(self) -> str:
        return self.name


LBHNC = KVLayout.from_name("LBHNC")
LBNHC = KVLayout.from_name("LBNHC")
LHBNC = KVLayout.from_name("LHBNC")
BLHNC = KVLayout.from_name("BLHNC")
BLNHC = KVLayout.from_name("BLNHC")
BHLNC = KVLayout.from_name("BHLNC")

#: vLLM 0.32's ``KVCacheLayout`` members, in its enum order.
STANDARD_LAYOUTS: tuple[KVLayout, ...] = (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC)
#: vLLM's legacy per-layer names (``VLLM_KV_CACHE_LAYOUT``) and what they mean.
LEGACY_ALIASES = {"NHD": LBNHC, "HND": LBHNC}


def layout_by_name(name: str) -> KVLayout:
    """A standard layout by its name or a legacy alias (``NHD``/``HND``)."""
    upper = name.upper()
    if upper in LEGACY_ALIASES:
        return LEGACY_ALIASES[upper]
    return KVLayout.from_name(upper)


#: ``lookup(attention_backend)``: the layouts the running engine's backend class declares
#: (``None``: any layout); raises when it has no answer.
EngineLayouts = Callable[[str], tuple[KVLayout, ...] | None]
#: Set by the adapter of the engine kvhal runs in (:mod:`kvhal.vllm` sets vLLM's), so that
#: this layer never imports an engine; ``None`` outside one.
_engine_layouts: EngineLayouts | None = None


def answer_layouts_from(lookup: EngineLayouts | None) -> None:
    """Let :func:`layouts_from_engine` ask ``lookup`` (an engine adapter calls it on import)."""
    global _engine_layouts
    _engine_layouts = lookup


def layouts_from_engine(
    attention_backend: str, any_layout: Sequence[KVLayout]
) -> tuple[KVLayout, ...] | None:
    """The layouts the running engine's own backend class declares, or ``None``.

    Inside a vLLM engine, asks vLLM's class for ``attention_backend``
    (``supported_kv_cache_layouts()``, through the lookup :mod:`kvhal.vllm.backends`
    set with :func:`answer_layouts_from`). Anywhere else it answers ``None`` at once
    rather than import vLLM (seconds, and platform detection) for what a table
    answers. Device plugins call it first and fall back to their own tables on
    ``None``.

    :param attention_backend: vLLM's backend name: an ``AttentionBackendEnum``
        name or a backend's ``get_name()``.
    :param any_layout: what "any layout" means on the caller's device, returned
        when the backend declares no restriction.
    :return: layouts, preferred first; ``None`` outside an engine, when the engine
        knows no imported backend by that name, or when its answer could not be
        read (the reason is logged at debug level).
    """
    lookup = _engine_layouts
    if lookup is None:
        return None
    try:
        declared = lookup(attention_backend)
    except Exception as exc:  # an engine lookup never breaks the hook: the caller's table answers
        log.debug("no KV layouts from the engine for %r: %s: %s", attention_backend, type(exc).__name__, exc)
        return None
    return tuple(any_layout) if declared is None else declared

"""The shapes vLLM and vllm-ascend hand ``register_kv_caches``, made into what
:meth:`kvhal.cache.KVCache.wrap` takes: per layer of an offloaded KV cache group, one
``[B, H, N, C]`` view or a (K, V) pair of them, every layer of the group alike.

Taken (docs/vllm-integration.md, "Cache shapes"):

- a tensor (vLLM): as it is;
- a ``(k_cache, v_cache)`` pair of one dtype whose ``B, H, N`` agree: as it is, ``C`` may
  differ (MLA's nope/rope split, models with ``head_size_v``);
- a pair of different dtypes or shapes (quantized K and V, an indexer's ``(k, scale)``):
  each part as bytes, one run per block (``[B, 1, 1, bytes]`` ``uint8`` over the same
  memory). Copies move bytes, so a dtype changes nothing but the view, and the host tier
  keeps each part's bytes apart, as for any split cache;
- a 1-tuple ``(k_cache,)`` (sparse MLA with C8 quantization, an indexer's ``(k,)``): its
  tensor, all of ``C`` taken as K.

Refused before any byte moves, naming the layer, its shape and what kvhal takes: lists
(vLLM's and vllm-ascend's Mamba state, DeepSeek V4's paged views: state whose blocks kvhal's
scheduler side does not address), tuples of other lengths, tensors not 4-D, a pair of
different dtypes or shapes whose blocks are not one run of memory, layers of one group
unlike each other, and two layers of one group over the same memory.

Only the layers of the groups kvhal offloads are read. A layer sharing another's cache
(vllm-ascend's and vLLM's ``kv_caches[layer] = kv_caches[target]``) has no KV cache spec, so
no group: its bytes are the target's, offloaded once under the target's name. One tensor
under layers of *different* groups is vLLM's hybrid allocator (a group's blocks are never
another's at the same time), so it is not an alias.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvhal.errors import ValidationError
from kvhal.vllm.config import GroupInfo

#: What a refusal says kvhal takes.
ACCEPTED = (
    "kvhal takes per layer a [B, H, N, C] tensor, a (k_cache, v_cache) pair of them, or a 1-tuple (k_cache,)"
)
PART_NAMES = ("k_cache", "v_cache")


@dataclass(frozen=True)
class GroupViews:
    """One KV cache group's tensors as :meth:`KVCache.wrap` takes them.

    :param layers: per layer of the group, in its order, one ``[B, H, N, C]`` view or a (K, V) pair.
    :param head_size: K's share of ``C`` where a layer is one tensor; ``None`` for pairs.
    """

    layers: tuple[tuple[torch.Tensor, ...], ...]
    head_size: int | None


def describe(value: Any) -> str:
    """A layer's value in a refusal: its type, and each tensor's shape and dtype."""
    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)} {value.dtype}"
    if isinstance(value, (tuple, list)):
        items = ", ".join(describe(item) for item in value)
        return f"{type(value).__name__} of {len(value)}: ({items})"
    return type(value).__name__


def _refuse(name: str, value: Any, problem: str) -> ValidationError:
    return ValidationError("kv_caches", f"layer {name!r}: {problem}, got {describe(value)}; {ACCEPTED}")


def _as_block_bytes(name: str, value: Any, part: int, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``[B, 1, 1, bytes]`` ``uint8`` over its own memory, one run per block."""
    if not tensor[0].is_contiguous():  # a block's bytes must be one run to be one byte row
        raise _refuse(
            name,
            value,
            f"the blocks of its {PART_NAMES[part]} (strides {tensor.stride()}) are not one run of memory, "
            "which kvhal needs to move K and V of different dtypes or shapes as bytes",
        )
    blocks, elements = tensor.shape[0], tensor[0].numel()
    rows = tensor.as_strided((blocks, elements), (tensor.stride(0), 1))  # the same memory
    return rows.view(torch.uint8)[:, None, None, :]


def layer_views(name: str, value: Any) -> tuple[tuple[torch.Tensor, ...], str]:
    """One layer's value as 1 or 2 ``[B, H, N, C]`` views, and its form (``"tensor"``,
    ``"one"``, ``"pair"`` or ``"bytes"``); a :class:`ValidationError` naming it otherwise."""
    if isinstance(value, torch.Tensor):
        parts, form = (value,), "tensor"
    elif isinstance(value, list):  # what vLLM and vllm-ascend give Mamba state as
        raise _refuse(
            name, value, "a list (vLLM and vllm-ascend pass Mamba state as one) is not KV that kvhal offloads"
        )
    elif (
        isinstance(value, tuple) and len(value) in (1, 2) and all(isinstance(t, torch.Tensor) for t in value)
    ):
        parts, form = value, ("one" if len(value) == 1 else "pair")
    else:
        raise _refuse(name, value, "not a tensor, a pair of tensors or a 1-tuple")
    for part, tensor in enumerate(parts):
        if tensor.dim() != 4:
            raise _refuse(name, value, f"its {PART_NAMES[part]} has {tensor.dim()} dimensions, not 4")
    if form != "pair":
        return tuple(parts), form
    k, v = parts
    if k.device != v.device:
        raise _refuse(name, value, f"K is on {k.device}, V on {v.device}")
    if k.shape[0] != v.shape[0]:
        raise _refuse(name, value, f"K has {k.shape[0]} blocks, V {v.shape[0]}")
    if k.data_ptr() == v.data_ptr():
        raise _refuse(name, value, "K and V are the same memory")
    if k.dtype == v.dtype and k.shape[1:3] == v.shape[1:3]:
        return (k, v), "pair"  # a split geometry's head_size_v covers a V of other size
    return tuple(_as_block_bytes(name, value, i, t) for i, t in enumerate(parts)), "bytes"


def _signature(parts: tuple[torch.Tensor, ...], form: str) -> tuple[Any, ...]:
    return (form, *((tuple(t.shape), t.dtype, t.device) for t in parts))


def group_views(kv_caches: Mapping[str, Any], groups: Sequence[GroupInfo]) -> dict[int, GroupViews]:
    """Every offloaded group's tensors from what vLLM registered, checked (module docstring).

    :raises ValidationError: naming the layer, its shape and what kvhal takes.
    """
    if not kv_caches:
        raise ValidationError("kv_caches", "vLLM registered no KV cache layer")
    views: dict[int, GroupViews] = {}
    for group in groups:
        missing = [name for name in group.layer_names if name not in kv_caches]
        if missing:
            raise ValidationError(
                "kv_caches", f"KV cache group {group.group_id} has no tensor for layers {missing}"
            )
        layers: list[tuple[torch.Tensor, ...]] = []
        first: tuple[str, tuple[Any, ...]] | None = None
        owner: dict[tuple[torch.device, int], str] = {}  # memory -> the layer of this group on it
        for name in group.layer_names:
            parts, form = layer_views(name, kv_caches[name])
            signature = _signature(parts, form)
            if first is None:
                first = (name, signature)
            elif signature != first[1]:  # KVCache.wrap takes one geometry for the group
                raise _refuse(
                    name,
                    kv_caches[name],
                    f"unlike layer {first[0]!r} ({describe(kv_caches[first[0]])}) of the same KV cache "
                    f"group {group.group_id}, whose layers kvhal offloads alike",
                )
            for tensor in parts:
                other = owner.setdefault((tensor.device, tensor.data_ptr()), name)
                if other != name:  # its blocks would be stored twice and loaded twice
                    raise _refuse(
                        name,
                        kv_caches[name],
                        f"its KV cache is layer {other!r}'s, in the same KV cache group {group.group_id}; "
                        "kvhal offloads a shared cache once, under the layer it belongs to, when the "
                        "sharing layer is in no group (as vLLM and vllm-ascend register it)",
                    )
            layers.append(parts)
        assert first is not None  # vLLM's groups are never empty
        form, (shape, _, _) = first[1][0], first[1][1]
        head_size = {"tensor": group.head_size, "one": shape[3]}.get(form)
        views[group.group_id] = GroupViews(tuple(layers), head_size)
    return views

"""The shapes vllm-ascend hands ``register_kv_caches`` (kvhal.vllm.cache_shapes), on CPU tensors.

Each shape is built as vllm-ascend's model runners build it (``vllm_ascend/worker/
model_runner_v1.py``, ``worker/v2/attn_utils.py``): ``[num_blocks, block_size, heads, dim]``
views, float32 where the dtype is not the point. Those kvhal takes are stored and loaded through
the real worker side and the CPU plugin, then compared byte for byte; those it refuses are
refused at ``register`` with the exact text, before a host tier exists. Not run on an NPU.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from kvhal.errors import ValidationError
from kvhal.tiers.backend import OK, TierSpec
from kvhal.tiers.disk import DiskTier
from kvhal.vllm.cache_shapes import ACCEPTED
from kvhal.vllm.config import ConnectorConfig, GroupInfo
from kvhal.vllm.metadata import LoadJob, StoreJob
from kvhal.vllm.worker_side import WorkerSide
from tests.test_worker_side import settle, step

BLOCKS, TOKENS, HEADS = 12, 4, 2
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
GENERATOR = torch.Generator().manual_seed(0)


def noise(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random contents of ``dtype`` (every byte pattern an int8 can hold, for int8)."""
    if dtype in (torch.int8, torch.uint8):
        return torch.randint(-128 if dtype == torch.int8 else 0, 128, shape, generator=GENERATOR, dtype=dtype)
    return torch.randn(*shape, generator=GENERATOR).to(dtype)


def block_bytes(tensor: torch.Tensor) -> int:
    return tensor[0].numel() * tensor.element_size()


def parts(value: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def config(caches: dict, groups: tuple[tuple[str, ...], ...] = (LAYERS,), slots: int = 4) -> ConnectorConfig:
    """A worker config whose pages are what the first layer's tensors hold (as vLLM's spec says)."""
    page = sum(block_bytes(t) for t in parts(caches[groups[0][0]]))
    infos = tuple(GroupInfo(i, names, page, 8) for i, names in enumerate(groups))
    return ConnectorConfig(
        cpu_bytes_to_use=slots * page * len(groups[0]),
        device=None,
        eviction_policy="lru",
        offload_prompt_only=True,
        block_size=TOKENS,
        groups=infos,
        world_size=1,
        layout="LBHNC",
    )


def snapshot(caches: dict, block: int) -> list[bytes]:
    """Every KV tensor's bytes of one device block, layer by layer and part by part (not a
    Mamba layer's state: kvhal leaves it alone)."""
    kv = [v for v in caches.values() if not isinstance(v, list)]
    return [t[block].contiguous().view(torch.uint8).numpy().tobytes() for v in kv for t in parts(v)]


def store(job_id: int, block_ids: list[int], slots: list[int], group: int = 0) -> StoreJob:
    return StoreJob(job_id, "a", {group: (block_ids, slots)})


def load(job_id: int, block_ids: list[int], slots: list[int], group: int = 0) -> LoadJob:
    return LoadJob(job_id, "b", {group: (block_ids, slots)})


# -- offloaded ----------------------------------------------------------------------

SHAPES: dict[str, Callable[[], tuple[torch.Tensor, ...]]] = {
    # MLA: k_cache holds the nope part (kv_lora_rank), v_cache the rope part
    "mla-nope-rope": lambda: (noise(BLOCKS, TOKENS, 1, 16), noise(BLOCKS, TOKENS, 1, 4)),
    # a model whose V heads are smaller than its K heads (kv_cache_spec.head_size_v)
    "head-size-v": lambda: (noise(BLOCKS, TOKENS, HEADS, 8), noise(BLOCKS, TOKENS, HEADS, 6)),
    # quantized attention: get_kv_quant_dtype gives K and V dtypes of their own
    "k-int8-v-bf16": lambda: (
        noise(BLOCKS, TOKENS, HEADS, 8, dtype=torch.int8),
        noise(BLOCKS, TOKENS, HEADS, 8, dtype=torch.bfloat16),
    ),
    # sparse MLA with C8: (k_cache,) only (float32 here: the dtype is not the point)
    "sparse-c8-one-tuple": lambda: (noise(BLOCKS, TOKENS, 1, 20),),
    # the SFA indexer without a scale: (indexer_k,)
    "indexer-k": lambda: (noise(BLOCKS, TOKENS, 1, 16),),
    # the SFA indexer with C8: (indexer_k int8, indexer_scale float16 [.., 1])
    "indexer-k-scale": lambda: (
        noise(BLOCKS, TOKENS, 1, 16, dtype=torch.int8),
        noise(BLOCKS, TOKENS, 1, 1, dtype=torch.float16),
    ),
}


def caches_of(shape: str) -> dict:
    return {name: SHAPES[shape]() for name in LAYERS}


def round_trip(
    worker: WorkerSide, caches: dict, corrupt: Callable[[WorkerSide], None] | None = None
) -> tuple:
    """Store blocks 3 and 5, load them back into 7 and 9 (crossed), optionally corrupting
    the host tier in between; the blocks' bytes before, and 7's and 9's after."""
    before = {b: snapshot(caches, b) for b in (3, 5, 7, 9)}
    step(worker, stores=[store(0, [3, 5], [0, 1])])
    settle(worker)
    if corrupt is not None:
        corrupt(worker)
    step(worker, loads=[load(1, [7, 9], [1, 0])])
    finished, failed, _ = settle(worker)
    assert finished == {"b"} and not failed
    return before, snapshot(caches, 7), snapshot(caches, 9)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_shape_is_offloaded_and_restored_byte_for_byte(shape):
    caches = caches_of(shape)
    worker = WorkerSide(config(caches))
    worker.register(caches)
    assert worker.device.name == "cpu"
    before, seven, nine = round_trip(worker, caches)
    assert seven == before[5] and nine == before[3]
    assert seven != before[7] and nine != before[9]  # they held other bytes before the load
    worker.shutdown()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_shape_round_trips_through_the_disk_tier_byte_for_byte(shape, tmp_path):
    """Host slots 0 and 1 (blocks 3 and 5) written to a real disk tier, read back into slots 2
    and 3, then loaded into blocks 7 and 9: the lower tier keeps every shape's bytes."""
    caches = caches_of(shape)
    worker = WorkerSide(config(caches))
    worker.register(caches)
    before = {b: snapshot(caches, b) for b in (3, 5, 7, 9)}
    step(worker, stores=[store(0, [3, 5], [0, 1])])
    settle(worker)
    host = worker.host_tier  # a layer-major host tier: a slot's bytes are gathered, as TierIO does
    rows, back = (np.zeros((2, host.slot_bytes), np.uint8) for _ in range(2))
    host.gather_slots([0, 1], rows)
    spec = TierSpec({"path": str(tmp_path), "bytes_to_use": 1 << 20}, host.slot_bytes, {"shape": shape})
    disk, keys = DiskTier(spec), [b"block-3", b"block-5"]
    assert disk.write([0, 1], keys, [memoryview(r) for r in rows]).result(timeout=30) == [True] * 2
    assert disk.read([0, 1], keys, [memoryview(r) for r in back]).result(timeout=30) == [OK] * 2
    disk.close()
    host.scatter_slots([3, 2], back)
    step(worker, loads=[load(1, [7, 9], [2, 3])])
    finished, failed, _ = settle(worker)
    assert finished == {"b"} and not failed
    assert snapshot(caches, 7) == before[5] and snapshot(caches, 9) == before[3]
    assert snapshot(caches, 7) != before[7]  # the control: block 7 held other bytes
    worker.shutdown()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_corrupted_host_bytes_make_the_comparison_fail(shape):
    """The negative control: one byte flipped in slot 0 (block 3's copy), last layer, last
    part, reaches block 9 and nothing else, so the comparisons above see the loaded bytes."""
    caches = caches_of(shape)
    worker = WorkerSide(config(caches))
    worker.register(caches)

    def flip(worker: WorkerSide) -> None:
        host = worker.host_views[0].layers[-1][-1][0]  # [H, N, C] of slot 0, dense
        host.view(torch.uint8).view(-1)[0] ^= 0xFF

    before, seven, nine = round_trip(worker, caches, corrupt=flip)
    assert seven == before[5]
    assert nine[:-1] == before[3][:-1] and nine[-1] != before[3][-1]
    worker.shutdown()


def test_mixed_dtypes_are_moved_as_bytes_each_part_apart():
    """K and V of different dtypes become one uint8 row per block each: a host slot holds
    every layer's K bytes and V bytes, nothing else."""
    caches = caches_of("k-int8-v-bf16")
    worker = WorkerSide(config(caches))
    worker.register(caches)
    geometry = worker.caches[0].geometry
    k, v = caches[LAYERS[0]]
    assert geometry.dtype == torch.uint8
    assert (geometry.head_size, geometry.head_size_v) == (block_bytes(k), block_bytes(v))
    assert worker.host_tier.slot_bytes == len(LAYERS) * (block_bytes(k) + block_bytes(v))
    worker.shutdown()


def test_a_shared_layer_is_offloaded_once_under_its_target():
    """vllm-ascend's ``kv_caches[layer] = kv_caches[target]``: the sharing layer has no KV cache
    spec, so no group; its blocks are stored once (the slots hold the group's layers only) and
    a load restores them for both names at once."""
    caches = caches_of("head-size-v")
    caches["model.layers.2.self_attn.attn"] = caches[LAYERS[0]]  # shares layer 0's cache
    worker = WorkerSide(config(caches))
    worker.register(caches)
    one_layer = sum(block_bytes(t) for t in caches[LAYERS[0]])
    assert worker.host_tier.slot_bytes == len(LAYERS) * one_layer  # not 3 layers
    assert worker.caches[0].geometry.num_layers == len(LAYERS)
    before, seven, nine = round_trip(worker, caches)
    # snapshot() lists the shared layer too: restored with layer 0, the same memory
    assert seven == before[5] and nine == before[3] and seven[-2:] == seven[:2]
    worker.shutdown()


def test_groups_sharing_tensors_are_vllms_hybrid_pool_not_an_alias():
    """vLLM's hybrid allocator gives one layer of each group the same tensor (a block belongs to
    one group at a time): both groups are offloaded, each its own blocks."""
    caches = caches_of("mla-nope-rope")
    sliding = ("model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn")
    for full, window in zip(LAYERS, sliding, strict=True):
        caches[window] = caches[full]
    worker = WorkerSide(config(caches, groups=(LAYERS, sliding)))
    worker.register(caches)
    assert set(worker.caches) == {0, 1}
    before = snapshot(caches, 2)
    step(worker, stores=[store(0, [2], [2], group=1)])
    settle(worker)
    step(worker, loads=[load(1, [10], [2], group=1)])
    settle(worker)
    assert snapshot(caches, 10) == before
    worker.shutdown()


def test_mamba_state_outside_the_offloaded_groups_is_not_read():
    """A hybrid model's Mamba layers (lists of state tensors) in a group kvhal does not store
    (vLLM 0.27.1 leaves Mamba groups out) do not stop the attention layers' offloading."""
    caches = caches_of("head-size-v")
    caches["model.layers.2.mixer"] = [noise(BLOCKS, 6, 3), noise(BLOCKS, 2, 4, 5, dtype=torch.bfloat16)]
    caches["model.layers.3.mixer"] = [noise(BLOCKS, 6, 3)]
    worker = WorkerSide(config(caches))
    worker.register(caches)
    before, seven, nine = round_trip(worker, caches)
    assert seven == before[5] and nine == before[3]
    worker.shutdown()


# -- refused --------------------------------------------------------------------------

NAME = LAYERS[1]


def refusal(caches: dict, groups: tuple[tuple[str, ...], ...] = (LAYERS,)) -> str:
    """The text register refuses ``caches`` with; asserts nothing was set up (no byte moved)."""
    worker = WorkerSide(config(caches, groups))
    with pytest.raises(ValidationError) as raised:
        worker.register(caches)
    assert raised.value.argument == "kv_caches"
    assert worker.host_tier is None and worker.engine is None and not worker.caches
    return str(raised.value)


def with_layer(value: object, base: str = "head-size-v") -> dict:
    caches = caches_of(base)
    caches[NAME] = value
    return caches


def test_mamba_state_in_an_offloaded_group_is_refused():
    state = [noise(BLOCKS, 6, 3), noise(BLOCKS, 2, 4, 5, dtype=torch.bfloat16)]
    assert refusal(with_layer(state)) == (
        f"kv_caches: layer {NAME!r}: a list (vLLM and vllm-ascend pass Mamba state as one) is not KV "
        f"that kvhal offloads, got list of 2: (tensor [{BLOCKS}, 6, 3] torch.float32, tensor "
        f"[{BLOCKS}, 2, 4, 5] torch.bfloat16); {ACCEPTED}"
    )


def test_a_layer_sharing_a_cache_inside_one_group_is_refused():
    """Named in the group it would be stored twice (and vLLM would have counted its page)."""
    caches = caches_of("head-size-v")
    caches[NAME] = caches[LAYERS[0]]
    assert refusal(caches) == (
        f"kv_caches: layer {NAME!r}: its KV cache is layer {LAYERS[0]!r}'s, in the same KV cache group 0; "
        "kvhal offloads a shared cache once, under the layer it belongs to, when the sharing layer "
        "is in no group (as vLLM and vllm-ascend register it), got tuple of 2: "
        f"(tensor [{BLOCKS}, {TOKENS}, {HEADS}, 8] torch.float32, tensor [{BLOCKS}, {TOKENS}, {HEADS}, 6] "
        f"torch.float32); {ACCEPTED}"
    )


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        pytest.param(
            (noise(BLOCKS, 4), noise(BLOCKS, 4), noise(BLOCKS, 4)),
            f"not a tensor, a pair of tensors or a 1-tuple, got tuple of 3: (tensor [{BLOCKS}, 4] "
            f"torch.float32, tensor [{BLOCKS}, 4] torch.float32, tensor [{BLOCKS}, 4] torch.float32)",
            id="three-tuple",
        ),
        pytest.param(
            noise(BLOCKS, TOKENS, 8),
            f"its k_cache has 3 dimensions, not 4, got tensor [{BLOCKS}, {TOKENS}, 8] torch.float32",
            id="three-dims",
        ),
        pytest.param(
            (noise(BLOCKS, TOKENS, HEADS, 8), noise(BLOCKS + 1, TOKENS, HEADS, 6)),
            f"K has {BLOCKS} blocks, V {BLOCKS + 1}, got tuple of 2: "
            f"(tensor [{BLOCKS}, {TOKENS}, {HEADS}, 8] torch.float32, "
            f"tensor [{BLOCKS + 1}, {TOKENS}, {HEADS}, 6] torch.float32)",
            id="blocks-differ",
        ),
        pytest.param("kv", "not a tensor, a pair of tensors or a 1-tuple, got str", id="str"),
    ],
)
def test_malformed_layers_are_refused_with_what_kvhal_takes(value, problem):
    assert refusal(with_layer(value)) == f"kv_caches: layer {NAME!r}: {problem}; {ACCEPTED}"


def test_k_that_is_v_is_refused():
    k = noise(BLOCKS, TOKENS, HEADS, 8)
    assert refusal(with_layer((k, k))) == (
        f"kv_caches: layer {NAME!r}: K and V are the same memory, got tuple of 2: (tensor "
        f"[{BLOCKS}, {TOKENS}, {HEADS}, 8] torch.float32, tensor [{BLOCKS}, {TOKENS}, {HEADS}, 8] "
        f"torch.float32); {ACCEPTED}"
    )


def test_mixed_dtypes_whose_blocks_are_not_one_run_are_refused():
    """A bytes view needs each block's bytes in one run: a head-major (HND) view is not."""
    k = noise(BLOCKS, HEADS, TOKENS, 8, dtype=torch.int8).transpose(1, 2)  # [B, N, H, C], strided
    v = noise(BLOCKS, TOKENS, HEADS, 8, dtype=torch.bfloat16)
    caches = {name: (k, v) for name in LAYERS}
    assert refusal(caches) == (
        f"kv_caches: layer {LAYERS[0]!r}: the blocks of its k_cache (strides {k.stride()}) are not one run "
        "of memory, which kvhal needs to move K and V of different dtypes or shapes as bytes, got tuple "
        f"of 2: (tensor [{BLOCKS}, {TOKENS}, {HEADS}, 8] torch.int8, tensor [{BLOCKS}, {TOKENS}, {HEADS}, 8] "
        f"torch.bfloat16); {ACCEPTED}"
    )


def test_layers_of_one_group_must_be_alike():
    caches = with_layer(SHAPES["mla-nope-rope"]())
    assert refusal(caches) == (
        f"kv_caches: layer {NAME!r}: unlike layer {LAYERS[0]!r} (tuple of 2: (tensor [{BLOCKS}, {TOKENS}, "
        f"{HEADS}, 8] torch.float32, tensor [{BLOCKS}, {TOKENS}, {HEADS}, 6] torch.float32)) of the same KV "
        f"cache group 0, whose layers kvhal offloads alike, got tuple of 2: (tensor [{BLOCKS}, {TOKENS}, 1, "
        f"16] torch.float32, tensor [{BLOCKS}, {TOKENS}, 1, 4] torch.float32); {ACCEPTED}"
    )

"""Contract: copy throughput, relative to a plain torch copy of the same bytes in the same run.

The plugin's block copy (through kvhal: validation, the plugin's copy, its
event) and ``dst.copy_(src)`` between a device tensor and one of the plugin's
host buffers are timed alternately, the fastest of several each. The ratio is
reported; below the floor (``--kvhal-throughput-floor``) the contract fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvhal.descriptor import Capability
from kvhal.device import Device
from kvhal.geometry import KVGeometry
from kvhal.layouts import KVLayout
from kvhal_conformance import blockdata, guarded, timing
from kvhal_conformance.base.fixtures import ContractFixtures, final
from kvhal_conformance.clauses import covers, depends_on, expect, violated
from kvhal_conformance.settings import Sizes
from kvhal_conformance.target import Target
from kvhal_conformance.timing import TorchCopy, fastest, settle, wait, wait_pinned

GiB = 1 << 30
#: A copy is timed until its event completes: an event that completes before the bytes are
#: written times nothing (not judged when these fail).
EVENT_CLAUSES = ("copy.event", "sync.waits")
SAMPLED = 64


class ThroughputContract(ContractFixtures):
    """Contract ``throughput``: device->host and host->device block copies reach the floor
    times a plain torch copy of the same bytes measured in the same run.

    Fixtures: ``kvhal_target``, ``kvhal_device``, ``kvhal_sizes`` (``throughput_bytes``,
    ``throughput_repeats``), ``kvhal_throughput_floor``, ``kvhal_rng`` (see
    :class:`ContractFixtures`). The measurements are left in ``kvhal_target.metrics["throughput"]``.

    Hooks: :meth:`throughput_block`, :meth:`throughput_layout`.
    """

    contract_id = "throughput"

    def throughput_block(self) -> KVGeometry:
        """The shape of the blocks measured (its ``num_blocks`` is replaced: the batch is
        ``kvhal_sizes.throughput_bytes`` of them). Default: bf16, 8 layers, 16 tokens, 8 heads
        of 64 (256 KiB a block). Override it to measure your models' blocks."""
        return KVGeometry(
            num_layers=8, num_blocks=1, block_size=16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16
        )

    def throughput_layout(self, target: Target, device: Device) -> KVLayout:
        """The layout measured. Default: the first cross-layer layout ``kvhal_kv_layouts(None)``
        offers when ``layout.cross_layer`` is declared, else its first layer-separate one."""
        layouts = device.kv_layouts()
        cross = [x for x in layouts if x.is_cross_layer] if target.declares(Capability.CROSS_LAYER) else []
        return cross[0] if cross else next(x for x in layouts if not x.is_cross_layer)

    @final
    @covers("copy.throughput", "host.pinned")
    @depends_on(*EVENT_CLAUSES, judges=("copy.throughput",))
    @pytest.mark.parametrize("direction", ("d2h", "h2d"))
    def test_throughput(
        self,
        kvhal_target: Target,
        kvhal_device: Device,
        kvhal_sizes: Sizes,
        kvhal_throughput_floor: float,
        kvhal_rng: np.random.Generator,
        direction: str,
    ) -> None:
        """Copying a batch of whole blocks (256 KiB each, scattered on the device) to or from pinned
        host memory reaches the floor times a plain torch copy.

        A plugin declaring host.pinned is measured on pinned memory only: a buffer that never
        reports pinned fails, naming host.pinned (with pageable memory both copies would be slow
        alike and the ratio would hide the defect). One not declaring it is measured on its
        pageable buffers, and the report says so.
        """
        device, sizes = kvhal_device, kvhal_sizes
        pinned = kvhal_target.declares(Capability.PINNED_HOST)
        layout = self.throughput_layout(kvhal_target, device)
        g = self.throughput_block()
        g = g.with_num_blocks(max(8, sizes.throughput_bytes // g.block_bytes))
        on_device = guarded.kv_cache(device, g, layout)
        on_host = guarded.host_cache(device, g, layout, g.num_blocks)
        if pinned and not wait_pinned(device, on_host.storage[0]):
            guarded.free_cache(device, on_host)
            violated(
                "host.pinned",
                f"plugin {kvhal_target.name!r} declares {Capability.PINNED_HOST.value}, but the "
                f"{on_host.storage[0].numel() >> 20} MiB host buffer of the throughput check never reported "
                f"pinned ({timing.pin_wait_note(device)}): copies to pageable memory are not measured",
            )
        scattered, packed = kvhal_rng.permutation(g.num_blocks), np.arange(g.num_blocks)
        if direction == "d2h":
            src, dst, mapping = on_device, on_host, np.stack([scattered, packed], axis=1)
        else:
            src, dst, mapping = on_host, on_device, np.stack([packed, scattered], axis=1)
        src_data = blockdata.fill(src, seed=7)
        settle(device)
        plan = device.plan_copy(src, dst, mapping)
        stream = device.create_stream()
        baseline = TorchCopy(device, plan.num_bytes)
        if pinned and not wait_pinned(device, baseline.buffer):
            baseline.free()
            guarded.free_cache(device, on_host)
            violated(
                "host.pinned",
                f"plugin {kvhal_target.name!r}: the host buffer of the torch baseline never reported pinned: "
                "copies to pageable memory are not measured",
            )

        def plugin_copy() -> None:
            wait(device, device.submit(plan, stream), f"throughput {direction}")

        plugin_s = torch_s = float("inf")
        for _ in range(sizes.throughput_repeats):  # alternate, so both see the same machine load
            plugin_s = min(plugin_s, fastest(plugin_copy, 1))
            torch_s = min(torch_s, fastest(lambda: baseline.run(direction), 1))
        baseline.free()
        rows = mapping[np.linspace(0, len(mapping) - 1, SAMPLED).astype(int)]
        arrived = blockdata.blocks_equal(
            blockdata.read(dst, rows[:, 1]), blockdata.take(src_data, rows[:, 0])
        ).numpy()
        guarded.free_cache(device, on_host)
        expect(
            arrived.all(),
            "copy.data",
            lambda: (
                f"kvhal_copy_blocks ({direction}, throughput run): sampled dst blocks "
                f"{blockdata.id_list(rows[~arrived, 1])} do not hold their source "
                "blocks: every destination block must hold its source block (a wrong copy is not measured)"
            ),
        )

        plugin_gib_s, torch_gib_s = plan.num_bytes / plugin_s / GiB, plan.num_bytes / torch_s / GiB
        ratio, floor = plugin_gib_s / torch_gib_s, kvhal_throughput_floor
        kvhal_target.metrics.setdefault("throughput", {})[direction] = {
            "layout": str(layout),
            "host_memory": "pinned" if pinned else "pageable (host.pinned not declared)",
            "bytes": plan.num_bytes,
            "blocks": plan.num_blocks,
            "descriptors": plan.num_descriptors,
            "plugin_gib_s": round(plugin_gib_s, 3),
            "torch_gib_s": round(torch_gib_s, 3),
            "ratio": round(ratio, 3),
            "floor": floor,
            "status": "pass" if ratio >= floor else "fail",
        }
        expect(
            ratio >= floor,
            "copy.throughput",
            f"kvhal_copy_blocks {direction}: {plugin_gib_s:.2f} GiB/s is {ratio:.2f}x a plain torch copy of "
            f"the same {plan.num_bytes >> 20} MiB ({torch_gib_s:.2f} GiB/s, same run); the floor is "
            f"{floor}x (--kvhal-throughput-floor)",
        )

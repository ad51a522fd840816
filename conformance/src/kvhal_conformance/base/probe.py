"""Contract: probing (``kvhal_probe``) and the set of required hooks."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from kvhal.descriptor import Capability, DeviceDescriptor
from kvhal.hookspecs import DEVICE_HOOKS
from kvhal_conformance.base.fixtures import ContractFixtures, final
from kvhal_conformance.clauses import covers, expect, violated
from kvhal_conformance.footprint import HOST_PROBE_LIMIT, describe
from kvhal_conformance.target import Target

KNOWN_CAPABILITIES = {c.value for c in Capability}


def _descriptor(target: Target) -> DeviceDescriptor:
    outcome = target.registry.probe(target.info)
    if outcome.error is not None:
        violated(
            "probe.result",
            f"{outcome.error}: kvhal_probe() must return a DeviceDescriptor or a Refusal, never raise",
        )
    if outcome.descriptor is None:
        pytest.fail(
            f"{target.label}: kvhal_probe() declined ({outcome.reason}); the suite needs the device present: "
            "run it where kvhal_probe returns a DeviceDescriptor"
        )
    return outcome.descriptor


class ProbeContract(ContractFixtures):
    """Contract ``probe``: every required hook is implemented; ``kvhal_probe`` returns a
    well-formed descriptor of a present device, every time, and starts no work.

    Fixtures: ``kvhal_target`` (see :class:`ContractFixtures`).

    Hooks: :meth:`device_memory`.
    """

    contract_id = "probe"

    def device_memory(self, device_type: str) -> int | None:
        """Bytes of device memory allocated on the device of ``device_type``, or None where
        that cannot be told (the memory half of ``probe.no_work`` is then not checked across
        probes again). The first probe is measured before this hook can be called (when the
        target is bound): through torch's accelerator, host memory for a ``cpu`` device, else
        not measured (:meth:`~kvhal_conformance.footprint.Footprint.device_growth`).

        Default: ``torch.accelerator.memory_allocated()`` when torch's current accelerator is
        of that type. Override it for a device whose memory torch does not count.
        """
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accelerator is None or accelerator.type != device_type:
            return None
        try:
            return int(torch.accelerator.memory_allocated())
        except (RuntimeError, AttributeError):
            return None

    @final
    @covers("plugin.hooks")
    def test_required_hooks_implemented(self, kvhal_target: Target) -> None:
        """Every hook in kvhal.hookspecs.DEVICE_HOOKS is implemented (a missing one fails, named)."""
        if kvhal_target.info.error is not None:
            pytest.fail(f"{kvhal_target.label} failed to load: {kvhal_target.info.error}")
        implemented = kvhal_target.registry.implemented_hooks(kvhal_target.info)
        missing = [hook for hook in DEVICE_HOOKS if hook not in implemented]
        expect(
            not missing,
            "plugin.hooks",
            f"{kvhal_target.label} does not implement required hook {', '.join(missing)}: every device "
            "plugin must implement all of kvhal.hookspecs.DEVICE_HOOKS",
        )

    @final
    @covers("probe.result")
    def test_probe_returns_descriptor(self, kvhal_target: Target) -> None:
        """kvhal_probe returns a DeviceDescriptor, every time it is called, without raising (the
        device must be present to be tested)."""
        for _ in range(3):
            _descriptor(kvhal_target)

    @final
    @covers("probe.no_work")
    def test_probe_starts_no_work(self, kvhal_target: Target) -> None:
        """The first probe keeps no thread running and no device memory; probing again leaves
        no new thread running and no device memory allocated.

        The first probe is measured from right before it (when the target was bound): a probe
        that reserves an arena or starts a worker once, and keeps it, shows only there.
        """
        descriptor = _descriptor(kvhal_target)
        gc.collect()
        threads, memory = set(threading.enumerate()), self.device_memory(descriptor.torch_device_type)
        for _ in range(3):
            _descriptor(kvhal_target)
        gc.collect()
        first = kvhal_target.first_probe
        deadline = time.monotonic() + 2.0  # threads a probe started and stopped may still be ending
        while True:
            kept = first.threads_kept() if first is not None else []
            new = [t for t in threading.enumerate() if t not in threads and t.is_alive()]
            if not (kept or new) or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        expect(
            not kept,
            "probe.no_work",
            lambda: (
                f"{kvhal_target.label}: hook kvhal_probe(), called for the first time, started "
                f"{len(kept)} threads that are still running ({', '.join(sorted({t.name for t in kept}))}): "
                "a probe must only detect the device; start workers when kvhal_create_stream is called"
            ),
        )
        expect(
            not new,
            "probe.no_work",
            f"{kvhal_target.label}: hook kvhal_probe(), called 3 more times, left {len(new)} new "
            f"threads running ({', '.join(sorted({t.name for t in new}))}): a probe must only detect "
            "the device, not start device work",
        )
        if first is not None:
            kept_bytes, how = first.device_growth(descriptor.torch_device_type)
            kvhal_target.metrics["first_probe"] = {  # the report says what was measured, and how
                "threads_kept": [t.name for t in kept],
                "host_memory": describe(first.host_growth),
                "device_memory": describe(kept_bytes),
                "device_memory_measured_by": how,
            }
            limit = HOST_PROBE_LIMIT if descriptor.torch_device_type == "cpu" else 0
            expect(
                kept_bytes is None or kept_bytes <= limit,
                "probe.no_work",
                lambda: (
                    f"{kvhal_target.label}: hook kvhal_probe(), called for the first time, kept "
                    f"{describe(kept_bytes)} of device memory ({how}; host memory "
                    f"{describe(first.host_growth)}; at most {describe(limit)} is allowed): a probe must "
                    "not allocate device memory; allocate when kvhal_allocate_kv_cache or "
                    "kvhal_allocate_host_buffer is called"
                ),
            )
        after = self.device_memory(descriptor.torch_device_type)
        expect(
            memory is None or after == memory,
            "probe.no_work",
            f"{kvhal_target.label}: hook kvhal_probe(), called 3 more times, changed the device memory "
            f"torch has allocated from {memory} to {after} bytes: a probe must not allocate device memory",
        )

    @final
    @covers("probe.descriptor")
    def test_descriptor_is_well_formed(self, kvhal_target: Target) -> None:
        """The descriptor's torch device type exists and every capability is one kvhal knows."""
        d = _descriptor(kvhal_target)
        try:
            torch.device(d.torch_device_type)
        except RuntimeError as exc:
            violated(
                "probe.descriptor",
                f"kvhal_probe() of {kvhal_target.label}: torch_device_type {d.torch_device_type!r} is not "
                f"a torch device type: {exc}; it must be one torch.device() accepts",
            )
        unknown = []
        for capability in sorted(d.capabilities):
            if capability.startswith("dtype."):
                if not isinstance(getattr(torch, capability.removeprefix("dtype."), None), torch.dtype):
                    unknown.append(capability)
            elif capability not in KNOWN_CAPABILITIES:
                unknown.append(capability)
        expect(
            not unknown,
            "probe.descriptor",
            f"kvhal_probe of {kvhal_target.label} declares unknown capabilities {unknown} (a typo?); known: "
            f"{sorted(KNOWN_CAPABILITIES)} and dtype.<torch dtype>; every capability must be one of them",
        )

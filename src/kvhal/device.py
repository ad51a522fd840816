"""The device facade: what the manager, transfer engine and connector call.

A :class:`Device` is bound to one selected device plugin. It checks every
argument before calling a hook, calls the hook on that plugin alone (plus
non-device wrappers), and checks every result, so that a broken plugin is
named (plugin, distribution, hook) instead of corrupting KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pluggy
import torch

from kvhal import hookspecs
from kvhal.cache import KVCache, dense_kv_cache, dense_nbytes
from kvhal.copyplan import BlockMapping, CopyPlan, plan_copy
from kvhal.descriptor import Capability, DeviceDescriptor, dtype_capability
from kvhal.errors import (
    CopyValidationError,
    KVHALError,
    MalformedResultError,
    PluginError,
    PluginValidationError,
    TransferError,
    ValidationError,
    check_int,
    plugin_hook_label,
)
from kvhal.geometry import KVFormat, KVGeometry
from kvhal.layouts import LOGICAL_DIMS, KVLayout

HOST_ALIGNMENT = 4096
#: dtypes every device plugin must copy; others need a ``dtype.*`` capability.
REQUIRED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class PluginManager(pluggy.PluginManager):
    """pluggy's manager, counting the changes to its hooks' implementations (registering,
    unregistering, new specs, call monitoring): a :class:`Device` calls a hook with one plain
    implementation directly, without pluggy's dispatch (4-5 us a call warm, 40-60 us with the
    caches cold after a forward; a returning turn's load makes about 7), until they change."""

    generation = 0

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        self.generation += 1
        return super().register(plugin, name)

    def unregister(self, plugin: Any = None, name: str | None = None) -> Any:
        self.generation += 1
        return super().unregister(plugin, name)

    def add_hookspecs(self, module_or_class: Any) -> None:
        self.generation += 1
        super().add_hookspecs(module_or_class)

    def add_hookcall_monitoring(self, before: Any, after: Any) -> Any:
        # tracing or monitoring sees every call: pluggy's dispatch only, from now on
        self.generation = -(1 << 62)
        return super().add_hookcall_monitoring(before, after)


#: What each first-result device hook must return, for the message when it returns None.
EXPECTED_RESULTS = {
    "kvhal_kv_layouts": "a non-empty sequence of KVLayout",
    "kvhal_allocate_kv_cache": "a KVCache",
    "kvhal_allocate_host_buffer": "a flat CPU byte tensor",
    "kvhal_host_buffer_is_pinned": "True or False",
    "kvhal_create_stream": "a new stream",
    "kvhal_current_stream": "the compute stream",
    "kvhal_create_event": "a new event",
    "kvhal_query_event": "True or False",
    "kvhal_copy_blocks": "an event recorded after the copy (a failed copy must return one too, "
    "whose query and synchronize raise TransferError)",
}


class Device:
    """One device plugin, bound: allocation, host memory, streams, events, copies.

    :param pm: the plugin manager holding every plugin.
    :param plugin_name: the selected device plugin's name.
    :param distribution: ``name version`` of its distribution.
    :param descriptor: what its probe returned.
    :param other_device_plugins: device plugins whose impls must not answer for this one.
    :param index: device index, or ``None`` for the plugin's current device.
    """

    def __init__(
        self,
        pm: pluggy.PluginManager,
        plugin_name: str,
        distribution: str | None,
        descriptor: DeviceDescriptor,
        other_device_plugins: Sequence[object] = (),
        index: int | None = None,
    ) -> None:
        self.plugin_name = plugin_name
        self.distribution = distribution
        self.descriptor = descriptor
        self.torch_device = (
            torch.device(descriptor.torch_device_type)
            if index is None
            else torch.device(descriptor.torch_device_type, index)
        )
        self._pm = pm
        self._others = list(other_device_plugins)
        self._callers = {
            name: pm.subset_hook_caller(name, remove_plugins=self._others) for name in hookspecs.DEVICE_HOOKS
        }
        self._direct: dict[str, tuple[int, Any, tuple[str, ...], bool]] = {}
        self._default_stream: Any = None
        self._layouts: dict[str | None, tuple[KVLayout, ...]] = {}

    def __repr__(self) -> str:
        return f"Device({self.plugin_name!r}, {self.torch_device}, {self.distribution})"

    @property
    def name(self) -> str:
        """The device's name as its plugin's probe declared it (``"cpu"``, ``"cuda"``)."""
        return self.descriptor.name

    @property
    def computes_on_host(self) -> bool:
        """Whether the device computes on the host's own cores (torch's ``cpu``: the CPU
        plugin): work kvhal does beside the engine's forward, a store's reads, takes cores from
        it, and the forward from the reads."""
        return self.torch_device.type == "cpu"

    def on(self, index: int) -> Device:
        """The same plugin bound to device ``index``."""
        return Device(self._pm, self.plugin_name, self.distribution, self.descriptor, self._others, index)

    # -- plumbing ----------------------------------------------------------

    def _error(self, cls: type[PluginError], hook: str, message: str) -> PluginError:
        return cls(self.plugin_name, self.distribution, hook, message)

    def _direct_call(self, hook: str) -> tuple[Any, tuple[str, ...], bool] | None:
        """The hook's one plain implementation (its function, argument names, whether the hook
        answers with its first result), while the manager's hooks have not changed; None where
        pluggy must dispatch (no implementation or several, a wrapper, no change count)."""
        generation = getattr(self._pm, "generation", -1)
        known = self._direct.get(hook)
        if known is not None and known[0] == generation:
            return known[1:] if known[1] is not None else None
        if generation < 0:
            return None
        caller = self._callers[hook]
        impls = caller.get_hookimpls()
        if len(impls) != 1 or impls[0].hookwrapper or impls[0].wrapper or caller.spec is None:
            self._direct[hook] = (generation, None, (), False)
            return None
        impl = impls[0]
        entry = (generation, impl.function, tuple(impl.argnames), bool(caller.spec.opts.get("firstresult")))
        self._direct[hook] = entry
        return entry[1:]

    def _call(self, hook: str, **kwargs: Any) -> Any:
        try:
            direct = self._direct_call(hook)
            if direct is not None:
                function, argnames, first = direct
                answer = function(*[kwargs[name] for name in argnames])
                result = answer if first else ([] if answer is None else [answer])
            else:
                result = self._callers[hook](**kwargs)
        except TransferError as exc:
            # which plugin's event failed, and asked through which hook: logs and the
            # conformance report name them, the plugin's own message says what failed
            where = plugin_hook_label(self.plugin_name, self.distribution, hook)
            raise TransferError(f"{where}: {exc}") from exc
        except ValidationError as exc:
            raise PluginValidationError(self.plugin_name, self.distribution, hook, exc) from exc
        except KVHALError as exc:
            raise self._error(PluginError, hook, f"{type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            raise self._error(PluginError, hook, f"raised {type(exc).__name__}: {exc}") from exc
        return result

    def _call_first(self, hook: str, **kwargs: Any) -> Any:
        result = self._call(hook, **kwargs)
        if result is None:
            expected = EXPECTED_RESULTS.get(hook, "a result")
            raise self._error(MalformedResultError, hook, f"returned None; expected {expected}")
        return result

    def _dev(self, device: torch.device | str | None) -> torch.device:
        return self.torch_device if device is None else torch.device(device)

    # -- layouts and allocation -------------------------------------------

    def kv_layouts(self, attention_backend: str | None = None) -> tuple[KVLayout, ...]:
        """Layouts the device's attention kernels accept, preferred first."""
        if attention_backend not in self._layouts:
            hook = "kvhal_kv_layouts"
            result = self._call_first(hook, attention_backend=attention_backend)
            if isinstance(result, (str, bytes)) or not isinstance(result, Sequence) or not result:
                raise self._error(
                    MalformedResultError, hook, f"returned {result!r}; expected a non-empty sequence"
                )
            for item in result:
                if not isinstance(item, KVLayout):
                    raise self._error(
                        MalformedResultError,
                        hook,
                        f"returned {item!r} ({type(item).__name__}); expected KVLayout",
                    )
                # A KVLayout built around its own validation (object.__new__, a subclass) is
                # still refused: copies and allocation trust the stride order.
                if sorted(item.stride_order) != list(range(len(LOGICAL_DIMS))):
                    raise self._error(
                        MalformedResultError,
                        hook,
                        f"returned a stride order that is not a permutation: layout {item.name!r} has "
                        f"{tuple(item.stride_order)} over {LOGICAL_DIMS}",
                    )
            self._layouts[attention_backend] = tuple(result)
        return self._layouts[attention_backend]

    def check_geometry(self, geometry: KVGeometry, layout: KVLayout) -> None:
        """Refuse (naming the argument) what this device did not declare it holds."""
        if not isinstance(geometry, KVGeometry):
            raise ValidationError("geometry", f"must be a KVGeometry, got {type(geometry).__name__}")
        if not isinstance(layout, KVLayout):
            raise ValidationError("layout", f"must be a KVLayout, got {type(layout).__name__}")
        accepted = self.kv_layouts()
        if layout.stride_order not in [a.stride_order for a in accepted]:
            raise ValidationError(
                "layout",
                f"{layout} is not among the layouts device {self.name!r} accepts: "
                f"{', '.join(str(a) for a in accepted)}",
            )
        self._check_capabilities(geometry, layout, ValidationError)

    def _check_capabilities(
        self, geometry: KVGeometry, layout: KVLayout, error: type[ValidationError]
    ) -> None:
        needs = []
        if layout.is_cross_layer:
            needs.append(("layout", Capability.CROSS_LAYER.value))
        if geometry.kv_format is KVFormat.SPLIT:
            needs.append(("geometry", Capability.SPLIT_KV.value))
        if geometry.dtype not in REQUIRED_DTYPES:
            needs.append(("geometry", dtype_capability(geometry.dtype)))
        for argument, capability in needs:
            if not self.descriptor.supports(capability):
                raise error(argument, f"device {self.name!r} does not declare capability {capability}")

    def allocate_kv_cache(
        self,
        geometry: KVGeometry,
        layout: KVLayout | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """A zeroed KV cache on the device; ``layout`` defaults to the preferred one."""
        layout = layout or self.kv_layouts()[0]
        self.check_geometry(geometry, layout)
        hook = "kvhal_allocate_kv_cache"
        cache = self._call_first(hook, geometry=geometry, layout=layout, device=self._dev(device))
        if not isinstance(cache, KVCache):
            raise self._error(
                MalformedResultError, hook, f"returned {type(cache).__name__}; expected KVCache"
            )
        if cache.geometry != geometry or cache.layout.stride_order != layout.stride_order:
            raise self._error(
                MalformedResultError,
                hook,
                f"returned a {cache.layout} cache of {cache.geometry}; asked for {layout} of {geometry}",
            )
        if cache.device.type != self.descriptor.torch_device_type:
            raise self._error(
                MalformedResultError,
                hook,
                f"returned a cache on {cache.device}, not {self.descriptor.torch_device_type}",
            )
        return cache

    # -- host memory ---------------------------------------------------------

    def allocate_host_buffer(self, nbytes: int) -> torch.Tensor:
        """A zeroed, 4 KiB-aligned flat host byte buffer, pinned where the device can."""
        check_int("nbytes", nbytes)
        hook = "kvhal_allocate_host_buffer"
        buf = self._call_first(hook, nbytes=nbytes)
        if (
            not isinstance(buf, torch.Tensor)
            or buf.device.type != "cpu"
            or buf.dim() != 1
            or buf.element_size() != 1
        ):
            raise self._error(
                MalformedResultError, hook, f"returned {buf!r:.80}; expected a flat CPU byte tensor"
            )
        if buf.numel() < nbytes:
            raise self._error(MalformedResultError, hook, f"returned {buf.numel()} bytes; {nbytes} asked for")
        if buf.data_ptr() % HOST_ALIGNMENT:
            raise self._error(
                MalformedResultError, hook, f"returned an address not {HOST_ALIGNMENT}-byte aligned"
            )
        return buf

    def free_host_buffer(self, buffer: torch.Tensor) -> None:
        """Release a buffer from :meth:`allocate_host_buffer` (unpin it); call once, after
        the copies that use it have finished and its views are dropped."""
        self._call("kvhal_free_host_buffer", buffer=buffer)

    def host_buffer_is_pinned(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` is page-locked (pinned, registered or locked) as the device defines it."""
        hook = "kvhal_host_buffer_is_pinned"
        result = self._call_first(hook, buffer=buffer)
        if not isinstance(result, bool):
            raise self._error(MalformedResultError, hook, f"returned {result!r}; expected bool")
        return result

    def allocate_host_cache(self, geometry: KVGeometry, layout: KVLayout, num_blocks: int) -> KVCache:
        """A host-side cache of ``num_blocks`` in ``layout``, mirroring a device cache so
        that runs of blocks copy as one piece. Free it with :meth:`free_host_cache`."""
        check_int("num_blocks", num_blocks)
        host_geometry = geometry.with_num_blocks(num_blocks)
        buffer = self.allocate_host_buffer(dense_nbytes(host_geometry))
        return dense_kv_cache(host_geometry, layout, buffer)

    def free_host_cache(self, cache: KVCache) -> None:
        """Release the host buffers under a cache from :meth:`allocate_host_cache`."""
        for buffer in cache.storage:
            self.free_host_buffer(buffer)

    # -- streams and events -------------------------------------------------

    def create_stream(self, device: torch.device | str | None = None) -> Any:
        """A new copy stream on ``device`` (default: this facade's device)."""
        return self._call_first("kvhal_create_stream", device=self._dev(device))

    def current_stream(self, device: torch.device | str | None = None) -> Any:
        """The stream the engine computes on: copies are ordered after its work."""
        return self._call_first("kvhal_current_stream", device=self._dev(device))

    def create_event(self, device: torch.device | str | None = None) -> Any:
        """A new event, to record on a stream and wait for."""
        return self._call_first("kvhal_create_event", device=self._dev(device))

    def record_event(self, event: Any, stream: Any) -> None:
        """Mark ``event`` to complete when the work submitted to ``stream`` so far has finished."""
        self._call("kvhal_record_event", event=event, stream=stream)

    def query_event(self, event: Any) -> bool:
        """True once ``event``'s work is done; raises :class:`TransferError` if it failed."""
        hook = "kvhal_query_event"
        result = self._call_first(hook, event=event)
        if not isinstance(result, bool):
            raise self._error(MalformedResultError, hook, f"returned {result!r}; expected bool")
        return result

    def synchronize_event(self, event: Any) -> None:
        """Block until ``event`` completes; raises :class:`TransferError` if its copy failed."""
        self._call("kvhal_synchronize_event", event=event)

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        """Make work submitted to ``stream`` from now on wait for ``event`` (without blocking)."""
        self._call("kvhal_stream_wait_event", stream=stream, event=event)

    def order_after_compute(self, stream: Any) -> None:
        """Make ``stream`` wait for work already on the compute stream.

        Stores must not read KV the model has not finished writing, and loads
        must not race the engine zeroing the blocks they fill (vLLM #31341,
        #46278, #50696): every copy kvhal submits goes through here first.
        """
        marker = self.create_event()
        self.record_event(marker, self.current_stream())
        self.stream_wait_event(stream, marker)

    @property
    def default_stream(self) -> Any:
        """A copy stream owned by this facade, created on first use."""
        if self._default_stream is None:
            self._default_stream = self.create_stream()
        return self._default_stream

    # -- copies --------------------------------------------------------------

    def plan_copy(self, src: KVCache, dst: KVCache, mapping: BlockMapping) -> CopyPlan:
        """Validate a copy between a device cache and a host cache (or two of either)."""
        plan = plan_copy(src, dst, mapping)
        allowed = {"cpu", self.descriptor.torch_device_type}
        for side, cache in (("src", src), ("dst", dst)):
            if cache.device.type not in allowed:
                raise CopyValidationError(
                    side, f"is on {cache.device}; device {self.name!r} copies {sorted(allowed)}"
                )
        self._check_capabilities(src.geometry, src.layout, CopyValidationError)
        return plan

    def copy_blocks(
        self,
        src: KVCache,
        dst: KVCache,
        mapping: BlockMapping,
        stream: Any = None,
        *,
        after_compute: bool = True,
    ) -> Any:
        """Copy whole blocks ``mapping = [(src id, dst id), ...]`` asynchronously.

        Validated before any byte moves. The copy is ordered after the compute
        stream unless ``after_compute`` is False. Returns an event; query or
        synchronize it through this facade.
        """
        plan = self.plan_copy(src, dst, mapping)
        return self.submit(plan, stream, after_compute=after_compute)

    def submit(self, plan: CopyPlan, stream: Any = None, *, after_compute: bool = True) -> Any:
        """Enqueue an already validated plan (see :meth:`copy_blocks`)."""
        stream = self.default_stream if stream is None else stream
        if after_compute:
            self.order_after_compute(stream)
        return self._call_first("kvhal_copy_blocks", plan=plan, stream=stream)

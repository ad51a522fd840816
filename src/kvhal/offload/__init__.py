"""The offloading core: device KV blocks kept in pinned host memory, on any device.

:mod:`~kvhal.offload.manager` decides (lookup, prepare/complete load and store,
eviction through :mod:`~kvhal.offload.eviction`, slot states in
:mod:`~kvhal.offload.slot_states`, keys in :mod:`~kvhal.offload.keyindex`);
:mod:`~kvhal.offload.host_tier` is the pinned buffer cut into slots;
:mod:`~kvhal.offload.transfer` moves the bytes through the device plugin;
:mod:`~kvhal.offload.offloader` wires the three in one process. It knows
nothing of the tiers below host memory (:mod:`kvhal.tiers`) nor of any engine.
"""

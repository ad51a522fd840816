"""Each store's state now, for the ``tier_state`` gauge: up, down, or refused.

- **down** (0): the scheduler's client of the store could not reach it at its last call
  (``tier_up`` 0; ``tier_lookup_errors`` and ``tier_unreachable`` count it).
- **up** (1): it answers, and the values read from it are served (or none was read yet).
- **refused** (2): it answers, but kvhal refuses what it holds: in the last report in
  which this engine read values from it, it accepted none (``tier_read_bytes`` did not grow)
  and refused some, as the remote tier refuses a value that is there (its ``_REFUSED``
  outcomes): ``tier_unauthenticated_blocks`` (no valid HMAC of the fleet's secret: another
  secret, or none), ``tier_foreign_blocks`` (another KV's value, or under another name) or
  ``tier_corrupt_blocks`` (a checksum mismatch, a malformed or oversized value). It stays
  refused until a read is served, or the store goes down.

A value that is simply not there (``tier_missing_blocks``) or a read that failed for the
network (``tier_io_errors``) is no refusal. A store that ``remote_strict`` refused at start
has no state: the engine did not start. The counters are those the reads made, wherever they
ran: the scheduler's own (an in-process worker's prefetch) and the workers' (each step's
``KVConnectorOutput.kv_connector_stats``), so the state reads what the dashboard's counters
read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvhal.vllm.stats import tier_key

DOWN, UP, REFUSED = 0, 1, 2
#: The gauge's values, by code.
STATES = {DOWN: "down", UP: "up", REFUSED: "refused"}
#: The families of a value the store holds and kvhal refused.
REFUSED_FAMILIES = ("tier_unauthenticated_blocks", "tier_foreign_blocks", "tier_corrupt_blocks")
#: The family that grows when a read is served.
SERVED_FAMILY = "tier_read_bytes"


def stats_data(stats: Any) -> Mapping[str, Any]:
    """A ``KVConnectorStats``'s counters (a dict as it crossed processes, or None)."""
    data = getattr(stats, "data", stats)
    return data if isinstance(data, Mapping) else {}


class StoreStates:
    """The state of each store of one engine, from the counters its reads report."""

    def __init__(self, names: Iterable[str]) -> None:
        self._refusing = dict.fromkeys(names, False)
        self._refused = dict.fromkeys(self._refusing, 0)
        self._served = dict.fromkeys(self._refusing, 0)

    def count(self, data: Mapping[str, Any]) -> None:
        """Take one report's counters (each counted once: a step's workers', or the
        scheduler's own at its report)."""
        for name in self._refusing:
            self._refused[name] += sum(data.get(tier_key(family, name), 0) for family in REFUSED_FAMILIES)
            self._served[name] += data.get(tier_key(SERVED_FAMILY, name), 0)

    def states(self, up: Mapping[str, bool]) -> dict[str, int]:
        """Each store's state code now, ``up`` saying which answered their last call; the
        counts taken since the last call decide between up and refused."""
        now = {}
        for name in self._refusing:
            if not up.get(name, False):
                self._refusing[name] = False  # back up, it is up until a read says otherwise
                now[name] = DOWN
            else:
                if self._served[name]:
                    self._refusing[name] = False
                elif self._refused[name]:
                    self._refusing[name] = True
                now[name] = REFUSED if self._refusing[name] else UP
            self._refused[name] = self._served[name] = 0
        return now

    def gauges(self, stores: Iterable[Any], data: Mapping[str, Any]) -> dict[str, int]:
        """``tier_state`` of each of ``stores`` (the scheduler's, each with its client
        ``store``, None once closed), after taking the scheduler's own counters ``data``."""
        self.count(data)
        up = {tier.name: tier.store is not None and tier.store.up for tier in stores}
        return {tier_key("tier_state", name): state for name, state in self.states(up).items()}

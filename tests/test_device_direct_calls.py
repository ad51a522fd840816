"""Device facade: a hook with one plain implementation is called without pluggy's dispatch,
with pluggy's answers, until the manager's hooks change (a wrapper, a plugin, monitoring)."""

from __future__ import annotations

from typing import Any

import pluggy
import pytest

from kvhal import hookspecs
from kvhal.errors import PluginError

hookimpl = pluggy.HookimplMarker(hookspecs.PROJECT)


def test_direct_answers_match_pluggys(cpu) -> None:
    stream = cpu.create_stream()
    direct = (cpu.current_stream(), cpu.query_event(cpu.create_event()))
    assert cpu._direct["kvhal_current_stream"][1] is not None
    # non-first-result hooks answer as pluggy does: a list of the answers that are not None
    assert cpu._call("kvhal_record_event", event=cpu.create_event(), stream=stream) == []
    cpu._direct.clear()
    cpu._pm.generation = -1  # pluggy's dispatch alone
    assert (cpu.current_stream(), cpu.query_event(cpu.create_event())) == direct
    assert cpu._call("kvhal_record_event", event=cpu.create_event(), stream=stream) == []


def test_a_wrapper_registered_later_is_called(cpu) -> None:
    seen: list[str] = []

    class Watch:
        @hookimpl(wrapper=True)
        def kvhal_current_stream(self, device: Any) -> Any:
            seen.append("current_stream")
            return (yield)

    stream = cpu.current_stream()
    cpu._pm.register(Watch(), name="watch")
    assert cpu.current_stream() is stream and seen == ["current_stream"]
    cpu._pm.unregister(name="watch")
    cpu.current_stream()
    assert seen == ["current_stream"]


def test_monitoring_sees_every_call(cpu) -> None:
    cpu.current_stream()
    calls: list[str] = []
    cpu._pm.add_hookcall_monitoring(lambda name, impls, kwargs: calls.append(name), lambda *a: None)
    cpu.current_stream()
    assert calls == ["kvhal_current_stream"]


def test_errors_are_named_as_through_pluggy(cpu) -> None:
    cpu.current_stream()
    impl = cpu._callers["kvhal_current_stream"].get_hookimpls()[0]
    generation, _, names, first = cpu._direct["kvhal_current_stream"]

    def broken(device: Any) -> Any:
        raise RuntimeError("boom")

    cpu._direct["kvhal_current_stream"] = (generation, broken, names, first)
    with pytest.raises(PluginError, match=r"kvhal_current_stream.*raised RuntimeError: boom"):
        cpu.current_stream()
    assert impl.function is not broken

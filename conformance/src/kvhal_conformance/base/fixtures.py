"""What every contract class's checks run with: the fixtures a subclass supplies or keeps, and
the rule that a check marked final cannot be overridden."""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from kvhal.cache import KVCache
from kvhal.device import REQUIRED_DTYPES, Device
from kvhal.geometry import KVGeometry
from kvhal.layouts import KVLayout
from kvhal_conformance import guarded
from kvhal_conformance.settings import DEFAULT_THROUGHPUT_FLOOR, QUICK, Sizes
from kvhal_conformance.target import Target
from kvhal_conformance.timing import Busy

if sys.version_info >= (3, 11):
    from typing import final
else:  # typing.final records nothing at run time before Python 3.11
    from typing_extensions import final

__all__ = ["CANDIDATE_DTYPES", "DEFAULT_SEED", "ContractFixtures", "HostCache", "final"]

#: The seed of the random block mappings when a subclass does not supply ``kvhal_run_seed``.
DEFAULT_SEED = 20261122
#: What a check taking ``dtype`` runs over in a subclass (see :meth:`ContractFixtures.dtypes_to_check`):
#: the required dtypes, every float8 dtype this torch has, and uint8 (vLLM moves caches whose K
#: and V dtypes differ as uint8 rows).
CANDIDATE_DTYPES: tuple[torch.dtype, ...] = tuple(
    dict.fromkeys(
        [
            *REQUIRED_DTYPES,
            *(
                getattr(torch, name)
                for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                if hasattr(torch, name)
            ),
            torch.uint8,
        ]
    )
)

HostCache = Callable[[KVGeometry, KVLayout, int], KVCache]


class ContractFixtures:
    """The fixtures of every contract class; subclass a contract class and supply them.

    Required (the default raises NotImplementedError):

    - ``kvhal_target`` (class scope): the plugin under test, a
      :class:`~kvhal_conformance.target.Target`: ``Target.find(NAME)`` for an installed
      plugin, ``Target.of_plugin(OBJECT, NAME)`` for a plugin object.

    Optional, with defaults (override as a fixture of the same name; keep class scope or
    wider where the default has it):

    - ``kvhal_device`` (class): the bound :class:`~kvhal.device.Device`; default the
      target's (a plugin that cannot be bound fails every check, saying why).
    - ``kvhal_sizes`` (class): how much work the checks do, a
      :class:`~kvhal_conformance.settings.Sizes`; default ``QUICK`` (``FULL`` is what the
      published report uses, ``TINY`` the least the checks hold at).
    - ``kvhal_run_seed`` (class): the seed of the random block mappings; default
      :data:`DEFAULT_SEED`. ``kvhal_seed`` mixes it with each test's id; ``kvhal_rng`` is
      a generator seeded with that.
    - ``kvhal_new_stream`` (function): makes the streams the checks submit work to; default
      ``kvhal_device.create_stream`` (``kvhal_create_stream`` itself is checked apart).
    - ``kvhal_backends`` (class): attention backend names of your kernels, asked of
      ``kvhal_kv_layouts`` besides ``LayoutsContract.attention_backends`` and the plugin's
      ``ATTENTION_BACKENDS``; default none.
    - ``kvhal_throughput_floor`` (class): the least ratio of the plugin's copy speed to a
      plain torch copy's; default 0.25 (0 measures without failing).
    - ``kvhal_busy`` (class): scratch caches that keep a stream busy for a measured time.
    - ``kvhal_host_cache`` (function): makes host caches from the plugin's host buffers,
      freed after the test.

    Hooks (override as methods): :meth:`dtypes_to_check`; each contract class documents
    its own. Checks are final (:func:`final`): a subclass that defines a name a base class
    marks final is refused with TypeError when it is created.
    """

    #: The contract's id in :data:`kvhal_conformance.contracts.CONTRACTS`.
    contract_id: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # typing.final is for type checkers only; a run-time subclass is checked here.
        for name in vars(cls):
            for base in cls.__mro__[1:]:
                if getattr(vars(base).get(name), "__final__", False):
                    raise TypeError(
                        f"{cls.__module__}.{cls.__qualname__} overrides {name}, a final check of "
                        f"{base.__module__}.{base.__qualname__}: a contract's checks do not change in a "
                        "subclass; supply fixtures or override a documented hook instead (see "
                        f"{base.__qualname__}'s docstring)"
                    )

    # -- hooks -------------------------------------------------------------------

    def dtypes_to_check(self, config: pytest.Config) -> Sequence[torch.dtype]:
        """The dtypes a check taking ``dtype`` runs over (collected before any fixture runs).

        Those neither required of every plugin nor declared (``dtype.*``) by the plugin
        under test skip, naming the capability. Default: :data:`CANDIDATE_DTYPES`.
        """
        return CANDIDATE_DTYPES

    def backends_to_check(self, config: pytest.Config) -> Sequence[str | None]:
        """The attention backend names a check taking ``backend`` runs over (collected before
        any fixture runs; None: the device's default kernels). Default: None alone;
        :class:`~kvhal_conformance.base.LayoutsContract` asks its ``attention_backends``."""
        return (None,)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "dtype" in metafunc.fixturenames:
            dtypes = list(self.dtypes_to_check(metafunc.config))
            metafunc.parametrize("dtype", dtypes, ids=[str(d).removeprefix("torch.") for d in dtypes])

    # -- required ----------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_target(cls) -> Target:
        raise NotImplementedError(
            f"{cls.__qualname__}: supply the plugin under test as a fixture 'kvhal_target' "
            "(class scope or wider) returning kvhal_conformance.base.Target.find(NAME) for an installed "
            "plugin or Target.of_plugin(OBJECT, NAME) for a plugin object"
        )

    # -- optional ----------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_device(cls, kvhal_target: Target) -> Device:
        return kvhal_target.require_device()

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_sizes(cls) -> Sizes:
        return QUICK

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_run_seed(cls) -> int:
        return DEFAULT_SEED

    @pytest.fixture
    def kvhal_seed(self, kvhal_run_seed: int, request: pytest.FixtureRequest) -> int:
        """A seed per test: the run's seed mixed with the test's id."""
        return (kvhal_run_seed ^ zlib.crc32(request.node.nodeid.encode())) & 0x7FFFFFFF

    @pytest.fixture
    def kvhal_rng(self, kvhal_seed: int) -> np.random.Generator:
        return np.random.default_rng(kvhal_seed)

    @pytest.fixture
    def kvhal_new_stream(self, kvhal_device: Device) -> Callable[[], Any]:
        return kvhal_device.create_stream

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_throughput_floor(cls) -> float:
        return DEFAULT_THROUGHPUT_FLOOR

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_backends(cls) -> tuple[str, ...]:
        return ()

    @pytest.fixture(scope="class")
    @classmethod
    def kvhal_busy(cls, kvhal_device: Device, kvhal_sizes: Sizes) -> Iterator[Busy]:
        """Scratch caches that keep a stream busy for a measured minimum time."""
        busy = Busy(kvhal_device, kvhal_device.kv_layouts()[0], kvhal_sizes.scratch_bytes)
        yield busy
        guarded.free_cache(kvhal_device, busy.dst)

    @pytest.fixture
    def kvhal_host_cache(self, kvhal_device: Device) -> Iterator[HostCache]:
        """Make host caches through the plugin's host buffers; they are freed after the test."""
        made: list[KVCache] = []

        def make(geometry: KVGeometry, layout: KVLayout, num_blocks: int) -> KVCache:
            cache = guarded.host_cache(kvhal_device, geometry, layout, num_blocks)
            made.append(cache)
            return cache

        yield make
        for cache in made:
            guarded.free_cache(kvhal_device, cache)

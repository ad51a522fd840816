"""kvhal's conformance suite for device plugins, shipped as a pytest plugin.

Run it against any installed plugin with ``kvhal conformance --device NAME`` or
``pytest --pyargs kvhal_conformance --kvhal-device NAME``. Without
``--kvhal-device`` the suite's tests skip, so installing this package does not
change other pytest runs. A plugin's own test suite can subclass the contract
classes of :mod:`kvhal_conformance.base` instead, supplying the plugin as a fixture.
"""

__version__ = "0.1.0"

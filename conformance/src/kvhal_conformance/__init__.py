"""kvhal's conformance suite for device plugins, shipped as a pytest plugin.

Run it against any installed plugin with ``kvhal conformance --device NAME`` or
``pytest --pyargs kvhal_conformance --kvhal-device NAME``. Without
``--kvhal-device`` the suite's tests skip, so installing this package does not
change other pytest runs.
"""

__version__ = "0.1.0"

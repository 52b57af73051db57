"""The tests' side of :mod:`fsdp_guide.isolation`: its ``loopback_only``, and a mark for the tests that need it."""

from __future__ import annotations

import sys

import pytest

from fsdp_guide.isolation import loopback_only  # noqa: F401  (the tests import it from here)

# Network namespaces (unshare) are Linux's: elsewhere the tests that need them say so and skip.
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux network namespaces (unshare -n)")

"""Shared test setup: hypothesis profiles and small graph helpers.

Profiles: ``ci`` (thorough, used by .ci/run) and ``dev`` (quick, the default for local runs).
Pick one with ``HYPOTHESIS_PROFILE=ci``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# 100 examples: the SP properties now run every example twice (SP and the SP-off reference) over a wider
# case grid, and the whole suite must stay within 25 minutes on 2 cores (300 took over 35).
settings.register_profile(
    "ci", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False
)
settings.register_profile("dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

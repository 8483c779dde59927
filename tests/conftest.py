"""Settings shared by the core test suite."""

from __future__ import annotations

from hypothesis import settings

# Hypothesis fails an example that takes over 200 ms ("deadline"); on the shared 2-core machines
# this suite runs on, next to servers and JVMs, a scheduling stall can do that to any example. Our
# property tests check results, not speed (speed is measured by the benchmarks).
settings.register_profile("waltz", deadline=None)
settings.load_profile("waltz")

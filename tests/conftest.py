"""Settings shared by the core test suite."""

from __future__ import annotations

from hypothesis import settings

# Hypothesis fails an example that takes over 200 ms ("deadline"); on the shared 2-core machines
# this suite runs on, next to servers and JVMs, a scheduling stall can do that to any example. Our
# property tests check results, not speed (speed is measured by the benchmarks).
settings.register_profile("waltz", deadline=None)
settings.load_profile("waltz")


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    """Print the figures tests recorded with ``record_property("figures", text)``, passed or not
    (they come back from xdist workers with the test reports; print() would be lost there)."""
    sections = []
    for outcome in ("passed", "failed"):
        for report in terminalreporter.stats.get(outcome, []):
            if getattr(report, "when", None) != "call":
                continue
            for name, value in getattr(report, "user_properties", ()):
                if name == "figures":
                    sections.append((report.nodeid, str(value)))
    if sections:
        terminalreporter.section("figures measured by tests")
        for nodeid, text in sections:
            terminalreporter.write_line(nodeid)
            for line in text.splitlines():
                terminalreporter.write_line(f"  {line}")

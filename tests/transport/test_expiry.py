"""Certificate expiry: a gauge per certificate, a log line at the start when one is near its end
or past it, and /readyz not ready while one has expired."""

from __future__ import annotations

import logging

import pytest

from waltz_core.metrics import MetricsRegistry
from waltz_core.transport.expiry import EXPIRY_WARNING_DAYS, GAUGE, CertificateWatch

NOW = 1_800_000_000.0
DAY = 86400.0


class _Transport:
    name = "fake"

    def __init__(self, expiry: dict[str, float]) -> None:
        self._expiry = expiry

    def certificate_expiry(self) -> dict[str, float]:
        return self._expiry


def test_each_certificate_is_a_gauge_and_an_expired_one_is_a_readiness_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    transport = _Transport({"tls_cert /etc/waltz/node.pem": NOW + 400 * DAY,
                            "tls_ca /etc/waltz/ca.pem CN=old": NOW + 3 * DAY,
                            "tls_ca /etc/waltz/ca.pem CN=gone": NOW - DAY})
    clock = [NOW]
    watch = CertificateWatch(transport, clock=lambda: clock[0])
    registry = MetricsRegistry(prefix="")
    watch.register(registry)
    text = registry.render_prometheus()
    assert f'{GAUGE}{{certificate="tls_cert /etc/waltz/node.pem"}} {NOW + 400 * DAY:.1f}' in text, text
    assert text.count(GAUGE + "{") == 3
    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        watch.log_at_start("storage node")
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines[0][0] == "ERROR" and "CN=gone expired at " in lines[0][1] and "replace it and restart" in lines[0][1]
    assert lines[1][0] == "WARNING" and "CN=old expires at " in lines[1][1] and "in 3 days" in lines[1][1]
    assert len(lines) == 2, lines  # 400 days left: nothing to say
    assert watch.reasons() == ["certificate tls_ca /etc/waltz/ca.pem CN=gone expired at 2027-01-14 08:00:00 UTC; "
                               "replace it and restart the process"]
    clock[0] = NOW + 4 * DAY  # a running process's certificate expires too
    assert len(watch.reasons()) == 2
    assert EXPIRY_WARNING_DAYS == 14


def test_a_transport_without_certificates_or_with_a_broken_method_has_nothing_to_watch(
        caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        name = "broken"

        def certificate_expiry(self) -> dict[str, float]:
            raise RuntimeError("a plugin bug")

    assert CertificateWatch(object()).expiry == {}
    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        watch = CertificateWatch(Broken())
    assert watch.expiry == {} and watch.reasons() == []
    assert "could not say when its certificates expire" in caplog.text

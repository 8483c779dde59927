"""Certificate expiry: what a transport says of its certificates, as a gauge, log lines at the
start and a readiness reason.

A transport may have a method ``certificate_expiry() -> Mapping[str, float]``: for each
certificate it presents or trusts, under a name an operator recognises (tcp: ``"tls_cert
/etc/waltz/node.pem"``), when it stops being valid, in seconds since the epoch. A transport
without it (plaintext, zmq's CURVE keys, which do not expire) has nothing to watch.

TLS contexts are built when a process starts, so a replaced certificate file takes effect at the
next restart: a rolling restart rotates a cluster's certificates (docs/security.md).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable

from ..metrics import MetricsRegistry

log = logging.getLogger("waltz.transport")

#: A certificate that expires within this many days is logged as a warning at the start.
EXPIRY_WARNING_DAYS = 14
GAUGE = "waltz_tls_certificate_expiry_timestamp_seconds"


def _when(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class CertificateWatch:
    """The certificates of one process's transport: read once, when the process starts."""

    def __init__(self, transport: object, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        method = getattr(transport, "certificate_expiry", None)
        self.expiry: dict[str, float] = {}
        if method is not None:
            try:
                self.expiry = dict(method())
            except Exception:
                log.warning("the %s transport could not say when its certificates expire",
                            getattr(transport, "name", "?"), exc_info=True)

    def register(self, registry: MetricsRegistry) -> None:
        """One gauge per certificate, in a registry without a prefix (the process metrics)."""
        for name, timestamp in self.expiry.items():
            registry.gauge(GAUGE, "When the certificate stops being valid (notAfter), in seconds since the epoch; "
                           "a replaced file takes effect at the next restart.", {"certificate": name}).set(timestamp)

    def log_at_start(self, who: str) -> None:
        now = self._clock()
        for name, timestamp in sorted(self.expiry.items(), key=lambda item: item[1]):
            days = (timestamp - now) / 86400
            if days <= 0:
                log.error("%s: certificate %s expired at %s: peers refuse its handshakes; replace it and restart",
                          who, name, _when(timestamp))
            elif days < EXPIRY_WARNING_DAYS:
                log.warning("%s: certificate %s expires at %s, in %.0f days: replace it and restart before then",
                            who, name, _when(timestamp), days)

    def reasons(self) -> list[str]:
        """What ``/readyz`` says while a certificate has expired (the process's links fail)."""
        now = self._clock()
        return [f"certificate {name} expired at {_when(timestamp)}; replace it and restart the process"
                for name, timestamp in self.expiry.items() if timestamp <= now]

"""The TLS keys that coordination backends share: ``tls``, ``tls_ca``, ``tls_cert``, ``tls_key``.

A backend's options class subclasses :class:`CoordinationTlsOptions` (the ``etcd`` and
``zookeeper`` backends do), so its ``[coordination.<name>]`` table takes the same four keys, with
the same meaning and checks, as a third-party backend's can.
"""

from __future__ import annotations

import attrs

from ..config import key
from ..errors import ConfigError


@attrs.frozen
class CoordinationTlsOptions:
    """TLS to the members of a coordination service (on when any of the keys is set)."""

    tls: bool = key(False, "Connect with TLS even without tls_ca/tls_cert (the members' certificates are checked "
                           "against the system CA store).")
    tls_ca: str = key("", "PEM file of the CA(s) the members' certificates are checked against; sets TLS on.")
    tls_cert: str = key("", "PEM client certificate presented to the members (for those that require one); sets "
                            "TLS on. Needs tls_key.")
    tls_key: str = key("", "PEM private key of tls_cert.")

    @property
    def tls_enabled(self) -> bool:
        return self.tls or bool(self.tls_ca) or bool(self.tls_cert)

    def check_tls(self, table: str) -> None:
        """ConfigError for a certificate without its key (call from ``__attrs_post_init__``)."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(f"{table}: tls_cert and tls_key go together")

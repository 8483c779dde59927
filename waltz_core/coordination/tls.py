"""The TLS keys that coordination backends share: ``tls``, ``tls_ca``, ``tls_cert``, ``tls_key``.

A backend's options class subclasses :class:`CoordinationTlsOptions` (the ``etcd`` and
``zookeeper`` backends do), so its ``[coordination.<name>]`` table takes the same four keys, with
the same meaning and checks, as a third-party backend's can.
"""

from __future__ import annotations

import attrs

from ..config import key
from ..errors import ConfigError, CoordinationError


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

    def load_tls_files(self, table: str) -> tuple[bytes | None, bytes | None, bytes | None]:
        """The PEM bytes of ``tls_ca``, ``tls_cert`` and ``tls_key`` (None where unset), each checked
        as Python's ``ssl`` loads it. A file that cannot be read, or does not hold what its key
        says, is a CoordinationError naming the key and the file, before any connection is tried
        (a TLS library would report it later, if at all, as a handshake or a connection failure)."""
        import ssl

        def read(name: str, path: str) -> bytes | None:
            if not path:
                return None
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as exc:
                raise CoordinationError(f"cannot read [{table}] {name} {path!r}: {exc.strerror or exc}") from None

        ca, cert, private_key = read("tls_ca", self.tls_ca), read("tls_cert", self.tls_cert), read("tls_key", self.tls_key)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if ca is not None:
            try:
                context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
            except (ssl.SSLError, ValueError) as exc:
                raise CoordinationError(f"[{table}] tls_ca {self.tls_ca!r} holds no PEM CA certificate: {exc}") from None
        if cert is not None:
            try:
                context.load_cert_chain(self.tls_cert, self.tls_key)
            except (ssl.SSLError, OSError) as exc:
                raise CoordinationError(f"[{table}] tls_cert {self.tls_cert!r} and tls_key {self.tls_key!r} are not a "
                                        f"PEM certificate and its private key: {exc}") from None
        return ca, cert, private_key

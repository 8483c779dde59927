"""A certificate authority for TLS in development and tests (``waltz certs create``, ``waltz up --secure``).

Built with the ``cryptography`` library (no shelling out to ``openssl``): one CA, one node
certificate valid as TLS server AND client (every Waltz process both listens and connects, so
one certificate per node serves mutual TLS in both roles) with the requested host names / IP
addresses as subject alternative names, and client-only certificates. Keys are P-256 (fast to
generate), written with mode 0600.

The CA key sits next to the certificates, unencrypted: fine for one machine's development
cluster, not for production, where the operator's own PKI issues the node and client
certificates (docs/security.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("127.0.0.1", "localhost")


@attrs.frozen(slots=True)
class TestCertificates:
    """Paths written by :func:`create_test_ca` (all PEM)."""

    __test__ = False  # not a pytest test class despite the name

    directory: Path
    ca: Path
    node_cert: Path
    node_key: Path
    clients: dict[str, tuple[Path, Path]]  #: name -> (certificate, key)

    def server_options(self, mutual: bool = True) -> dict[str, str]:
        """``[transport.tcp]`` for a process (listens and connects) with mutual TLS when ``mutual``."""
        opts = {"tls_cert": str(self.node_cert), "tls_key": str(self.node_key), "tls_ca": str(self.ca)}
        return opts if mutual else {**opts, "tls_verify_clients": False}  # type: ignore[dict-item]

    def client_options(self, name: str = "client") -> dict[str, str]:
        """``[transport.tcp]`` for a client presenting certificate ``name``."""
        cert, key = self.clients[name]
        return {"tls_cert": str(cert), "tls_key": str(key), "tls_ca": str(self.ca)}


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return names


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey,
             days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days)))


def create_test_ca(directory: Path | str, hosts: Sequence[str] = DEFAULT_HOSTS, clients: Sequence[str] = ("client",),
                   days: int = 30, ca_name: str = "waltz-test-ca") -> TestCertificates:
    """Write ``ca.pem``/``ca.key``, ``node.pem``/``node.key`` and ``<client>.pem``/``.key`` into ``directory``."""
    if not hosts:
        raise ValueError("a node certificate needs at least one host name or address")
    if days < 1:
        raise ValueError(f"days must be 1 or more, got {days}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = _name(ca_name)
    ca = (_builder(ca_subject, ca_subject, ca_key.public_key(), days)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    _write_key(out / "ca.key", ca_key)
    _write_cert(out / "ca.pem", ca)

    def issue(name: str, common_name: str, usages: list[x509.ObjectIdentifier],
              alt: Sequence[str] = ()) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (_builder(_name(common_name), ca_subject, key.public_key(), days)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                                  critical=False))
        if alt:
            builder = builder.add_extension(x509.SubjectAlternativeName(_alt_names(alt)), critical=False)
        cert_path, key_path = out / f"{name}.pem", out / f"{name}.key"
        _write_key(key_path, key)
        _write_cert(cert_path, builder.sign(ca_key, hashes.SHA256()))
        return cert_path, key_path

    node = issue("node", "waltz-node", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], hosts)
    made = {c: issue(c, c, [ExtendedKeyUsageOID.CLIENT_AUTH]) for c in clients}
    return TestCertificates(out, out / "ca.pem", node[0], node[1], made)

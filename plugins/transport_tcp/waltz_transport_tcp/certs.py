"""A throw-away certificate authority for TLS tests and development (``waltz certs create``).

It runs the ``openssl`` command line (present wherever Python's ``ssl`` module is, and no extra
Python dependency): one CA, one node certificate valid as TLS server AND client (every Waltz
process both listens and connects, so one certificate per node serves mutual TLS in both roles)
with the requested host names / IP addresses as subject alternative names, and client-only
certificates. Keys are P-256 (fast to generate). The same recipe, by hand::

    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \\
        -subj "/CN=waltz-test-ca" -keyout ca.key -out ca.pem
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=waltz-node" \\
        -keyout node.key -out node.csr
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nextendedKeyUsage=serverAuth,clientAuth\\n' > node.ext
    openssl x509 -req -in node.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \\
        -extfile node.ext -out node.pem

Not for production: the CA key sits next to the certificates, unencrypted.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import attrs

from waltz_core.errors import ConfigError

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


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise ConfigError("the openssl command is needed to create test certificates (apt-get install openssl)")
    done = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ConfigError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")


def _san(hosts: Sequence[str]) -> str:
    names = []
    for h in hosts:
        try:
            ipaddress.ip_address(h)
            names.append(f"IP:{h}")
        except ValueError:
            names.append(f"DNS:{h}")
    return ",".join(names)


def _issue(directory: Path, name: str, subject: str, extensions: str, days: int) -> tuple[Path, Path]:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", subject,
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=directory)
    (directory / f"{name}.ext").write_text(extensions)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", str(days), "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=directory)
    (directory / f"{name}.csr").unlink()
    (directory / f"{name}.ext").unlink()
    (directory / f"{name}.key").chmod(0o600)
    return directory / f"{name}.pem", directory / f"{name}.key"


def create_test_ca(directory: Path | str, hosts: Sequence[str] = DEFAULT_HOSTS, clients: Sequence[str] = ("client",),
                   days: int = 30, ca_name: str = "waltz-test-ca") -> TestCertificates:
    """Write ``ca.pem``/``ca.key``, ``node.pem``/``node.key`` and ``<client>.pem``/``.key`` into ``directory``.

    Blocks (runs openssl, about 50 ms per certificate). ConfigError when openssl is missing or fails.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", str(days),
             "-subj", f"/CN={ca_name}", "-keyout", "ca.key", "-out", "ca.pem", cwd=out)
    (out / "ca.key").chmod(0o600)
    node = _issue(out, "node", "/CN=waltz-node",
                  f"subjectAltName={_san(hosts)}\nextendedKeyUsage=serverAuth,clientAuth\n", days)
    made = {c: _issue(out, c, f"/CN={c}", "extendedKeyUsage=clientAuth\n", days) for c in clients}
    return TestCertificates(out, out / "ca.pem", node[0], node[1], made)

"""CURVE key pairs for the ``zmq`` transport, in ZeroMQ's certificate file format.

Make a key pair per server and per client::

    waltz curve create --dir /etc/waltz/keys server client-1

or from Python, :func:`create_keypair`. Each name gets ``NAME.key`` (public: give it to
peers) and ``NAME.key_secret`` (public and secret: keep it private, mode 0600). Then configure

* the listener: ``curve_server_secret_key_file = "server.key_secret"`` and either
  ``curve_allowed_clients_dir`` (a directory holding the clients' ``*.key`` files) or
  ``curve_allowed_client_keys`` (their Z85 public keys, see :func:`public_key`);
* each client: ``curve_server_public_key_file = "server.key"`` and
  ``curve_client_secret_key_file = "client-1.key_secret"``.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq
import zmq.auth

from waltz_core.errors import ConfigError


def create_keypair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` into ``directory`` (created if missing).

    Returns (public file, secret file). The secret file is made readable by its owner only.
    Blocks on file I/O: call it from setup code, not from an event loop's hot path.
    """
    if not zmq.has("curve"):
        raise ConfigError("this libzmq was built without CURVE support")
    Path(directory).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(os.fspath(directory), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def load_keypair(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    """(public, secret-or-None) Z85 keys from a certificate file; ConfigError when unreadable."""
    try:
        public, secret = zmq.auth.load_certificate(os.fspath(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read CURVE certificate {path}: {exc}") from exc
    return public, secret


def load_secret_keypair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """Like :func:`load_keypair` but the file must hold the secret key too."""
    public, secret = load_keypair(path)
    if secret is None:
        raise ConfigError(f"CURVE certificate {path} has no secret key (use the NAME.key_secret file)")
    return public, secret


def public_key(path: str | os.PathLike[str]) -> str:
    """The Z85 public key stored in a certificate file (for ``curve_allowed_client_keys``)."""
    return load_keypair(path)[0].decode("ascii")


def load_public_keys_dir(directory: str | os.PathLike[str]) -> set[bytes]:
    """Z85 public keys of every ``*.key`` certificate in ``directory``."""
    keys = set()
    for path in sorted(Path(directory).glob("*.key")):
        keys.add(load_keypair(path)[0])
    return keys

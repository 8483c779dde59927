"""The hello handshake that opens every link (sans-IO).

Both sides send a hello frame first: ``b"H"``, the one-byte protocol id (``L`` client/server,
``S`` storage, ``A`` storage admin), the protocol versions they speak and a free-text role.
Each side then uses the highest version both speak. A peer speaking another protocol or no
common version gets a :class:`~waltz_core.errors.HandshakeError` that says which.
"""

from __future__ import annotations

import struct
from typing import Final

import attrs

from ..errors import HandshakeError, ProtocolError
from .wire import Reader, w_str

MAGIC: Final = 0x48  # "H"
_U16: Final = struct.Struct(">H")

PROTOCOL_NAMES: Final = {b"L": "client/server", b"S": "storage", b"A": "storage admin"}


@attrs.frozen(slots=True)
class Hello:
    protocol: bytes  #: one byte: b"L", b"S" or b"A"
    versions: tuple[int, ...]
    role: str  #: for logs, e.g. "waltz-server 0.1.0"


def encode_hello(h: Hello) -> bytes:
    if len(h.protocol) != 1:
        raise ProtocolError("protocol id must be one byte")
    if not 0 < len(h.versions) < 256:
        raise ProtocolError("a hello lists 1..255 versions")
    if not all(0 <= v <= 0xFFFF for v in h.versions):
        raise ProtocolError(f"protocol versions are 16-bit unsigned integers, got {list(h.versions)}")
    out = [bytes([MAGIC]), h.protocol, bytes([len(h.versions)])]
    out.extend(_U16.pack(v) for v in h.versions)
    w_str(out, h.role)
    return b"".join(out)


def decode_hello(buf: bytes | memoryview) -> Hello:
    if len(buf) < 3 or buf[0] != MAGIC:
        raise HandshakeError("expected a hello frame first; the peer does not speak the Waltz protocol")
    protocol = bytes(buf[1:2])
    n = buf[2]
    r = Reader(buf, 3, "hello")
    versions = tuple(r.unpack(_U16, "version")[0] for _ in range(n))
    role = r.str("role")
    r.done()
    return Hello(protocol, versions, role)


def negotiate(local: Hello, remote: Hello) -> int:
    """The protocol version both sides speak; :class:`HandshakeError` if none."""
    if remote.protocol != local.protocol:
        want = PROTOCOL_NAMES.get(local.protocol, repr(local.protocol))
        got = PROTOCOL_NAMES.get(remote.protocol, repr(remote.protocol))
        raise HandshakeError(f"peer {remote.role!r} speaks the {got} protocol, this endpoint speaks {want}")
    common = set(local.versions) & set(remote.versions)
    if not common:
        raise HandshakeError(
            f"no common protocol version with {remote.role!r}: we speak {sorted(local.versions)}, "
            f"it speaks {sorted(remote.versions)}; upgrade the older side"
        )
    return max(common)

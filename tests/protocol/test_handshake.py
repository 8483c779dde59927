"""Hello handshake: version negotiation and clear refusals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from waltz_core.errors import HandshakeError, ProtocolError
from waltz_core.protocol import FAMILIES
from waltz_core.protocol.handshake import Hello, decode_hello, encode_hello, negotiate

version_sets = st.sets(st.integers(0, 2**16 - 1), min_size=1, max_size=10)


@given(a=version_sets, b=version_sets, shared=st.integers(0, 2**16 - 1))
def test_negotiation_picks_the_highest_common_version(a: set[int], b: set[int], shared: int) -> None:
    a, b = a | {shared}, b | {shared}
    local = Hello(b"L", tuple(sorted(a)), "server")
    remote = Hello(b"L", tuple(sorted(b, reverse=True)), "client")  # order on the wire does not matter
    assert negotiate(local, remote) == max(a & b)
    assert negotiate(remote, local) == max(a & b)


def test_negotiation_over_the_wire() -> None:
    server = Hello(b"S", (1, 2, 3), "storage-node")
    client = decode_hello(encode_hello(Hello(b"S", (2, 3, 4), "server 0.1")))
    assert negotiate(server, client) == 3


def test_other_protocol_is_refused_naming_both() -> None:
    with pytest.raises(HandshakeError, match="speaks the storage protocol, this endpoint speaks client/server"):
        negotiate(Hello(b"L", (1,), "server"), Hello(b"S", (1,), "storage-client"))
    with pytest.raises(HandshakeError, match=r"b'Z' protocol"):
        negotiate(Hello(b"A", (1,), "admin"), Hello(b"Z", (1,), "other"))


def test_no_common_version_is_refused_listing_both() -> None:
    with pytest.raises(HandshakeError, match=r"no common protocol version with 'old-client': we speak \[3, 4\], it speaks \[1, 2\]"):
        negotiate(Hello(b"L", (4, 3), "server"), Hello(b"L", (1, 2), "old-client"))


def test_handshake_error_is_a_protocol_error() -> None:
    assert issubclass(HandshakeError, ProtocolError)


def test_every_family_negotiates_with_itself() -> None:
    for fam in FAMILIES:
        hello = Hello(fam.protocol, fam.versions, fam.name)
        assert negotiate(hello, decode_hello(encode_hello(hello))) == max(fam.versions)


def test_encode_hello_rejects_invalid_hellos() -> None:
    with pytest.raises(ProtocolError):
        encode_hello(Hello(b"LL", (1,), "x"))
    with pytest.raises(ProtocolError):
        encode_hello(Hello(b"L", (), "x"))
    with pytest.raises(ProtocolError):
        encode_hello(Hello(b"L", (2**16,), "x"))


def test_empty_version_list_from_a_peer_is_refused() -> None:
    raw = b"HL\x00" + (1).to_bytes(4, "big") + b"x"  # zero versions, role "x"
    with pytest.raises(HandshakeError):
        negotiate(Hello(b"L", (1,), "server"), decode_hello(raw))

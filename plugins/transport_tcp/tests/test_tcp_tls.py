"""TLS on the tcp transport: the conformance kit with mutual TLS on, refusals, and no plaintext on the wire."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from waltz_core.cli.main import build_cli
from waltz_core.errors import ConfigError, ConnectError, ConnectionClosedError
from waltz_core.testing.conformance.transport import TransportConformance
from waltz_core.testing.faults.proxy import capture_echo_exchange
from waltz_core.transport.base import Connection
from waltz_transport_tcp import TcpOptions, TcpTransport
from waltz_transport_tcp.certs import TestCertificates, create_test_ca

PAYLOAD = b"WALTZ-KNOWN-PLAINTEXT-0123456789"
STEP = 20.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TestCertificates:
    return create_test_ca(tmp_path_factory.mktemp("ca"), clients=("client",))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> TestCertificates:
    """A second, untrusted CA with its own client and node certificates."""
    return create_test_ca(tmp_path_factory.mktemp("other-ca"), clients=("intruder",), ca_name="intruder-ca")


class TestTcpTransportWithMutualTls(TransportConformance):
    """The whole kit over mutual TLS (both sides present node certificates of one CA).

    ``raw-socket`` is not declared: the kit's raw peers speak plaintext frames, which a TLS
    listener refuses by design (tested below).
    """

    backend_name = "tcp"
    capabilities = frozenset({"heartbeat", "send-nowait"})
    idle_timeout = 0.6

    @pytest.fixture
    def transport_options(self, certs: TestCertificates) -> dict[str, Any]:
        return {"heartbeat_interval": 0.1, "idle_timeout": 0.6, **certs.server_options(mutual=True)}


@pytest.fixture
async def make() -> AsyncIterator[Callable[..., TcpTransport]]:
    made: list[TcpTransport] = []

    def build(**options: Any) -> TcpTransport:
        # long: a refusal comes from the handshake at once, and a loaded CI machine must not turn
        # one into "no answer" (it did once, in the e2e matrix's CURVE cell)
        t = TcpTransport(1024 * 1024, TcpOptions(**options), connect_timeout=20.0)
        made.append(t)
        return t

    yield build
    for t in made:
        await t.aclose()


async def _echo(conn: Connection) -> None:
    with contextlib.suppress(ConnectionClosedError):
        while True:
            await conn.send(await conn.recv())


async def _refused(transport: TcpTransport, address: str) -> str:
    """Connect and exchange one frame; return the error message (the exchange must fail)."""
    with pytest.raises((ConnectError, ConnectionClosedError)) as info:
        conn = await transport.connect(address)
        try:
            async with asyncio.timeout(STEP):
                await conn.send(b"let me in")
                await conn.recv()
        finally:
            await conn.close()
    return str(info.value)


async def test_mutual_tls_refuses_clients_without_a_valid_certificate(
    make: Callable[..., TcpTransport], certs: TestCertificates, other_ca: TestCertificates
) -> None:
    handled: list[str] = []

    async def handler(conn: Connection) -> None:
        handled.append(conn.peer)
        await _echo(conn)

    listener = await make(**certs.server_options(mutual=True)).listen("127.0.0.1", 0, handler)
    try:
        # The right client certificate works (control).
        conn = await make(**certs.client_options("client")).connect(listener.address)
        async with asyncio.timeout(STEP):
            await conn.send(b"hello")
            assert await conn.recv() == b"hello"
        await conn.close()
        assert len(handled) == 1

        # TLS but no client certificate.
        msg = await _refused(make(tls_ca=str(certs.ca)), listener.address)
        assert "TLS" in msg and "refused our TLS credentials" in msg
        # A certificate from an untrusted CA (the client trusts the server, the server does not trust it).
        msg = await _refused(make(**{**other_ca.client_options("intruder"), "tls_ca": str(certs.ca)}), listener.address)
        assert "TLS" in msg
        # Plaintext client: closed before any data, with a hint about TLS.
        msg = await _refused(make(), listener.address)
        assert "requires TLS" in msg
        # The client does not trust the server's CA: its own handshake fails, naming the reason.
        with pytest.raises(ConnectError, match="TLS handshake failed: CERTIFICATE_VERIFY_FAILED"):
            await make(**other_ca.client_options("intruder")).connect(listener.address)
        assert len(handled) == 1, "a refused client reached the handler"
    finally:
        await listener.close()


async def test_server_only_tls_accepts_clients_without_certificate(
    make: Callable[..., TcpTransport], certs: TestCertificates
) -> None:
    listener = await make(**certs.server_options(mutual=False)).listen("127.0.0.1", 0, _echo)
    conn = await make(tls_ca=str(certs.ca)).connect(listener.address)
    async with asyncio.timeout(STEP):
        await conn.send(b"no client cert")
        assert await conn.recv() == b"no client cert"
    await conn.close()
    # The host name is verified: the node certificate is not valid for another name.
    with pytest.raises(ConnectError, match="TLS handshake failed"):
        await make(tls_ca=str(certs.ca), tls_server_name="elsewhere.example").connect(listener.address)
    await listener.close()


async def test_tls_client_to_plaintext_server_and_back_name_the_mismatch(
    make: Callable[..., TcpTransport], certs: TestCertificates
) -> None:
    plain = await make().listen("127.0.0.1", 0, _echo)
    with pytest.raises(ConnectError, match="TLS"):
        await make(**certs.client_options()).connect(plain.address)
    await plain.close()


async def _exchange_through_relay(server: TcpTransport, client: TcpTransport) -> bytes:
    return await capture_echo_exchange(server, client, PAYLOAD, STEP)


async def test_tls_traffic_is_not_plaintext(make: Callable[..., TcpTransport], certs: TestCertificates) -> None:
    # Control: without TLS the relay sees the payload, so the capture really works.
    plain = await _exchange_through_relay(make(), make())
    assert PAYLOAD in plain
    secure = await _exchange_through_relay(make(**certs.server_options()), make(**certs.client_options()))
    assert len(secure) > 40 * len(PAYLOAD), "the encrypted exchange went through the relay"
    assert PAYLOAD not in secure
    assert PAYLOAD[:12] not in secure  # not even a fragment


def test_bad_tls_configuration_is_a_config_error(tmp_path: Path, certs: TestCertificates) -> None:
    with pytest.raises(ConfigError, match="cannot load TLS certificate"):
        TcpTransport(1024, TcpOptions(tls_cert=str(tmp_path / "missing.pem")))
    with pytest.raises(ConfigError, match="cannot load TLS CA bundle"):
        TcpTransport(1024, TcpOptions(tls_ca=str(tmp_path / "missing-ca.pem")))
    with pytest.raises(ConfigError, match="cannot load TLS certificate"):  # a key that does not match
        TcpTransport(1024, TcpOptions(tls_cert=str(certs.node_cert), tls_key=str(certs.clients["client"][1])))
    with pytest.raises(ValueError, match="tls_key is set but tls_cert is not"):
        TcpOptions(tls_key=str(certs.node_key))


async def test_listening_needs_a_certificate_when_tls_is_on(certs: TestCertificates) -> None:
    transport = TcpTransport(1024, TcpOptions(tls_ca=str(certs.ca)))
    assert transport.encrypted
    with pytest.raises(ConfigError, match="tls_cert is not set"):
        await transport.listen("127.0.0.1", 0, _echo)
    assert TcpTransport(1024, TcpOptions()).encrypted is False


def test_waltz_certs_create_command(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    result = CliRunner().invoke(build_cli(), ["certs", "create", "--dir", str(out), "--client", "app-1",
                                              "--host", "127.0.0.1", "--host", "node-a.internal"])
    assert result.exit_code == 0, result.output
    for name in ("ca.pem", "ca.key", "node.pem", "node.key", "app-1.pem", "app-1.key"):
        assert (out / name).stat().st_size > 100, name
    assert f'tls_ca = "{out / "ca.pem"}"' in result.output
    assert (out / "node.key").stat().st_mode & 0o077 == 0, "private keys are not world-readable"
    # The certificates it wrote are usable: the transport loads them.
    TcpTransport(1024, TcpOptions(tls_cert=str(out / "node.pem"), tls_key=str(out / "node.key"),
                                  tls_ca=str(out / "ca.pem")))


def test_the_transport_says_when_its_certificate_and_its_ca_expire(certs: TestCertificates, tmp_path: Path) -> None:
    from cryptography import x509

    def not_after(path: Path) -> float:
        return x509.load_pem_x509_certificate(path.read_bytes()).not_valid_after_utc.timestamp()

    tls = TcpTransport(options=TcpOptions(tls_cert=str(certs.node_cert), tls_key=str(certs.node_key),
                                          tls_ca=str(certs.ca)))
    expiry = tls.certificate_expiry()
    assert expiry == {f"tls_cert {certs.node_cert}": not_after(certs.node_cert),
                      f"tls_ca {certs.ca} CN=waltz-test-ca": not_after(certs.ca)}
    assert TcpTransport(options=TcpOptions()).certificate_expiry() == {}
    # A CA bundle of two: each CA is watched.
    bundle = tmp_path / "bundle.pem"
    other = create_test_ca(tmp_path / "other", ca_name="second-ca", days=3)
    bundle.write_bytes(certs.ca.read_bytes() + other.ca.read_bytes())
    client = TcpTransport(options=TcpOptions(tls_ca=str(bundle)))
    assert sorted(client.certificate_expiry()) == [f"tls_ca {bundle} CN=second-ca", f"tls_ca {bundle} CN=waltz-test-ca"]

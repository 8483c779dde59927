"""Entry-point plugin module of the TCP transport: registers ``tcp`` and the ``waltz certs`` commands."""

from __future__ import annotations

from pathlib import Path

import click

from waltz_core.config import TransportConfig
from waltz_core.hookspecs import hookimpl
from waltz_core.registry import Registry, TransportFactory

from .options import TcpOptions
from .transport import TcpTransport


def tcp_factory(config: TransportConfig, options: TcpOptions | None) -> TcpTransport:
    """Build the transport from ``[transport]`` and its validated ``[transport.tcp]`` options."""
    return TcpTransport(config.max_frame_size, options or TcpOptions(), connect_timeout=config.connect_timeout)


@hookimpl
def waltz_register_transports(registry: Registry[TransportFactory]) -> None:
    registry.add(
        "tcp",
        tcp_factory,
        config_cls=TcpOptions,
        description="asyncio TCP, length-prefixed frames, heartbeats, back pressure, optional (mutual) TLS",
        capabilities={"heartbeat", "raw-socket"},
    )


@click.group("certs")
def certs_group() -> None:
    """Test certificates for the tcp transport's TLS (a throw-away CA; not for production)."""


@certs_group.command("create")
@click.option("--dir", "directory", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory to write ca.pem, node.pem/key and the client certificates into.")
@click.option("--host", "hosts", multiple=True, default=("127.0.0.1", "localhost"), show_default=True,
              help="Host name or IP address the node certificate is valid for (repeatable).")
@click.option("--client", "clients", multiple=True, default=("client",), show_default=True,
              help="Name of a client certificate to issue (repeatable).")
@click.option("--days", type=click.IntRange(1), default=30, show_default=True, help="Validity in days.")
def certs_create(directory: Path, hosts: tuple[str, ...], clients: tuple[str, ...], days: int) -> None:
    """Create a test CA, a node certificate (TLS server and client) and client certificates."""
    from .certs import create_test_ca

    made = create_test_ca(directory, hosts, clients, days)
    click.echo(f"CA:   {made.ca}\nnode: {made.node_cert} (key {made.node_key}) for {', '.join(hosts)}")
    for name, (cert, key) in made.clients.items():
        click.echo(f"client {name}: {cert} (key {key})")
    click.echo("\n# storage and server processes ([transport.tcp], mutual TLS):\n"
               f'tls_cert = "{made.node_cert}"\ntls_key = "{made.node_key}"\ntls_ca = "{made.ca}"')
    if made.clients:
        name, (cert, key) = next(iter(made.clients.items()))
        click.echo(f'\n# a client ({name}):\ntls_cert = "{cert}"\ntls_key = "{key}"\ntls_ca = "{made.ca}"')


@hookimpl
def waltz_add_commands(cli: click.Group) -> None:
    cli.add_command(certs_group)

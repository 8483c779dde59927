"""Entry-point plugin module of the ZeroMQ transport: registers ``zmq`` and ``waltz curve``."""

from __future__ import annotations

from pathlib import Path

import click

from waltz_core.hookspecs import hookimpl
from waltz_core.registry import Registry, TransportFactory

from .options import ZmqOptions
from .transport import zmq_factory


@hookimpl
def waltz_register_transports(registry: Registry[TransportFactory]) -> None:
    registry.add(
        "zmq",
        zmq_factory,
        config_cls=ZmqOptions,
        description="ZeroMQ DEALER/ROUTER, credit windows, heartbeats, optional CURVE encryption",
        capabilities={"heartbeat"},
    )


@click.group("curve")
def curve_group() -> None:
    """CURVE key pairs for the zmq transport's encryption and authentication."""


@curve_group.command("create")
@click.option("--dir", "directory", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory to write NAME.key (public) and NAME.key_secret (mode 0600) into.")
@click.argument("names", nargs=-1, required=True)
def curve_create(directory: Path, names: tuple[str, ...]) -> None:
    """Create a key pair for each NAME (a server, a client): NAME.key and NAME.key_secret."""
    from .keys import create_keypair, public_key

    for name in names:
        if not name or "/" in name or name.startswith("."):
            raise click.BadParameter(f"{name!r} is not a plain file name", param_hint="NAME")
    for name in names:
        public, secret = create_keypair(directory, name)
        click.echo(f"{name}: public {public} ({public_key(public)}), secret {secret}")


@hookimpl
def waltz_add_commands(cli: click.Group) -> None:
    cli.add_command(curve_group)

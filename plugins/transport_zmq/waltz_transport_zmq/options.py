"""Options of the ``zmq`` transport (``[transport.zmq]`` in a config file)."""

from __future__ import annotations

import attrs


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@attrs.frozen(slots=True)
class ZmqOptions:
    """Heartbeat, flow-control, high-water-mark and CURVE settings of the ZeroMQ transport.

    Heartbeats are control messages sent when nothing else was sent for ``heartbeat_interval``;
    a connection on which nothing arrived for ``heartbeat_timeout`` fails with
    :class:`~waltz_core.errors.PeerTimeoutError`. Both sides should use the same values.

    Flow control is a credit window per direction: a sender may have at most ``window_frames``
    frames and ``window_bytes`` bytes (a single larger frame is always allowed alone) that the
    receiving application has not consumed yet (a frame may start while the window is not
full, so at most ``window_bytes`` plus one frame is in flight); beyond that ``send`` waits. This bounds memory
    per connection on both sides, and keeps the listener's shared ROUTER socket reading even when
    one handler stops reading. ``send_hwm``/``recv_hwm`` are ZeroMQ's per-pipe high-water marks
    (in messages); the ROUTER runs with ``ROUTER_MANDATORY`` so hitting them makes ``send`` wait
    and retry instead of ZeroMQ silently dropping the message.

    CURVE (all values are paths to files made by :func:`waltz_transport_zmq.keys.create_keypair`,
    ZeroMQ's certificate format): a listener with ``curve_server_secret_key_file`` is a CURVE
    server; a client with ``curve_server_public_key_file`` encrypts and authenticates the server
    and, with ``curve_client_secret_key_file``, authenticates itself (an ephemeral key pair is used
    otherwise). ``curve_allowed_client_keys`` (Z85 public keys) and ``curve_allowed_clients_dir``
    (a directory of ``*.key`` public certificates, re-read at every handshake) restrict the clients
    a CURVE listener accepts; with neither, any client that completes the CURVE handshake is
    accepted (encryption without client authentication).
    """

    heartbeat_interval: float = attrs.field(
        default=1.0, validator=attrs.validators.ge(0.0),
        metadata=_doc("Seconds of send silence after which a heartbeat is sent; 0 disables heartbeats."))
    heartbeat_timeout: float = attrs.field(
        default=10.0, validator=attrs.validators.ge(0.0),
        metadata=_doc("Seconds without any received message after which the peer is declared dead; 0 disables."))
    window_frames: int = attrs.field(
        default=4096, validator=attrs.validators.ge(1),
        metadata=_doc("Frames a peer may send us that our application has not read yet (credit window)."))
    window_bytes: int = attrs.field(
        default=8 * 1024 * 1024, validator=attrs.validators.ge(1),
        metadata=_doc("Bytes a peer may send us that our application has not read yet (credit window)."))
    send_hwm: int = attrs.field(
        default=8192, validator=attrs.validators.ge(1),
        metadata=_doc("ZeroMQ send high-water mark per peer, in messages (ZMQ_SNDHWM)."))
    recv_hwm: int = attrs.field(
        default=8192, validator=attrs.validators.ge(1),
        metadata=_doc("ZeroMQ receive high-water mark per peer, in messages (ZMQ_RCVHWM)."))
    close_timeout: float = attrs.field(
        default=5.0, validator=attrs.validators.gt(0.0),
        metadata=_doc("Seconds close() waits for the peer to confirm it received everything sent before."))
    curve_server_secret_key_file: str = attrs.field(
        default="", metadata=_doc("Listener: this server's secret certificate (NAME.key_secret); enables CURVE."))
    curve_server_public_key_file: str = attrs.field(
        default="", metadata=_doc("Client: the server's public certificate (NAME.key); enables CURVE on connect."))
    curve_client_secret_key_file: str = attrs.field(
        default="", metadata=_doc("Client: this client's secret certificate (NAME.key_secret)."))
    curve_allowed_client_keys: list[str] = attrs.field(
        factory=list, metadata=_doc("Listener: Z85 public keys of the clients allowed to connect."))
    curve_allowed_clients_dir: str = attrs.field(
        default="", metadata=_doc("Listener: directory of *.key public certificates of allowed clients."))

    def __attrs_post_init__(self) -> None:
        if self.heartbeat_interval and self.heartbeat_timeout and self.heartbeat_interval >= self.heartbeat_timeout:
            raise ValueError(f"heartbeat_interval ({self.heartbeat_interval}) must be below "
                             f"heartbeat_timeout ({self.heartbeat_timeout}), or idle peers would time out")
        if self.curve_client_secret_key_file and not self.curve_server_public_key_file:
            raise ValueError("curve_client_secret_key_file needs curve_server_public_key_file "
                             "(a CURVE client must know the server's public key)")
        if (self.curve_allowed_client_keys or self.curve_allowed_clients_dir) and not self.curve_server_secret_key_file:
            raise ValueError("curve_allowed_client_keys/curve_allowed_clients_dir need curve_server_secret_key_file")

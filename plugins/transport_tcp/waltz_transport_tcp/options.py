"""Options of the ``tcp`` transport (``[transport.tcp]`` in a config file)."""

from __future__ import annotations

import attrs


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@attrs.frozen(slots=True)
class TcpOptions:
    """Socket, heartbeat and buffer settings of the TCP transport.

    Heartbeats are zero-length frames written when nothing else was sent for
    ``heartbeat_interval``; a connection on which nothing (not even a heartbeat) arrived for
    ``idle_timeout`` fails with :class:`~waltz_core.errors.PeerTimeoutError`. Both sides should
    use the same values; detection takes between ``idle_timeout`` and ``idle_timeout`` plus one
    heartbeat interval.

    TLS (see :mod:`waltz_transport_tcp.tls`) is on when ``tls`` is true or ``tls_cert`` / ``tls_ca``
    is set. A listener then presents ``tls_cert``/``tls_key``; when ``tls_ca`` is set on a listener
    (and ``tls_verify_clients`` is left true) every client must present a certificate signed by it
    (mutual TLS). A connecting side verifies the server against ``tls_ca`` (or the system store)
    and presents ``tls_cert``/``tls_key`` as its client certificate when they are set. One table
    serves a process that both listens and connects (a server: clients in, storage nodes out).
    """

    nodelay: bool = attrs.field(default=True, metadata=_doc("Set TCP_NODELAY (no Nagle delay on small frames)."))
    keepalive: bool = attrs.field(default=True, metadata=_doc("Set SO_KEEPALIVE (the kernel probes dead peers too)."))
    heartbeat_interval: float = attrs.field(
        default=1.0, validator=attrs.validators.ge(0.0),
        metadata=_doc("Seconds of send silence after which a heartbeat frame is written; 0 disables heartbeats."))
    idle_timeout: float = attrs.field(
        default=10.0, validator=attrs.validators.ge(0.0),
        metadata=_doc("Seconds without any received byte after which the peer is declared dead; 0 disables."))
    write_buffer_high: int = attrs.field(
        default=1024 * 1024, validator=attrs.validators.ge(1),
        metadata=_doc("Bytes buffered for writing above which send waits (back pressure)."))
    write_buffer_low: int = attrs.field(
        default=256 * 1024, validator=attrs.validators.ge(0),
        metadata=_doc("Bytes buffered for writing below which waiting senders resume."))
    read_chunk_size: int = attrs.field(
        default=256 * 1024, validator=attrs.validators.ge(4096),
        metadata=_doc("Size of the buffer one socket read fills."))
    read_queue_frames: int = attrs.field(
        default=4096, validator=attrs.validators.ge(1),
        metadata=_doc("Received frames queued before the socket stops being read (back pressure on the peer)."))
    read_queue_bytes: int = attrs.field(
        default=4 * 1024 * 1024, validator=attrs.validators.ge(1),
        metadata=_doc("Received bytes queued before the socket stops being read (back pressure on the peer)."))
    close_timeout: float = attrs.field(
        default=5.0, validator=attrs.validators.gt(0.0),
        metadata=_doc("Seconds close() waits for queued frames to be flushed before it aborts the connection."))

    tls: bool = attrs.field(
        default=False,
        metadata=_doc("Use TLS even without tls_cert/tls_ca (a client trusting the system CA store)."))
    tls_cert: str = attrs.field(
        default="", metadata=_doc("PEM certificate (chain) of this process: the server certificate of its "
                                  "listeners and its client certificate when it connects. Turns TLS on."))
    tls_key: str = attrs.field(default="", metadata=_doc("PEM private key of tls_cert (default: read from tls_cert)."))
    tls_ca: str = attrs.field(
        default="", metadata=_doc("PEM CA bundle. Connecting: the CAs that may sign servers (default: system store). "
                                  "Listening: client certificates signed by it are REQUIRED (mutual TLS). "
                                  "Turns TLS on."))
    tls_verify_clients: bool = attrs.field(
        default=True, metadata=_doc("With tls_ca on a listener, require client certificates; false = server-only TLS."))
    tls_verify: bool = attrs.field(
        default=True, metadata=_doc("Verify the server's certificate and host name when connecting "
                                    "(false only for development: a warning is logged)."))
    tls_server_name: str = attrs.field(
        default="", metadata=_doc("Host name expected in server certificates (default: the host of the address)."))

    @property
    def tls_enabled(self) -> bool:
        """True when connections and listeners of this transport use TLS."""
        return self.tls or bool(self.tls_cert) or bool(self.tls_ca)

    def __attrs_post_init__(self) -> None:
        if self.tls_key and not self.tls_cert:
            raise ValueError("tls_key is set but tls_cert is not")
        if self.write_buffer_low > self.write_buffer_high:
            raise ValueError(f"write_buffer_low ({self.write_buffer_low}) must not exceed "
                             f"write_buffer_high ({self.write_buffer_high})")
        if self.heartbeat_interval and self.idle_timeout and self.heartbeat_interval >= self.idle_timeout:
            raise ValueError(f"heartbeat_interval ({self.heartbeat_interval}) must be below "
                             f"idle_timeout ({self.idle_timeout}), or idle peers would time out")

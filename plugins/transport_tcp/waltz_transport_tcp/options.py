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
    heartbeat interval. TLS settings will join this class later (``tls_*``).
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

    def __attrs_post_init__(self) -> None:
        if self.write_buffer_low > self.write_buffer_high:
            raise ValueError(f"write_buffer_low ({self.write_buffer_low}) must not exceed "
                             f"write_buffer_high ({self.write_buffer_high})")
        if self.heartbeat_interval and self.idle_timeout and self.heartbeat_interval >= self.idle_timeout:
            raise ValueError(f"heartbeat_interval ({self.heartbeat_interval}) must be below "
                             f"idle_timeout ({self.idle_timeout}), or idle peers would time out")

"""TLS contexts of the tcp transport, built once per transport from :class:`TcpOptions`.

asyncio does the TLS work (``create_server`` / ``create_connection`` with an ``ssl`` context); the
frame protocol above it is unchanged. Failures are made explicit: an unreadable certificate is a
:class:`~waltz_core.errors.ConfigError` when the transport is built, a failed handshake is a
:class:`~waltz_core.errors.ConnectError` naming TLS, and a connection the peer ends with a TLS
alert (e.g. a mutual-TLS server refusing our certificate, which under TLS 1.3 the client only
learns after its own handshake finished) fails with a message naming TLS as well.
"""

from __future__ import annotations

import logging
import ssl

from waltz_core.errors import ConfigError

from .options import TcpOptions

log = logging.getLogger("waltz.transport.tcp")

#: First two bytes of a TLS record (handshake 0x16 or alert 0x15, major version 3): never a valid
#: Waltz length prefix below 16 MiB, so a plaintext endpoint can name the mistake instead of
#: reporting an absurd frame length.
TLS_RECORD_TYPES = (0x15, 0x16)


def looks_like_tls(data: bytes | memoryview) -> bool:
    """True when ``data`` starts like a TLS record (a peer speaking TLS to a plaintext endpoint)."""
    return len(data) >= 2 and data[0] in TLS_RECORD_TYPES and data[1] == 3


def _load_chain(ctx: ssl.SSLContext, options: TcpOptions) -> None:
    try:
        ctx.load_cert_chain(options.tls_cert, options.tls_key or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS certificate {options.tls_cert!r} / key "
                          f"{options.tls_key or options.tls_cert!r}: {exc}") from exc


def _load_ca(ctx: ssl.SSLContext, options: TcpOptions) -> None:
    try:
        ctx.load_verify_locations(cafile=options.tls_ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS CA bundle {options.tls_ca!r}: {exc}") from exc


def server_context(options: TcpOptions) -> ssl.SSLContext | None:
    """The listeners' context, None without TLS; ConfigError when TLS is on but no certificate is set."""
    if not options.tls_enabled:
        return None
    if not options.tls_cert:
        # A client-only TLS table (tls = true or tls_ca alone) cannot serve: say so when listening.
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, options)
    if options.tls_ca and options.tls_verify_clients:
        _load_ca(ctx, options)
        ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: no certificate, no connection
    return ctx


def client_context(options: TcpOptions) -> ssl.SSLContext | None:
    """The connecting side's context, None without TLS."""
    if not options.tls_enabled:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if options.tls_ca:
        _load_ca(ctx, options)
    else:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    if not options.tls_verify:
        log.warning("tcp transport: tls_verify = false, server certificates are NOT checked (development only)")
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if options.tls_cert:
        _load_chain(ctx, options)
    return ctx


def describe_tls_error(exc: BaseException) -> str:
    """A one-line reason for a TLS failure (OpenSSL's reason code when it has one)."""
    reason = getattr(exc, "reason", None)
    verify = getattr(exc, "verify_message", None)
    if verify:
        return f"{reason or 'certificate verify failed'}: {verify}"
    return str(reason or exc)


def certificate_expiry(options: TcpOptions) -> dict[str, float]:
    """When each certificate this transport presents or trusts stops being valid (``notAfter``, in
    seconds since the epoch): ``tls_cert`` (the first certificate of the file, the process's own)
    and each CA of ``tls_ca``, keyed ``"tls_cert <file>"`` / ``"tls_ca <file> <subject>"``.
    Files that do not parse are left out: building the contexts has reported them already."""
    from cryptography import x509

    out: dict[str, float] = {}
    for key, path in (("tls_cert", options.tls_cert), ("tls_ca", options.tls_ca)):
        if not path:
            continue
        try:
            with open(path, "rb") as fh:
                certs = x509.load_pem_x509_certificates(fh.read())
        except (OSError, ValueError):
            continue
        for cert in certs[:1] if key == "tls_cert" else certs:
            name = f"{key} {path}" if key == "tls_cert" else f"{key} {path} {cert.subject.rfc4514_string()}"
            out[name] = cert.not_valid_after_utc.timestamp()
    return out

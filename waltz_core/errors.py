"""The one exception tree of Waltz, with the wire code of every class.

::

    class                                   code  retriable  meaning
    WaltzError                                 1  no         the root; raised only through a subclass
    ├── ConfigError                          100  no         bad configuration; names the key and the file
    ├── PluginError                          150  no         a plugin misbehaved while registering
    │   └── BackendNotFoundError             151  no         a backend name nobody registered
    ├── ProtocolError                        200  no         bytes that do not decode; the connection is closed
    │   ├── FrameTooLargeError               201  no         a frame above the configured maximum
    │   ├── ChecksumError                    202  yes        CRC-32 of transaction data does not match
    │   └── HandshakeError                   203  no         no common protocol version / wrong protocol
    ├── TransportError                       300  yes        the link failed; reconnect and retry
    │   ├── ConnectError                     301  yes        could not connect
    │   ├── ConnectionClosedError            302  yes        used after close, or closed by the peer
    │   └── PeerTimeoutError                 303  yes        the peer stopped answering (heartbeats)
    │       └── RequestTimeoutError          304  yes        a request got no answer within its deadline
    ├── CoordinationError                    400  yes        coordination backend failure
    │   ├── SessionLostError                 401  yes        the session/lease expired; ephemerals are gone
    │   ├── CasConflictError                 402  yes        compare-and-set lost a race (re-read, retry)
    │   ├── NodeExistsError                  403  no         create-if-absent found a value
    │   ├── NoNodeError                      404  no         the key does not exist
    │   ├── ClusterNotFoundError             405  no         no cluster under that root
    │   └── MetadataEditError                406  no         an admin edit that would make cluster metadata inconsistent
    ├── StorageError                         500  varies     a storage node refused a request
    │   ├── ClusterKeyMismatchError          501  no         storage belongs to another cluster
    │   ├── StaleSessionError                502  no         a higher store session exists (fenced)
    │   ├── OutOfOrderAppendError            503  no         append does not continue the log
    │   ├── PartitionNotFoundError           504  yes        partition not assigned / not available here
    │   └── StorageCorruptionError           505  no         on-disk data failed its checksums
    ├── ServerError                          600  varies     a Waltz server refused a request
    │   ├── GenerationMismatchError          601  yes        partition moved; refresh the assignment
    │   └── PartitionNotReadyError           602  yes        the server does not (yet) own the partition
    └── ClientError                          700  varies     raised to applications
        ├── ClientClosedError                701  no         the client was closed
        ├── ClientTimeoutError               702  yes        an operation did not finish in time
        ├── ClientAheadError                 703  no         client high-water mark is above the server's
        ├── TransactionExpiredError          704  no         a transaction context's deadline/retries ran out
        └── TransactionTooLargeError         705  no         an append would not fit in one frame
            └── TooManyLocksError            706  no         an append names more locks than the server takes

Policy flags
    ``retriable`` says whether the same request may succeed if sent again (possibly elsewhere);
    ``refresh_assignment`` says the partition assignment should be re-read first. Retry loops read
    them through :mod:`waltz_core.retry` (``is_retriable``, ``needs_refresh``), never through
    ``except`` lists of class names.

Wire codes
    Failures cross the wire as ``(error_code: int, message: str)``, translated once at each
    boundary: the producer calls :func:`wire_code`, the consumer :func:`error_from_wire`.
    The hundreds are the families: 1xx configuration and plugins (100-149 configuration, 150-199
    plugins), 2xx protocol, 3xx transport, 4xx coordination, 5xx storage, 6xx server, 7xx client.

    - Codes are stable: a code is never reused for another class, and a class never changes its
      code (a peer of another version must read the same meaning). New classes take the next free
      code of their family. Uniqueness is checked when this module is imported.
    - An exception class outside this module (``RecoveryRefused(StorageError)``) has no code of its
      own: it is sent with the code of its nearest ancestor here.
    - Non-Waltz exceptions (a bug, an untranslated library error) are sent as the family's generic
      internal error: ``wire_code(exc)`` gives :class:`StorageError`'s code unless told otherwise.
    - An unknown code (a newer peer) becomes the base class of its family (an unknown 5xx is a
      :class:`StorageError`, an unknown 16x a :class:`PluginError`), with the code in the message;
      a code outside every family becomes a :class:`StorageError`, as an unknown class name did
      before codes: not retriable, so nothing retries what it does not understand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, TypeVar

__all__ = [
    "BackendNotFoundError", "CasConflictError", "ChecksumError", "ClientAheadError", "ClientClosedError",
    "ClientError", "ClientTimeoutError", "ClusterKeyMismatchError", "ClusterNotFoundError", "ConfigError",
    "ConnectError", "ConnectionClosedError", "CoordinationError", "FrameTooLargeError", "GenerationMismatchError",
    "HandshakeError", "MetadataEditError", "NoNodeError", "NodeExistsError", "OutOfOrderAppendError",
    "PartitionNotFoundError", "PartitionNotReadyError", "PeerTimeoutError", "PluginError", "ProtocolError",
    "RequestTimeoutError", "ServerError", "SessionLostError", "StaleSessionError", "StorageCorruptionError",
    "StorageError", "TooManyLocksError", "TransactionExpiredError", "TransactionTooLargeError", "TransportError",
    "WaltzError", "error_from_wire", "wire_code",
]

_E = TypeVar("_E", bound="type[WaltzError]")

#: code -> class, filled by :func:`_code` as the classes below are defined
_BY_CODE: dict[int, type[WaltzError]] = {}


def _code(code: int) -> Callable[[_E], _E]:
    """Give a class its wire code (the kazoo ``_zookeeper_exception`` registry): unique, or import fails."""

    def register(cls: _E) -> _E:
        if code in _BY_CODE:
            raise RuntimeError(f"wire code {code} of {cls.__name__} is already {_BY_CODE[code].__name__}'s")
        cls.code = code
        _BY_CODE[code] = cls
        return cls

    return register


@_code(1)
class WaltzError(Exception):
    """Base of every error Waltz raises on purpose."""

    code: ClassVar[int]  #: the stable wire code (module docstring); subclasses elsewhere inherit it
    retriable: bool = False
    refresh_assignment: bool = False


# ------------------------------------------------------------------------------ configuration
@_code(100)
class ConfigError(WaltzError):
    """Invalid configuration. The message names the key and, when known, the file."""


@_code(150)
class PluginError(WaltzError):
    """A plugin failed to load or registered something invalid."""


@_code(151)
class BackendNotFoundError(PluginError):
    """No backend of that kind is registered under that name."""


# ----------------------------------------------------------------------------------- protocol
@_code(200)
class ProtocolError(WaltzError):
    """Bytes from a peer that do not form a valid frame or message."""


@_code(201)
class FrameTooLargeError(ProtocolError):
    """A frame larger than the configured maximum."""


@_code(202)
class ChecksumError(ProtocolError):
    """The CRC-32 of transaction data does not match its checksum."""

    retriable = True


@_code(203)
class HandshakeError(ProtocolError):
    """The peer speaks another protocol or shares no protocol version with us."""


# ---------------------------------------------------------------------------------- transport
@_code(300)
class TransportError(WaltzError):
    """The link to a peer failed."""

    retriable = True


@_code(301)
class ConnectError(TransportError):
    """A connection could not be established."""


@_code(302)
class ConnectionClosedError(TransportError):
    """The connection is closed (locally, or by the peer)."""


@_code(303)
class PeerTimeoutError(TransportError):
    """The peer sent nothing (not even a heartbeat) within the idle timeout."""


@_code(304)
class RequestTimeoutError(PeerTimeoutError):
    """A request got no answer within its deadline; the connection it was sent on is closed."""


# ------------------------------------------------------------------------------- coordination
@_code(400)
class CoordinationError(WaltzError):
    """The coordination backend failed or refused an operation."""

    retriable = True


@_code(401)
class SessionLostError(CoordinationError):
    """The coordination session (ZooKeeper session, etcd lease, local lease) expired."""


@_code(402)
class CasConflictError(CoordinationError):
    """A compare-and-set found another version than expected."""


@_code(403)
class NodeExistsError(CoordinationError):
    """Create-if-absent found an existing value."""

    retriable = False


@_code(404)
class NoNodeError(CoordinationError):
    """The key does not exist."""

    retriable = False


@_code(405)
class ClusterNotFoundError(CoordinationError):
    """No Waltz cluster exists under the configured root."""

    retriable = False


@_code(406)
class MetadataEditError(CoordinationError):
    """An admin edit refused because it would make cluster metadata inconsistent.

    For example: a partition id outside the cluster, a storage node that still holds partitions,
    assigning a partition twice to one node, deleting a cluster under another name.
    """

    retriable = False


# ------------------------------------------------------------------------------------ storage
@_code(500)
class StorageError(WaltzError):
    """A storage node refused a request."""


@_code(501)
class ClusterKeyMismatchError(StorageError):
    """The storage directory belongs to another cluster (cluster key or partition count differ)."""


@_code(502)
class StaleSessionError(StorageError):
    """The request's store session id is lower than the one the storage has seen (fenced)."""


@_code(503)
class OutOfOrderAppendError(StorageError):
    """The appended records do not continue the partition's log."""


@_code(504)
class PartitionNotFoundError(StorageError):
    """The partition is not assigned to, or not available on, this node."""

    retriable = True


@_code(505)
class StorageCorruptionError(StorageError):
    """Data on disk failed its checksums and cannot be served."""


# ------------------------------------------------------------------------------------- server
@_code(600)
class ServerError(WaltzError):
    """A Waltz server refused a request."""


@_code(601)
class GenerationMismatchError(ServerError):
    """The request carries another generation than the partition's current one."""

    retriable = True
    refresh_assignment = True


@_code(602)
class PartitionNotReadyError(ServerError):
    """The server does not own the partition or has not finished recovering it."""

    retriable = True
    refresh_assignment = True


# ------------------------------------------------------------------------------------- client
@_code(700)
class ClientError(WaltzError):
    """Errors the client library raises to applications."""


@_code(701)
class ClientClosedError(ClientError):
    """The client was closed."""


@_code(702)
class ClientTimeoutError(ClientError):
    """An operation did not complete in time."""

    retriable = True


@_code(703)
class ClientAheadError(ClientError):
    """The client's high-water mark is above the server's: the client's database is ahead of the log."""


@_code(704)
class TransactionExpiredError(ClientError):
    """A transaction context ran past its deadline or retry limit."""


@_code(705)
class TransactionTooLargeError(ClientError):
    """A transaction's append (data, header and locks) is larger than ``transport.max_frame_size``."""


@_code(706)
class TooManyLocksError(TransactionTooLargeError):
    """A transaction names more locks than the server takes in one (``[server] max_locks_per_transaction``)."""


# ------------------------------------------------------------------------------ wire translation
#: the families an unknown code can fall back to: the direct subclasses of WaltzError, by code
_FAMILIES: tuple[type[WaltzError], ...] = tuple(
    sorted((cls for cls in _BY_CODE.values() if cls.__bases__ == (WaltzError,)), key=lambda cls: cls.code)
)


def _family_of(code: int) -> type[WaltzError]:
    """The family base an unknown code belongs to: same hundred, highest base code not above it."""
    found: type[WaltzError] = StorageError  # outside every family: not retriable, as before codes
    for family in _FAMILIES:
        if family.code // 100 == code // 100 and family.code <= code:
            found = family
    return found


def wire_code(exc: BaseException, *, default: type[WaltzError] = StorageError) -> int:
    """The code to send for ``exc``: its class's (or nearest registered ancestor's) code.

    Exceptions outside the Waltz tree are sent as ``default`` (the producer's generic internal
    error, :class:`StorageError` for a storage node); their text goes in the message.
    """
    return type(exc).code if isinstance(exc, WaltzError) else default.code


def error_from_wire(code: int, message: str) -> WaltzError:
    """Turn a failure received from a peer back into the exception class its code names.

    An unknown code (a newer peer) becomes its family's base class, or :class:`StorageError` when
    it belongs to no family; the message then starts with the code so the original is not lost.
    """
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls(message)
    return _family_of(code)(f"error code {code}: {message}")

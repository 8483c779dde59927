"""The one exception tree of Waltz.

::

    WaltzError                              retriable  meaning
    ├── ConfigError                         no         bad configuration; names the key and the file
    ├── PluginError                         no         a plugin misbehaved while registering
    │   └── BackendNotFoundError            no         a backend name nobody registered
    ├── ProtocolError                       no         bytes that do not decode; the connection is closed
    │   ├── FrameTooLargeError              no         a frame above the configured maximum
    │   ├── ChecksumError                   yes        CRC-32 of transaction data does not match
    │   └── HandshakeError                  no         no common protocol version / wrong protocol
    ├── TransportError                      yes        the link failed; reconnect and retry
    │   ├── ConnectError                    yes        could not connect
    │   ├── ConnectionClosedError           yes        used after close, or closed by the peer
    │   └── PeerTimeoutError                yes        the peer stopped answering (heartbeats)
    │       └── RequestTimeoutError         yes        a request got no answer within its deadline
    ├── CoordinationError                   yes        coordination backend failure
    │   ├── SessionLostError                yes        the session/lease expired; ephemerals are gone
    │   ├── CasConflictError                yes        compare-and-set lost a race (re-read, retry)
    │   ├── NodeExistsError                 no         create-if-absent found a value
    │   ├── NoNodeError                     no         the key does not exist
    │   ├── ClusterNotFoundError            no         no cluster under that root
    │   └── MetadataEditError               no         an admin edit that would make cluster metadata inconsistent
    ├── StorageError                        varies     a storage node refused a request
    │   ├── ClusterKeyMismatchError         no         storage belongs to another cluster
    │   ├── StaleSessionError               no         a higher store session exists (fenced)
    │   ├── OutOfOrderAppendError           no         append does not continue the log
    │   ├── PartitionNotFoundError          yes        partition not assigned / not available here
    │   └── StorageCorruptionError          no         on-disk data failed its checksums
    ├── ServerError                         varies     a Waltz server refused a request
    │   ├── GenerationMismatchError         yes        partition moved; refresh the assignment
    │   └── PartitionNotReadyError          yes        the server does not (yet) own the partition
    └── ClientError                         varies     raised to applications
        ├── ClientClosedError               no         the client was closed
        ├── ClientTimeoutError              yes        an operation did not finish in time
        ├── ClientAheadError                no         client high-water mark is above the server's
        └── TransactionExpiredError         no         a transaction context's deadline/retries ran out

``retriable`` says whether the same request may succeed if sent again (possibly elsewhere);
``refresh_assignment`` says the partition assignment should be re-read first.
Failures that cross the wire carry the class name (``error_type``); :func:`error_from_wire`
turns them back into these classes at the boundary.
"""

from __future__ import annotations


class WaltzError(Exception):
    """Base of every error Waltz raises on purpose."""

    retriable: bool = False
    refresh_assignment: bool = False


# ------------------------------------------------------------------------------ configuration
class ConfigError(WaltzError):
    """Invalid configuration. The message names the key and, when known, the file."""


class PluginError(WaltzError):
    """A plugin failed to load or registered something invalid."""


class BackendNotFoundError(PluginError):
    """No backend of that kind is registered under that name."""


# ----------------------------------------------------------------------------------- protocol
class ProtocolError(WaltzError):
    """Bytes from a peer that do not form a valid frame or message."""


class FrameTooLargeError(ProtocolError):
    """A frame larger than the configured maximum."""


class ChecksumError(ProtocolError):
    """The CRC-32 of transaction data does not match its checksum."""

    retriable = True


class HandshakeError(ProtocolError):
    """The peer speaks another protocol or shares no protocol version with us."""


# ---------------------------------------------------------------------------------- transport
class TransportError(WaltzError):
    """The link to a peer failed."""

    retriable = True


class ConnectError(TransportError):
    """A connection could not be established."""


class ConnectionClosedError(TransportError):
    """The connection is closed (locally, or by the peer)."""


class PeerTimeoutError(TransportError):
    """The peer sent nothing (not even a heartbeat) within the idle timeout."""


class RequestTimeoutError(PeerTimeoutError):
    """A request got no answer within its deadline; the connection it was sent on is closed."""


# ------------------------------------------------------------------------------- coordination
class CoordinationError(WaltzError):
    """The coordination backend failed or refused an operation."""

    retriable = True


class SessionLostError(CoordinationError):
    """The coordination session (ZooKeeper session, etcd lease, local lease) expired."""


class CasConflictError(CoordinationError):
    """A compare-and-set found another version than expected."""


class NodeExistsError(CoordinationError):
    """Create-if-absent found an existing value."""

    retriable = False


class NoNodeError(CoordinationError):
    """The key does not exist."""

    retriable = False


class ClusterNotFoundError(CoordinationError):
    """No Waltz cluster exists under the configured root."""

    retriable = False


class MetadataEditError(CoordinationError):
    """An admin edit refused because it would make cluster metadata inconsistent.

    For example: a partition id outside the cluster, a storage node that still holds partitions,
    assigning a partition twice to one node, deleting a cluster under another name.
    """

    retriable = False


# ------------------------------------------------------------------------------------ storage
class StorageError(WaltzError):
    """A storage node refused a request."""


class ClusterKeyMismatchError(StorageError):
    """The storage directory belongs to another cluster (cluster key or partition count differ)."""


class StaleSessionError(StorageError):
    """The request's store session id is lower than the one the storage has seen (fenced)."""


class OutOfOrderAppendError(StorageError):
    """The appended records do not continue the partition's log."""


class PartitionNotFoundError(StorageError):
    """The partition is not assigned to, or not available on, this node."""

    retriable = True


class StorageCorruptionError(StorageError):
    """Data on disk failed its checksums and cannot be served."""


# ------------------------------------------------------------------------------------- server
class ServerError(WaltzError):
    """A Waltz server refused a request."""


class GenerationMismatchError(ServerError):
    """The request carries another generation than the partition's current one."""

    retriable = True
    refresh_assignment = True


class PartitionNotReadyError(ServerError):
    """The server does not own the partition or has not finished recovering it."""

    retriable = True
    refresh_assignment = True


# ------------------------------------------------------------------------------------- client
class ClientError(WaltzError):
    """Errors the client library raises to applications."""


class ClientClosedError(ClientError):
    """The client was closed."""


class ClientTimeoutError(ClientError):
    """An operation did not complete in time."""

    retriable = True


class ClientAheadError(ClientError):
    """The client's high-water mark is above the server's: the client's database is ahead of the log."""


class TransactionExpiredError(ClientError):
    """A transaction context ran past its deadline or retry limit."""


def _all_error_classes() -> dict[str, type[WaltzError]]:
    out: dict[str, type[WaltzError]] = {}
    stack: list[type[WaltzError]] = [WaltzError]
    while stack:
        cls = stack.pop()
        out[cls.__name__] = cls
        stack.extend(cls.__subclasses__())
    return out


def error_from_wire(error_type: str, message: str) -> WaltzError:
    """Translate a failure received from a peer into the matching local exception class.

    Unknown names (a newer peer) become the nearest safe base: :class:`StorageError`.
    """
    cls = _all_error_classes().get(error_type)
    if cls is None:
        return StorageError(f"{error_type}: {message}")
    return cls(message)

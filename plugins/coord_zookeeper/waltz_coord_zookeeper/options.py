"""Options of the ``zookeeper`` coordination backend, read from ``[coordination.zookeeper]``.

Example (digest authentication; nodes this client creates are readable by everyone and writable
only by ``waltz``)::

    [coordination]
    name = "zookeeper"
    connect = "zk1:2181,zk2:2181,zk3:2181"

    [coordination.zookeeper]
    auth_scheme = "digest"
    auth_credentials = "waltz:secret"
    acl = ["digest:waltz:<base64 sha1 of 'waltz:secret'>:cdrwa", "world:anyone:r"]

The digest id is what ``kazoo.security.make_digest_acl_credential("waltz", "secret")`` (or
ZooKeeper's ``DigestAuthenticationProvider``) prints; ``auth::cdrwa`` means "whoever is
authenticated as this client's user" (ZooKeeper's creator ACL).

With TLS (the members' ``secureClientPort`` in ``connect``)::

    [coordination.zookeeper]
    tls_ca = "/etc/waltz/zk-ca.pem"           # the CA of the members' certificates
    tls_cert = "/etc/waltz/zk-client.pem"     # for ssl.clientAuth=need (ZooKeeper's default)
    tls_key = "/etc/waltz/zk-client.key"
"""

from __future__ import annotations

import attrs

from waltz_core.config import key
from waltz_core.coordination.tls import CoordinationTlsOptions
from waltz_core.errors import ConfigError

_PERMISSION_BITS = {"r": 1, "w": 2, "c": 4, "d": 8, "a": 16}  # ZooKeeper's Perms (READ, WRITE, CREATE, DELETE, ADMIN)


@attrs.frozen
class ZooKeeperOptions(CoordinationTlsOptions):
    """``[coordination.zookeeper]``: authentication, ACLs and connection tuning."""

    auth_scheme: str = key("", "Authentication scheme sent after connecting (usually \"digest\"); empty for none.")
    auth_credentials: str = key("", "Credentials for auth_scheme, for digest \"user:password\".")
    acl: list[str] = key(
        [], "ACL of the znodes this client creates, as zkCli writes it: \"scheme:id:perms\" (perms from cdrwa); "
            "empty means world:anyone:cdrwa."
    )
    connect_timeout: float = key(15.0, "Seconds start() waits for the first connection before failing.")
    reconnect_max_delay: float = key(1.0, "Longest pause, in seconds, between two reconnection attempts.")
    member_connect_timeout: float = key(
        0.0, "Seconds one TCP connect to an ensemble member may take (a member whose host vanished answers "
             "nothing); 0: the session timeout divided by the number of members plus one.",
        validator=attrs.validators.ge(0.0))

    def __attrs_post_init__(self) -> None:
        if bool(self.auth_scheme) != bool(self.auth_credentials):
            raise ConfigError("coordination.zookeeper: auth_scheme and auth_credentials go together")
        self.check_tls("coordination.zookeeper")
        for entry in self.acl:
            parse_acl_entry(entry)  # validate early, with the entry in the message


@attrs.frozen(slots=True)
class AclEntry:
    """One parsed ACL entry: ``scheme``, ``id`` and the permission bits."""

    scheme: str
    id: str
    perms: int


def parse_acl_entry(entry: str) -> AclEntry:
    """Parse ``scheme:id:perms`` (the id may itself hold colons, as digest ids do)."""
    scheme, sep, rest = entry.partition(":")
    ident, sep2, perms = rest.rpartition(":")
    if not sep or not sep2 or not scheme or not perms:
        raise ConfigError(f"coordination.zookeeper.acl: {entry!r} is not scheme:id:perms")
    bits = 0
    for letter in perms.lower():
        if letter not in _PERMISSION_BITS:
            raise ConfigError(f"coordination.zookeeper.acl: {entry!r}: permission {letter!r} is not one of cdrwa")
        bits |= _PERMISSION_BITS[letter]
    return AclEntry(scheme, ident, bits)

"""Options of the ``etcd`` coordination backend, read from ``[coordination.etcd]``.

Example (three members, failover between them, TLS with a client certificate, and
user/password authentication)::

    [coordination]
    name = "etcd"
    connect = "10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379"
    session_timeout = 10          # the lease TTL, in whole seconds

    [coordination.etcd]
    tls_ca = "/etc/waltz/etcd-ca.pem"         # etcd --trusted-ca-file's CA
    tls_cert = "/etc/waltz/etcd-client.pem"   # for etcd --client-cert-auth
    tls_key = "/etc/waltz/etcd-client.key"
    user = "waltz"
    password = "secret"
"""

from __future__ import annotations

import attrs

from waltz_core.config import key
from waltz_core.coordination.tls import CoordinationTlsOptions
from waltz_core.errors import ConfigError


@attrs.frozen
class EtcdOptions(CoordinationTlsOptions):
    """``[coordination.etcd]``: authentication and client tuning."""

    user: str = key("", "etcd user for authentication; empty for none (then password must be empty too).")
    password: str = key("", "Password of user.")
    request_timeout: float = key(3.0, "Seconds one etcd RPC may take before it counts as failed (and is retried).")
    endpoint_retry: float = key(1.0, "Seconds a failed endpoint is skipped before the client tries it again.")

    def __attrs_post_init__(self) -> None:
        if bool(self.user) != bool(self.password):
            raise ConfigError("coordination.etcd: user and password go together")
        self.check_tls("coordination.etcd")
        if self.request_timeout <= 0:
            raise ConfigError("coordination.etcd.request_timeout: must be positive")

"""A whole Waltz cluster on one machine, for tests: re-exported from :mod:`waltz_core.app.local_cluster`
(where ``waltz up`` finds it)."""

from __future__ import annotations

from ..app.local_cluster import (
    ClusterSpec,
    InProcessCluster,
    NodeSpec,
    ProcessCluster,
    to_toml,
)
from ..ports import free_ports

__all__ = ["ClusterSpec", "InProcessCluster", "NodeSpec", "ProcessCluster", "free_ports", "to_toml"]

"""A 3-node ZooKeeper ensemble: the leader is SIGKILLed in the middle of recipe operations
(the shared scenario of the coordination kit: CAS updates and the cluster manager keep working
under the new leader and nothing committed is lost)."""

from __future__ import annotations

import pytest

from waltz_core.config import CoordinationConfig
from waltz_core.testing.conformance.coordination import leader_kill_scenario
from waltz_core.testing.servers import ZooKeeperServer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]


async def test_leader_kill_during_recipe_operations(zookeeper_ensemble: ZooKeeperServer) -> None:
    # 10 s, the most tickTime 500 ms allows: an election on 2 loaded cores must not expire the session.
    config = CoordinationConfig(name="zookeeper", connect=zookeeper_ensemble.connect_string, session_timeout=10.0)
    await leader_kill_scenario(config, zookeeper_ensemble)

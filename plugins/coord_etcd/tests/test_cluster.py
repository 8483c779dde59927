"""A 3-member etcd cluster: the leader is SIGKILLed in the middle of recipe operations
(the shared scenario of the coordination kit: CAS updates and the cluster manager keep working
under the new leader and nothing committed is lost)."""

from __future__ import annotations

import pytest

from waltz_core.config import CoordinationConfig
from waltz_core.testing.conformance.coordination import leader_kill_scenario
from waltz_core.testing.servers import EtcdServer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]


async def test_leader_kill_during_recipe_operations(etcd_ensemble: EtcdServer) -> None:
    config = CoordinationConfig(name="etcd", connect=etcd_ensemble.endpoints, session_timeout=10.0)
    await leader_kill_scenario(config, etcd_ensemble)

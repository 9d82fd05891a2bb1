"""`plan()` is a pure function: devices and roles in, a Plan object out, clear errors otherwise."""

from __future__ import annotations

import pytest

from gcore_rl.errors import ConfigError
from gcore_rl.placement.plan import plan


def test_colocate_puts_every_role_on_every_device_and_slices_evenly():
    result = plan("colocate", devices=4, roles=["actor", "rollout", "reference"], controllers=2)
    assert result.devices == (0, 1, 2, 3)
    assert result.slices == ((0, 1), (2, 3))
    assert result.devices_of("rollout", "rollout") == (0, 1, 2, 3)
    assert result.devices_of("update", "actor") == (0, 1, 2, 3)
    assert result.devices_of("update", "reference") == (0, 1, 2, 3)
    assert result.devices_of("rollout", "actor") == ()
    assert result.roles_on("update", 3) == ("actor", "reference")
    assert result.roles_on("rollout", 0) == ("rollout",)


def test_single_controller_owns_all_devices():
    assert plan("colocate", devices=1, roles=["actor", "rollout"]).slices == ((0,),)


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"strategy": "spread", "devices": 2, "roles": ["actor"]}, "placement.strategy"),
    ({"strategy": "colocate", "devices": 0, "roles": ["actor"]}, "runtime.num_processes"),
    ({"strategy": "colocate", "devices": 3, "roles": ["actor"], "controllers": 2}, "runtime.num_processes"),
    ({"strategy": "colocate", "devices": 2, "roles": ["actor", "critics"]}, "placement.roles"),
])
def test_impossible_requests_name_the_key(kwargs, key):
    with pytest.raises(ConfigError) as info:
        plan(**kwargs)
    assert info.value.key == key

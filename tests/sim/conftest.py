"""Fixtures of the simulator tests: the small scenario of `small_scenario.py`."""

from __future__ import annotations

import pytest
from small_scenario import make_scenario

from gcore_rl.sim.scenario import Scenario


@pytest.fixture
def small() -> Scenario:
    return make_scenario()


@pytest.fixture
def make():
    """`make(*overrides)`: the small scenario with dotted overrides."""
    return make_scenario

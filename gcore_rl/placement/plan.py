"""Placement plans as plain data, built by a pure function.

A plan says, for each phase of a step, which devices host which roles, and which slice of the
devices each controller owns. The runtime turns it into processes; it never decides placement
itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from gcore_rl.errors import ConfigError

Strategy = Literal["colocate"]
PHASES = ("rollout", "update")
KNOWN_ROLES = ("actor", "reference", "critic", "rollout", "judge", "reward_model")


@dataclass(frozen=True)
class Plan:
    """Which devices host which roles in each phase.

    `slices[c]` are the devices of controller c; `phases[phase][role]` the devices of a role.
    """

    strategy: str
    devices: tuple[int, ...]
    slices: tuple[tuple[int, ...], ...]
    phases: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)

    def devices_of(self, phase: str, role: str) -> tuple[int, ...]:
        return self.phases.get(phase, {}).get(role, ())

    def roles_on(self, phase: str, device: int) -> tuple[str, ...]:
        return tuple(role for role, devs in self.phases.get(phase, {}).items() if device in devs)


@dataclass
class PlacementConfig:
    """How roles are laid out on devices."""

    strategy: Strategy = field(default="colocate", metadata={"help": "Placement strategy; 'colocate' puts every role on every device and the engine and trainer take turns."})


def plan(strategy: str, devices: int, roles: Sequence[str], controllers: int = 1) -> Plan:
    """Build the plan for `devices` devices split evenly over `controllers` controllers.

    Roles in the rollout phase are the generation roles (`rollout`, `judge`); every role runs on
    all devices of the update phase. Raises ConfigError for impossible requests.
    """
    unknown = [r for r in roles if r not in KNOWN_ROLES]
    if unknown:
        raise ConfigError("placement.roles", f"unknown role(s) {unknown}; known roles are {', '.join(KNOWN_ROLES)}")
    if devices < 1:
        raise ConfigError("runtime.num_processes", f"need at least one device, got {devices}")
    if controllers < 1 or devices % controllers:
        raise ConfigError("runtime.num_processes", f"{devices} devices cannot be split evenly over {controllers} controllers")
    if strategy != "colocate":
        raise ConfigError("placement.strategy", f"unknown strategy '{strategy}'; available: colocate")
    all_devices = tuple(range(devices))
    per = devices // controllers
    slices = tuple(all_devices[c * per:(c + 1) * per] for c in range(controllers))
    rollout_roles = [r for r in roles if r in ("rollout", "judge")]
    update_roles = [r for r in roles if r not in ("rollout", "judge")]
    phases = {
        "rollout": {role: all_devices for role in rollout_roles},
        "update": {role: all_devices for role in update_roles},
    }
    return Plan(strategy=strategy, devices=all_devices, slices=slices, phases=phases)

"""Placement plans as plain data, built by a pure function.

A plan says, for each phase of a step, which devices host which roles, and which slice of the
devices each controller owns. The runtime turns it into processes; it never decides placement
itself. Strategies (names after G-Core and arXiv 2312.11819):

- `colocate`: every role on every device of its slice; generation roles take turns (sleep/wake).
- `partial`: in the rollout phase each slice is split into policy-rollout devices and reward
  devices (the judge and/or the scalar reward model) that run at the same time; the update
  phase uses the whole slice.
- `dynamic`: laid out as `partial`, but every device of a slice can host either side of the
  rollout phase; between steps the split is re-chosen by `placement.rebalance.rebalance` from
  the measured load (the devices' engines sleep and wake accordingly).
- `disaggregated`: each slice is split into fixed, disjoint training, rollout and reward devices,
  the same in both phases (rollout of step t+1 may overlap training of step t). With a single
  generation device per slice, rollout and the reward models take turns on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gcore_rl.errors import ConfigError
from gcore_rl.placement.rebalance import RebalanceConfig

Strategy = Literal["colocate", "partial", "dynamic", "disaggregated"]
STRATEGIES = ("colocate", "partial", "dynamic", "disaggregated")
PHASES = ("rollout", "update")
KNOWN_ROLES = ("actor", "reference", "critic", "rollout", "judge", "reward_model")
REWARD_ROLES = ("judge", "reward_model")
ROLLOUT_PHASE_ROLES = ("rollout", *REWARD_ROLES)
"""Roles that work in the rollout phase: policy generation and the model rewards (judge, scalar RM)."""


@dataclass(frozen=True)
class Plan:
    """Which devices host which roles in each phase.

    `slices[c]` are the devices of controller c; `phases[phase][role]` the devices of a role
    over all slices.
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

    strategy: Strategy = field(default="colocate", metadata={"help": "colocate | partial | dynamic | disaggregated (see docs/architecture.md)."})
    rollout_devices: int | None = field(default=None, metadata={"help": "partial/disaggregated: policy-rollout devices per controller slice; dynamic: the first step's (None = the plan's default split)."})
    train_devices: int | None = field(default=None, metadata={"help": "disaggregated: training devices per controller slice (None = half the slice)."})
    min_devices: dict[str, int] = field(default_factory=dict, metadata={"help": "Devices per slice a role's model needs to fit (e.g. its tensor-parallel size), by role name: {judge: 2}; a plan that gives a role fewer is refused."})
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig, metadata={"help": "dynamic: how the rollout / reward split follows the measured load."})

    def validate(self) -> None:
        for role, count in self.min_devices.items():
            if role not in KNOWN_ROLES:
                raise ConfigError(f"min_devices.{role}", f"unknown role; known roles are {', '.join(KNOWN_ROLES)}")
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ConfigError(f"min_devices.{role}", f"must be a positive integer, got {count!r}")


def plan(strategy: str, devices: int, roles: Sequence[str], controllers: int = 1, *,
         rollout_devices: int | None = None, train_devices: int | None = None,
         min_devices: Mapping[str, int] | None = None) -> Plan:
    """Build the plan for `devices` devices split evenly over `controllers` controllers.

    `rollout_devices` / `train_devices` are per slice; `min_devices[role]` is how many devices a
    role's model needs to fit (e.g. its tensor-parallel size). Raises ConfigError naming the
    config key for impossible requests.
    """
    _check_request(strategy, devices, roles, controllers)
    per = devices // controllers
    slices = tuple(tuple(range(c * per, (c + 1) * per)) for c in range(controllers))
    split_slice = {"colocate": _colocate, "partial": _partial, "dynamic": _partial, "disaggregated": _disaggregated}[strategy]
    phases: dict[str, dict[str, list[int]]] = {phase: {} for phase in PHASES}
    for devs in slices:
        for phase, role_devices in split_slice(devs, roles, rollout_devices, train_devices).items():
            for role, assigned in role_devices.items():
                phases[phase].setdefault(role, []).extend(assigned)
    frozen = {phase: {role: tuple(d) for role, d in by_role.items()} for phase, by_role in phases.items()}
    result = Plan(strategy=strategy, devices=tuple(range(devices)), slices=slices, phases=frozen)
    _check_fit(result, min_devices or {}, controllers)
    return result


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker process of one device hosts (built from a Plan by `worker_specs`).

    `roles` are the roles the device hosts in any phase (under `dynamic`, every role of its slice,
    since the split moves between steps); `trainer_rank` is its rank in the
    trainer group (None when it holds no trainer role). With `time_share` (every strategy but
    `disaggregated`) the device is shared over time, so its engines release their memory while
    another role uses it. `publishes_weights` marks the one trainer per slice that hands the
    updated weights to the slice's separate rollout devices (`disaggregated`).
    """

    device: int
    slice_index: int
    roles: tuple[str, ...]
    trainer_rank: int | None
    trainer_world: int
    time_share: bool
    publishes_weights: bool


def worker_specs(result: Plan) -> list[WorkerSpec]:
    """One `WorkerSpec` per device of the plan, in device order."""
    trainers = result.devices_of("update", "actor")
    specs = []
    for index, devs in enumerate(result.slices):
        slice_trainers = [d for d in devs if d in trainers]
        for device in devs:
            hosts = devs if result.strategy == "dynamic" else (device,)
            roles = tuple(dict.fromkeys(r for phase in PHASES for d in hosts for r in result.roles_on(phase, d)))
            specs.append(WorkerSpec(
                device=device, slice_index=index, roles=roles,
                trainer_rank=trainers.index(device) if device in trainers else None, trainer_world=len(trainers),
                time_share=result.strategy != "disaggregated" or ("rollout" in roles and bool(_reward_roles(roles))),
                publishes_weights=result.strategy == "disaggregated" and device == slice_trainers[0],
            ))
    return specs


def _check_request(strategy: str, devices: int, roles: Sequence[str], controllers: int) -> None:
    unknown = [r for r in roles if r not in KNOWN_ROLES]
    if unknown:
        raise ConfigError("placement.roles", f"unknown role(s) {unknown}; known roles are {', '.join(KNOWN_ROLES)}")
    if strategy not in STRATEGIES:
        raise ConfigError("placement.strategy", f"unknown strategy '{strategy}'; available: {', '.join(STRATEGIES)}")
    if devices < 1:
        raise ConfigError("runtime.controllers", f"need at least one device, got {devices}")
    if controllers < 1 or devices % controllers:
        raise ConfigError("runtime.controllers", f"{devices} devices cannot be split evenly over {controllers} controllers")


def _rollout_roles(roles: Sequence[str]) -> list[str]:
    return [r for r in roles if r in ROLLOUT_PHASE_ROLES]


def _reward_roles(roles: Sequence[str]) -> list[str]:
    return [r for r in roles if r in REWARD_ROLES]


def _training_roles(roles: Sequence[str]) -> list[str]:
    return [r for r in roles if r not in ROLLOUT_PHASE_ROLES]


def _colocate(devs, roles, rollout_devices, train_devices) -> dict[str, dict[str, list[int]]]:
    return {"rollout": {r: list(devs) for r in _rollout_roles(roles)},
            "update": {r: list(devs) for r in _training_roles(roles)}}


def _split_rollout_reward(devs: Sequence[int], roles: Sequence[str], rollout_devices: int | None) -> dict[str, list[int]]:
    """Split `devs` into policy-rollout and reward devices (all to rollout when no model scores rewards).

    The reward devices host every reward role of the job (judge and scalar reward model).
    """
    rewards = _reward_roles(roles)
    if not rewards:
        return {"rollout": list(devs)} if "rollout" in roles else {}
    count = rollout_devices if rollout_devices is not None else max(1, len(devs) // 2)
    if not 1 <= count <= len(devs) - 1:
        raise ConfigError("placement.rollout_devices", f"must leave at least one device each for rollout and the "
                          f"reward models ({', '.join(rewards)}) in a slice of {len(devs)} devices, got {count}")
    return {"rollout": list(devs[:count]), **{r: list(devs[count:]) for r in rewards}}


def _partial(devs, roles, rollout_devices, train_devices) -> dict[str, dict[str, list[int]]]:
    return {"rollout": _split_rollout_reward(devs, roles, rollout_devices),
            "update": {r: list(devs) for r in _training_roles(roles)}}


def _disaggregated(devs, roles, rollout_devices, train_devices) -> dict[str, dict[str, list[int]]]:
    count = train_devices if train_devices is not None else max(1, len(devs) // 2)
    if not 1 <= count <= len(devs) - 1:
        raise ConfigError("placement.train_devices", f"must leave at least one training and one generation device "
                          f"in a slice of {len(devs)} devices, got {count}")
    rest = devs[count:]
    if len(rest) == 1 and _reward_roles(roles) and rollout_devices is None:
        # one generation device: rollout and the reward models take turns on it, still apart from training
        generation = {r: list(rest) for r in _rollout_roles(roles)}
    else:
        generation = _split_rollout_reward(rest, roles, rollout_devices)
    training = {r: list(devs[:count]) for r in _training_roles(roles)}
    # fixed devices: each role keeps the same devices in both phases
    return {"rollout": generation, "update": {**training, **generation}}


def rollout_split(result: Plan) -> int:
    """Policy-rollout devices per slice in the plan's rollout phase."""
    return len(result.devices_of("rollout", "rollout")) // len(result.slices)


def _check_fit(result: Plan, min_devices: Mapping[str, int], controllers: int) -> None:
    for role, needed in min_devices.items():
        for phase in PHASES:
            assigned = result.devices_of(phase, role)
            if assigned and len(assigned) // controllers < needed:
                raise ConfigError("placement.min_devices", f"role '{role}' needs {needed} device(s) per slice to fit its model, "
                                  f"but the {result.strategy} plan gives it {len(assigned) // controllers} in the {phase} phase")

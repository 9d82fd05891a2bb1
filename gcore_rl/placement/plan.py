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
- `interleave` (Ant Group's Interleaving, arXiv 2312.11819: models that do not depend on each
  other run at the same time on exclusive devices): every device of a slice generates; then,
  per wave, the reward models (judge and/or scalar RM) score the completions on the first half of
  the slice while the frozen reference computes their log-probs on the other half; the update
  phase (old log-probs, training, and the critic with it) uses the whole slice. It needs a reward
  model and a reference (`algo.kl_coef > 0`), or there is nothing to interleave.
- `disaggregated`: each slice is split into fixed, disjoint training, rollout and reward devices,
  the same in both phases (rollout of step t+1 may overlap training of step t). With a single
  generation device per slice, rollout and the reward models take turns on it.

What a strategy means for the processes that carry it out is a set of `StrategyTraits` (does the
next rollout overlap this update, are finished samples streamed to separate reward devices, is
the split re-chosen between steps, are weights published to separate rollout devices). Every
consumer asks the plan's traits, never the strategy's name, so a new strategy is a new entry in
`STRATEGY_TRAITS` plus its slice-splitting function, and nothing outside this module changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from gcore_rl.errors import ConfigError
from gcore_rl.placement.rebalance import ForecastConfig, RebalanceConfig

Strategy = Literal["colocate", "partial", "dynamic", "interleave", "disaggregated"]
PHASES = ("rollout", "update")
BASE_ROLES = ("actor", "reference", "critic", "rollout")
"""The roles of the policy and its training; every other role of a job is a reward model's, named by its
kind (`gcore_rl.rewards.kinds`: ``judge``, ``reward_model``, a registered kind), which works in the rollout
phase beside the policy's generation (`reward_roles`)."""


def reward_roles(roles: Sequence[str]) -> list[str]:
    """The reward models' roles among `roles` (those not in `BASE_ROLES`), in order."""
    return [r for r in roles if r not in BASE_ROLES]


@dataclass(frozen=True)
class StrategyTraits:
    """What a placement strategy asks of the runtime and the controller loop.

    - `splits_slice`: roles sit on separate devices of a slice in the rollout phase, so a slice
      needs at least `min_slice_devices` devices (one device per controller cannot run it).
    - `streams_to_scorers`: finished completions go to the reward devices at once, while
      generation goes on (the reward models do not share devices with the policy's rollout).
    - `rebalances`: the rollout / reward split is re-chosen between steps from the measured load;
      every device of a slice hosts either side, and each move makes a new plan version.
    - `overlaps_steps`: the next steps' rollouts run while step t trains, at most
      `placement.max_staleness` updates behind the trainer (one-step-off by default).
    - `publishes_weights`: training devices are apart from the generation devices, so one trainer
      per slice publishes the new weights to them (instead of every device loading its own gather).
    - `reference_in_rollout`: the frozen reference computes its log-probs in the rollout phase, on
      devices of its own, at the same time as the reward models score (not in the update phase,
      where it would be sharded with the actor).
    """

    splits_slice: bool
    streams_to_scorers: bool
    rebalances: bool
    overlaps_steps: bool
    publishes_weights: bool
    min_slice_devices: int = 1
    reference_in_rollout: bool = False


STRATEGY_TRAITS: dict[str, StrategyTraits] = {
    "colocate": StrategyTraits(splits_slice=False, streams_to_scorers=False, rebalances=False, overlaps_steps=False,
                               publishes_weights=False),
    "partial": StrategyTraits(splits_slice=True, streams_to_scorers=True, rebalances=False, overlaps_steps=False,
                              publishes_weights=False),
    "dynamic": StrategyTraits(splits_slice=True, streams_to_scorers=True, rebalances=True, overlaps_steps=False,
                              publishes_weights=False, min_slice_devices=3),
    "interleave": StrategyTraits(splits_slice=True, streams_to_scorers=False, rebalances=False, overlaps_steps=False,
                                 publishes_weights=False, min_slice_devices=2, reference_in_rollout=True),
    "disaggregated": StrategyTraits(splits_slice=True, streams_to_scorers=True, rebalances=False, overlaps_steps=True,
                                    publishes_weights=True, min_slice_devices=2),
}
STRATEGIES = tuple(STRATEGY_TRAITS)


@dataclass(frozen=True)
class Plan:
    """Which devices host which roles in each phase.

    `slices[c]` are the devices of controller c; `phases[phase][role]` the devices of a role
    over all slices; `roles` every role of the job. The driver builds the plan once and ships it
    to the processes that need it; a dynamic move makes a new plan (`with_rollout_devices`) whose
    `version` is one higher, the same on every controller.
    """

    strategy: str
    devices: tuple[int, ...]
    slices: tuple[tuple[int, ...], ...]
    phases: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)
    roles: tuple[str, ...] = ()
    version: int = 0

    @property
    def traits(self) -> StrategyTraits:
        return STRATEGY_TRAITS[self.strategy]

    def devices_of(self, phase: str, role: str) -> tuple[int, ...]:
        return self.phases.get(phase, {}).get(role, ())

    def roles_on(self, phase: str, device: int) -> tuple[str, ...]:
        return tuple(role for role, devs in self.phases.get(phase, {}).items() if device in devs)

    @property
    def rollout_devices(self) -> int:
        """Policy-rollout devices per slice in the rollout phase."""
        return len(self.devices_of("rollout", "rollout")) // len(self.slices)

    def with_rollout_devices(self, rollout_devices: int) -> Plan:
        """The next version of a rebalancing plan: the first `rollout_devices` devices of every slice
        generate in the rollout phase, the others run the reward models; the update phase is unchanged.

        Raises ConfigError when the split leaves a side without a device.
        """
        if not self.traits.rebalances:
            raise ValueError(f"the {self.strategy} plan has a fixed split; only a rebalancing plan moves devices")
        rollout: dict[str, list[int]] = {}
        for devs in self.slices:
            for role, assigned in _split_rollout_reward(devs, self.roles, rollout_devices).items():
                rollout.setdefault(role, []).extend(assigned)
        phases = {**self.phases, "rollout": {role: tuple(d) for role, d in rollout.items()}}
        return replace(self, phases=phases, version=self.version + 1)


@dataclass
class SharedPlacementSettings:
    """The part of a placement section that every policy kind's job shares (a language job's `PlacementConfig`,
    a diffusion job's): the split of a slice, the devices a role needs, dynamic placement's rebalancing and the
    bounded staleness of a plan that rolls out ahead."""

    rollout_devices: int | None = field(default=None, metadata={"help": "partial/disaggregated: policy-rollout devices per controller slice; dynamic: the first step's (None = the plan's default split)."})
    train_devices: int | None = field(default=None, metadata={"help": "disaggregated: training devices per controller slice (None = half the slice)."})
    min_devices: dict[str, int] = field(default_factory=dict, metadata={"help": "Devices per slice a role's model needs to fit (e.g. its tensor-parallel size), by role name: {judge: 2}; a plan that gives a role fewer is refused."})
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig, metadata={"help": "dynamic: how the rollout / reward split follows the measured load."})
    max_staleness: int = field(default=1, metadata={"help": "disaggregated: bounded staleness k (>= 1), in trainer updates. While step t trains, the rollouts of steps t+1..t+k are queued, each generated with the weights the engines hold when it starts, so no trained sample lags the trainer by more than k updates (1 = one-step-off). With k > 1 a controller thread makes the rollouts, so a slow rollout does not stall the trainer while earlier ones are queued."})

    def validate_shared(self, strategy: str) -> None:
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 1:
            raise ConfigError("max_staleness", f"must be a positive integer (updates a trained sample may lag the "
                              f"trainer), got {self.max_staleness!r}")
        if self.max_staleness > 1 and not STRATEGY_TRAITS[strategy].overlaps_steps:
            overlapping = ", ".join(name for name, traits in STRATEGY_TRAITS.items() if traits.overlaps_steps)
            raise ConfigError("max_staleness", f"{self.max_staleness} needs a strategy that rolls out ahead while "
                              f"training ({overlapping}); '{strategy}' trains on fresh samples, so leave it at 1")
        for role, count in self.min_devices.items():  # its roles are checked against the job's
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ConfigError(f"min_devices.{role}", f"must be a positive integer, got {count!r}")


@dataclass
class PlacementConfig(SharedPlacementSettings):
    """How roles are laid out on devices."""

    strategy: Strategy = field(default="colocate", metadata={"help": "colocate | partial | dynamic | interleave | disaggregated (see docs/placement.md)."})
    forecast: ForecastConfig = field(default_factory=ForecastConfig, metadata={"help": "dynamic: how the controllers predict the rollout phase at other splits."})
    critic_devices: int = field(default=0, metadata={"help": "PPO with GAE: devices per controller slice that train the critic on their own, taken from the slice's training devices (0 = the critic sits with the actor on every training device). The critic's value pass and update then run on them while the actor prepares and trains on the others; in the rollout phase they generate or score as the strategy says (docs/algorithms.md)."})

    def validate(self) -> None:
        self.validate_shared(self.strategy)
        if isinstance(self.critic_devices, bool) or not isinstance(self.critic_devices, int) or self.critic_devices < 0:
            raise ConfigError("critic_devices", f"must be an integer >= 0 (devices per slice for the critic), "
                              f"got {self.critic_devices!r}")


def plan(strategy: str, devices: int, roles: Sequence[str], controllers: int = 1, *,
         rollout_devices: int | None = None, train_devices: int | None = None,
         min_devices: Mapping[str, int] | None = None, critic_devices: int = 0) -> Plan:
    """Build the plan for `devices` devices split evenly over `controllers` controllers.

    `rollout_devices` / `train_devices` are per slice; `min_devices[role]` is how many devices a
    role's model needs to fit (e.g. its tensor-parallel size). `critic_devices` > 0 gives the
    `critic` the last that many training devices of each slice in the update phase, apart from the
    `actor` (and its reference shard), which keeps the others (`_own_critic`). Raises ConfigError
    naming the config key for impossible requests.
    """
    _check_request(strategy, devices, roles, controllers)
    per = devices // controllers
    slices = tuple(tuple(range(c * per, (c + 1) * per)) for c in range(controllers))
    split_slice = _SPLIT_SLICE[strategy]
    phases: dict[str, dict[str, list[int]]] = {phase: {} for phase in PHASES}
    for devs in slices:
        layout = split_slice(devs, roles, rollout_devices, train_devices)
        if critic_devices:
            layout["update"] = _own_critic(layout["update"], roles, critic_devices)
        for phase, role_devices in layout.items():
            for role, assigned in role_devices.items():
                phases[phase].setdefault(role, []).extend(assigned)
    frozen = {phase: {role: tuple(d) for role, d in by_role.items()} for phase, by_role in phases.items()}
    result = Plan(strategy=strategy, devices=tuple(range(devices)), slices=slices, phases=frozen, roles=tuple(roles))
    _check_fit(result, min_devices or {}, controllers)
    return result


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker process of one device hosts (built from a Plan by `worker_specs`).

    `roles` are the roles the device hosts in any phase (under a rebalancing plan, every rollout-phase
    role of its slice, since the split moves between steps, and its own update-phase roles); `trainer_rank` is its rank in the trainer
    group (None when it holds no trainer role). With `time_share` (every strategy whose trainers
    share devices with generation) the device is shared over time, so its engines release their
    memory while another role uses it. `publishes_weights` marks the one trainer per slice that
    hands the updated weights to the slice's separate rollout devices. `reference_phase` is the
    phase in which the device computes reference log-probs: "update" (a shard of the reference,
    next to the actor), "rollout" (a whole frozen reference of its own, `interleave`) or None.
    `critic_rank` is its rank in the critic group, the devices that train the critic apart from the
    actor (`placement.critic_devices`); None where there is no such group or the device is not in it.
    """

    device: int
    slice_index: int
    roles: tuple[str, ...]
    trainer_rank: int | None
    trainer_world: int
    time_share: bool
    publishes_weights: bool
    reference_phase: str | None = None
    critic_rank: int | None = None
    critic_world: int = 0

    @property
    def group_rank(self) -> int | None:
        """Its rank in the process group it trains in (trainer or critic group); None when it trains nothing."""
        return self.trainer_rank if self.trainer_rank is not None else self.critic_rank

    @property
    def group_world(self) -> int:
        return self.trainer_world if self.trainer_rank is not None else self.critic_world


def worker_specs(result: Plan) -> list[WorkerSpec]:
    """One `WorkerSpec` per device of the plan, in device order."""
    trainers = result.devices_of("update", "actor")
    # with the critic apart from the actor, its devices form a group of their own
    critics = tuple(d for d in result.devices_of("update", "critic") if d not in trainers)
    traits = result.traits
    specs = []
    for index, devs in enumerate(result.slices):
        slice_trainers = [d for d in devs if d in trainers]
        # generation devices without a trainer take the new weights from one trainer that publishes them
        publishes = traits.publishes_weights or any(
            d in critics and (traits.rebalances or d in result.devices_of("rollout", "rollout")) for d in devs)
        for device in devs:
            hosts = devs if traits.rebalances else (device,)  # a rebalancing plan moves the rollout-phase roles
            roles = tuple(dict.fromkeys([*(r for d in hosts for r in result.roles_on("rollout", d)),
                                         *result.roles_on("update", device)]))
            specs.append(WorkerSpec(
                device=device, slice_index=index, roles=roles,
                trainer_rank=trainers.index(device) if device in trainers else None, trainer_world=len(trainers),
                time_share=not traits.publishes_weights or ("rollout" in roles and bool(reward_roles(roles))),
                publishes_weights=publishes and device == slice_trainers[0],
                reference_phase=next((phase for phase in PHASES if device in result.devices_of(phase, "reference")), None),
                critic_rank=critics.index(device) if device in critics else None, critic_world=len(critics),
            ))
    return specs


def _check_request(strategy: str, devices: int, roles: Sequence[str], controllers: int) -> None:
    if not all(isinstance(r, str) and r for r in roles):
        raise ConfigError("placement.roles", f"roles are non-empty names, got {list(roles)}")
    if strategy not in STRATEGIES:
        raise ConfigError("placement.strategy", f"unknown strategy '{strategy}'; available: {', '.join(STRATEGIES)}")
    if devices < 1:
        raise ConfigError("runtime.controllers", f"need at least one device, got {devices}")
    if controllers < 1 or devices % controllers:
        raise ConfigError("runtime.controllers", f"{devices} devices cannot be split evenly over {controllers} controllers")
    traits = STRATEGY_TRAITS[strategy]
    if traits.rebalances and not reward_roles(roles):
        raise ConfigError("placement.strategy", f"'{strategy}' resizes the rollout-phase split between the policy and the "
                          "reward models, so it needs judge.enabled or reward_model.enabled; without a reward model "
                          "use 'colocate'")
    if traits.reference_in_rollout and not (reward_roles(roles) and "reference" in roles):
        raise ConfigError("placement.strategy", f"'{strategy}' runs the reward models and the reference model at the "
                          "same time on separate halves of a slice, so it needs both: judge.enabled or "
                          "reward_model.enabled, and algo.kl_coef > 0 (the reference); without them use 'colocate'")
    if devices // controllers < traits.min_slice_devices:
        why = ("moves devices between rollout and the reward models" if traits.rebalances
               else "runs the reward models and the reference on separate halves of a slice" if traits.reference_in_rollout
               else "keeps the training devices apart from the generation devices")
        raise ConfigError("placement.strategy", f"'{strategy}' {why}, which needs at least {traits.min_slice_devices} "
                          f"devices per slice; runtime.devices_per_controller is {devices // controllers} "
                          "(use 'partial' or 'colocate')")


def _rollout_roles(roles: Sequence[str]) -> list[str]:
    """The roles that work in the rollout phase: the policy's generation and the reward models."""
    return [r for r in roles if r == "rollout" or r not in BASE_ROLES]


def _training_roles(roles: Sequence[str]) -> list[str]:
    return [r for r in roles if r in BASE_ROLES and r != "rollout"]


def _colocate(devs, roles, rollout_devices, train_devices) -> dict[str, dict[str, list[int]]]:
    return {"rollout": {r: list(devs) for r in _rollout_roles(roles)},
            "update": {r: list(devs) for r in _training_roles(roles)}}


def _split_rollout_reward(devs: Sequence[int], roles: Sequence[str], rollout_devices: int | None) -> dict[str, list[int]]:
    """Split `devs` into policy-rollout and reward devices (all to rollout when no model scores rewards).

    The reward devices host every reward role of the job (judge and scalar reward model).
    """
    rewards = reward_roles(roles)
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
    if len(rest) == 1 and reward_roles(roles) and rollout_devices is None:
        # one generation device: rollout and the reward models take turns on it, still apart from training
        generation = {r: list(rest) for r in _rollout_roles(roles)}
    else:
        generation = _split_rollout_reward(rest, roles, rollout_devices)
    training = {r: list(devs[:count]) for r in _training_roles(roles)}
    # fixed devices: each role keeps the same devices in both phases
    return {"rollout": generation, "update": {**training, **generation}}


def _interleave(devs, roles, rollout_devices, train_devices) -> dict[str, dict[str, list[int]]]:
    """Generation on every device; the reward models on the first half (at least one device), the
    reference on the rest, at the same time; the update (without the reference) on every device."""
    if rollout_devices is not None or train_devices is not None:
        key = "rollout_devices" if rollout_devices is not None else "train_devices"
        raise ConfigError(f"placement.{key}", "'interleave' generates and trains on every device of a slice and splits "
                          "it in halves for the reward models and the reference; leave placement.rollout_devices and "
                          "placement.train_devices unset")
    half = max(1, len(devs) // 2)
    rollout = {r: list(devs) for r in _rollout_roles(roles) if r in BASE_ROLES}
    rollout.update({r: list(devs[:half]) for r in reward_roles(roles)})
    rollout["reference"] = list(devs[half:])
    return {"rollout": rollout, "update": {r: list(devs) for r in _training_roles(roles) if r != "reference"}}


def _own_critic(update: dict[str, list[int]], roles: Sequence[str], critic_devices: int) -> dict[str, list[int]]:
    """The update phase of one slice with the critic on the last `critic_devices` of its training
    devices and the actor (with its reference shard) on the others."""
    if "critic" not in roles:
        raise ConfigError("placement.critic_devices", f"{critic_devices} device(s) for a critic, but this job trains "
                          "none: the critic is PPO's value model (algo.advantage=gae); leave critic_devices at 0")
    training = update.get("actor", [])
    if not 1 <= critic_devices <= len(training) - 1:
        raise ConfigError("placement.critic_devices", f"must leave at least one of the slice's {len(training)} "
                          f"training device(s) to the actor, got {critic_devices}: a critic of its own needs the "
                          "Ray runtime (runtime.kind=ray) and a slice with at least 2 training devices")
    actor, critic = training[:-critic_devices], training[-critic_devices:]
    out = {role: list(devs) for role, devs in update.items() if role not in ("actor", "reference", "critic")}
    out["actor"] = actor
    if "reference" in update:  # a reference shard sits with the actor; under `interleave` it is in the rollout phase
        out["reference"] = actor
    out["critic"] = critic
    return out


_SPLIT_SLICE = {"colocate": _colocate, "partial": _partial, "dynamic": _partial, "interleave": _interleave,
                "disaggregated": _disaggregated}
"""How each strategy lays the roles out on one slice's devices (keys: `STRATEGY_TRAITS`)."""


def _check_fit(result: Plan, min_devices: Mapping[str, int], controllers: int) -> None:
    for role, needed in min_devices.items():
        for phase in PHASES:
            assigned = result.devices_of(phase, role)
            if assigned and len(assigned) // controllers < needed:
                raise ConfigError("placement.min_devices", f"role '{role}' needs {needed} device(s) per slice to fit its model, "
                                  f"but the {result.strategy} plan gives it {len(assigned) // controllers} in the {phase} phase")

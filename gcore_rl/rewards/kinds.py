"""Model reward kinds: the reward models a job can add to its rule rewards, each behind one registry entry.

A kind is one module that calls `register_reward_kind` with a `RewardKind`: where its settings live in
the job config (``enabled``, ``weight``, ``model_path``), what to check before any process starts, and
how to build its `RewardScorer` on a device. The rest of the framework reads the registry and never a
kind's name: the job's placement roles (a kind's name is its role), the device worker that hosts and
time-shares the scorers, the slice that gathers their scores (`records.ModelScores`, a mapping by kind),
the combined reward (weighted by each kind's ``weight``), the step metrics ``<kind>/mean_score`` (and
``<kind>/unparsed`` for a generating kind), and the frozen models a checkpoint refers to.

The built-in kinds: ``judge`` (`gcore_rl.rewards.judge_role`, a generative judge) and ``reward_model``
(`gcore_rl.rewards.reward_model`, a scalar head). A new kind is a module of its own that registers
itself when imported. Every process of the job must have imported it: today that holds for a job that runs
in one process (`runtime.kind=local`, one controller); no config key yet names plugin modules to import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gcore_rl.records import RewardInput, Verdict
from gcore_rl.rollout.stats import EngineStats

BUILTIN_KIND_MODULES = ("gcore_rl.rewards.judge_role", "gcore_rl.rewards.reward_model")
"""The modules of the built-in kinds, in the order their roles, rewards and metrics are listed."""


class RewardScorer(Protocol):
    """A reward model on one device, as the device worker hosts it.

    `resident` is what sleeps and wakes when the device is time-shared (an engine, or a model with
    `state` ``awake`` / ``offloaded``, `sleep(level) -> bytes released` and `wake()`, as `HostOffload`);
    `engine` and `pad_id` are a generating kind's `RolloutEngine` and its pad token (probed for the
    forecast, closed at the end), None for a scalar head.
    """

    engine: Any | None
    pad_id: int | None

    @property
    def resident(self) -> Any: ...

    def score(self, samples: Sequence[RewardInput]) -> list[Verdict]:
        """One verdict per sample (input order); `Verdict.reward` is what the kind adds, before its weight."""
        ...

    def take_stats(self) -> EngineStats | None:
        """A generating kind's engine statistics since the last take (None: the kind generates nothing)."""
        ...


@dataclass(frozen=True)
class RewardKind:
    """One kind of model reward.

    Attributes:
        name: the kind's name: its placement role, its reward component, its metrics' prefix.
        section: the job config's settings of this kind (an object with ``enabled``, ``weight`` and
            ``model_path``), e.g. ``lambda cfg: cfg.judge``.
        build: ``(job config, device, seed) -> RewardScorer``, in the device worker that hosts the role.
        check: ``job config -> None``, run by the driver before any process starts; raises a
            ConfigError / ModelLoadError for a model folder or backend that cannot work.
        generates: the kind generates its verdicts with an engine: its work is counted and priced as the
            judge's (`work/<kind>/*`), and its unparsed verdicts are counted (``<kind>/unparsed``).
        engine: a generating kind's engine settings (``job config -> EngineConfig``), whose backend's
            environment the driver checks; None for a kind without an engine.
    """

    name: str
    section: Callable[[Any], Any]
    build: Callable[[Any, Any, int], RewardScorer]
    check: Callable[[Any], None]
    generates: bool = False
    engine: Callable[[Any], Any] | None = None


_KINDS: dict[str, RewardKind] = {}


def register_reward_kind(kind: RewardKind) -> RewardKind:
    """Add `kind` to the registry (ValueError when its name is taken by another kind); returns it."""
    held = _KINDS.get(kind.name)
    if held is not None and held is not kind:
        raise ValueError(f"a model reward kind named '{kind.name}' is registered already")
    _KINDS[kind.name] = kind
    return kind


def unregister_reward_kind(name: str) -> None:
    """Remove a kind registered by `register_reward_kind` (tests that register one of their own)."""
    _KINDS.pop(name, None)


def reward_kinds() -> dict[str, RewardKind]:
    """Every registered kind by name: the built-in kinds first, then the others in registration order."""
    for module in BUILTIN_KIND_MODULES:
        importlib.import_module(module)  # each registers itself on import
    rank = {module: index for index, module in enumerate(BUILTIN_KIND_MODULES)}
    ordered = sorted(_KINDS.values(), key=lambda kind: rank.get(kind.build.__module__, len(rank)))  # stable
    return {kind.name: kind for kind in ordered}


def enabled_kinds(cfg: Any) -> list[RewardKind]:
    """The kinds a job config turns on (``<section>.enabled``), in registry order."""
    return [kind for kind in reward_kinds().values() if getattr(kind.section(cfg), "enabled", False)]


def generates(name: str) -> bool:
    """Whether the kind `name` generates its verdicts (False for a name no kind has)."""
    kind = reward_kinds().get(name)
    return kind is not None and kind.generates

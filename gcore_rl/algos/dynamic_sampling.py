"""Dynamic sampling in waves (DAPO / G-Core style), as a pure per-controller state machine.

GRPO normalises rewards within a *group* (the ``n`` completions of one prompt). When every completion of
a prompt gets the same reward the group's advantages are all zero and it contributes nothing to the
gradient. Dynamic sampling therefore keeps generating until a step has ``target_groups`` *valid*
groups (rewards not all equal), in a bounded number of *waves*:

* the first wave (and every refill) requests ``ceil(gap * min(1 / ema, max_multiplier) * oversampling)``
  prompts, where ``gap`` is the number of valid groups still missing and ``ema`` is an exponential
  moving average of the fraction of valid groups seen so far (initially ``initial_valid_fraction``);
* after every wave the EMA is updated: ``ema = decay * ema + (1 - decay) * observed``;
* valid groups beyond the target are kept in a FIFO buffer and used first at the next step, unless they
  would then lag the trainer by more updates than the sampler's `max_age`: such a group is not trained
  on, and `begin_step` hands it back so that its prompt is generated again with the current weights;
* if the target is still not reached after ``max_waves`` waves, the batch is padded with invalid groups
  whose mask is ``False``, so the trainer gives them a sample mask of 0 and they contribute nothing.

Nothing here touches torch, devices or files: the controller does the generation and reward work and
feeds the results in as :class:`Group` objects whose ``payload`` is never inspected.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gcore_rl.errors import ConfigError

__all__ = [
    "DynamicSamplingConfig",
    "Group",
    "StepBatch",
    "WaveSampler",
    "group_is_valid",
    "wave_size",
]

_STATE_VERSION = 1


@dataclass
class DynamicSamplingConfig:
    """Settings of dynamic sampling (filtering out zero-advantage groups and refilling in waves)."""

    enabled: bool = field(
        default=False,
        metadata={"help": "Keep generating in waves until the step has `target_groups` groups whose rewards "
                          "are not all equal; when false every generated group is trained on (plain GRPO)."},
    )
    target_groups: int | None = field(
        default=None,
        metadata={"help": "Valid groups wanted per step and controller; null means the controller's prompts "
                          "per step."},
    )
    oversampling: float = field(
        default=1.2,
        metadata={"help": "Safety factor on each wave's size on top of the expected valid fraction (>= 1)."},
    )
    ema_decay: float = field(
        default=0.9,
        metadata={"help": "Decay of the moving average of the valid-group fraction, in [0, 1): "
                          "ema = decay * ema + (1 - decay) * observed after every wave."},
    )
    initial_valid_fraction: float = field(
        default=1.0,
        metadata={"help": "Starting value of the valid-fraction moving average, in (0, 1]."},
    )
    max_multiplier: float = field(
        default=10.0,
        metadata={"help": "Upper bound on 1 / ema when sizing a wave (>= 1), so a near-zero valid fraction "
                          "cannot request an unbounded number of prompts."},
    )
    max_waves: int = field(
        default=3,
        metadata={"help": "Most generation waves per step, the first one included (>= 1); after the last one "
                          "a short batch is padded with masked-out invalid groups."},
    )
    min_reward_spread: float = field(
        default=0.0,
        metadata={"help": "A group is valid when max(rewards) - min(rewards) is greater than this (>= 0)."},
    )
    max_surplus_age: int = field(
        default=1,
        metadata={"help": "Strategies other than disaggregated: the most trainer updates a surplus valid group, "
                          "kept for a later step, may lag the trainer when trained on (>= 0; 1 = the next step may "
                          "train it, its ratio against the engine's log-probs as for any stale row; 0 = none is kept). "
                          "An older group is dropped and its prompt generated again. Disaggregated holds all "
                          "samples, surplus too, to placement.max_staleness."},
    )

    def validate(self) -> None:
        """Raise :class:`~gcore_rl.errors.ConfigError` naming the first unusable field."""
        if self.target_groups is not None and (isinstance(self.target_groups, bool) or self.target_groups < 1):
            raise ConfigError("target_groups", f"must be null or at least 1, got {self.target_groups}")
        if not (math.isfinite(self.oversampling) and self.oversampling >= 1.0):
            raise ConfigError("oversampling", f"must be a finite number >= 1, got {self.oversampling}")
        if not (0.0 <= self.ema_decay < 1.0):
            raise ConfigError("ema_decay", f"must be in [0, 1), got {self.ema_decay}")
        if not (0.0 < self.initial_valid_fraction <= 1.0):
            raise ConfigError("initial_valid_fraction", f"must be in (0, 1], got {self.initial_valid_fraction}")
        if not (math.isfinite(self.max_multiplier) and self.max_multiplier >= 1.0):
            raise ConfigError("max_multiplier", f"must be a finite number >= 1, got {self.max_multiplier}")
        if isinstance(self.max_waves, bool) or self.max_waves < 1:
            raise ConfigError("max_waves", f"must be at least 1, got {self.max_waves}")
        if not (math.isfinite(self.min_reward_spread) and self.min_reward_spread >= 0.0):
            raise ConfigError("min_reward_spread", f"must be a finite number >= 0, got {self.min_reward_spread}")
        if isinstance(self.max_surplus_age, bool) or self.max_surplus_age < 0:
            raise ConfigError("max_surplus_age", f"must be an integer >= 0 (trainer updates), got {self.max_surplus_age}")

    def resolve_target(self, prompts_per_step: int) -> int:
        """Valid groups wanted per step: `target_groups`, or `prompts_per_step` when that is null."""
        return self.target_groups if self.target_groups is not None else prompts_per_step


def group_is_valid(rewards: Sequence[float], min_spread: float = 0.0) -> bool:
    """True when the group's rewards spread by more than `min_spread` (non-zero GRPO advantages).

    Groups with fewer than two rewards, and groups containing NaN, are never valid.
    """
    if len(rewards) < 2:
        return False
    spread = max(rewards) - min(rewards)
    return spread > min_spread  # NaN compares false


def _multiplier(ema_valid_fraction: float, max_multiplier: float) -> float:
    """``min(1 / ema, max_multiplier)``; an EMA of zero (or less) gives the maximum."""
    if ema_valid_fraction <= 0.0:
        return max_multiplier
    return min(1.0 / ema_valid_fraction, max_multiplier)


def wave_size(gap: int, ema_valid_fraction: float, cfg: DynamicSamplingConfig) -> int:
    """Prompts to request to close a gap of `gap` valid groups; 0 when `gap <= 0`.

    ``ceil(gap * min(1 / ema, max_multiplier) * oversampling)``. The product is rounded to 9 decimals
    before the ceiling so that float noise (``10 * 1.2 == 12.000000000000002``) does not add a prompt.
    """
    if gap <= 0:
        return 0
    raw = gap * _multiplier(ema_valid_fraction, cfg.max_multiplier) * cfg.oversampling
    return max(gap, math.ceil(round(raw, 9)))


@dataclass(frozen=True)
class Group:
    """One prompt's completions after rewarding; the sampler looks only at `rewards` and `version`.

    `key` identifies the prompt (index or id); `version` is the policy version (trainer updates) of the
    oldest weights that generated its completions; `payload` is whatever the controller attaches
    (token ids, completions, log-probs...) and is passed through untouched.
    """

    key: int
    rewards: tuple[float, ...]
    payload: object = None
    version: int = 0


@dataclass
class StepBatch:
    """What a step trains on: `groups` with a parallel `mask` (False = padding, sample mask 0).

    With dynamic sampling enabled there are exactly `target_groups` entries, valid ones first. `waves` is
    the number of generation waves this step used, `generated_groups` the groups generated in them
    (buffered groups not counted) and `valid_fraction_observed` the valid share of those groups
    (0.0 when nothing was generated). `stale_dropped` counts the buffered groups `begin_step` dropped as too old.
    """

    groups: list[Group]
    mask: list[bool]
    waves: int
    generated_groups: int
    valid_fraction_observed: float
    stale_dropped: int = 0

    @property
    def num_valid(self) -> int:
        """Number of unmasked groups."""
        return sum(self.mask)


class WaveSampler:
    """Per-controller state machine. Usage per step::

        sampler.begin_step()
        while (n := sampler.next_wave_size()) > 0:
            groups = generate_and_reward(n)   # controller work
            sampler.add_wave(groups)
        batch = sampler.finish_step()

    The EMA of the valid fraction and the buffer of surplus valid groups persist across steps. With
    `max_age` set, `begin_step(trained_version)` leaves out every buffered group it takes that would lag the
    trainer (at version `trained_version`) by more than `max_age` updates, and returns those groups.

    Checkpointing: :meth:`state_dict` stores the EMA and the buffered groups' keys and rewards, and
    their payloads when given a function that turns a payload into JSON; :meth:`load_state_dict` with
    the inverse function restores the buffer as it was, so a resumed run trains on the same groups.
    Without payloads the buffer is dropped, and the first step after the restart generates for its
    whole target.
    """

    def __init__(self, cfg: DynamicSamplingConfig, target_groups: int, max_age: int | None = None):
        cfg.validate()
        if isinstance(target_groups, bool) or target_groups < 1:
            raise ValueError(f"target_groups must be at least 1, got {target_groups}")
        if max_age is not None and max_age < 0:
            raise ValueError(f"max_age must be None or >= 0, got {max_age}")
        self.cfg = cfg
        self.target_groups = int(target_groups)
        self.max_age = max_age
        self._stale_dropped = 0
        self._ema = float(cfg.initial_valid_fraction)
        self._buffer: deque[Group] = deque()
        self._active = False
        self._valid: list[Group] = []
        self._invalid: list[Group] = []
        self._all: list[Group] = []  # disabled mode: everything, in order
        self._waves = 0
        self._generated = 0
        self._generated_valid = 0

    # ------------------------------------------------------------------ properties
    @property
    def ema(self) -> float:
        """Current moving average of the valid-group fraction."""
        return self._ema

    @property
    def buffered(self) -> int:
        """Number of surplus valid groups waiting for the next step."""
        return len(self._buffer)

    @property
    def gap(self) -> int:
        """Valid groups still missing in the current step (0 outside a step)."""
        if not self._active:
            return 0
        return max(0, self.target_groups - len(self._valid))

    # ------------------------------------------------------------------ step protocol
    def begin_step(self, trained_version: int | None = None) -> list[Group]:
        """Start a step, taking buffered valid groups first (up to the target; the rest stay buffered).

        `trained_version`: the trainer's version when this step's batch is trained. A buffered group older
        than `max_age` updates at that version is dropped instead of taken; the dropped groups are returned
        (their prompts are worth generating again) and counted in the step's `StepBatch.stale_dropped`.
        Calling it again before :meth:`finish_step` discards the unfinished step's groups (buffered
        groups it had taken are lost too).
        """
        self._active = True
        self._valid = []
        self._invalid = []
        self._all = []
        self._waves = 0
        self._generated = 0
        self._generated_valid = 0
        dropped: list[Group] = []
        if self.cfg.enabled:
            while self._buffer and len(self._valid) < self.target_groups:
                group = self._buffer.popleft()
                (dropped if self._too_old(group, trained_version) else self._valid).append(group)
        self._stale_dropped = len(dropped)
        return dropped

    def _too_old(self, group: Group, trained_version: int | None) -> bool:
        return self.max_age is not None and trained_version is not None and trained_version - group.version > self.max_age

    def next_wave_size(self) -> int:
        """Prompts to generate in the next wave; 0 when the target is reached or `max_waves` were used. The first
        wave is at least as large as the number of groups `begin_step` dropped, so all their prompts fit in it.

        Disabled mode: the target once (first wave), then 0.
        """
        self._require_active("next_wave_size")
        if not self.cfg.enabled:
            return self.target_groups if self._waves == 0 else 0
        if self._waves >= self.cfg.max_waves:
            return 0
        size = wave_size(self.gap, self._ema, self.cfg)
        # the first wave also takes back every prompt `begin_step` dropped, even past the gap (surplus is buffered)
        return max(size, self._stale_dropped) if self._waves == 0 else size

    def add_wave(self, groups: Sequence[Group]) -> None:
        """Record one wave's rewarded groups.

        Enabled: update the EMA with this wave's valid fraction (an empty wave leaves it unchanged), keep
        valid groups up to the target, push the surplus to the buffer and remember invalid groups for
        padding. Disabled: keep every group as is.
        """
        self._require_active("add_wave")
        groups = list(groups)
        self._waves += 1
        self._generated += len(groups)
        n_valid = 0
        for g in groups:
            valid = group_is_valid(g.rewards, self.cfg.min_reward_spread)
            n_valid += valid
            if not self.cfg.enabled:
                self._all.append(g)
            elif not valid:
                self._invalid.append(g)
            elif len(self._valid) < self.target_groups:
                self._valid.append(g)
            else:
                self._buffer.append(g)
        self._generated_valid += n_valid
        if self.cfg.enabled and groups:
            observed = n_valid / len(groups)
            decay = self.cfg.ema_decay
            self._ema = decay * self._ema + (1.0 - decay) * observed

    def finish_step(self) -> StepBatch:
        """Close the step and return its batch.

        Enabled: the valid groups (mask True) followed by padding up to `target_groups` (mask False):
        invalid groups in the order they arrived, then, if those run out, repeats of the last available
        group (last invalid one, else last valid one). Raises ``RuntimeError`` when padding is needed but
        the step has no group at all. Disabled: every added group, mask True, no filtering.
        """
        self._require_active("finish_step")
        self._active = False
        observed = self._generated_valid / self._generated if self._generated else 0.0
        if not self.cfg.enabled:
            groups = list(self._all)
            mask = [True] * len(groups)
        else:
            groups = list(self._valid)
            mask = [True] * len(groups)
            missing = self.target_groups - len(groups)
            if missing > 0:
                pool = self._invalid[:missing]
                last = self._invalid[-1] if self._invalid else (self._valid[-1] if self._valid else None)
                if last is None:
                    raise RuntimeError("dynamic sampling: no group was generated this step, nothing to pad with")
                pad = pool + [last] * (missing - len(pool))
                groups.extend(pad)
                mask.extend([False] * len(pad))
        batch = StepBatch(groups=groups, mask=mask, waves=self._waves, generated_groups=self._generated,
                          valid_fraction_observed=observed, stale_dropped=self._stale_dropped)
        self._valid, self._invalid, self._all = [], [], []
        return batch

    def _require_active(self, what: str) -> None:
        if not self._active:
            raise RuntimeError(f"WaveSampler.{what}() called outside a step; call begin_step() first")

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self, encode_payload: Callable[[Any], Any] | None = None) -> dict[str, Any]:
        """JSON-friendly state: the EMA and the buffered groups' keys and rewards, with
        ``encode_payload(payload)`` of each when it is given."""
        def entry(group: Group) -> dict[str, Any]:
            out = {"key": group.key, "rewards": list(group.rewards), "version": group.version}
            if encode_payload is not None:
                out["payload"] = encode_payload(group.payload)
            return out

        return {"version": _STATE_VERSION, "ema": self._ema, "buffer": [entry(g) for g in self._buffer]}

    def load_state_dict(self, state: dict[str, Any], decode_payload: Callable[[Any], Any] | None = None) -> None:
        """Restore the EMA, and the buffer when its payloads were saved and `decode_payload` rebuilds
        them (else it is dropped, see the class doc)."""
        version = state.get("version", _STATE_VERSION)
        if version != _STATE_VERSION:
            raise ValueError(f"unsupported WaveSampler state version {version}")
        ema = float(state["ema"])
        if not (math.isfinite(ema) and 0.0 <= ema <= 1.0):
            raise ValueError(f"WaveSampler state has an invalid ema {ema}")
        self._ema = ema
        self._buffer.clear()
        buffer = state.get("buffer", [])
        if decode_payload is not None and all("payload" in entry for entry in buffer):
            # a state saved before groups carried their version reads as version 0: too old, it is dropped and
            # generated again rather than trained past the bound
            self._buffer.extend(Group(key=entry["key"], rewards=tuple(float(r) for r in entry["rewards"]),
                                      payload=decode_payload(entry["payload"]), version=int(entry.get("version", 0)))
                                for entry in buffer)
        self._active = False
        self._valid, self._invalid, self._all = [], [], []

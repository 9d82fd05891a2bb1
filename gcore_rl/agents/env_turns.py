"""`env_turns`: a rollout function that plays environments (`rollout.function=gcore_rl.agents.env_turns:env_turns`).

Each prompt opens an episode of the environment its data row's `env` column names (`gcore_rl.agents.environments`:
a `textarena:<ID>` game or an import path; the row's prompt is the episode's opening, rendered when the data
was built). Every sample plays its own copy, kept in this process for the trajectory's life: the policy's turn
(decoded without special tokens) goes to `step`, the environment's answer is rendered as the next user turn by
the chat template (`TurnRenderer`, by delta) and the trajectory continues (`turns.turn_loop`: one batched
engine call per turn). It ends when the episode is done, after `max_turns` assistant turns, when a turn does not
end with the end-of-turn token (cut by the token budget), or when the answer does not fit in
`sampling.max_new_tokens`.

Rewards: each turn's reward is credited at the last token of that turn (`Completion.turn_rewards`). The sample's
reward is their sum plus any other reward the job configures (rule rewards, reward models): group estimators
(GRPO, RLOO, ...) see the whole trajectory's return; GAE (PPO with a critic) gets each turn's reward at its
token, so earlier turns are credited through the discount and the critic (see `records.TokenBatch.turn_rewards`).

An environment that raises in `reset` or `step` ends that trajectory without a reward for the turn and is
counted (`rollout/env_errors`); the run goes on. Each completion carries `rollout_stats`: `turns`, `env_errors`,
`episodes_done` (1 when the environment ended the episode) and `env_reward` (the sum of its rewards).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gcore_rl.agents.environments import Environment, environment_factory, spec_name
from gcore_rl.agents.template import TurnRenderer
from gcore_rl.agents.turns import Trajectory, turn_loop
from gcore_rl.configlib import from_dict
from gcore_rl.errors import ConfigError, DataError, GcoreError, RolloutError
from gcore_rl.records import Completion, EpisodePrompt
from gcore_rl.rollout.functions import RolloutRequest

log = logging.getLogger(__name__)


@dataclass
class EnvTurnsOptions:
    """`rollout.options` of `env_turns`."""

    max_turns: int = field(default=8, metadata={"help": "Most assistant turns of an episode; an episode still going after them ends there (truncated: no reward for what it did not finish)."})

    def validate(self) -> None:
        if self.max_turns < 1:
            raise ConfigError("max_turns", f"must be at least 1, got {self.max_turns}")


COUNTS = ("env_errors", "episodes_done", "env_reward")
"""What `env_turns` counts of each sample (`Completion.rollout_stats`, beside `turns`)."""

_FACTORIES: dict[tuple[str, str], Callable[[], Environment]] = {}
"""Environment factories of this process, by name and options."""


def _factory(spec: Any, index: int) -> Callable[[], Environment]:
    """The factory of the environment prompt `index`'s spec names (DataError naming the prompt's `env` column when
    it names none that can be made: the row's mistake, not the environment's)."""
    try:
        name, options = spec_name(spec, "env")
        key = (name, repr(sorted(options.items())))
        if key not in _FACTORIES:
            _FACTORIES[key] = environment_factory(name, options, "env.name")
    except ConfigError as exc:
        raise DataError(f"the `env` column of prompt {index} ({spec!r}) names no environment that can be made: "
                        f"{exc}") from None
    return _FACTORIES[key]


def check_options(options: Mapping[str, Any], tokenizer: Any = None) -> None:
    """What the driver checks before any process starts: the options, and that the policy's chat template can give
    a user message back after an assistant turn (ConfigError naming the dotted key otherwise)."""
    from_dict(EnvTurnsOptions, dict(options), prefix="rollout.options")
    if tokenizer is not None:
        TurnRenderer(tokenizer, role="user")


def episode_spec(prompt: Any, index: int) -> Mapping[str, Any]:
    """The `env` spec a prompt carries (RolloutError when its row had no `env` column)."""
    if not isinstance(prompt, EpisodePrompt):
        raise RolloutError(f"rollout function env_turns: prompt {index} has no environment; its data row needs an "
                           "`env` column (e.g. {\"name\": \"textarena:GuessTheNumber-v0\", \"seed\": 3}), as the "
                           "textarena:<ID> tasks write")
    return prompt.env


def env_turns(request: RolloutRequest) -> Iterator[list[Completion]]:
    """The rollout function (see the module docstring)."""
    opts = from_dict(EnvTurnsOptions, dict(request.options), prefix="rollout.options")
    specs = [episode_spec(p, i) for i, p in enumerate(request.prompts)]
    renderer = TurnRenderer(request.tokenizer, role="user")
    budget, eos = request.params.max_new_tokens, request.tokenizer.eos_token_id
    episodes: dict[tuple[int, int], Environment | None] = {}

    def start(trajectory: Trajectory) -> None:
        for name in COUNTS:
            trajectory.count(name, 0.0)
        spec = specs[trajectory.prompt_index]
        episodes[(trajectory.prompt_index, trajectory.sample_index)] = _guarded(
            trajectory, "reset", lambda: _reset(spec, trajectory.prompt_index))

    def answer(finished: list[Trajectory], last: bool) -> list[Trajectory]:
        going = []
        for trajectory in finished:
            key = (trajectory.prompt_index, trajectory.sample_index)
            env = episodes.get(key)
            ended_turn = bool(trajectory.last_turn) and trajectory.last_turn[-1] == eos
            if env is None or not ended_turn:
                _end(episodes, key)
                continue
            reply = request.tokenizer.decode(trajectory.last_turn, skip_special_tokens=True)
            outcome = _guarded(trajectory, "step", lambda env=env, reply=reply: env.step(reply))
            if outcome is not None:
                trajectory.reward_turn(outcome.reward)
                trajectory.count("env_reward", outcome.reward)
                trajectory.count("episodes_done", float(outcome.done))
            if outcome is None or outcome.done or last:
                _end(episodes, key)
                continue
            inserted = renderer.message_ids(outcome.messages)
            if trajectory.fits(inserted, budget):
                trajectory.insert(inserted)
                going.append(trajectory)
            else:
                _end(episodes, key)
        return going

    try:
        yield from turn_loop(request, opts.max_turns, answer, start=start)
    finally:
        for key in list(episodes):
            _end(episodes, key)


def _reset(spec: Mapping[str, Any], index: int) -> Environment:
    env = _factory(spec, index)()
    env.reset(spec)
    return env


def _guarded(trajectory: Trajectory, what: str, call: Callable[[], Any]) -> Any:
    """`call()`, or None when it raised (counted as an environment error of `trajectory`, and logged). A GcoreError
    (a spec that names no environment) is the job's mistake, not the environment's, and stops the run."""
    try:
        return call()
    except GcoreError:
        raise
    except Exception as exc:
        trajectory.count("env_errors")
        log.warning("environment %s raised %s: %s (sample %d/%d ended there)", what, type(exc).__name__, exc,
                    trajectory.prompt_index, trajectory.sample_index)
        return None


def _end(episodes: dict[tuple[int, int], Environment | None], key: tuple[int, int]) -> None:
    env = episodes.pop(key, None)
    if env is not None:
        try:
            env.close()
        except Exception as exc:  # an episode that will not close costs nothing more than a line
            log.warning("environment close raised %s: %s", type(exc).__name__, exc)


def close() -> None:
    """Forget this process's environment factories (a device worker calls it when it closes)."""
    _FACTORIES.clear()


env_turns.check_options = check_options  # type: ignore[attr-defined]  (see `rollout.functions.check_rollout`)
env_turns.close = close  # type: ignore[attr-defined]  (a device worker closes its rollout function's resources)
